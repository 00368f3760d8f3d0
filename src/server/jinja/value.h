// Value: what a Jinja expression evaluates to, with Python's semantics as
// Hugging Face's chat templates rely on them (jinja2 runs on Python objects):
// undefined, None, bool, int, float, str, list, dict (insertion-ordered),
// namespace, and callables (macros, builtins, bound methods).
//
//   Value v = Value::from_json(nlohmann::ordered_json::parse(R"({"role": "user"})"));
//   v.get_attr("role").str()          // "user"
//   v.to_string()                      // Python str(): "{'role': 'user'}"
//   v.to_json(...)                     // HF's tojson: json.dumps(ensure_ascii=False)
//
// Lists, dicts and namespaces are shared by reference, as Python objects
// are; everything else is a plain value. Errors are thrown as
// jinja::Error (caught by Template, never outside this folder).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace siesta::jinja {

// A template that cannot be parsed or rendered: the message names the
// construct and its line.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Value;
using List = std::vector<Value>;

// Insertion-ordered string-keyed map (Python dicts keep insertion order).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(std::string key, Value value);
};

struct CallArgs;
using NativeFn = std::function<Value(CallArgs&)>;

struct Callable {
  std::string name;
  NativeFn fn;
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };

  Value() = default;  // undefined
  static Value none();
  static Value undefined(std::string name = {});
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double d);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  static Value list(List items = {});
  static Value dict(Dict d = {});
  static Value ns(Dict d = {});
  static Value callable(std::string name, NativeFn fn);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  double as_double() const;
  const std::string& str() const { return s_; }
  List& items() const { return *list_; }
  Dict& entries() const { return *dict_; }
  const Callable& fn() const { return *fn_; }
  // The name an undefined value was looked up by (for error messages).
  const std::string& undefined_name() const { return s_; }

  // Python truthiness.
  bool truthy() const;
  // Python str() / repr().
  std::string to_string() const;
  std::string repr() const;
  // Hugging Face's tojson: json.dumps(value, ensure_ascii=False, indent=indent,
  // separators=..., sort_keys=...). indent < 0: none.
  std::string to_json(int indent = -1, std::optional<std::pair<std::string, std::string>> separators = std::nullopt,
                      bool sort_keys = false) const;
  // Python ==.
  bool equals(const Value& other) const;
  // "a string", "an integer", ... and the Python type name ("str", "int").
  std::string type_name() const;

  // Jinja's getattr: for a dict, a method of dict first, then the key; for
  // a namespace, its attribute; for a string, its methods. Undefined when absent.
  Value get_attr(const std::string& name) const;
  // Jinja's getitem: a key or index first, then an attribute.
  Value get_item(const Value& key) const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double d_ = 0.0;
  std::string s_;  // string value, or the undefined name
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;  // dict or namespace
  std::shared_ptr<Callable> fn_;
};

// Positional and keyword arguments of a call.
struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
  std::string callee;  // for messages

  // The i-th positional argument or the keyword `name`; `fallback` when neither.
  Value get(size_t i, const char* name, Value fallback = Value()) const;
  size_t count() const { return args.size() + kwargs.size(); }
};

// Python's repr() of a float ("0.1", "1e-05", "100.0").
std::string format_float(double d);
// Number of Unicode code points of UTF-8 text.
size_t utf8_length(std::string_view s);

}  // namespace siesta::jinja
