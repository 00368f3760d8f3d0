#include "server/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "server/jinja/builtins.h"

namespace siesta::jinja {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(std::string key, Value value) {
  for (auto& [k, v] : items)
    if (k == key) {
      v = std::move(value);
      return;
    }
  items.emplace_back(std::move(key), std::move(value));
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::undefined(std::string name) {
  Value v;
  v.s_ = std::move(name);
  return v;
}

Value::Value(bool b) : kind_(Kind::kBool), b_(b) {}
Value::Value(int64_t i) : kind_(Kind::kInt), i_(i) {}
Value::Value(double d) : kind_(Kind::kFloat), d_(d) {}
Value::Value(std::string s) : kind_(Kind::kString), s_(std::move(s)) {}

Value Value::list(List items) {
  Value v;
  v.kind_ = Kind::kList;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}

Value Value::dict(Dict d) {
  Value v;
  v.kind_ = Kind::kDict;
  v.dict_ = std::make_shared<Dict>(std::move(d));
  return v;
}

Value Value::ns(Dict d) {
  Value v = dict(std::move(d));
  v.kind_ = Kind::kNamespace;
  return v;
}

Value Value::callable(std::string name, NativeFn fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.fn_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u > static_cast<uint64_t>(INT64_MAX) ? Value(static_cast<double>(u)) : Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(from_json(e));
      return list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.items.emplace_back(it.key(), from_json(it.value()));
      return dict(std::move(d));
    }
    default:
      return none();
  }
}

double Value::as_double() const {
  switch (kind_) {
    case Kind::kFloat:
      return d_;
    case Kind::kInt:
      return static_cast<double>(i_);
    case Kind::kBool:
      return b_ ? 1.0 : 0.0;
    default:
      return 0.0;
  }
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return d_ != 0.0;
    case Kind::kString:
      return !s_.empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->items.empty();
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
  }
  return false;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::string format_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0.0) return std::signbit(d) ? "-0.0" : "0.0";
  // The shortest digits that round-trip, then Python's repr layout: positional
  // for exponents in [-4, 16), else d.ddde+XX.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::stoi(sci.substr(e + 1));
  bool neg = false;
  if (!mant.empty() && mant[0] == '-') {
    neg = true;
    mant.erase(0, 1);
  }
  std::string digits;
  for (char c : mant)
    if (c != '.') digits.push_back(c);
  // Built by appending (GCC 12 warns falsely about "lit" + std::string&&).
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out.append(digits, 0, 1);
    if (digits.size() > 1) out.append(".").append(digits, 1, std::string::npos);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out.append(eb);
  } else if (exp < 0) {
    out.append("0.").append(static_cast<size_t>(-exp - 1), '0').append(digits);
  } else {
    const size_t int_digits = static_cast<size_t>(exp) + 1;
    if (digits.size() <= int_digits) {
      out.append(digits).append(int_digits - digits.size(), '0').append(".0");
    } else {
      out.append(digits, 0, int_digits).append(".").append(digits, int_digits, std::string::npos);
    }
  }
  return out;
}

namespace {

std::string py_repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c == static_cast<unsigned char>(q)) {
          out += '\\';
          out += static_cast<char>(c);
        } else if (c < 0x20 || c == 0x7f) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\x%02x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += q;
  return out;
}

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

struct JsonStyle {
  int indent;
  std::string item_sep;
  std::string key_sep;
  bool sort_keys;
};

