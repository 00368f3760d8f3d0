// Errors as the proxy's clients expect them, in the OpenAI shape `siesta
// serve` also answers with:
//   {"error": {"message": "...", "type": "server_error", "param": null, "code": "prefill_failed"}}
// type follows the HTTP status (400/404/409 invalid_request_error, 401
// authentication_error, 403 permission_error, 5xx server_error); code is
// machine-readable.
#pragma once

#include <string>
#include <string_view>

namespace siesta::proxy {

// Codes the proxy uses.
namespace error_code {
inline constexpr std::string_view kInvalidJson = "invalid_json";
inline constexpr std::string_view kInvalidValue = "invalid_value";
inline constexpr std::string_view kJsonTooDeep = "json_too_deep";
inline constexpr std::string_view kInvalidApiKey = "invalid_api_key";
inline constexpr std::string_view kAdminNotAllowed = "admin_not_allowed";
inline constexpr std::string_view kNotFound = "not_found";
inline constexpr std::string_view kNoInstanceUp = "no_instance_up";
inline constexpr std::string_view kWakeTimeout = "wake_timeout";
inline constexpr std::string_view kPrefillFailed = "prefill_failed";
inline constexpr std::string_view kDecodeFailed = "decode_failed";
inline constexpr std::string_view kPrefillAborted = "prefill_aborted";
inline constexpr std::string_view kProxyStopping = "proxy_stopping";
inline constexpr std::string_view kInternal = "internal_error";
}  // namespace error_code

// The error JSON as text. param: the request field at fault, or empty (null).
std::string openai_error_body(int status, std::string_view code, const std::string& message,
                              const std::string& param = {});

}  // namespace siesta::proxy
