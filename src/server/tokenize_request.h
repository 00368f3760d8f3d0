// A /tokenize body: the text it asks to encode, its prompt or its
// conversation in the chat format (openai_request.h renders it as
// /v1/chat/completions does). A pure function; fuzzed (tests/fuzz).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "common/status.h"

namespace siesta::server {

Result<std::string> tokenize_text(const nlohmann::json& body);

}  // namespace siesta::server