void json_value(std::string& out, const Value& v, const JsonStyle& st, int level) {
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(static_cast<size_t>(st.indent) * static_cast<size_t>(lvl), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat: {
      const double d = v.as_double();
      if (std::isnan(d))
        out += "NaN";
      else if (std::isinf(d))
        out += d > 0 ? "Infinity" : "-Infinity";
      else
        out += format_float(d);
      return;
    }
    case Value::Kind::kString:
      json_string(out, v.str());
      return;
    case Value::Kind::kList: {
      const List& l = v.items();
      if (l.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < l.size(); ++i) {
        if (i > 0) out += st.item_sep;
        if (st.indent >= 0) newline(level + 1);
        json_value(out, l[i], st, level + 1);
      }
      if (st.indent >= 0) newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      if (v.is_namespace()) throw Error("Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.entries().items) entries.push_back(&e);
      if (st.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      if (entries.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) out += st.item_sep;
        if (st.indent >= 0) newline(level + 1);
        json_string(out, entries[i]->first);
        out += st.key_sep;
        json_value(out, entries[i]->second, st, level + 1);
      }
      if (st.indent >= 0) newline(level);
      out += '}';
      return;
    }
    case Value::Kind::kUndefined:
      throw Error("Object of type Undefined is not JSON serializable");
    case Value::Kind::kCallable:
      throw Error("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string Value::repr() const {
  switch (kind_) {
    case Kind::kString:
      return py_repr_string(s_);
    case Kind::kUndefined:
      return "";
    default:
      return to_string();
  }
}

std::string Value::to_string() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return b_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(i_);
    case Kind::kFloat:
      return format_float(d_);
    case Kind::kString:
      return s_;
    case Kind::kList: {
      std::string out = "[";
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i > 0) out += ", ";
        out += (*list_)[i].repr();
      }
      return out + "]";
    }
    case Kind::kDict: {
      std::string out = "{";
      for (size_t i = 0; i < dict_->items.size(); ++i) {
        if (i > 0) out += ", ";
        out += py_repr_string(dict_->items[i].first) + ": " + dict_->items[i].second.repr();
      }
      return out + "}";
    }
    case Kind::kNamespace:
      return "<Namespace>";
    case Kind::kCallable:
      return "<function " + fn_->name + ">";
  }
  return "";
}

std::string Value::to_json(int indent, std::optional<std::pair<std::string, std::string>> separators,
                           bool sort_keys) const {
  JsonStyle st{indent, indent >= 0 ? "," : ", ", ": ", sort_keys};
  if (separators) {
    st.item_sep = separators->first;
    st.key_sep = separators->second;
  }
  std::string out;
  json_value(out, *this, st, 0);
  return out;
}

bool Value::equals(const Value& o) const {
  if (is_number() && o.is_number()) {
    if ((kind_ == Kind::kFloat) || (o.kind_ == Kind::kFloat)) return as_double() == o.as_double();
    return as_int() == o.as_int();
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return s_ == o.s_;
    case Kind::kList: {
      if (list_->size() != o.list_->size()) return false;
      for (size_t i = 0; i < list_->size(); ++i)
        if (!(*list_)[i].equals((*o.list_)[i])) return false;
      return true;
    }
    case Kind::kDict: {
      if (dict_->items.size() != o.dict_->items.size()) return false;
      for (const auto& [k, v] : dict_->items) {
        const Value* w = o.dict_->find(k);
        if (!w || !v.equals(*w)) return false;
      }
      return true;
    }
    case Kind::kNamespace:
      return dict_ == o.dict_;
    case Kind::kCallable:
      return fn_ == o.fn_;
    default:
      return false;
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

Value Value::get_attr(const std::string& name) const {
  switch (kind_) {
    case Kind::kUndefined:
      throw Error("'" + (s_.empty() ? std::string("value") : s_) + "' is undefined (reading its attribute '" + name +
                  "')");
    case Kind::kDict: {
      if (Value m = bound_method(*this, name); !m.is_undefined()) return m;
      if (const Value* v = dict_->find(name)) return *v;
      return undefined(name);
    }
    case Kind::kNamespace: {
      if (const Value* v = dict_->find(name)) return *v;
      return undefined(name);
    }
    default:
      return bound_method(*this, name);
  }
}

Value Value::get_item(const Value& key) const {
  switch (kind_) {
    case Kind::kUndefined:
      throw Error("'" + (s_.empty() ? std::string("value") : s_) + "' is undefined (reading its item " + key.repr() +
                  ")");
    case Kind::kList: {
      if (key.is_int() || key.is_bool()) {
        int64_t i = key.as_int();
        const auto n = static_cast<int64_t>(list_->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return undefined("list index " + std::to_string(key.as_int()));
        return (*list_)[static_cast<size_t>(i)];
      }
      break;
    }
    case Kind::kString: {
      if (key.is_int()) {
        const std::vector<std::string> chars = utf8_chars(s_);
        int64_t i = key.as_int();
        const auto n = static_cast<int64_t>(chars.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return undefined("string index " + std::to_string(key.as_int()));
        return Value(chars[static_cast<size_t>(i)]);
      }
      break;
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      if (key.is_string()) {
        if (const Value* v = dict_->find(key.str())) return *v;
      }
      break;
    }
    default:
      break;
  }
  if (key.is_string() && kind_ != Kind::kNamespace) return get_attr(key.str());
  return undefined(key.to_string());
}

Value CallArgs::get(size_t i, const char* name, Value fallback) const {
  if (i < args.size()) return args[i];
  for (const auto& [k, v] : kwargs)
    if (k == name) return v;
  return fallback;
}

}  // namespace siesta::jinja
