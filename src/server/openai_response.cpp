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

}  // namespace

OpenAiResponse::OpenAiResponse(const GenerationJob& job, std::string id, std::string model, int64_t created,
                               const Tokenizer& tokenizer)
    : job_(job), id_(std::move(id)), model_(std::move(model)), created_(created), tok_(tokenizer) {
  choices_.resize(job.requests.size());
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].prompt_tokens = job.requests[i].prompt_tokens;
    if (job.logprobs)
      choices_[i].logprobs = job.kind == ApiKind::kChat
                                 ? nlohmann::json{{"content", nlohmann::json::array()}}
                                 : nlohmann::json{{"text_offset", nlohmann::json::array()},
                                                  {"token_logprobs", nlohmann::json::array()},
                                                  {"tokens", nlohmann::json::array()},
                                                  {"top_logprobs", nlohmann::json::array()}};
  }
}

nlohmann::json OpenAiResponse::envelope(bool chunk) const {
  const char* object = job_.kind == ApiKind::kChat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                    : "text_completion";
  return nlohmann::json{{"id", id_}, {"object", object}, {"created", created_}, {"model", model_}};
}

nlohmann::json OpenAiResponse::logprobs_json(Choice& c, const std::vector<TokenLogprobs>& lps) {
  if (job_.kind == ApiKind::kChat) {
    nlohmann::json content = nlohmann::json::array();
    auto entry = [&](const TokenLogprob& t) {
      const std::string bytes = tok_.token_bytes(t.token);
      std::vector<int> b(bytes.begin(), bytes.end());
      for (int& x : b) x &= 0xFF;
      return nlohmann::json{{"token", tok_.decode({t.token})}, {"logprob", finite_logprob(t.logprob)}, {"bytes", b}};
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
    const std::string token = tok_.decode({lp.chosen.token});
    out["text_offset"].push_back(c.text_offset);
    c.text_offset += utf8_chars(token);
    out["token_logprobs"].push_back(finite_logprob(lp.chosen.logprob));
    out["tokens"].push_back(token);
    nlohmann::json top = nlohmann::json::object();
    for (const TokenLogprob& t : lp.top) top[tok_.decode({t.token})] = finite_logprob(t.logprob);
    // vLLM lists the chosen token among the top ones too.
    top[token] = finite_logprob(lp.chosen.logprob);
    out["top_logprobs"].push_back(std::move(top));
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

std::vector<nlohmann::json> OpenAiResponse::start_chunks() {
  std::vector<nlohmann::json> out;
  if (job_.kind != ApiKind::kChat) return out;
  for (size_t i = 0; i < choices_.size(); ++i) {
    nlohmann::json choice{{"index", i},
                          {"delta", {{"role", "assistant"}, {"content", ""}}},
                          {"logprobs", nullptr},
                          {"finish_reason", nullptr}};
    if (job_.return_token_ids) choice["prompt_token_ids"] = choices_[i].prompt_tokens;
    choices_[i].started = true;
    nlohmann::json chunk = envelope(true);
    chunk["choices"] = nlohmann::json::array({std::move(choice)});
    out.push_back(std::move(chunk));
  }
  return out;
}

std::vector<nlohmann::json> OpenAiResponse::chunks(const IndexedDelta& in) {
  Choice& c = choices_[in.index];
  const RequestDelta& d = in.delta;
  note(d);
  if (d.finish) c.finish = d.finish;
  std::string text = d.text;
  if (!c.started && !job_.echo[in.index].empty()) text = job_.echo[in.index] + text;
  nlohmann::json choice{{"index", in.index}};
  if (job_.kind == ApiKind::kChat) {
    choice["delta"] = text.empty() ? nlohmann::json::object() : nlohmann::json{{"content", text}};
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = job_.logprobs && !d.logprobs.empty() ? logprobs_json(c, d.logprobs) : nlohmann::json();
  choice["finish_reason"] = d.finish ? nlohmann::json(finish_reason_name(d.finish->reason)) : nlohmann::json();
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
  if (text.empty() && !d.finish && !(tokens_matter && !d.token_ids.empty())) return out;
  nlohmann::json chunk = envelope(true);
  chunk["choices"] = nlohmann::json::array({std::move(choice)});
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
  c.text += d.text;
  c.token_ids.insert(c.token_ids.end(), d.token_ids.begin(), d.token_ids.end());
  if (job_.logprobs && !d.logprobs.empty()) append_logprobs(c.logprobs, logprobs_json(c, d.logprobs));
  if (d.finish) c.finish = d.finish;
}

bool OpenAiResponse::all_finished() const {
  for (const Choice& c : choices_)
    if (!c.finish) return false;
  return true;
}

nlohmann::json OpenAiResponse::response() const {
  nlohmann::json r = envelope(false);
  nlohmann::json choices = nlohmann::json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    nlohmann::json choice{{"index", i}};
    if (job_.kind == ApiKind::kChat)
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    else
      choice["text"] = job_.echo[i] + c.text;
    choice["logprobs"] = job_.logprobs ? c.logprobs : nlohmann::json();
    choice["finish_reason"] = c.finish ? nlohmann::json(finish_reason_name(c.finish->reason)) : nlohmann::json();
    choice["stop_reason"] = c.finish ? stop_reason_json(*c.finish) : nlohmann::json();
    if (job_.return_token_ids) {
      choice["prompt_token_ids"] = c.prompt_tokens;
      choice["token_ids"] = c.token_ids;
    }
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
  if (job_.kind == ApiKind::kChat && job_.return_token_ids && !choices_.empty())
    r["prompt_token_ids"] = choices_[0].prompt_tokens;
  return r;
}

}  // namespace siesta::server
