#include "server/json_fields.h"

#include <cmath>

namespace siesta::server {
namespace {

const nlohmann::json* member(const nlohmann::json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string quoted(const char* key) { return std::string("'") + key + "'"; }

// An integral JSON number (1 and 1.0, not 1.5) as int64.
std::optional<int64_t> as_integer(const nlohmann::json& v) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return INT64_MAX;
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

std::string range_rule(int64_t min, int64_t max) {
  if (min == INT64_MIN && max == INT64_MAX) return "an integer";
  if (max == INT64_MAX) return "an integer >= " + std::to_string(min);
  if (min == INT64_MIN) return "an integer <= " + std::to_string(max);
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

}  // namespace

std::string json_type_name(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::number_float: return "a number (" + v.dump() + ")";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "an integer (" + v.dump() + ")";
    default: return "an unsupported value";
  }
}

Result<std::optional<bool>> read_bool(const nlohmann::json& obj, const char* key) {
  const nlohmann::json* v = member(obj, key);
  if (!v) return std::optional<bool>();
  if (!v->is_boolean()) return invalid_argument(quoted(key) + " must be a boolean, got " + json_type_name(*v));
  return std::optional<bool>(v->get<bool>());
}

Result<std::optional<int64_t>> read_int(const nlohmann::json& obj, const char* key, int64_t min, int64_t max) {
  const nlohmann::json* v = member(obj, key);
  if (!v) return std::optional<int64_t>();
  const std::optional<int64_t> i = v->is_number() ? as_integer(*v) : std::nullopt;
  if (!i) return invalid_argument(quoted(key) + " must be " + range_rule(min, max) + ", got " + json_type_name(*v));
  if (*i < min || *i > max)
    return invalid_argument(quoted(key) + " must be " + range_rule(min, max) + ", got " + std::to_string(*i));
  return std::optional<int64_t>(*i);
}

Result<std::optional<double>> read_number(const nlohmann::json& obj, const char* key) {
  const nlohmann::json* v = member(obj, key);
  if (!v) return std::optional<double>();
  if (!v->is_number()) return invalid_argument(quoted(key) + " must be a number, got " + json_type_name(*v));
  return std::optional<double>(v->get<double>());
}

Result<std::optional<std::string>> read_string(const nlohmann::json& obj, const char* key) {
  const nlohmann::json* v = member(obj, key);
  if (!v) return std::optional<std::string>();
  if (!v->is_string()) return invalid_argument(quoted(key) + " must be a string, got " + json_type_name(*v));
  return std::optional<std::string>(v->get<std::string>());
}

Result<std::vector<std::string>> read_strings(const nlohmann::json& obj, const char* key) {
  std::vector<std::string> out;
  const nlohmann::json* v = member(obj, key);
  if (!v) return out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
    return out;
  }
  if (!v->is_array())
    return invalid_argument(quoted(key) + " must be a string or an array of strings, got " + json_type_name(*v));
  for (const nlohmann::json& e : *v) {
    if (!e.is_string())
      return invalid_argument(quoted(key) + " must be a string or an array of strings, got an element that is " +
                              json_type_name(e));
    out.push_back(e.get<std::string>());
  }
  return out;
}

Result<std::vector<int32_t>> read_int_list(const nlohmann::json& obj, const char* key, int64_t min, int64_t max) {
  std::vector<int32_t> out;
  const nlohmann::json* v = member(obj, key);
  if (!v) return out;
  if (!v->is_array()) return invalid_argument(quoted(key) + " must be an array of integers, got " + json_type_name(*v));
  for (const nlohmann::json& e : *v) {
    const std::optional<int64_t> i = e.is_number() ? as_integer(e) : std::nullopt;
    if (!i || *i < min || *i > max)
      return invalid_argument(quoted(key) + " must hold " + range_rule(min, max) + " values, got " +
                              json_type_name(e));
    out.push_back(static_cast<int32_t>(*i));
  }
  return out;
}

Result<nlohmann::json> read_object(const nlohmann::json& obj, const char* key) {
  const nlohmann::json* v = member(obj, key);
  if (!v) return nlohmann::json::object();
  if (!v->is_object()) return invalid_argument(quoted(key) + " must be an object, got " + json_type_name(*v));
  return *v;
}

Result<int32_t> token_id_at(const nlohmann::json& v, const std::string& where, int64_t max) {
  const std::optional<int64_t> i = v.is_number() ? as_integer(v) : std::nullopt;
  if (!i) return invalid_argument(where + " must be a token id (an integer), got " + json_type_name(v));
  if (*i < 0 || *i >= max)
    return invalid_argument(where + " is token id " + std::to_string(*i) + ", outside the vocabulary [0, " +
                            std::to_string(max) + ")");
  return static_cast<int32_t>(*i);
}

}  // namespace siesta::server
