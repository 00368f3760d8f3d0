#include "server/jinja/parser.h"

#include <set>

namespace siesta::jinja {
namespace {

std::string at_line(int line) { return " (line " + std::to_string(line) + ")"; }

// Expressions of one tag.
class ExprParser {
 public:
  ExprParser(const std::vector<Token>& tokens) : t_(tokens) {}

  const Token& cur() const { return t_[pos_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(pos_ + k, t_.size() - 1)]; }
  bool at_end() const { return cur().kind == Token::Kind::kEnd; }
  bool is_op(const char* op) const { return cur().kind == Token::Kind::kOp && cur().text == op; }
  bool is_name(const char* n) const { return cur().kind == Token::Kind::kName && cur().text == n; }
  void next() {
    if (!at_end()) ++pos_;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  [[noreturn]] void fail(const std::string& what) const {
    const std::string got = at_end() ? std::string("the end of the tag") : "'" + cur().text + "'";
    throw Error(what + ", got " + got + at_line(cur().line));
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(std::string("expected '") + op + "'");
  }
  std::string expect_name(const char* what) {
    if (cur().kind != Token::Kind::kName) fail(std::string("expected ") + what);
    std::string n = cur().text;
    next();
    return n;
  }
  void expect_end() {
    if (!at_end()) fail("expected the end of the tag");
  }

  ExprPtr make(Expr::Kind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  ExprPtr expression(bool with_condexpr = true) {
    ExprPtr e = parse_or();
    if (!with_condexpr) return e;
    while (is_name("if")) {
      const int line = cur().line;
      next();
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (skip_name("else")) other = expression(true);
      ExprPtr c = make(Expr::Kind::kCond, line);
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  // An expression, or several separated by commas (a tuple).
  ExprPtr tuple(bool with_condexpr = true) {
    const int line = cur().line;
    ExprPtr first = expression(with_condexpr);
    if (!is_op(",")) return first;
    ExprPtr t = make(Expr::Kind::kTuple, line);
    t->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (at_end() || is_op(")") || is_op("%}")) break;
      t->args.push_back(expression(with_condexpr));
    }
    return t;
  }

 private:
  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      const int line = cur().line;
      next();
      ExprPtr e = make(Expr::Kind::kOr, line);
      e->args.push_back(std::move(l));
      e->args.push_back(parse_and());
      l = std::move(e);
    }
    return l;
  }
  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      const int line = cur().line;
      next();
      ExprPtr e = make(Expr::Kind::kAnd, line);
      e->args.push_back(std::move(l));
      e->args.push_back(parse_not());
      l = std::move(e);
    }
    return l;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      const int line = cur().line;
      next();
      ExprPtr e = make(Expr::Kind::kUnary, line);
      e->name = "not";
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    for (;;) {
      std::string op;
      if (cur().kind == Token::Kind::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                             cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().kind == Token::Kind::kName && peek().text == "in") {
        op = "notin";
        next();
        next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Kind::kCompare, line);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprPtr binary(const std::string& op, ExprPtr l, ExprPtr r, int line) {
    ExprPtr e = make(Expr::Kind::kBinary, line);
    e->name = op;
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return e;
  }
  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = cur().text;
      const int line = cur().line;
      next();
      l = binary(op, std::move(l), parse_concat(), line);
    }
    return l;
  }
  ExprPtr parse_concat() {
    ExprPtr l = parse_math2();
    while (is_op("~")) {
      const int line = cur().line;
      next();
      l = binary("~", std::move(l), parse_math2(), line);
    }
    return l;
  }
  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = cur().text;
      const int line = cur().line;
      next();
      l = binary(op, std::move(l), parse_pow(), line);
    }
    return l;
  }
  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      next();
      l = binary("**", std::move(l), parse_unary(true), line);
    }
    return l;
  }
  ExprPtr parse_unary(bool with_filter) {
    const int line = cur().line;
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const std::string op = cur().text;
      next();
      node = make(Expr::Kind::kUnary, line);
      node->name = op;
      node->args.push_back(parse_unary(false));
    } else {
      node = primary();
    }
    node = postfix(std::move(node));
    if (with_filter) node = filter_expr(std::move(node));
    return node;
  }
  ExprPtr primary() {
    const Token& tk = cur();
    const int line = tk.line;
    switch (tk.kind) {
      case Token::Kind::kName: {
        const std::string n = tk.text;
        next();
        ExprPtr e = make(Expr::Kind::kLiteral, line);
        if (n == "true" || n == "True")
          e->value = Value(true);
        else if (n == "false" || n == "False")
          e->value = Value(false);
        else if (n == "none" || n == "None")
          e->value = Value::none();
        else {
          e->kind = Expr::Kind::kName;
          e->name = n;
        }
        return e;
      }
      case Token::Kind::kString: {
        std::string s;
        while (cur().kind == Token::Kind::kString) {
          s += cur().text;
          next();
        }
        ExprPtr e = make(Expr::Kind::kLiteral, line);
        e->value = Value(std::move(s));
        return e;
      }
      case Token::Kind::kInt: {
        ExprPtr e = make(Expr::Kind::kLiteral, line);
        try {
          e->value = Value(static_cast<int64_t>(std::stoll(tk.text)));
        } catch (const std::exception&) {
          throw Error("integer literal " + tk.text + " is out of range" + at_line(line));
        }
        next();
        return e;
      }
      case Token::Kind::kFloat: {
        ExprPtr e = make(Expr::Kind::kLiteral, line);
        e->value = Value(std::stod(tk.text));
        next();
        return e;
      }
      case Token::Kind::kOp:
        if (tk.text == "(") {
          next();
          if (skip_op(")")) return make(Expr::Kind::kTuple, line);
          ExprPtr first = expression();
          if (skip_op(")")) return first;
          ExprPtr t = make(Expr::Kind::kTuple, line);
          t->args.push_back(std::move(first));
          while (skip_op(",")) {
            if (is_op(")")) break;
            t->args.push_back(expression());
          }
          expect_op(")");
          return t;
        }
        if (tk.text == "[") {
          next();
          ExprPtr l = make(Expr::Kind::kList, line);
          while (!is_op("]")) {
            l->args.push_back(expression());
            if (!skip_op(",")) break;
          }
          expect_op("]");
          return l;
        }
        if (tk.text == "{") {
          next();
          ExprPtr d = make(Expr::Kind::kDict, line);
          while (!is_op("}")) {
            d->args.push_back(expression());
            expect_op(":");
            d->args.push_back(expression());
            if (!skip_op(",")) break;
          }
          expect_op("}");
          return d;
        }
        break;
      default:
        break;
    }
    fail("expected an expression");
  }
  ExprPtr postfix(ExprPtr node) {
    for (;;) {
      const int line = cur().line;
      if (is_op(".")) {
        next();
        if (cur().kind == Token::Kind::kInt) {
          ExprPtr e = make(Expr::Kind::kItem, line);
          e->args.push_back(std::move(node));
          ExprPtr k = make(Expr::Kind::kLiteral, line);
          k->value = Value(static_cast<int64_t>(std::stoll(cur().text)));
          next();
          e->args.push_back(std::move(k));
          node = std::move(e);
          continue;
        }
        ExprPtr e = make(Expr::Kind::kAttr, line);
        e->name = expect_name("an attribute name after '.'");
        e->args.push_back(std::move(node));
        node = std::move(e);
      } else if (is_op("[")) {
        next();
        node = subscript(std::move(node), line);
      } else if (is_op("(")) {
        node = call(std::move(node), line);
      } else {
        return node;
      }
    }
  }
  ExprPtr subscript(ExprPtr obj, int line) {
    // a[b] or a[start:stop:step]
    ExprPtr start, stop, step;
    bool is_slice = false;
    if (!is_op(":")) start = expression();
    if (skip_op(":")) {
      is_slice = true;
      if (!is_op("]") && !is_op(":")) stop = expression();
      if (skip_op(":")) {
        if (!is_op("]")) step = expression();
      }
    }
    expect_op("]");
    if (!is_slice) {
      ExprPtr e = make(Expr::Kind::kItem, line);
      e->args.push_back(std::move(obj));
      e->args.push_back(std::move(start));
      return e;
    }
    ExprPtr e = make(Expr::Kind::kSlice, line);
    e->args.push_back(std::move(obj));
    e->args.push_back(std::move(start));
    e->args.push_back(std::move(stop));
    e->args.push_back(std::move(step));
    return e;
  }
  void call_args(Expr& into) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) fail("*args and **kwargs in calls are not supported");
      if (cur().kind == Token::Kind::kName && peek().kind == Token::Kind::kOp && peek().text == "=") {
        std::string key = cur().text;
        next();
        next();
        into.kwargs.emplace_back(std::move(key), expression());
      } else {
        if (!into.kwargs.empty()) fail("a positional argument after a keyword argument");
        into.args.push_back(expression());
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
  }
  ExprPtr call(ExprPtr callee, int line) {
    ExprPtr e = make(Expr::Kind::kCall, line);
    e->args.push_back(std::move(callee));
    call_args(*e);
    return e;
  }
  ExprPtr filter_expr(ExprPtr node) {
    for (;;) {
      const int line = cur().line;
      if (is_op("|")) {
        next();
        ExprPtr f = make(Expr::Kind::kFilter, line);
        f->name = expect_name("a filter name after '|'");
        while (is_op(".") && peek().kind == Token::Kind::kName) {
          next();
          f->name += "." + cur().text;
          next();
        }
        f->args.push_back(std::move(node));
        if (is_op("(")) call_args(*f);
        node = std::move(f);
      } else if (is_name("is")) {
        next();
        ExprPtr t = make(Expr::Kind::kTest, line);
        t->negated = skip_name("not");
        t->name = expect_name("a test name after 'is'");
        t->args.push_back(std::move(node));
        if (is_op("(")) {
          call_args(*t);
        } else if ((cur().kind == Token::Kind::kName || cur().kind == Token::Kind::kString ||
                    cur().kind == Token::Kind::kInt || cur().kind == Token::Kind::kFloat || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail("tests cannot be chained with 'is'");
          t->args.push_back(postfix(primary()));
        }
        node = std::move(t);
      } else if (is_op("(")) {
        node = call(std::move(node), line);
      } else {
        return node;
      }
    }
  }

  const std::vector<Token>& t_;
  size_t pos_ = 0;
};

