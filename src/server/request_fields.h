// Which request fields /v1/completions and /v1/chat/completions know, and
// what happens to each: siesta refuses a field it does not know, and a known
// field it cannot honour unless the field holds its neutral value, so that
// nothing a client sends is silently ignored. The few fields accepted with
// no effect are those vLLM ignores too (ignored_fields(); docs/vllm-compatibility.md).
//
//   SIESTA_TRY(check_request_fields(body, ApiKind::kChat));   // before reading the fields
//
// Pure functions.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "server/sampling_request.h"

namespace siesta::server {

// kInvalidArgument naming the first field that is unknown, or known and not
// supported with the value it has.
Result<void> check_request_fields(const nlohmann::json& body, ApiKind kind);

// Fields accepted and without effect, because vLLM gives them none either
// (for this model family and this server's features).
const std::vector<std::string_view>& ignored_fields(ApiKind kind);

}  // namespace siesta::server
