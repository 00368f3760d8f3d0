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
  return {};
}

}  // namespace siesta
