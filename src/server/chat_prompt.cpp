#include "server/chat_prompt.h"

#include <string_view>

namespace siesta::server {
namespace {

constexpr std::string_view kStart = "<|im_start|>";
constexpr std::string_view kEnd = "<|im_end|>\n";

std::string lstrip_newlines(std::string_view s) {
  const size_t b = s.find_first_not_of('\n');
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b));
}
std::string rstrip_newlines(std::string_view s) {
  const size_t e = s.find_last_not_of('\n');
  return e == std::string_view::npos ? std::string() : std::string(s.substr(0, e + 1));
}
std::string strip_newlines(std::string_view s) { return lstrip_newlines(rstrip_newlines(s)); }

bool is_tool_response(const std::string& s) {
  constexpr std::string_view open = "<tool_response>";
  constexpr std::string_view close = "</tool_response>";
  return s.size() >= open.size() + close.size() && s.compare(0, open.size(), open) == 0 &&
         s.compare(s.size() - close.size(), close.size(), close) == 0;
}

}  // namespace

Result<std::string> render_qwen3_chat(const std::vector<ChatMessage>& msgs, const ChatPromptOptions& opt) {
  if (msgs.empty()) return invalid_argument("'messages' must hold at least one message");
  for (size_t i = 0; i < msgs.size(); ++i) {
    const std::string& r = msgs[i].role;
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      return invalid_argument("messages[" + std::to_string(i) + "].role must be system, user, assistant or tool, got '" +
                              r + "'");
  }
  if (opt.continue_final_message) {
    if (opt.add_generation_prompt)
      return invalid_argument("'continue_final_message' and 'add_generation_prompt' cannot both be true");
    if (msgs.back().role != "assistant")
      return invalid_argument("'continue_final_message' needs the last message to be from the assistant");
  }

  std::string out;
  if (msgs[0].role == "system") out.append(kStart).append("system\n").append(msgs[0].content).append(kEnd);

  // The last user query: later assistant turns keep their reasoning.
  size_t last_query = msgs.size() - 1;
  for (size_t k = msgs.size(); k-- > 0;) {
    if (msgs[k].role == "user" && !is_tool_response(msgs[k].content)) {
      last_query = k;
      break;
    }
  }

  size_t open_turn_end = std::string::npos;  // where the last assistant turn's <|im_end|> starts
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const bool last = i + 1 == msgs.size();
    if (m.role == "user" || (m.role == "system" && i > 0)) {
      out.append(kStart).append(m.role).append("\n").append(m.content).append(kEnd);
    } else if (m.role == "assistant") {
      std::string content = m.content;
      std::string reasoning;
      if (m.reasoning_content) {
        reasoning = *m.reasoning_content;
      } else if (const size_t close = m.content.find("</think>"); close != std::string::npos) {
        std::string before = rstrip_newlines(std::string_view(m.content).substr(0, close));
        const size_t open = before.rfind("<think>");
        if (open != std::string::npos) before = before.substr(open + 7);
        reasoning = lstrip_newlines(before);
        content = lstrip_newlines(std::string_view(m.content).substr(m.content.rfind("</think>") + 8));
      }
      out.append(kStart).append("assistant\n");
      if (i > last_query && (last || !reasoning.empty()))
        out.append("<think>\n").append(strip_newlines(reasoning)).append("\n</think>\n\n").append(lstrip_newlines(content));
      else
        out.append(content);
      open_turn_end = out.size();
      out.append(kEnd);
    } else if (m.role == "tool") {
      if (i == 0 || msgs[i - 1].role != "tool") out.append(kStart).append("user");
      out.append("\n<tool_response>\n").append(m.content).append("\n</tool_response>");
      if (last || msgs[i + 1].role != "tool") out.append(kEnd);
    }
  }
  if (opt.continue_final_message) {
    out.resize(open_turn_end);
    return out;
  }
  if (opt.add_generation_prompt) {
    out.append(kStart).append("assistant\n");
    if (!opt.enable_thinking) out.append("<think>\n\n</think>\n\n");
  }
  return out;
}

}  // namespace siesta::server
