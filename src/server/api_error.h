// ApiError: an HTTP error as the OpenAI API shapes it:
//   {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": "..."}}
//
//   return ApiError::from_status(result.error());       // 400 / 404 / 409 / 503 ... by ErrorCode
//   return ApiError{404, "invalid_request_error", "model_not_found", "The model `x` does not exist."};
//
// A plain value; thread-safe as any value.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "common/status.h"

namespace siesta::server {

struct ApiError {
  int status = 500;
  std::string type;     // invalid_request_error, authentication_error, server_error, ...
  std::string code;     // machine-readable: invalid_value, model_not_found, ...
  std::string message;  // one line an operator or a client can act on
  std::string param;    // the request field at fault, when one is

  // kInvalidArgument 400, kNotFound 404, kConflict 409, kUnavailable 503,
  // kTimeout 504, kOutOfMemory 503, anything else 500.
  static ApiError from_status(const Status& status);
  nlohmann::json to_json() const;
};

ApiError bad_request(std::string message, std::string param = {});

}  // namespace siesta::server