class StmtParser {
 public:
  explicit StmtParser(std::vector<Piece> pieces) : p_(std::move(pieces)) {}

  Body parse_all() {
    std::string ended;
    Body b = body({}, ended);
    return b;
  }

 private:
  static std::string tag_name(const Piece& p) {
    return !p.tokens.empty() && p.tokens[0].kind == Token::Kind::kName ? p.tokens[0].text : std::string();
  }

  // Statements until one of `ends` (its name in `ended`; the tag is consumed,
  // its parser left at the token after the name).
  Body body(const std::set<std::string>& ends, std::string& ended, std::unique_ptr<ExprParser>* end_tag = nullptr) {
    Body out;
    while (i_ < p_.size()) {
      Piece& p = p_[i_];
      if (p.kind == Piece::Kind::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = p.line;
        s->text = std::move(p.text);
        out.push_back(std::move(s));
        ++i_;
        continue;
      }
      if (p.kind == Piece::Kind::kVar) {
        ExprParser ep(p.tokens);
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = p.line;
        if (ep.at_end()) ep.fail("expected an expression in {{ }}");
        s->expr = ep.tuple();
        ep.expect_end();
        out.push_back(std::move(s));
        ++i_;
        continue;
      }
      const std::string name = tag_name(p);
      if (ends.count(name)) {
        ended = name;
        if (end_tag) {
          *end_tag = std::make_unique<ExprParser>(p.tokens);
          (*end_tag)->next();
        }
        ++i_;
        return out;
      }
      out.push_back(statement(p));
    }
    if (!ends.empty()) {
      std::string list;
      for (const std::string& e : ends) list += (list.empty() ? "" : " or ") + std::string("{% ") + e + " %}";
      throw Error("the template ended while looking for " + list + " (a block is not closed)");
    }
    return out;
  }

