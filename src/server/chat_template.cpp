#include "server/chat_template.h"

#include <fstream>
#include <sstream>

#include "common/log.h"

namespace siesta::server {
namespace {

constexpr const char* kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

// Variables the request's own fields set; chat_template_kwargs may not.
constexpr const char* kReserved[] = {"messages", "tools", "documents", "add_generation_prompt"};

Result<std::string> read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return io_error("cannot read " + p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// tokenizer_config.json's special tokens: a string or {"content": ...}.
nlohmann::ordered_json special_tokens_of(const nlohmann::ordered_json& cfg) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    auto it = cfg.find(key);
    if (it == cfg.end()) continue;
    if (it->is_string())
      out[key] = *it;
    else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
      out[key] = (*it)["content"];
  }
  if (auto it = cfg.find("additional_special_tokens"); it != cfg.end() && it->is_array())
    out["additional_special_tokens"] = *it;
  return out;
}

}  // namespace

const std::string& builtin_qwen3_template() {
  static const std::string kQwen3 = R"qwen3({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %})qwen3";
  return kQwen3;
}

Result<ChatTemplate> ChatTemplate::from_source(std::string source, std::string origin,
                                               nlohmann::ordered_json special_tokens, std::string tool_use_source) {
  auto parsed = jinja::Template::parse(source);
  if (!parsed) return parsed.error().with_context("the chat template of " + origin);
  ChatTemplate t;
  t.template_ = std::make_shared<const jinja::Template>(std::move(*parsed));
  if (!tool_use_source.empty()) {
    auto tool_use = jinja::Template::parse(tool_use_source);
    if (!tool_use) return tool_use.error().with_context("the tool_use chat template of " + origin);
    t.tool_use_ = std::make_shared<const jinja::Template>(std::move(*tool_use));
  }
  t.source_ = std::move(source);
  t.origin_ = std::move(origin);
  t.special_tokens_ = std::move(special_tokens);
  return t;
}

Result<ChatTemplate> ChatTemplate::load(const std::filesystem::path& dir, const std::string& override) {
  nlohmann::ordered_json cfg = nlohmann::ordered_json::object();
  const std::filesystem::path cfg_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(cfg_path)) {
    SIESTA_ASSIGN_OR_RETURN(std::string text, read_file(cfg_path));
    cfg = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!cfg.is_object()) return invalid_argument(cfg_path.string() + " is not a JSON object");
  }
  nlohmann::ordered_json special = special_tokens_of(cfg);
  if (!override.empty()) {
    // A path if one exists, else the template text itself (vLLM's --chat-template).
    std::error_code ec;
    if (override.find("{%") == std::string::npos && override.find("{{") == std::string::npos) {
      if (!std::filesystem::is_regular_file(override, ec))
        return invalid_argument("--chat-template " + override +
                                ": no such file (and not a template: it has no {% or {{)");
      SIESTA_ASSIGN_OR_RETURN(std::string text, read_file(override));
      return from_source(std::move(text), override, std::move(special));
    }
    return from_source(override, "--chat-template", std::move(special));
  }
  if (auto it = cfg.find("chat_template"); it != cfg.end() && !it->is_null()) {
    if (it->is_string()) return from_source(it->get<std::string>(), cfg_path.string(), std::move(special));
    if (it->is_array()) {
      std::string def, tool_use;
      for (const auto& e : *it) {
        if (!e.is_object() || !e.contains("name") || !e.contains("template") || !e["template"].is_string()) continue;
        if (e["name"] == "default") def = e["template"].get<std::string>();
        if (e["name"] == "tool_use") tool_use = e["template"].get<std::string>();
      }
      if (def.empty())
        return invalid_argument(cfg_path.string() + ": chat_template is a list without a \"default\" template");
      return from_source(std::move(def), cfg_path.string(), std::move(special), std::move(tool_use));
    }
    return invalid_argument(cfg_path.string() + ": chat_template must be a string or a list of {name, template}");
  }
  const std::filesystem::path jinja_path = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) {
    SIESTA_ASSIGN_OR_RETURN(std::string text, read_file(jinja_path));
    return from_source(std::move(text), jinja_path.string(), std::move(special));
  }
  SIESTA_LOG_INFO(
      "server: {} has no chat template (tokenizer_config.json or chat_template.jinja); chat uses the "
      "built-in Qwen3 template",
      dir.string());
  return from_source(builtin_qwen3_template(), "the built-in Qwen3 template", std::move(special));
}

Result<std::string> ChatTemplate::render(const ChatRenderInput& in) const {
  if (!in.messages.is_array() || in.messages.empty())
    return invalid_argument("'messages' must hold at least one message");
  if (in.continue_final_message && in.add_generation_prompt)
    return invalid_argument("Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
  nlohmann::ordered_json messages = in.messages;
  std::string final_text;
  if (in.continue_final_message) {
    nlohmann::ordered_json& last = messages.back();
    if (!last.contains("content") || !last["content"].is_string())
      return invalid_argument("continue_final_message is set but the final message has no content to continue");
    final_text = last["content"].get<std::string>();
    last["content"] = final_text + kContinueTag;
  }
  jinja::Dict ctx;
  ctx.set("messages", jinja::Value::from_json(messages));
  ctx.set("tools", in.tools.is_null() ? jinja::Value::none() : jinja::Value::from_json(in.tools));
  ctx.set("documents", in.documents.is_null() ? jinja::Value::none() : jinja::Value::from_json(in.documents));
  ctx.set("add_generation_prompt", jinja::Value(in.add_generation_prompt));
  for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it)
    ctx.set(it.key(), jinja::Value::from_json(it.value()));
  if (!in.kwargs.is_object()) return invalid_argument("'chat_template_kwargs' must be an object");
  for (auto it = in.kwargs.begin(); it != in.kwargs.end(); ++it) {
    for (const char* r : kReserved)
      if (it.key() == r)
        return invalid_argument("'chat_template_kwargs' may not set '" + it.key() +
                                "': the request's own field sets it");
    ctx.set(it.key(), jinja::Value::from_json(it.value()));
  }
  const jinja::Template& t = !in.tools.is_null() && tool_use_ ? *tool_use_ : *template_;
  auto rendered = t.render(ctx);
  if (!rendered) return rendered.error().with_context("rendering the chat template (" + origin_ + ")");
  std::string out = std::move(*rendered);
  if (in.continue_final_message) {
    const std::string tag = kContinueTag;
    const std::string tag_word = tag.substr(0, tag.size() - 1);
    auto strip = [](std::string s) {
      const size_t b = s.find_first_not_of(" \t\n\r\f\v");
      if (b == std::string::npos) return std::string();
      return s.substr(b, s.find_last_not_of(" \t\n\r\f\v") - b + 1);
    };
    const size_t loc = out.rfind(tag_word);
    if (out.find(strip(final_text)) == std::string::npos || loc == std::string::npos)
      return invalid_argument(
          "continue_final_message is set but the final message does not appear in the chat after applying the chat "
          "template! This can happen if the chat template deletes portions of the final message.");
    if (out.compare(loc, tag.size(), tag) == 0) {
      out.resize(loc);
    } else {
      out.resize(loc);
      while (!out.empty() && std::string(" \t\n\r\f\v").find(out.back()) != std::string::npos) out.pop_back();
    }
  }
  return out;
}

}  // namespace siesta::server
