#include "server/sampling_request.h"

#include <algorithm>
#include <fstream>

#include "common/log.h"
#include "server/json_fields.h"

namespace siesta::server {
namespace {

// logit_bias: {"token id": bias}, ids inside the vocabulary, biases clamped to [-100, 100] (OpenAI, vLLM).
Result<std::vector<std::pair<int32_t, double>>> read_logit_bias(const nlohmann::json& body, int32_t vocab) {
  std::vector<std::pair<int32_t, double>> out;
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json bias, read_object(body, "logit_bias"));
  for (auto it = bias.begin(); it != bias.end(); ++it) {
    const std::string& key = it.key();
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (key.empty() || used != key.size())
      return invalid_argument("'logit_bias' keys must be token ids (integers as strings), got '" + key + "'");
    if (id < 0 || id >= vocab)
      return invalid_argument("'logit_bias': token id " + key + " is outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
    if (!it.value().is_number())
      return invalid_argument("'logit_bias[\"" + key + "\"]' must be a number, got " + json_type_name(it.value()));
    const double b = std::clamp(it.value().get<double>(), -100.0, 100.0);
    out.emplace_back(static_cast<int32_t>(id), b);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first == b.first; }),
            out.end());
  return out;
}

}  // namespace

SamplingDefaults SamplingDefaults::load(const std::filesystem::path& model_dir) {
  SamplingDefaults d;
  std::ifstream f(model_dir / "generation_config.json");
  if (!f) return d;
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    SIESTA_LOG_WARN("server: {} is not a JSON object; no sampling defaults from it",
                    (model_dir / "generation_config.json").string());
    return d;
  }
  auto number = [&](const char* key) -> std::optional<double> {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  };
  d.temperature = number("temperature");
  d.top_p = number("top_p");
  d.min_p = number("min_p");
  d.repetition_penalty = number("repetition_penalty");
  if (auto k = number("top_k")) d.top_k = static_cast<int32_t>(*k);
  return d;
}

std::vector<std::vector<int32_t>> bad_words_token_ids(const std::vector<std::string>& words, const Tokenizer& tok) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& w : words) {
    const size_t b = w.find_first_not_of(" \t\n\r\f\v");
    const std::string word = b == std::string::npos ? std::string() : w.substr(b);
    std::vector<int32_t> plain = tok.encode(word);
    if (plain.empty()) continue;
    std::vector<int32_t> spaced = tok.encode(" " + word);
    out.push_back(plain);
    if (!spaced.empty() && spaced[0] != plain[0] && spaced.size() == plain.size()) out.push_back(std::move(spaced));
  }
  return out;
}

