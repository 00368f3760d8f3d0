#include "server/jinja/builtins.h"

#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <limits>

namespace siesta::jinja {
namespace {

// ---- UTF-8 code points -------------------------------------------------------------------------------------------

std::vector<uint32_t> decode(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                                static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(static_cast<uint32_t>(cp));
    i += static_cast<size_t>(n);
  }
  return out;
}

std::string encode(const std::vector<uint32_t>& cps, size_t begin = 0, size_t end = std::string::npos) {
  std::string out;
  end = std::min(end, cps.size());
  for (size_t i = begin; i < end; ++i) {
    utf8proc_uint8_t buf[4];
    const utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cps[i]), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
  }
  return out;
}

// Python's str.isspace().
bool py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::vector<uint32_t> cps = decode(s);
  std::vector<uint32_t> set;
  const bool whitespace = chars.is_undefined() || chars.is_none();
  if (!whitespace) {
    if (!chars.is_string()) throw Error("strip arg must be None or str, got " + chars.type_name());
    set = decode(chars.str());
  }
  auto strip_it = [&](uint32_t c) {
    return whitespace ? py_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  return encode(cps, b, e);
}

Value py_split(const std::string& s, const Value& sep, const Value& maxsplit_v, bool from_right) {
  int64_t maxsplit = maxsplit_v.is_undefined() || maxsplit_v.is_none() ? -1 : maxsplit_v.as_int();
  List out;
  if (sep.is_undefined() || sep.is_none()) {
    const std::vector<uint32_t> cps = decode(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && py_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      size_t j = i;
      while (j < cps.size() && !py_space(cps[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit < 0 || static_cast<size_t>(maxsplit) >= words.size()) {
      for (auto [b, e] : words) out.push_back(Value(encode(cps, b, e)));
      return Value::list(std::move(out));
    }
    if (!from_right) {
      for (int64_t k = 0; k < maxsplit; ++k) out.push_back(Value(encode(cps, words[k].first, words[k].second)));
      // The rest, leading whitespace stripped, trailing kept.
      out.push_back(Value(py_strip(encode(cps, words[maxsplit].first), Value(), false, true)));
    } else {
      const size_t keep = words.size() - static_cast<size_t>(maxsplit);
      out.push_back(Value(encode(cps, words[0].first, words[keep - 1].second)));
      for (size_t k = keep; k < words.size(); ++k) out.push_back(Value(encode(cps, words[k].first, words[k].second)));
    }
    return Value::list(std::move(out));
  }
  if (!sep.is_string()) throw Error("split: the separator must be a string, got " + sep.type_name());
  const std::string& d = sep.str();
  if (d.empty()) throw Error("split: empty separator");
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t p = s.find(d, start);
    if (p == std::string::npos) break;
    parts.push_back(s.substr(start, p - start));
    start = p + d.size();
  }
  parts.push_back(s.substr(start));
  if (maxsplit >= 0 && parts.size() > static_cast<size_t>(maxsplit) + 1) {
    std::vector<std::string> joined;
    if (!from_right) {
      for (int64_t k = 0; k < maxsplit; ++k) joined.push_back(parts[k]);
      std::string rest;
      for (size_t k = static_cast<size_t>(maxsplit); k < parts.size(); ++k)
        rest += (k > static_cast<size_t>(maxsplit) ? d : "") + parts[k];
      joined.push_back(rest);
    } else {
      const size_t head = parts.size() - static_cast<size_t>(maxsplit);
      std::string first;
      for (size_t k = 0; k < head; ++k) first += (k > 0 ? d : "") + parts[k];
      joined.push_back(first);
      for (size_t k = head; k < parts.size(); ++k) joined.push_back(parts[k]);
    }
    parts = std::move(joined);
  }
  for (std::string& p : parts) out.push_back(Value(std::move(p)));
  return Value::list(std::move(out));
}

std::string map_case(const std::string& s, bool upper) {
  std::vector<uint32_t> cps = decode(s);
  for (uint32_t& c : cps)
    c = static_cast<uint32_t>(upper ? utf8proc_toupper(static_cast<utf8proc_int32_t>(c))
                                    : utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
  return encode(cps);
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends).
    const std::vector<uint32_t> cps = decode(s);
    std::string out;
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      if (i < cps.size()) out += encode(cps, i, i + 1);
    }
    return out;
  }
  std::string out;
  size_t start = 0;
  int64_t done = 0;
  for (;;) {
    const size_t p = s.find(from, start);
    if (p == std::string::npos || (count >= 0 && done >= count)) break;
    out += s.substr(start, p - start) + to;
    start = p + from.size();
    ++done;
  }
  return out + s.substr(start);
}

