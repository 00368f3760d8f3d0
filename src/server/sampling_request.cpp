#include "server/sampling_request.h"

#include <fstream>

#include "common/log.h"
#include "server/json_fields.h"

namespace siesta::server {
namespace {

Result<void> refuse_unless(const nlohmann::json& body, const char* key, double neutral) {
  SIESTA_ASSIGN_OR_RETURN(std::optional<double> v, read_number(body, key));
  if (v && *v != neutral)
    return invalid_argument(std::string("'") + key + "' is not supported by this server (only " +
                            nlohmann::json(neutral).dump() + ", the neutral value)");
  return {};
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
  if (auto k = number("top_k")) d.top_k = static_cast<int32_t>(*k);
  return d;
}

Result<SamplingRequest> parse_sampling(const nlohmann::json& body, ApiKind kind, const SamplingDefaults& defaults,
                                       int32_t vocab_size) {
  SamplingRequest s;
  SamplingParams& p = s.params;
  p.temperature = defaults.temperature.value_or(1.0);
  p.top_p = defaults.top_p.value_or(1.0);
  p.top_k = defaults.top_k.value_or(0);
  p.min_p = defaults.min_p.value_or(0.0);

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

  SIESTA_TRY(refuse_unless(body, "presence_penalty", 0.0));
  SIESTA_TRY(refuse_unless(body, "frequency_penalty", 0.0));
  SIESTA_TRY(refuse_unless(body, "repetition_penalty", 1.0));
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json bias, read_object(body, "logit_bias"));
  if (!bias.empty()) return invalid_argument("'logit_bias' is not supported by this server");

  SIESTA_TRY(p.validate());
  return s;
}

}  // namespace siesta::server
