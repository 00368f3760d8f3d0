// ChatConfig: how a server renders and reads chat requests, from vLLM's
// serve flags (--enable-auto-tool-choice, --tool-call-parser,
// --reasoning-parser, --trust-request-chat-template,
// --exclude-tools-when-tool-choice-none, --default-chat-template-kwargs).
// A plain value.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace siesta::server {

struct ChatConfig {
  bool enable_auto_tool_choice = false;
  std::string tool_call_parser;  // "" or "hermes" (Qwen's <tool_call> JSON format)
  std::string reasoning_parser;  // "" or "qwen3"
  bool trust_request_chat_template = false;
  bool exclude_tools_when_tool_choice_none = false;
  nlohmann::ordered_json default_chat_template_kwargs = nlohmann::ordered_json::object();
};

}  // namespace siesta::server