void need_string(const Value& v, const char* what) {
  if (!v.is_string()) throw Error(std::string(what) + " needs a string, got " + v.type_name());
}

bool starts_or_ends(const std::string& s, const Value& arg, bool start, const char* name) {
  auto one = [&](const Value& p) {
    if (!p.is_string())
      throw Error(std::string(name) + " first arg must be str or a tuple of str, got " + p.type_name());
    const std::string& x = p.str();
    if (x.size() > s.size()) return false;
    return start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (arg.is_list()) {
    for (const Value& p : arg.items())
      if (one(p)) return true;
    return false;
  }
  return one(arg);
}

}  // namespace

std::vector<std::string> utf8_chars(const std::string& s) {
  std::vector<std::string> out;
  const std::vector<uint32_t> cps = decode(s);
  for (size_t i = 0; i < cps.size(); ++i) out.push_back(encode(cps, i, i + 1));
  return out;
}

Value bound_method(const Value& self, const std::string& name) {
  if (self.is_string()) {
    const std::string s = self.str();
    auto method = [&](auto fn) { return Value::callable("str." + name, fn); };
    if (name == "startswith" || name == "endswith") {
      const bool start = name == "startswith";
      return method(
          [s, start, name](CallArgs& a) { return Value(starts_or_ends(s, a.get(0, "prefix"), start, name.c_str())); });
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const bool l = name != "rstrip", r = name != "lstrip";
      return method([s, l, r](CallArgs& a) { return Value(py_strip(s, a.get(0, "chars"), l, r)); });
    }
    if (name == "split" || name == "rsplit") {
      const bool right = name == "rsplit";
      return method([s, right](CallArgs& a) { return py_split(s, a.get(0, "sep"), a.get(1, "maxsplit"), right); });
    }
    if (name == "upper" || name == "lower") {
      const bool up = name == "upper";
      return method([s, up](CallArgs&) { return Value(map_case(s, up)); });
    }
    if (name == "capitalize" || name == "title") {
      const bool title = name == "title";
      return method([s, title](CallArgs&) {
        std::vector<uint32_t> cps = decode(s);
        bool word_start = true;
        for (size_t i = 0; i < cps.size(); ++i) {
          const auto c = static_cast<utf8proc_int32_t>(cps[i]);
          const bool letter =
              utf8proc_category(c) >= UTF8PROC_CATEGORY_LU && utf8proc_category(c) <= UTF8PROC_CATEGORY_LO;
          if ((title && word_start) || (!title && i == 0))
            cps[i] = static_cast<uint32_t>(utf8proc_toupper(c));
          else
            cps[i] = static_cast<uint32_t>(utf8proc_tolower(c));
          word_start = !letter;
        }
        return Value(encode(cps));
      });
    }
    if (name == "replace") {
      return method([s](CallArgs& a) {
        const Value from = a.get(0, "old"), to = a.get(1, "new"), count = a.get(2, "count");
        need_string(from, "replace");
        need_string(to, "replace");
        return Value(replace_all(s, from.str(), to.str(), count.is_int() ? count.as_int() : -1));
      });
    }
    if (name == "find" || name == "rfind" || name == "count") {
      return method([s, name](CallArgs& a) {
        const Value sub = a.get(0, "sub");
        need_string(sub, name.c_str());
        if (name == "count") {
          if (sub.str().empty()) return Value(static_cast<int64_t>(utf8_length(s) + 1));
          int64_t n = 0;
          for (size_t p = s.find(sub.str()); p != std::string::npos; p = s.find(sub.str(), p + sub.str().size())) ++n;
          return Value(n);
        }
        const size_t p = name == "find" ? s.find(sub.str()) : s.rfind(sub.str());
        if (p == std::string::npos) return Value(static_cast<int64_t>(-1));
        return Value(static_cast<int64_t>(utf8_length(s.substr(0, p))));
      });
    }
    if (name == "join") {
      return method([s](CallArgs& a) {
        std::string out;
        const List items = iterate(a.get(0, "iterable"));
        for (size_t i = 0; i < items.size(); ++i) {
          if (!items[i].is_string())
            throw Error("str.join: item " + std::to_string(i) + " is " + items[i].type_name() + ", not str");
          if (i > 0) out += s;
          out += items[i].str();
        }
        return Value(out);
      });
    }
    if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isupper" || name == "islower") {
      return method([s, name](CallArgs&) {
        const std::vector<uint32_t> cps = decode(s);
        if (cps.empty()) return Value(false);
        bool cased = false;
        for (uint32_t c : cps) {
          const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
          if (name == "isdigit" && cat != UTF8PROC_CATEGORY_ND) return Value(false);
          if (name == "isalpha" && !(cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO)) return Value(false);
          if (name == "isspace" && !py_space(c)) return Value(false);
          if (name == "isupper" && cat == UTF8PROC_CATEGORY_LL) return Value(false);
          if (name == "islower" && cat == UTF8PROC_CATEGORY_LU) return Value(false);
          cased |= cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL;
        }
        if (name == "isupper" || name == "islower") return Value(cased);
        return Value(true);
      });
    }
    return Value::undefined("str." + name);
  }
  if (self.is_dict()) {
    const Value d = self;
    if (name == "items")
      return Value::callable("dict.items", [d](CallArgs&) {
        List out;
        for (const auto& [k, v] : d.entries().items) out.push_back(Value::list({Value(k), v}));
        return Value::list(std::move(out));
      });
    if (name == "keys")
      return Value::callable("dict.keys", [d](CallArgs&) {
        List out;
        for (const auto& kv : d.entries().items) out.push_back(Value(kv.first));
        return Value::list(std::move(out));
      });
    if (name == "values")
      return Value::callable("dict.values", [d](CallArgs&) {
        List out;
        for (const auto& kv : d.entries().items) out.push_back(kv.second);
        return Value::list(std::move(out));
      });
    if (name == "get")
      return Value::callable("dict.get", [d](CallArgs& a) {
        const Value key = a.get(0, "key");
        if (key.is_string())
          if (const Value* v = d.entries().find(key.str())) return *v;
        return a.get(1, "default", Value::none());
      });
    return Value::undefined(name);
  }
  if (self.is_list()) {
    const Value l = self;
    if (name == "index")
      return Value::callable("list.index", [l](CallArgs& a) {
        const Value x = a.get(0, "value");
        for (size_t i = 0; i < l.items().size(); ++i)
          if (l.items()[i].equals(x)) return Value(static_cast<int64_t>(i));
        throw Error(x.repr() + " is not in list");
      });
    if (name == "count")
      return Value::callable("list.count", [l](CallArgs& a) {
        const Value x = a.get(0, "value");
        int64_t n = 0;
        for (const Value& v : l.items()) n += v.equals(x);
        return Value(n);
      });
    return Value::undefined(name);
  }
  return Value::undefined(name);
}

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value(a.to_string() + b.to_string());
  if (a.is_undefined() || b.is_undefined()) {
    const Value& u = a.is_undefined() ? a : b;
    throw Error("'" + (u.undefined_name().empty() ? std::string("value") : u.undefined_name()) +
                "' is undefined (in '" + op + "')");
  }
  auto type_error = [&]() -> Value {
    throw Error("unsupported operand types for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
  };
  const bool nums = a.is_number() && b.is_number();
  const bool ints = nums && !a.is_float() && !b.is_float();
  if (op == "+") {
    if (ints) return Value(a.as_int() + b.as_int());
    if (nums) return Value(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) return Value(a.str() + b.str());
    if (a.is_list() && b.is_list()) {
      List out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return Value::list(std::move(out));
    }
    return type_error();
  }
  if (op == "-") {
    if (ints) return Value(a.as_int() - b.as_int());
    if (nums) return Value(a.as_double() - b.as_double());
    return type_error();
  }
  if (op == "*") {
    if (ints) return Value(a.as_int() * b.as_int());
    if (nums) return Value(a.as_double() * b.as_double());
    const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
    const Value* n = seq == &a ? &b : &a;
    if (seq && (n->is_int() || n->is_bool())) {
      const int64_t times = std::max<int64_t>(n->as_int(), 0);
      if (times > 1000000) throw Error("sequence repetition too large");
      if (seq->is_string()) {
        std::string out;
        for (int64_t i = 0; i < times; ++i) out += seq->str();
        return Value(out);
      }
      List out;
      for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq->items().begin(), seq->items().end());
      return Value::list(std::move(out));
    }
    return type_error();
  }
  if (op == "/") {
    if (!nums) return type_error();
    if (b.as_double() == 0.0) throw Error("division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (!nums) {
      if (op == "%" && a.is_string()) throw Error("printf-style string formatting ('%') is not supported");
      return type_error();
    }
    if (b.as_double() == 0.0) throw Error("integer division or modulo by zero");
    if (ints) {
      const int64_t x = a.as_int(), y = b.as_int();
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        --q;
        r += y;
      }
      return op == "//" ? Value(q) : Value(r);
    }
    const double x = a.as_double(), y = b.as_double();
    const double q = std::floor(x / y);
    return op == "//" ? Value(q) : Value(x - q * y);
  }
  if (op == "**") {
    if (!nums) return type_error();
    if (ints && b.as_int() >= 0) {
      int64_t r = 1;
      for (int64_t i = 0; i < b.as_int() && i < 64; ++i) r *= a.as_int();
      return Value(r);
    }
    return Value(std::pow(a.as_double(), b.as_double()));
  }
  throw Error("unknown operator " + op);
}

