#include "proxy/openai_error.h"

#include <nlohmann/json.hpp>

namespace siesta::proxy {

std::string openai_error_body(int status, std::string_view code, const std::string& message, const std::string& param) {
  const char* type = status == 401   ? "authentication_error"
                     : status == 403 ? "permission_error"
                     : status >= 500 ? "server_error"
                                     : "invalid_request_error";
  nlohmann::json error = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", std::string(code)}};
  if (!param.empty()) error["param"] = param;
  return nlohmann::json{{"error", std::move(error)}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace siesta::proxy
