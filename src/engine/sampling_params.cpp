#include "engine/sampling_params.h"

#include <cmath>
#include <sstream>

namespace siesta {
namespace {

template <class T>
std::string str(T v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

Result<void> SamplingParams::validate() const {
  // Written as !(x >= ...) so that NaN is refused too.
  if (!(temperature >= 0.0) || std::isinf(temperature))
    return invalid_argument("temperature must be a finite number >= 0, got " + str(temperature));
  if (!(top_p > 0.0 && top_p <= 1.0)) return invalid_argument("top_p must be in (0, 1], got " + str(top_p));
  if (top_k < -1)
    return invalid_argument("top_k must be 0 or -1 (disabled) or at least 1, got " + str(top_k));
  if (!(min_p >= 0.0 && min_p <= 1.0)) return invalid_argument("min_p must be in [0, 1], got " + str(min_p));
  if (max_tokens && *max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got " + str(*max_tokens));
  if (min_tokens < 0) return invalid_argument("min_tokens must be at least 0, got " + str(min_tokens));
  if (max_tokens && min_tokens > *max_tokens)
    return invalid_argument("min_tokens must be less than or equal to max_tokens=" + str(*max_tokens) + ", got " +
                            str(min_tokens));
  for (int32_t id : stop_token_ids)
    if (id < 0) return invalid_argument("stop_token_ids must be token ids >= 0, got " + str(id));
  for (const std::string& s : stop)
    if (s.empty()) return invalid_argument("stop strings must not be empty");
  if (logprobs && (*logprobs < 0 || *logprobs > kMaxLogprobs))
    return invalid_argument("logprobs must be in [0, " + str(kMaxLogprobs) + "], got " + str(*logprobs));
  if (prompt_logprobs && (*prompt_logprobs < 0 || *prompt_logprobs > kMaxLogprobs))
    return invalid_argument("prompt_logprobs must be in [0, " + str(kMaxLogprobs) + "], got " + str(*prompt_logprobs));
  if (!(presence_penalty >= -2.0 && presence_penalty <= 2.0))
    return invalid_argument("presence_penalty must be in [-2, 2], got " + str(presence_penalty));
  if (!(frequency_penalty >= -2.0 && frequency_penalty <= 2.0))
    return invalid_argument("frequency_penalty must be in [-2, 2], got " + str(frequency_penalty));
  if (!(repetition_penalty > 0.0) || std::isinf(repetition_penalty))
    return invalid_argument("repetition_penalty must be a finite number > 0, got " + str(repetition_penalty));
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto& [id, bias] = logit_bias[i];
    if (id < 0) return invalid_argument("logit_bias: token id " + str(id) + " is negative");
    if (i > 0 && logit_bias[i - 1].first >= id)
      return invalid_argument("logit_bias: token ids must be ascending and distinct");
    if (!(bias >= -100.0 && bias <= 100.0))
      return invalid_argument("logit_bias: the bias of token " + str(id) + " must be in [-100, 100], got " + str(bias));
  }
  for (size_t i = 0; i < allowed_token_ids.size(); ++i) {
    if (allowed_token_ids[i] < 0)
      return invalid_argument("allowed_token_ids: " + str(allowed_token_ids[i]) + " is negative");
    if (i > 0 && allowed_token_ids[i - 1] >= allowed_token_ids[i])
      return invalid_argument("allowed_token_ids must be ascending and distinct");
  }
  for (const std::vector<int32_t>& word : bad_words_token_ids) {
    if (word.empty()) return invalid_argument("bad_words: a bad word has no tokens");
    for (int32_t id : word)
      if (id < 0) return invalid_argument("bad_words: token id " + str(id) + " is negative");
  }
  for (int32_t id : forced_tokens)
    if (id < 0) return invalid_argument("forced tokens must be token ids >= 0, got " + str(id));
  return {};
}

}  // namespace siesta
