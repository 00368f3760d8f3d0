#include "server/jinja/template.h"

#include "server/jinja/ast.h"
#include "server/jinja/builtins.h"
#include "server/jinja/lexer.h"
#include "server/jinja/parser.h"

namespace siesta::jinja {
namespace {

constexpr size_t kMaxOutputBytes = 64u << 20;
constexpr int64_t kMaxIterations = 10'000'000;
constexpr int kMaxCallDepth = 200;

std::string at_line(int line) { return " (line " + std::to_string(line) + ")"; }

struct Scope {
  Scope* parent = nullptr;
  Dict vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent)
      if (const Value* v = s->vars.find(name)) return v;
    return nullptr;
  }
};

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const Dict& context) : globals_(make_globals()) { root_.vars = context; }

  std::string run(const Body& body) {
    std::string out;
    exec(body, root_, out);
    return out;
  }

 private:
  void emit(std::string& out, const std::string& s) {
    out += s;
    if (out.size() > kMaxOutputBytes) throw Error("the rendered prompt is larger than 64 MiB");
  }

  Flow exec(const Body& body, Scope& scope, std::string& out) {
    for (const StmtPtr& s : body) {
      const Flow f = exec_one(*s, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  void assign(Scope& scope, const std::vector<std::string>& targets, const Value& v, int line) {
    if (targets.size() == 1) {
      scope.vars.set(targets[0], v);
      return;
    }
    const List items = iterate(v);
    if (items.size() != targets.size())
      throw Error("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(targets.size()) +
                  " names" + at_line(line));
    for (size_t i = 0; i < targets.size(); ++i) scope.vars.set(targets[i], items[i]);
  }

  Flow exec_one(const Stmt& s, Scope& scope, std::string& out) {
    switch (s.kind) {
      case Stmt::Kind::kText:
        emit(out, s.text);
        return Flow::kNormal;
      case Stmt::Kind::kOutput:
        emit(out, eval(*s.expr, scope).to_string());
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (size_t i = 0; i < s.conds.size(); ++i)
          if (eval(*s.conds[i], scope).truthy()) return exec(s.bodies[i], scope, out);
        return exec(s.else_body, scope, out);
      case Stmt::Kind::kFor:
        return exec_for(s, scope, out);
      case Stmt::Kind::kSet: {
        if (s.block_set) {
          std::string captured;
          exec(s.body, scope, captured);
          scope.vars.set(s.targets[0], Value(std::move(captured)));
          return Flow::kNormal;
        }
        const Value v = eval(*s.expr, scope);
        if (!s.attr_of.empty()) {
          const Value* ns = scope.find(s.attr_of);
          if (!ns || !ns->is_namespace())
            throw Error("cannot set the attribute '" + s.name + "' of '" + s.attr_of +
                        "': only a namespace() takes attributes" + at_line(s.line));
          ns->entries().set(s.name, v);
          return Flow::kNormal;
        }
        assign(scope, s.targets, v, s.line);
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro: {
        const Stmt* macro = &s;
        scope.vars.set(s.name, Value::callable(s.name, [this, macro](CallArgs& a) { return call_macro(*macro, a); }));
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
        if (loop_depth_ == 0) throw Error("{% break %} outside a loop" + at_line(s.line));
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        if (loop_depth_ == 0) throw Error("{% continue %} outside a loop" + at_line(s.line));
        return Flow::kContinue;
      case Stmt::Kind::kBlock:
        return exec(s.body, scope, out);
    }
    return Flow::kNormal;
  }

  Flow exec_for(const Stmt& s, Scope& scope, std::string& out) {
    const Value iterable = eval(*s.expr, scope);
    if (iterable.is_none()) throw Error("'NoneType' object is not iterable (the for loop" + at_line(s.line) + ")");
    List items = iterate(iterable);
    if (s.filter) {
      List kept;
      for (const Value& item : items) {
        Scope probe;
        probe.parent = &scope;
        assign(probe, s.targets, item, s.line);
        if (eval(*s.filter, probe).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(s.else_body, scope, out);
    const auto n = static_cast<int64_t>(items.size());
    ++loop_depth_;
    for (int64_t i = 0; i < n; ++i) {
      if (++iterations_ > kMaxIterations) throw Error("the template loops more than 10000000 times");
      Scope body_scope;
      body_scope.parent = &scope;
      Dict loop;
      loop.set("index", Value(i + 1));
      loop.set("index0", Value(i));
      loop.set("revindex", Value(n - i));
      loop.set("revindex0", Value(n - i - 1));
      loop.set("first", Value(i == 0));
      loop.set("last", Value(i == n - 1));
      loop.set("length", Value(n));
      loop.set("depth", Value(static_cast<int64_t>(1)));
      loop.set("depth0", Value(static_cast<int64_t>(0)));
      loop.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("loop.previtem"));
      loop.set("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value::undefined("loop.nextitem"));
      loop.set("cycle", Value::callable("loop.cycle", [i](CallArgs& a) -> Value {
                 if (a.args.empty()) throw Error("loop.cycle() needs at least one argument");
                 return a.args[static_cast<size_t>(i) % a.args.size()];
               }));
      body_scope.vars.set("loop", Value::dict(std::move(loop)));
      assign(body_scope, s.targets, items[static_cast<size_t>(i)], s.line);
      if (exec(s.body, body_scope, out) == Flow::kBreak) break;
    }
    --loop_depth_;
    return Flow::kNormal;
  }

  Value call_macro(const Stmt& m, CallArgs& a) {
    if (++depth_ > kMaxCallDepth) throw Error("macro calls nested more than 200 deep (" + m.name + ")");
    Scope scope;
    scope.parent = &root_;
    if (a.args.size() > m.params.size())
      throw Error("macro '" + m.name + "' takes " + std::to_string(m.params.size()) + " arguments, got " +
                  std::to_string(a.args.size()) + at_line(m.line));
    for (size_t i = 0; i < m.params.size(); ++i) {
      const auto& [pname, def] = m.params[i];
      Value v = a.get(i, pname.c_str());
      if (v.is_undefined() && def) v = eval(*def, scope);
      scope.vars.set(pname, v);
    }
    for (const auto& [k, v] : a.kwargs) {
      bool known = false;
      for (const auto& p : m.params) known |= p.first == k;
      if (!known) throw Error("macro '" + m.name + "' has no parameter '" + k + "'" + at_line(m.line));
    }
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    std::string out;
    exec(m.body, scope, out);
    loop_depth_ = saved_loops;
    --depth_;
    return Value(std::move(out));
  }

  CallArgs args_of(const Expr& e, Scope& scope, size_t first) {
    CallArgs a;
    for (size_t i = first; i < e.args.size(); ++i) a.args.push_back(eval(*e.args[i], scope));
    for (const auto& [k, v] : e.kwargs) a.kwargs.emplace_back(k, eval(*v, scope));
    return a;
  }

  Value eval(const Expr& e, Scope& scope) {
    try {
      return eval_inner(e, scope);
    } catch (const Error& err) {
      const std::string what = err.what();
      if (what.find("(line ") != std::string::npos) throw;
      throw Error(what + at_line(e.line));
    }
  }

  Value eval_inner(const Expr& e, Scope& scope) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName: {
        if (const Value* v = scope.find(e.name)) return *v;
        if (const Value* g = globals_.find(e.name)) return *g;
        return Value::undefined(e.name);
      }
      case Expr::Kind::kAttr:
        return eval(*e.args[0], scope).get_attr(e.name);
      case Expr::Kind::kItem:
        return eval(*e.args[0], scope).get_item(eval(*e.args[1], scope));
      case Expr::Kind::kSlice: {
        const Value obj = eval(*e.args[0], scope);
        auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], scope) : Value(); };
        return slice(obj, part(1), part(2), part(3));
      }
      case Expr::Kind::kCall: {
        const Value callee = eval(*e.args[0], scope);
        CallArgs a = args_of(e, scope, 1);
        if (!callee.is_callable()) {
          const std::string what = e.args[0]->kind == Expr::Kind::kName   ? "'" + e.args[0]->name + "'"
                                   : e.args[0]->kind == Expr::Kind::kAttr ? "the method '" + e.args[0]->name + "'"
                                                                          : std::string("a value");
          if (callee.is_undefined())
            throw Error("the template calls " + what + ", which is not defined or not supported");
          throw Error("the template calls " + what + ", which is a " + callee.type_name() + ", not a function");
        }
        ++calls_;
        return callee.fn().fn(a);
      }
      case Expr::Kind::kFilter: {
        const Value v = eval(*e.args[0], scope);
        CallArgs a = args_of(e, scope, 1);
        std::optional<Value> r = apply_filter(e.name, v, a);
        if (!r) throw Error("the filter '" + e.name + "' is not supported by this server's chat template renderer");
        return *r;
      }
      case Expr::Kind::kTest: {
        const Value v = eval(*e.args[0], scope);
        CallArgs a = args_of(e, scope, 1);
        std::optional<bool> r = apply_test(e.name, v, a);
        if (!r) throw Error("the test '" + e.name + "' is not supported by this server's chat template renderer");
        return Value(e.negated ? !*r : *r);
      }
      case Expr::Kind::kUnary: {
        const Value v = eval(*e.args[0], scope);
        if (e.name == "not") return Value(!v.truthy());
        if (!v.is_number()) throw Error("bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
        if (e.name == "+") return v.is_float() ? Value(v.as_double()) : Value(v.as_int());
        return v.is_float() ? Value(-v.as_double()) : Value(-v.as_int());
      }
      case Expr::Kind::kBinary:
        return binary_op(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope));
      case Expr::Kind::kCompare: {
        Value left = eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], scope);
          if (!compare_op(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kAnd: {
        Value l = eval(*e.args[0], scope);
        if (!l.truthy()) return l;
        return eval(*e.args[1], scope);
      }
      case Expr::Kind::kOr: {
        Value l = eval(*e.args[0], scope);
        if (l.truthy()) return l;
        return eval(*e.args[1], scope);
      }
      case Expr::Kind::kCond: {
        if (eval(*e.args[1], scope).truthy()) return eval(*e.args[0], scope);
        return e.args[2] ? eval(*e.args[2], scope) : Value::undefined("the else branch of an inline if");
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        List items;
        for (const ExprPtr& x : e.args) items.push_back(eval(*x, scope));
        return Value::list(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const Value k = eval(*e.args[i], scope);
          if (!k.is_string()) throw Error("dict literal keys must be strings, got " + k.type_name());
          d.set(k.str(), eval(*e.args[i + 1], scope));
        }
        return Value::dict(std::move(d));
      }
    }
    return Value();
  }

  Dict globals_;
  Scope root_;
  int loop_depth_ = 0;
  int depth_ = 0;
  int64_t iterations_ = 0;
  int64_t calls_ = 0;
};

}  // namespace

Result<Template> Template::parse(std::string_view source) {
  try {
    auto body = std::make_shared<Body>(jinja::parse(lex(source)));
    return Template(std::move(body));
  } catch (const Error& e) {
    return invalid_argument(e.what());
  }
}

Result<std::string> Template::render(const Dict& context) const {
  try {
    Renderer r(context);
    return r.run(*body_);
  } catch (const Error& e) {
    return invalid_argument(e.what());
  } catch (const std::exception& e) {
    return internal_error(std::string("rendering the template: ") + e.what());
  }
}

}  // namespace siesta::jinja
