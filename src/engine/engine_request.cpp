#include "engine/engine_request.h"

#include <iterator>

namespace siesta {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
  }
  return "abort";
}

void RequestDelta::append(RequestDelta&& later) {
  text += later.text;
  token_ids.insert(token_ids.end(), later.token_ids.begin(), later.token_ids.end());
  logprobs.insert(logprobs.end(), std::make_move_iterator(later.logprobs.begin()),
                  std::make_move_iterator(later.logprobs.end()));
  if (later.prompt_logprobs) prompt_logprobs = std::move(later.prompt_logprobs);
  if (later.finish) finish = std::move(later.finish);
}

}  // namespace siesta