  StmtPtr statement(Piece& p) {
    const int line = p.line;
    const std::string name = tag_name(p);
    ExprParser ep(p.tokens);
    ep.next();
    auto s = std::make_unique<Stmt>();
    s->line = line;
    ++i_;
    if (name == "if") {
      s->kind = Stmt::Kind::kIf;
      s->conds.push_back(ep.expression());
      ep.expect_end();
      for (;;) {
        std::string ended;
        std::unique_ptr<ExprParser> end;
        Body b = body({"elif", "else", "endif"}, ended, &end);
        if (ended == "elif") {
          s->bodies.push_back(std::move(b));
          s->conds.push_back(end->expression());
          end->expect_end();
          continue;
        }
        s->bodies.push_back(std::move(b));
        end->expect_end();
        if (ended == "else") {
          std::string e2;
          std::unique_ptr<ExprParser> end2;
          s->else_body = body({"endif"}, e2, &end2);
          end2->expect_end();
        }
        break;
      }
      return s;
    }
    if (name == "for") {
      s->kind = Stmt::Kind::kFor;
      const bool paren = ep.skip_op("(");
      s->targets.push_back(ep.expect_name("a loop variable"));
      while (ep.skip_op(",")) s->targets.push_back(ep.expect_name("a loop variable"));
      if (paren) ep.expect_op(")");
      if (!ep.skip_name("in")) ep.fail("expected 'in' in the for tag");
      s->expr = ep.tuple(/*with_condexpr=*/false);
      if (ep.skip_name("if")) s->filter = ep.expression();
      if (ep.is_name("recursive")) ep.fail("recursive loops are not supported");
      ep.expect_end();
      std::string ended;
      std::unique_ptr<ExprParser> end;
      s->body = body({"else", "endfor"}, ended, &end);
      end->expect_end();
      if (ended == "else") {
        std::string e2;
        std::unique_ptr<ExprParser> end2;
        s->else_body = body({"endfor"}, e2, &end2);
        end2->expect_end();
      }
      return s;
    }
    if (name == "set") {
      s->kind = Stmt::Kind::kSet;
      const std::string first = ep.expect_name("a variable name after 'set'");
      if (ep.skip_op(".")) {
        s->attr_of = first;
        s->name = ep.expect_name("an attribute name");
      } else {
        s->targets.push_back(first);
        while (ep.skip_op(",")) s->targets.push_back(ep.expect_name("a variable name"));
      }
      if (ep.skip_op("=")) {
        s->expr = ep.tuple();
        ep.expect_end();
        return s;
      }
      if (!s->attr_of.empty() || s->targets.size() != 1) ep.fail("expected '=' in the set tag");
      if (ep.is_op("|")) ep.fail("filters on block assignments are not supported");
      ep.expect_end();
      s->block_set = true;
      std::string ended;
      std::unique_ptr<ExprParser> end;
      s->body = body({"endset"}, ended, &end);
      end->expect_end();
      return s;
    }
    if (name == "macro") {
      s->kind = Stmt::Kind::kMacro;
      s->name = ep.expect_name("a macro name");
      ep.expect_op("(");
      while (!ep.is_op(")")) {
        std::string param = ep.expect_name("a parameter name");
        ExprPtr def;
        if (ep.skip_op("=")) def = ep.expression();
        s->params.emplace_back(std::move(param), std::move(def));
        if (!ep.skip_op(",")) break;
      }
      ep.expect_op(")");
      ep.expect_end();
      std::string ended;
      std::unique_ptr<ExprParser> end;
      s->body = body({"endmacro"}, ended, &end);
      if (end->cur().kind == Token::Kind::kName) end->next();  // {% endmacro name %}
      end->expect_end();
      return s;
    }
    if (name == "break" || name == "continue") {
      s->kind = name == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      ep.expect_end();
      return s;
    }
    if (name == "generation") {
      s->kind = Stmt::Kind::kBlock;
      ep.expect_end();
      std::string ended;
      std::unique_ptr<ExprParser> end;
      s->body = body({"endgeneration"}, ended, &end);
      end->expect_end();
      return s;
    }
    if (name.empty()) throw Error("a {% %} tag without a tag name" + at_line(line));
    static const std::set<std::string> kClosers = {"endif", "endfor", "endset",        "endmacro",
                                                   "elif",  "else",   "endgeneration", "endraw"};
    if (kClosers.count(name)) throw Error("{% " + name + " %} without its opening tag" + at_line(line));
    throw Error("the tag {% " + name + " %} is not supported by this server's chat template renderer" + at_line(line));
  }

  std::vector<Piece> p_;
  size_t i_ = 0;
};

}  // namespace

Body parse(std::vector<Piece> pieces) { return StmtParser(std::move(pieces)).parse_all(); }

}  // namespace siesta::jinja
