// Typed reads of the optional members of a JSON object (a request body).
// A missing member and null both mean "absent". A member of the wrong type or
// out of range is kInvalidArgument naming the field, the rule and what came:
//   "'max_tokens' must be an integer >= 1, got -3"
//   "'temperature' must be a number, got a string"
//
//   SIESTA_ASSIGN_OR_RETURN(std::optional<double> t, read_number(body, "temperature"));
//
// Free functions over nlohmann::json; no exceptions escape them.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta::server {

// "a string", "an array", "null", ... for messages.
std::string json_type_name(const nlohmann::json& v);

Result<std::optional<bool>> read_bool(const nlohmann::json& obj, const char* key);
Result<std::optional<int64_t>> read_int(const nlohmann::json& obj, const char* key, int64_t min = INT64_MIN,
                                        int64_t max = INT64_MAX);
Result<std::optional<double>> read_number(const nlohmann::json& obj, const char* key);
Result<std::optional<std::string>> read_string(const nlohmann::json& obj, const char* key);
// A string or an array of strings (OpenAI's `stop`).
Result<std::vector<std::string>> read_strings(const nlohmann::json& obj, const char* key);
// An array of integers in [min, max].
Result<std::vector<int32_t>> read_int_list(const nlohmann::json& obj, const char* key, int64_t min, int64_t max);
// An object member; absent or null gives an empty object.
Result<nlohmann::json> read_object(const nlohmann::json& obj, const char* key);

// One array element as a token id in [0, max).
Result<int32_t> token_id_at(const nlohmann::json& v, const std::string& where, int64_t max);

}  // namespace siesta::server
