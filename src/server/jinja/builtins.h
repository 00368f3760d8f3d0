// The Python and Jinja behaviour the renderer needs: operators, slicing,
// iteration, string and dict methods, filters, tests and globals. Each
// throws jinja::Error naming what it cannot do.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "server/jinja/value.h"

namespace siesta::jinja {

std::vector<std::string> utf8_chars(const std::string& s);

// The method `name` of a str, dict or list value bound to it; undefined when
// it has none (or when it would mutate: the sandbox HF renders in forbids that).
Value bound_method(const Value& self, const std::string& name);

Value binary_op(const std::string& op, const Value& a, const Value& b);
bool compare_op(const std::string& op, const Value& a, const Value& b);
Value slice(const Value& v, const Value& start, const Value& stop, const Value& step);
// Python iteration: list items, dict keys, string characters; undefined is empty.
List iterate(const Value& v);

// Filters and tests by name; nullopt when the name is not known.
std::optional<Value> apply_filter(const std::string& name, const Value& v, const CallArgs& args);
std::optional<bool> apply_test(const std::string& name, const Value& v, const CallArgs& args);

// range, namespace, dict, raise_exception, strftime_now (HF's globals).
Dict make_globals();

}  // namespace siesta::jinja
