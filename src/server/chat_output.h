// What a chat choice's generated text becomes in the response: reasoning
// split from the answer as vLLM's qwen3 reasoning parser splits it, and tool
// calls parsed from Qwen3's <tool_call> format as vLLM's hermes tool parser
// parses them. Whole (parse_chat_output) or as a stream (ChatStreamParser).
//
// Reasoning (ReasoningMode::kSplit): a leading "<think>" is dropped; the
// text before "</think>" is the reasoning, the rest the content (null when
// empty). Without "</think>" the output was cut short: all of it is
// reasoning. kContentOnly (thinking disabled, or the prompt already closed
// the reasoning): all of it is content. kNone: no reasoning parser.
//
// Tool calls (parse_tools): every <tool_call>JSON</tool_call> (the last one
// may be unclosed) holds {"name", "arguments"}; arguments are written back
// as JSON text (Python's json.dumps, ensure_ascii off). The content is the
// text before the first <tool_call> (null when empty). One block that is not
// such JSON and no tool call is taken (the whole text stays content), as in
// vLLM. Streaming sends each tool call whole, in one delta, once its
// </tool_call> arrives (vLLM streams the arguments in pieces; clients that
// join deltas by index see the same call).
//
// Pure functions and a per-choice value; not thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace siesta::server {

enum class ReasoningMode { kNone, kContentOnly, kSplit };

struct ParsedToolCall {
  std::string id;  // "chatcmpl-tool-" + 32 hex digits
  std::string name;
  std::string arguments;  // JSON text
};

struct ChatOutputOptions {
  ReasoningMode reasoning = ReasoningMode::kNone;
  bool include_reasoning = true;  // false: the reasoning is dropped from the answer
  bool parse_tools = false;
  bool single_tool_call = false;  // parallel_tool_calls false, or a named tool_choice: the first call only
};

struct ParsedChatOutput {
  std::optional<std::string> reasoning;
  std::optional<std::string> content;
  std::vector<ParsedToolCall> tool_calls;
};

// vLLM's Qwen3ReasoningParser.extract_reasoning (mode kSplit or kContentOnly).
ParsedChatOutput split_reasoning(const std::string& text, ReasoningMode mode);

// vLLM's Hermes2ProToolParser.extract_tool_calls on `content`.
struct ToolCallParse {
  bool tools_called = false;
  std::vector<ParsedToolCall> calls;
  std::optional<std::string> content;
};
ToolCallParse parse_tool_calls(const std::string& content);

ParsedChatOutput parse_chat_output(const std::string& text, const ChatOutputOptions& options);

class ChatStreamParser {
 public:
  explicit ChatStreamParser(ChatOutputOptions options) : o_(std::move(options)) {}

  struct Delta {
    std::string reasoning;
    std::string content;
    std::vector<ParsedToolCall> tool_calls;
    size_t first_tool_index = 0;  // index of tool_calls[0] among the choice's calls
    bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  };

  Delta push(const std::string& text);
  // The end of the choice: whatever was held back.
  Delta finish();
  bool tools_called() const { return num_tools_ > 0; }

 private:
  void route(const std::string& content, Delta& d, bool final);
  void tools(const std::string& content, Delta& d, bool final);

  ChatOutputOptions o_;
  // reasoning
  bool started_ = false;  // past a possible leading <think>
  bool in_reasoning_ = true;
  std::string held_;  // text that may be the start of <think> / </think>
  // tools
  enum class ToolState { kText, kInCall, kAfterCalls } tool_state_ = ToolState::kText;
  std::string tool_buf_;
  size_t num_tools_ = 0;
};

// "chatcmpl-tool-" + 32 random hex digits.
std::string make_tool_call_id();

}  // namespace siesta::server