Result<SamplingRequest> parse_sampling(const nlohmann::json& body, ApiKind kind, const SamplingDefaults& defaults,
                                       const Tokenizer& tok) {
  const int32_t vocab_size = tok.vocab_size();
  SamplingRequest s;
  SamplingParams& p = s.params;
  p.temperature = defaults.temperature.value_or(1.0);
  p.top_p = defaults.top_p.value_or(1.0);
  p.top_k = defaults.top_k.value_or(0);
  p.min_p = defaults.min_p.value_or(0.0);
  p.repetition_penalty = defaults.repetition_penalty.value_or(1.0);

  SIESTA_ASSIGN_OR_RETURN(std::optional<double> temperature, read_number(body, "temperature"));
  if (temperature) p.temperature = *temperature;
  SIESTA_ASSIGN_OR_RETURN(std::optional<double> top_p, read_number(body, "top_p"));
  if (top_p) p.top_p = *top_p;
  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> top_k, read_int(body, "top_k", -1, INT32_MAX));
  if (top_k) p.top_k = static_cast<int32_t>(*top_k);
  SIESTA_ASSIGN_OR_RETURN(std::optional<double> min_p, read_number(body, "min_p"));
  if (min_p) p.min_p = *min_p;
  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> seed, read_int(body, "seed"));
  if (seed) p.seed = static_cast<uint64_t>(*seed);

  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens, read_int(body, "max_tokens", 1, INT32_MAX));
  if (kind == ApiKind::kChat) {
    SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> mct, read_int(body, "max_completion_tokens", 1, INT32_MAX));
    if (mct) max_tokens = mct;
    p.max_tokens = max_tokens ? std::optional<int32_t>(static_cast<int32_t>(*max_tokens)) : std::nullopt;
  } else {
    p.max_tokens = static_cast<int32_t>(max_tokens.value_or(16));
  }
  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> min_tokens, read_int(body, "min_tokens", 0, INT32_MAX));
  if (min_tokens) p.min_tokens = static_cast<int32_t>(*min_tokens);
  SIESTA_ASSIGN_OR_RETURN(p.stop, read_strings(body, "stop"));
  SIESTA_ASSIGN_OR_RETURN(p.stop_token_ids, read_int_list(body, "stop_token_ids", 0, vocab_size - 1));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> ignore_eos, read_bool(body, "ignore_eos"));
  p.ignore_eos = ignore_eos.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> include_stop, read_bool(body, "include_stop_str_in_output"));
  p.include_stop_str_in_output = include_stop.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> skip_special, read_bool(body, "skip_special_tokens"));
  s.skip_special_tokens = skip_special.value_or(true);
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> salt, read_string(body, "cache_salt"));
  if (salt) s.cache_salt = *salt;

  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> n, read_int(body, "n", 1, kMaxChoices));
  s.n = static_cast<int32_t>(n.value_or(1));
  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> best_of, read_int(body, "best_of", 1, kMaxChoices));
  if (best_of && *best_of != s.n)
    return invalid_argument("'best_of' different from 'n' is not supported by this server");
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> beam, read_bool(body, "use_beam_search"));
  if (beam.value_or(false)) return invalid_argument("'use_beam_search' is not supported by this server");
  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> priority, read_int(body, "priority"));
  if (priority.value_or(0) != 0)
    return invalid_argument("'priority' other than 0 is not supported: this server schedules first come, first served");
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> add_special, read_bool(body, "add_special_tokens"));
  (void)add_special;  // Qwen tokenizers add no special tokens either way

  if (kind == ApiKind::kCompletion) {
    SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> lp, read_int(body, "logprobs", 0, SamplingParams::kMaxLogprobs));
    if (lp) p.logprobs = static_cast<int32_t>(*lp);
  } else {
    SIESTA_ASSIGN_OR_RETURN(std::optional<bool> lp, read_bool(body, "logprobs"));
    SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> top,
                            read_int(body, "top_logprobs", 0, SamplingParams::kMaxLogprobs));
    s.chat_logprobs = lp.value_or(false);
    if (top && !s.chat_logprobs) return invalid_argument("'top_logprobs' needs 'logprobs': true");
    if (s.chat_logprobs) p.logprobs = static_cast<int32_t>(top.value_or(0));
  }

  SIESTA_ASSIGN_OR_RETURN(std::optional<int64_t> prompt_lp, read_int(body, "prompt_logprobs"));
  if (prompt_lp) {
    if (*prompt_lp == -1)
      return invalid_argument("'prompt_logprobs' -1 (the whole vocabulary) is more than this server returns; ask for "
                              "at most " + std::to_string(SamplingParams::kMaxLogprobs));
    if (*prompt_lp < 0 || *prompt_lp > SamplingParams::kMaxLogprobs)
      return invalid_argument("'prompt_logprobs' must be in [0, " + std::to_string(SamplingParams::kMaxLogprobs) +
                              "], got " + std::to_string(*prompt_lp));
    p.prompt_logprobs = static_cast<int32_t>(*prompt_lp);
  }

  SIESTA_ASSIGN_OR_RETURN(std::optional<double> presence, read_number(body, "presence_penalty"));
  if (presence) p.presence_penalty = *presence;
  SIESTA_ASSIGN_OR_RETURN(std::optional<double> frequency, read_number(body, "frequency_penalty"));
  if (frequency) p.frequency_penalty = *frequency;
  SIESTA_ASSIGN_OR_RETURN(std::optional<double> repetition, read_number(body, "repetition_penalty"));
  if (repetition) p.repetition_penalty = *repetition;
  SIESTA_ASSIGN_OR_RETURN(p.logit_bias, read_logit_bias(body, vocab_size));
  if (auto it = body.find("allowed_token_ids"); it != body.end() && !it->is_null()) {
    if (it->is_array() && it->empty())
      return invalid_argument("'allowed_token_ids' is an empty list: no token could be chosen");
    SIESTA_ASSIGN_OR_RETURN(p.allowed_token_ids, read_int_list(body, "allowed_token_ids", 0, vocab_size - 1));
    std::sort(p.allowed_token_ids.begin(), p.allowed_token_ids.end());
    p.allowed_token_ids.erase(std::unique(p.allowed_token_ids.begin(), p.allowed_token_ids.end()),
                              p.allowed_token_ids.end());
  }
  SIESTA_ASSIGN_OR_RETURN(std::vector<std::string> bad_words, read_strings(body, "bad_words"));
  if (auto it = body.find("bad_words"); it != body.end() && it->is_string())
    return invalid_argument("'bad_words' must be an array of strings, got a string");
  p.bad_words_token_ids = bad_words_token_ids(bad_words, tok);

  SIESTA_ASSIGN_OR_RETURN(s.truncate_prompt_tokens, read_int(body, "truncate_prompt_tokens", -1, INT64_MAX));
  if (s.truncate_prompt_tokens && *s.truncate_prompt_tokens == 0)
    return invalid_argument("'truncate_prompt_tokens' must be -1 (the model's length) or at least 1, got 0");
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> side, read_string(body, "truncation_side"));
  if (side && *side != "left" && *side != "right")
    return invalid_argument("'truncation_side' must be \"left\" or \"right\", got \"" + *side + "\"");
  s.truncate_left = side.value_or("left") == "left";
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> as_ids, read_bool(body, "return_tokens_as_token_ids"));
  s.return_tokens_as_token_ids = as_ids.value_or(false);

  SIESTA_TRY(p.validate());
  return s;
}

}  // namespace siesta::server
