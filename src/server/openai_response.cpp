#include "server/openai_response.h"

#include <cmath>

namespace siesta::server {
namespace {

double finite_logprob(double lp) { return std::isfinite(lp) ? lp : -9999.0; }

size_t utf8_chars(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

nlohmann::json stop_reason_json(const RequestFinish& f) {
  if (const auto* id = std::get_if<int32_t>(&f.stop_reason)) return *id;
  if (const auto* s = std::get_if<std::string>(&f.stop_reason)) return *s;
  return nullptr;
}

nlohmann::json opt_json(const std::optional<std::string>& s) { return s ? nlohmann::json(*s) : nlohmann::json(); }

nlohmann::json tool_call_json(const ParsedToolCall& c) {
  return nlohmann::json{
      {"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
}

bool plain_chat(const ChatOutputOptions& o) { return o.reasoning == ReasoningMode::kNone && !o.parse_tools; }

}  // namespace

OpenAiResponse::OpenAiResponse(const GenerationJob& job, std::string id, std::string model, int64_t created,
                               const Tokenizer& tokenizer)
    : job_(job), id_(std::move(id)), model_(std::move(model)), created_(created), tok_(tokenizer) {
  choices_.resize(job.requests.size());
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].prompt_tokens = job.requests[i].prompt_tokens;
    if (job.kind == ApiKind::kChat && job.stream && !plain_chat(job.output))
      choices_[i].parser = std::make_shared<ChatStreamParser>(job.output);
    if (job.logprobs)
      choices_[i].logprobs = job.kind == ApiKind::kChat ? nlohmann::json{{"content", nlohmann::json::array()}}
                                                        : nlohmann::json{{"text_offset", nlohmann::json::array()},
                                                                         {"token_logprobs", nlohmann::json::array()},
                                                                         {"tokens", nlohmann::json::array()},
                                                                         {"top_logprobs", nlohmann::json::array()}};
  }
}

nlohmann::json OpenAiResponse::envelope(bool chunk) const {
  const char* object =
      job_.kind == ApiKind::kChat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  return nlohmann::json{{"id", id_}, {"object", object}, {"created", created_}, {"model", model_}};
}

std::string OpenAiResponse::token_name(int32_t id) const {
  if (job_.return_tokens_as_token_ids) return "token_id:" + std::to_string(id);
  return tok_.decode({id});
}

nlohmann::json OpenAiResponse::logprobs_json(Choice& c, const std::vector<TokenLogprobs>& lps) {
  if (job_.kind == ApiKind::kChat) {
    nlohmann::json content = nlohmann::json::array();
    auto entry = [&](const TokenLogprob& t) {
      const std::string bytes = tok_.token_bytes(t.token);
      std::vector<int> b(bytes.begin(), bytes.end());
      for (int& x : b) x &= 0xFF;
      return nlohmann::json{{"token", token_name(t.token)}, {"logprob", finite_logprob(t.logprob)}, {"bytes", b}};
    };
    for (const TokenLogprobs& lp : lps) {
      nlohmann::json e = entry(lp.chosen);
      nlohmann::json top = nlohmann::json::array();
      for (const TokenLogprob& t : lp.top) top.push_back(entry(t));
      e["top_logprobs"] = std::move(top);
      content.push_back(std::move(e));
    }
    return nlohmann::json{{"content", std::move(content)}};
  }
  nlohmann::json out{{"text_offset", nlohmann::json::array()},
                     {"token_logprobs", nlohmann::json::array()},
                     {"tokens", nlohmann::json::array()},
                     {"top_logprobs", nlohmann::json::array()}};
  for (const TokenLogprobs& lp : lps) {
    const std::string token = token_name(lp.chosen.token);
    out["text_offset"].push_back(c.text_offset);
    c.text_offset += utf8_chars(token);
    out["token_logprobs"].push_back(finite_logprob(lp.chosen.logprob));
    out["tokens"].push_back(token);
    nlohmann::json top = nlohmann::json::object();
    for (const TokenLogprob& t : lp.top) top[token_name(t.token)] = finite_logprob(t.logprob);
    // vLLM lists the chosen token among the top ones too.
    top[token] = finite_logprob(lp.chosen.logprob);
    out["top_logprobs"].push_back(std::move(top));
  }
  return out;
}

// Completions with echo and logprobs: the prompt's tokens first; the first
// has no log-probability (nothing predicts it).
nlohmann::json OpenAiResponse::echo_logprobs_json(Choice& c, const std::vector<TokenLogprobs>& prompt_lps) {
  nlohmann::json out{{"text_offset", nlohmann::json::array()},
                     {"token_logprobs", nlohmann::json::array()},
                     {"tokens", nlohmann::json::array()},
                     {"top_logprobs", nlohmann::json::array()}};
  if (c.prompt_tokens.empty()) return out;
  const std::string first = token_name(c.prompt_tokens[0]);
  out["text_offset"].push_back(c.text_offset);
  c.text_offset += utf8_chars(first);
  out["token_logprobs"].push_back(nullptr);
  out["tokens"].push_back(first);
  out["top_logprobs"].push_back(nullptr);
  append_logprobs(out, logprobs_json(c, prompt_lps));
  return out;
}

nlohmann::json OpenAiResponse::prompt_logprobs_json(const Choice& c) const {
  nlohmann::json out = nlohmann::json::array();
  if (c.prompt_tokens.empty()) return out;
  out.push_back(nullptr);
  if (!c.prompt_logprobs) return out;
  for (const TokenLogprobs& lp : *c.prompt_logprobs) {
    nlohmann::json d = nlohmann::json::object();
    auto put = [&](const TokenLogprob& t) {
      d[std::to_string(t.token)] = {
          {"logprob", finite_logprob(t.logprob)}, {"rank", t.rank}, {"decoded_token", token_name(t.token)}};
    };
    put(lp.chosen);
    for (const TokenLogprob& t : lp.top) put(t);
    out.push_back(std::move(d));
  }
  return out;
}

void OpenAiResponse::append_logprobs(nlohmann::json& into, const nlohmann::json& more) const {
  for (auto& [key, values] : more.items())
    for (const nlohmann::json& v : values) into[key].push_back(v);
}

void OpenAiResponse::note(const RequestDelta& d) {
  if (d.finish && d.finish->error && !error_) error_ = d.finish->error;
}

nlohmann::json OpenAiResponse::choice_usage(const Choice& c) const {
  const auto prompt = static_cast<int64_t>(c.prompt_tokens.size());
  return nlohmann::json{{"prompt_tokens", prompt},
                        {"total_tokens", prompt + c.completion_tokens},
                        {"completion_tokens", c.completion_tokens}};
}

std::string OpenAiResponse::chat_finish_reason(const RequestFinish& f, bool tools_called) const {
  const std::string engine = finish_reason_name(f.reason);
  if (tools_called && job_.tool_choice == ToolChoice::kAuto) return "tool_calls";
  if (tools_called && job_.tool_choice == ToolChoice::kRequired && f.reason == FinishReason::kStop) return "tool_calls";
  return engine;
}

std::vector<nlohmann::json> OpenAiResponse::start_chunks() {
  std::vector<nlohmann::json> out;
  if (job_.kind != ApiKind::kChat) return out;
  for (size_t i = 0; i < choices_.size(); ++i) {
    nlohmann::json choice{{"index", i},
                          {"delta", {{"role", job_.role}, {"content", ""}}},
                          {"logprobs", nullptr},
                          {"finish_reason", nullptr}};
    if (job_.return_token_ids) choice["prompt_token_ids"] = choices_[i].prompt_tokens;
    choices_[i].started = true;
    nlohmann::json chunk = envelope(true);
    chunk["choices"] = nlohmann::json::array({std::move(choice)});
    if (job_.return_prompt_text && i == 0) chunk["prompt_text"] = job_.prompt_text;
    if (job_.continuous_usage) chunk["usage"] = choice_usage(choices_[i]);
    out.push_back(std::move(chunk));
    // vLLM's chat echo: the continued message's text, as its own chunk.
    if (!job_.echo[i].empty()) {
      nlohmann::json echo{
          {"index", i}, {"delta", {{"content", job_.echo[i]}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
      nlohmann::json e = envelope(true);
      e["choices"] = nlohmann::json::array({std::move(echo)});
      if (job_.continuous_usage) e["usage"] = choice_usage(choices_[i]);
      out.push_back(std::move(e));
    }
  }
  return out;
}

std::vector<nlohmann::json> OpenAiResponse::chunks(const IndexedDelta& in) {
  Choice& c = choices_[in.index];
  const RequestDelta& d = in.delta;
  note(d);
  if (d.finish) c.finish = d.finish;
  if (d.prompt_logprobs) c.prompt_logprobs = d.prompt_logprobs;
  c.completion_tokens += static_cast<int64_t>(d.token_ids.size());
  nlohmann::json choice{{"index", in.index}};
  bool has_content = false;
  bool tools_called = false;
  if (job_.kind == ApiKind::kChat) {
    nlohmann::json delta = nlohmann::json::object();
    if (c.parser) {
      ChatStreamParser::Delta p = c.parser->push(d.text);
      if (d.finish) {
        ChatStreamParser::Delta rest = c.parser->finish();
        p.reasoning += rest.reasoning;
        p.content += rest.content;
        if (p.tool_calls.empty()) p.first_tool_index = rest.first_tool_index;
        for (ParsedToolCall& t : rest.tool_calls) p.tool_calls.push_back(std::move(t));
      }
      if (!p.reasoning.empty()) {
        delta["reasoning"] = p.reasoning;
        delta["reasoning_content"] = p.reasoning;
      }
      if (!p.content.empty()) delta["content"] = p.content;
      if (!p.tool_calls.empty()) {
        nlohmann::json calls = nlohmann::json::array();
        for (size_t k = 0; k < p.tool_calls.size(); ++k) {
          nlohmann::json tc = tool_call_json(p.tool_calls[k]);
          tc["index"] = p.first_tool_index + k;
          calls.push_back(std::move(tc));
        }
        delta["tool_calls"] = std::move(calls);
      }
      has_content = !p.empty();
      tools_called = c.parser->tools_called();
    } else if (!d.text.empty()) {
      delta["content"] = d.text;
      has_content = true;
    }
    choice["delta"] = std::move(delta);
  } else {
    std::string text = d.text;
    if (!c.started && !job_.echo[in.index].empty()) text = job_.echo[in.index] + text;
    has_content = !text.empty();
    choice["text"] = std::move(text);
  }
  nlohmann::json logprobs;
  if (job_.logprobs) {
    if (job_.echo_logprobs && !c.started && d.prompt_logprobs) {
      logprobs = echo_logprobs_json(c, *d.prompt_logprobs);
      if (!d.logprobs.empty()) append_logprobs(logprobs, logprobs_json(c, d.logprobs));
    } else if (!d.logprobs.empty()) {
      logprobs = logprobs_json(c, d.logprobs);
    }
  }
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] =
      d.finish ? nlohmann::json(job_.kind == ApiKind::kChat ? chat_finish_reason(*d.finish, tools_called)
                                                            : std::string(finish_reason_name(d.finish->reason)))
               : nlohmann::json();
  choice["stop_reason"] = d.finish ? stop_reason_json(*d.finish) : nlohmann::json();
  if (job_.return_token_ids) {
    if (!c.started) choice["prompt_token_ids"] = c.prompt_tokens;
    choice["token_ids"] = d.token_ids;
  }
  if (d.finish && !d.finish->kv_transfer_params.is_null()) choice["kv_transfer_params"] = d.finish->kv_transfer_params;
  c.started = true;
  c.token_ids.insert(c.token_ids.end(), d.token_ids.begin(), d.token_ids.end());
  std::vector<nlohmann::json> out;
  // Chat sends no empty deltas (tokens whose text is held back), unless the
  // client asked for token ids or logprobs, which those tokens still have.
  const bool tokens_matter = job_.kind == ApiKind::kCompletion || job_.return_token_ids || job_.logprobs;
  if (!has_content && !d.finish && !(tokens_matter && !d.token_ids.empty())) return out;
  nlohmann::json chunk = envelope(true);
  chunk["choices"] = nlohmann::json::array({std::move(choice)});
  if (job_.continuous_usage) chunk["usage"] = choice_usage(c);
  out.push_back(std::move(chunk));
  return out;
}

nlohmann::json OpenAiResponse::usage() const {
  int64_t prompt = 0, completion = 0, cached = 0;
  std::vector<bool> counted(job_.requests.empty() ? 0 : job_.prompt_of_choice.back() + 1, false);
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    completion += c.finish ? c.finish->num_output_tokens : static_cast<int64_t>(c.token_ids.size());
    const size_t p = job_.prompt_of_choice[i];
    if (counted[p]) continue;
    counted[p] = true;
    prompt += static_cast<int64_t>(c.prompt_tokens.size());
    if (c.finish) cached += c.finish->num_cached_tokens;
  }
  return nlohmann::json{{"prompt_tokens", prompt},
                        {"total_tokens", prompt + completion},
                        {"completion_tokens", completion},
                        {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

nlohmann::json OpenAiResponse::usage_chunk() const {
  nlohmann::json chunk = envelope(true);
  chunk["choices"] = nlohmann::json::array();
  chunk["usage"] = usage();
  return chunk;
}

void OpenAiResponse::add(const IndexedDelta& in) {
  Choice& c = choices_[in.index];
  const RequestDelta& d = in.delta;
  note(d);
  if (d.prompt_logprobs) {
    c.prompt_logprobs = d.prompt_logprobs;
    if (job_.logprobs && job_.echo_logprobs) append_logprobs(c.logprobs, echo_logprobs_json(c, *d.prompt_logprobs));
  }
  c.text += d.text;
  c.token_ids.insert(c.token_ids.end(), d.token_ids.begin(), d.token_ids.end());
  c.completion_tokens += static_cast<int64_t>(d.token_ids.size());
  if (job_.logprobs && !d.logprobs.empty()) append_logprobs(c.logprobs, logprobs_json(c, d.logprobs));
  if (d.finish) c.finish = d.finish;
}

bool OpenAiResponse::all_finished() const {
  for (const Choice& c : choices_)
    if (!c.finish) return false;
  return true;
}

nlohmann::json OpenAiResponse::chat_message(const Choice& c, size_t index) const {
  ParsedChatOutput parsed;
  if (plain_chat(job_.output))
    parsed.content = c.text;
  else
    parsed = parse_chat_output(c.text, job_.output);
  std::optional<std::string> content = parsed.content;
  if (!job_.echo[index].empty()) content = job_.echo[index] + content.value_or("");
  // vLLM's named tool choice and required tool choice leave no content beside the calls.
  if (!parsed.tool_calls.empty() && job_.tool_choice == ToolChoice::kNamed) content = std::nullopt;
  nlohmann::json m{{"role", job_.role}, {"content", opt_json(content)}, {"refusal", nullptr}, {"annotations", nullptr},
                   {"audio", nullptr},  {"function_call", nullptr}};
  if (!parsed.tool_calls.empty()) {
    nlohmann::json calls = nlohmann::json::array();
    for (const ParsedToolCall& t : parsed.tool_calls) calls.push_back(tool_call_json(t));
    m["tool_calls"] = std::move(calls);
  }
  m["reasoning"] = opt_json(parsed.reasoning);
  m["reasoning_content"] = opt_json(parsed.reasoning);
  return m;
}

nlohmann::json OpenAiResponse::response() const {
  nlohmann::json r = envelope(false);
  nlohmann::json choices = nlohmann::json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    nlohmann::json choice{{"index", i}};
    bool tools_called = false;
    if (job_.kind == ApiKind::kChat) {
      choice["message"] = chat_message(c, i);
      tools_called = choice["message"].contains("tool_calls");
    } else {
      choice["text"] = job_.echo[i] + c.text;
    }
    choice["logprobs"] = job_.logprobs ? c.logprobs : nlohmann::json();
    choice["finish_reason"] =
        c.finish ? nlohmann::json(job_.kind == ApiKind::kChat ? chat_finish_reason(*c.finish, tools_called)
                                                              : std::string(finish_reason_name(c.finish->reason)))
                 : nlohmann::json();
    choice["stop_reason"] = c.finish ? stop_reason_json(*c.finish) : nlohmann::json();
    if (job_.return_token_ids) {
      choice["prompt_token_ids"] = c.prompt_tokens;
      choice["token_ids"] = c.token_ids;
    }
    if (job_.kind == ApiKind::kCompletion && job_.prompt_logprobs) choice["prompt_logprobs"] = prompt_logprobs_json(c);
    choices.push_back(std::move(choice));
  }
  r["choices"] = std::move(choices);
  // P/D: vLLM puts kv_transfer_params at the top of the response (one per
  // response: the first choice's).
  for (const Choice& c : choices_) {
    if (!c.finish || c.finish->kv_transfer_params.is_null()) continue;
    r["kv_transfer_params"] = c.finish->kv_transfer_params;
    break;
  }
  r["usage"] = usage();
  if (job_.kind == ApiKind::kChat) {
    if (job_.return_token_ids && !choices_.empty()) r["prompt_token_ids"] = choices_[0].prompt_tokens;
    if (job_.prompt_logprobs && !choices_.empty()) r["prompt_logprobs"] = prompt_logprobs_json(choices_[0]);
    if (job_.return_prompt_text) r["prompt_text"] = job_.prompt_text;
  }
  return r;
}

}  // namespace siesta::server