namespace {

int three_way(const Value& a, const Value& b, const std::string& op) {
  if (a.is_number() && b.is_number()) {
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : a.str() > b.str() ? 1 : 0;
  if (a.is_list() && b.is_list()) {
    const List &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (x[i].equals(y[i])) continue;
      return three_way(x[i], y[i], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  throw Error("'" + op + "' not supported between '" + a.type_name() + "' and '" + b.type_name() + "'");
}

bool contains(const Value& container, const Value& x) {
  if (container.is_string()) {
    if (!x.is_string()) throw Error("'in <string>' requires a string as left operand, not " + x.type_name());
    return container.str().find(x.str()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& v : container.items())
      if (v.equals(x)) return true;
    return false;
  }
  if (container.is_dict() || container.is_namespace()) return x.is_string() && container.entries().find(x.str());
  if (container.is_undefined()) return false;
  throw Error("argument of type '" + container.type_name() + "' is not iterable");
}

}  // namespace

bool compare_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return a.equals(b);
  if (op == "!=") return !a.equals(b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  const int c = three_way(a, b, op);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  if (op == ">=") return c >= 0;
  throw Error("unknown comparison " + op);
}

Value slice(const Value& v, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto opt = [](const Value& x) -> std::optional<int64_t> {
    if (x.is_undefined() || x.is_none()) return std::nullopt;
    if (!x.is_int() && !x.is_bool()) throw Error("slice indices must be integers or None, got " + x.type_name());
    return x.as_int();
  };
  const int64_t step = opt(step_v).value_or(1);
  if (step == 0) throw Error("slice step cannot be zero");
  std::vector<std::string> chars;
  int64_t n = 0;
  if (v.is_list())
    n = static_cast<int64_t>(v.items().size());
  else if (v.is_string()) {
    chars = utf8_chars(v.str());
    n = static_cast<int64_t>(chars.size());
  } else {
    throw Error("'" + v.type_name() + "' object is not subscriptable with a slice");
  }
  // CPython's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> x, int64_t dflt) {
    if (!x) return dflt;
    int64_t i = *x;
    if (i < 0) {
      i += n;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= n) {
      i = step < 0 ? n - 1 : n;
    }
    return i;
  };
  const int64_t start = adjust(opt(start_v), step < 0 ? n - 1 : 0);
  const int64_t stop = adjust(opt(stop_v), step < 0 ? -1 : n);
  List items;
  std::string text;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (v.is_list())
      items.push_back(v.items()[static_cast<size_t>(i)]);
    else
      text += chars[static_cast<size_t>(i)];
  }
  return v.is_list() ? Value::list(std::move(items)) : Value(text);
}

List iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
      return v.items();
    case Value::Kind::kDict: {
      List out;
      for (const auto& kv : v.entries().items) out.push_back(Value(kv.first));
      return out;
    }
    case Value::Kind::kString: {
      List out;
      for (std::string& c : utf8_chars(v.str())) out.push_back(Value(std::move(c)));
      return out;
    }
    case Value::Kind::kUndefined:
      return {};
    default:
      throw Error("'" + v.type_name() + "' object is not iterable");
  }
}

