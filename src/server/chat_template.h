// ChatTemplate: the model's chat template (Jinja, from tokenizer_config.json)
// rendering a conversation into the prompt text, as Hugging Face's
// apply_chat_template renders it for vLLM.
//
//   SIESTA_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::load(model_dir, flags.chat_template));
//   ChatRenderInput in;
//   in.messages = ...;                     // vLLM's conversation: roles, string contents, tool_calls with
//                                          // arguments as objects, tool_call_id, reasoning_content
//   in.tools = ...;                        // null, or vLLM's tool dicts {type, function{name, description,
//   parameters}} SIESTA_ASSIGN_OR_RETURN(std::string prompt, t.render(in));
//
// Where the template comes from, first found: `override` (--chat-template:
// a file, or the template text itself), DIR/tokenizer_config.json's
// chat_template (a string, or a list of {name, template}: "tool_use" when
// tools are given and it exists, else "default"), DIR/chat_template.jinja,
// else the Qwen3 template built in (the embedded test model has none).
//
// The context is HF's: messages, tools, documents, add_generation_prompt,
// the tokenizer's special tokens (bos_token, eos_token, ...), then
// chat_template_kwargs. continue_final_message renders the last message with
// a tag and cuts there, as transformers 5 does. Immutable; render is
// thread-safe.
#pragma once

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"
#include "server/jinja/template.h"

namespace siesta::server {

struct ChatRenderInput {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;      // null or an array
  nlohmann::ordered_json documents;  // null or an array
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();  // chat_template_kwargs
};

class ChatTemplate {
 public:
  static Result<ChatTemplate> load(const std::filesystem::path& model_dir, const std::string& override = {});
  // `special_tokens`: {"eos_token": "...", ...} as tokenizer_config.json names them.
  static Result<ChatTemplate> from_source(std::string source, std::string origin,
                                          nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object(),
                                          std::string tool_use_source = {});

  // kInvalidArgument: what the template cannot render (naming the construct
  // and line), a template's raise_exception, continue_final_message whose
  // message the template drops, kwargs naming a reserved variable.
  Result<std::string> render(const ChatRenderInput& in) const;

  const std::string& origin() const { return origin_; }
  const std::string& source() const { return source_; }

 private:
  ChatTemplate() = default;
  std::string source_;
  std::string origin_;
  std::shared_ptr<const jinja::Template> template_;
  std::shared_ptr<const jinja::Template> tool_use_;  // null: the default serves tools too
  nlohmann::ordered_json special_tokens_;
};

// The Qwen3 chat template (tokenizer_config.json of the Qwen3 releases), used
// when a model directory has none.
const std::string& builtin_qwen3_template();

}  // namespace siesta::server
