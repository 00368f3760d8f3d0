#include "server/api_error.h"

namespace siesta::server {

ApiError ApiError::from_status(const Status& s) {
  switch (s.code) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kCorrupt:
      return ApiError{400, "invalid_request_error", "invalid_value", s.message, {}};
    case ErrorCode::kNotFound:
      return ApiError{404, "invalid_request_error", "not_found", s.message, {}};
    case ErrorCode::kConflict:
      return ApiError{409, "invalid_request_error", "conflict", s.message, {}};
    case ErrorCode::kUnavailable:
    case ErrorCode::kOutOfMemory:
      return ApiError{503, "service_unavailable", "unavailable", s.message, {}};
    case ErrorCode::kTimeout:
      return ApiError{504, "server_error", "timeout", s.message, {}};
    case ErrorCode::kIo:
    case ErrorCode::kInternal:
      break;
  }
  return ApiError{500, "server_error", "internal_error", s.message, {}};
}

nlohmann::json ApiError::to_json() const {
  nlohmann::json e{{"message", message}, {"type", type}, {"code", code}};
  e["param"] = param.empty() ? nlohmann::json() : nlohmann::json(param);
  return nlohmann::json{{"error", std::move(e)}};
}

ApiError bad_request(std::string message, std::string param) {
  return ApiError{400, "invalid_request_error", "invalid_value", std::move(message), std::move(param)};
}

}  // namespace siesta::server
