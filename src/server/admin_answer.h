// AdminAnswer: what an admin call answers, apart from the transport that
// carries it: the HTTP status and the JSON body (OpenAI error JSON, api_error.h,
// for a status of 400 and above). The HTTP routes send it as they are; the
// weight socket (weight_socket.h) wraps it as {"status": ..., "body": ...}.
#pragma once

#include <nlohmann/json.hpp>

#include "server/api_error.h"

namespace siesta::server {

struct AdminAnswer {
  int status = 200;
  nlohmann::json body;

  static AdminAnswer refusal(const ApiError& error) { return AdminAnswer{error.status, error.to_json()}; }
};

}  // namespace siesta::server