std::optional<bool> apply_test(const std::string& name, const Value& v, const CallArgs& a) {
  using K = Value::Kind;
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind() == K::kInt;
  if (name == "float") return v.kind() == K::kFloat;
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
  if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
  if (name == "callable") return v.is_callable();
  if (name == "odd" || name == "even") {
    if (!v.is_int()) throw Error("the test '" + name + "' needs an integer, got " + v.type_name());
    const bool odd = (v.as_int() % 2) != 0;
    return name == "odd" ? odd : !odd;
  }
  if (name == "divisibleby") {
    const Value n = a.get(0, "num");
    if (!v.is_int() || !n.is_int() || n.as_int() == 0) throw Error("'divisibleby' needs integers");
    return v.as_int() % n.as_int() == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return v.equals(a.get(0, "other"));
  if (name == "ne" || name == "!=") return !v.equals(a.get(0, "other"));
  if (name == "lt" || name == "<" || name == "lessthan") return compare_op("<", v, a.get(0, "other"));
  if (name == "le" || name == "<=") return compare_op("<=", v, a.get(0, "other"));
  if (name == "gt" || name == "greaterthan" || name == ">") return compare_op(">", v, a.get(0, "other"));
  if (name == "ge" || name == ">=") return compare_op(">=", v, a.get(0, "other"));
  if (name == "in") return compare_op("in", v, a.get(0, "seq"));
  if (name == "sameas") {
    const Value o = a.get(0, "other");
    if (v.kind() != o.kind()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.is_bool()) return v.as_bool() == o.as_bool();
    return v.equals(o) && !v.is_list() && !v.is_dict();
  }
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    return name == "lower" ? map_case(v.str(), false) == v.str() : map_case(v.str(), true) == v.str();
  }
  return std::nullopt;
}

