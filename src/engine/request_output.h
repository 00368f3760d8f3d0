// RequestOutput: what one step produced for one request (Scheduler::update).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engine/block_pool.h"
#include "engine/request.h"
#include "engine/sampled_token.h"

namespace siesta {

struct RequestOutput {
  RequestId request_id;
  std::vector<SampledToken> new_tokens;   // generated this step (zero or one)
  RequestState state = RequestState::kRunning;
  std::optional<int32_t> stop_token;      // the stop token id that finished it (vLLM's stop_reason)
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;
  int32_t num_cached_tokens = 0;          // prompt tokens served by the prefix cache
  // Finished with hold_blocks_for_remote_reader: the blocks kept for the
  // reader under send_hold_owner(request_id).
  std::vector<BlockId> held_blocks;
  // With the first generated token of a request with prompt_logprobs: one
  // entry per prompt token after the first.
  std::vector<TokenLogprobs> prompt_logprobs;

  bool finished() const { return is_finished(state); }
};

}  // namespace siesta
