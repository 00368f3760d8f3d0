// The parsed form of a template: expressions and statements, as the parser
// (parser.h) builds them and the renderer (template.cpp) walks them.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/jinja/value.h"

namespace siesta::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,  // value
    kName,     // name
    kAttr,     // a.name
    kItem,     // a[b]
    kSlice,    // a[b:c:d] (args: start, stop, step; null = omitted)
    kCall,     // a(args, kwargs)
    kFilter,   // a | name(args, kwargs)
    kTest,     // a is [not] name(args)
    kUnary,    // op a (op: "-", "+", "not")
    kBinary,   // a op b (+ - * / // % ** ~)
    kCompare,  // a op b op c ... (== != < <= > >= in notin)
    kAnd,
    kOr,
    kCond,  // a if b else c (args: then, cond, else-or-null)
    kList,
    kTuple,
    kDict,  // args: key, value, key, value ...
  };
  Kind kind = Kind::kLiteral;
  int line = 0;
  Value value;                // kLiteral
  std::string name;           // kName, kAttr, kFilter, kTest, kUnary/kBinary op
  bool negated = false;       // kTest
  std::vector<ExprPtr> args;  // operands, positional arguments
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // kCompare
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    kText,    // text
    kOutput,  // {{ expr }}
    kIf,      // conds[i] -> bodies[i]; else_body
    kFor,     // targets in expr [if filter]: body; else_body
    kSet,     // targets = expr, or attr_of.attr = expr, or {% set name %}body{% endset %}
    kMacro,   // name(params): body
    kBreak,
    kContinue,
    kBlock,  // a transparent block ({% generation %}): body
  };
  Kind kind = Kind::kText;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body body;
  Body else_body;
  std::vector<std::string> targets;
  std::string attr_of;                                  // kSet: namespace.attr
  std::string name;                                     // kMacro, kSet attr
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro (null default: required)
  bool block_set = false;
};

}  // namespace siesta::jinja