std::optional<Value> apply_filter(const std::string& name, const Value& v, const CallArgs& a) {
  if (name == "length" || name == "count") {
    if (v.is_string()) return Value(static_cast<int64_t>(utf8_length(v.str())));
    if (v.is_list()) return Value(static_cast<int64_t>(v.items().size()));
    if (v.is_dict()) return Value(static_cast<int64_t>(v.entries().items.size()));
    if (v.is_undefined()) return Value(static_cast<int64_t>(0));
    throw Error("object of type '" + v.type_name() + "' has no len()");
  }
  if (name == "tojson") {
    const Value indent = a.get(1, "indent");
    const Value separators = a.get(2, "separators");
    const Value sort_keys = a.get(3, "sort_keys");
    std::optional<std::pair<std::string, std::string>> seps;
    if (separators.is_list() && separators.items().size() == 2 && separators.items()[0].is_string() &&
        separators.items()[1].is_string())
      seps = std::make_pair(separators.items()[0].str(), separators.items()[1].str());
    const int ind = indent.is_int() ? static_cast<int>(indent.as_int()) : -1;
    return Value(v.to_json(ind, seps, sort_keys.truthy()));
  }
  if (name == "string") return Value(v.to_string());
  if (name == "trim") {
    if (v.is_undefined()) return Value(std::string());
    return Value(py_strip(v.to_string(), a.get(0, "chars"), true, true));
  }
  if (name == "upper" || name == "lower") return Value(map_case(v.to_string(), name == "upper"));
  if (name == "capitalize" || name == "title") {
    CallArgs none;
    return bound_method(Value(v.to_string()), name).fn().fn(none);
  }
  if (name == "first" || name == "last") {
    const List items = iterate(v);
    if (items.empty()) return Value::undefined("first item of an empty sequence");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const Value sep = a.get(0, "d", Value(std::string()));
    const Value attr = a.get(1, "attribute");
    std::string out;
    const List items = iterate(v);
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += sep.to_string();
      out += (attr.is_string() ? items[i].get_attr(attr.str()) : items[i]).to_string();
    }
    return Value(out);
  }
  if (name == "default" || name == "d") {
    const Value fallback = a.get(0, "default_value", Value(std::string()));
    const bool boolean = a.get(1, "boolean", Value(false)).truthy();
    if (v.is_undefined() || (boolean && !v.truthy())) return fallback;
    return v;
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::list();
    if (!v.is_dict()) throw Error("the filter 'items' needs a mapping, got " + v.type_name());
    CallArgs none;
    return v.get_attr("items").fn().fn(none);
  }
  if (name == "list") return Value::list(iterate(v));
  if (name == "reverse") {
    if (v.is_string()) {
      std::vector<std::string> c = utf8_chars(v.str());
      std::string out;
      for (auto it = c.rbegin(); it != c.rend(); ++it) out += *it;
      return Value(out);
    }
    List items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::list(std::move(items));
  }
  if (name == "int") {
    const Value fallback = a.get(0, "default", Value(static_cast<int64_t>(0)));
    if (v.is_int() || v.is_bool()) return Value(v.as_int());
    if (v.is_float()) return Value(static_cast<int64_t>(v.as_double()));
    if (v.is_string()) {
      try {
        size_t used = 0;
        const int64_t i = std::stoll(v.str(), &used);
        if (used == v.str().size()) return Value(i);
      } catch (const std::exception&) {
      }
    }
    return fallback;
  }
  if (name == "float") {
    const Value fallback = a.get(0, "default", Value(0.0));
    if (v.is_number()) return Value(v.as_double());
    if (v.is_string()) {
      try {
        size_t used = 0;
        const double d = std::stod(v.str(), &used);
        if (used == v.str().size()) return Value(d);
      } catch (const std::exception&) {
      }
    }
    return fallback;
  }
  if (name == "abs") {
    if (v.is_int()) return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
    if (v.is_number()) return Value(std::fabs(v.as_double()));
    throw Error("bad operand type for abs(): '" + v.type_name() + "'");
  }
  if (name == "replace") {
    CallArgs b = a;
    return bound_method(Value(v.to_string()), "replace").fn().fn(b);
  }
  if (name == "safe") return v;
  if (name == "indent") {
    const Value width = a.get(0, "width", Value(static_cast<int64_t>(4)));
    const bool first = a.get(1, "first", Value(false)).truthy();
    const bool blank = a.get(2, "blank", Value(false)).truthy();
    const std::string pad =
        width.is_string() ? width.str() : std::string(static_cast<size_t>(std::max<int64_t>(width.as_int(), 0)), ' ');
    const std::string s = v.to_string();
    std::string out;
    size_t start = 0;
    bool first_line = true;
    for (;;) {
      const size_t nl = s.find('\n', start);
      const std::string line = s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
      if ((!first_line || first) && (blank || !line.empty())) out += pad;
      out += line;
      if (nl == std::string::npos) break;
      out += '\n';
      start = nl + 1;
      first_line = false;
    }
    return Value(out);
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool attr = name == "selectattr" || name == "rejectattr";
    const bool keep_if = name == "select" || name == "selectattr";
    const size_t first_test_arg = attr ? 1 : 0;
    const Value attr_name = attr ? a.get(0, "attribute") : Value();
    const Value test = a.args.size() > first_test_arg ? a.args[first_test_arg] : Value();
    CallArgs test_args;
    for (size_t i = first_test_arg + 1; i < a.args.size(); ++i) test_args.args.push_back(a.args[i]);
    List out;
    for (const Value& item : iterate(v)) {
      const Value subject = attr ? item.get_attr(attr_name.to_string()) : item;
      bool ok = subject.truthy();
      if (test.is_string()) {
        std::optional<bool> r = apply_test(test.str(), subject, test_args);
        if (!r) throw Error("the test '" + test.str() + "' is not supported");
        ok = *r;
      }
      if (ok == keep_if) out.push_back(item);
    }
    return Value::list(std::move(out));
  }
  if (name == "map") {
    const Value attr = a.get(99, "attribute");
    List out;
    if (attr.is_string()) {
      const Value fallback = a.get(99, "default");
      for (const Value& item : iterate(v)) {
        Value x = item.get_attr(attr.str());
        out.push_back(x.is_undefined() && !fallback.is_undefined() ? fallback : x);
      }
      return Value::list(std::move(out));
    }
    if (a.args.empty() || !a.args[0].is_string()) throw Error("the filter 'map' needs a filter name or attribute=");
    CallArgs rest;
    for (size_t i = 1; i < a.args.size(); ++i) rest.args.push_back(a.args[i]);
    for (const Value& item : iterate(v)) {
      std::optional<Value> r = apply_filter(a.args[0].str(), item, rest);
      if (!r) throw Error("the filter '" + a.args[0].str() + "' is not supported");
      out.push_back(*r);
    }
    return Value::list(std::move(out));
  }
  if (name == "unique") {
    List out;
    for (const Value& item : iterate(v)) {
      bool seen = false;
      for (const Value& o : out) seen |= o.equals(item);
      if (!seen) out.push_back(item);
    }
    return Value::list(std::move(out));
  }
  if (name == "sort") {
    const bool reverse = a.get(0, "reverse", Value(false)).truthy();
    const Value attr = a.get(2, "attribute");
    List items = iterate(v);
    auto key = [&](const Value& x) { return attr.is_string() ? x.get_attr(attr.str()) : x; };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      return reverse ? compare_op("<", key(y), key(x)) : compare_op("<", key(x), key(y));
    });
    return Value::list(std::move(items));
  }
  return std::nullopt;
}

