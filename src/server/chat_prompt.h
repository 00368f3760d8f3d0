// The Qwen3 chat format (ChatML), written out natively: what Qwen3's
// tokenizer_config.json chat template renders for conversations without tools.
//
//   <|im_start|>system\n{content}<|im_end|>\n        (a leading system message)
//   <|im_start|>user\n{content}<|im_end|>\n
//   <|im_start|>assistant\n{content}<|im_end|>\n
//   <|im_start|>assistant\n                          (add_generation_prompt)
//   <think>\n\n</think>\n\n                          (and enable_thinking: false)
//
// As the template does: assistant turns before the last user query lose their
// <think>...</think> part; assistant turns after it keep their reasoning
// (reasoning_content, or the <think> part of content) as a <think> block;
// consecutive tool messages become one user turn of <tool_response> blocks;
// a system message after the first is kept in place.
// continue_final_message leaves the last (assistant) turn open, without
// <|im_end|>, as transformers' apply_chat_template does.
// Pure functions.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta::server {

struct ChatMessage {
  std::string role;     // system, user, assistant, tool
  std::string content;
  std::optional<std::string> reasoning_content;  // assistant
};

struct ChatPromptOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;
  bool continue_final_message = false;
};

// kInvalidArgument: no messages, an unknown role, continue_final_message
// without a final assistant message or together with add_generation_prompt.
Result<std::string> render_qwen3_chat(const std::vector<ChatMessage>& messages, const ChatPromptOptions& options);

}  // namespace siesta::server