Dict make_globals() {
  Dict g;
  g.set("range", Value::callable("range", [](CallArgs& a) {
          int64_t start = 0, stop = 0, step = 1;
          for (const Value& x : a.args)
            if (!x.is_int()) throw Error("range() arguments must be integers, got " + x.type_name());
          if (a.args.size() == 1)
            stop = a.args[0].as_int();
          else if (a.args.size() >= 2) {
            start = a.args[0].as_int();
            stop = a.args[1].as_int();
            if (a.args.size() >= 3) step = a.args[2].as_int();
          } else {
            throw Error("range() takes 1 to 3 arguments");
          }
          if (step == 0) throw Error("range() step must not be zero");
          List out;
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (out.size() >= 1000000) throw Error("range() of more than 1000000 items");
            out.push_back(Value(i));
          }
          return Value::list(std::move(out));
        }));
  g.set("namespace", Value::callable("namespace", [](CallArgs& a) {
          Dict d;
          for (const Value& x : a.args) {
            if (!x.is_dict()) throw Error("namespace() takes keyword arguments or a mapping");
            for (const auto& [k, v] : x.entries().items) d.set(k, v);
          }
          for (const auto& [k, v] : a.kwargs) d.set(k, v);
          return Value::ns(std::move(d));
        }));
  g.set("dict", Value::callable("dict", [](CallArgs& a) {
          Dict d;
          for (const Value& x : a.args)
            if (x.is_dict())
              for (const auto& [k, v] : x.entries().items) d.set(k, v);
          for (const auto& [k, v] : a.kwargs) d.set(k, v);
          return Value::dict(std::move(d));
        }));
  g.set("raise_exception", Value::callable("raise_exception", [](CallArgs& a) -> Value {
          throw Error("the chat template raised an error: " + a.get(0, "message").to_string());
        }));
  g.set("strftime_now", Value::callable("strftime_now", [](CallArgs& a) {
          const Value fmt = a.get(0, "format");
          if (!fmt.is_string()) throw Error("strftime_now() needs a format string");
          const std::time_t t = std::time(nullptr);
          std::tm tm{};
          localtime_r(&t, &tm);
          char buf[256];
          const size_t n = std::strftime(buf, sizeof(buf), fmt.str().c_str(), &tm);
          return Value(std::string(buf, n));
        }));
  return g;
}

}  // namespace siesta::jinja
