// Request: one generation request as the scheduler keeps it.
//
// Created by Scheduler::add_request from a NewRequest; owned by the scheduler
// until it finishes; read by the engine loop between steps (find()). The
// state changes only through apply() (request_state.h's table).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/block_hash.h"
#include "engine/block_pool.h"
#include "engine/request_state.h"
#include "engine/sampled_token.h"
#include "engine/sampling_params.h"

namespace siesta {

// What a caller submits.
struct NewRequest {
  RequestId id;
  std::vector<int32_t> prompt_tokens;
  SamplingParams params;
  // Requests with different salts never share KV through the prefix cache.
  std::string cache_salt;
  // P/D producer: when the request finishes (not aborted), its blocks stay
  // allocated under the hold send_hold_owner(id) (hold_key.h) until released
  // (Scheduler::release_hold), so a decode engine can read them.
  bool hold_blocks_for_remote_reader = false;
};

struct Request {
  RequestId id;
  SamplingParams params;
  std::string cache_salt;
  uint64_t salt_hash = 0;
  bool hold_blocks_for_remote_reader = false;

  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int32_t num_prompt_tokens = 0;

  RequestState state = RequestState::kWaiting;
  int32_t num_computed_tokens = 0;  // tokens whose KV is in the cache
  int32_t num_cached_tokens = -1;   // prefix-cache hit at first admission (-1: not admitted yet)
  int32_t num_preemptions = 0;
  std::optional<int32_t> stop_token;  // the stop token id that ended it (eos excluded, as vLLM)

  // params.prompt_logprobs: the log-probabilities of prompt tokens 1, 2, ...
  // as far as computed (entry k is position k + 1; kept across preemption).
  std::vector<TokenLogprobs> prompt_logprobs;

  std::vector<BlockId> block_table;      // covers [0, num_computed_tokens + tokens scheduled now)
  std::vector<BlockHash> block_hashes;   // one per full block of `tokens`
  int32_t num_published_blocks = 0;      // leading blocks already in the prefix cache

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  std::span<const int32_t> output_tokens() const {
    return std::span<const int32_t>(tokens).subspan(num_prompt_tokens);
  }
  bool finished() const { return is_finished(state); }
  // Prompt positions whose log-probabilities are still to compute.
  bool needs_prompt_logprobs() const {
    return params.prompt_logprobs && static_cast<int32_t>(prompt_logprobs.size()) + 1 < num_prompt_tokens;
  }

  // The one way to change `state`.
  Result<void> apply(RequestEvent event) {
    SIESTA_ASSIGN_OR_RETURN(state, next_state(state, event));
    return {};
  }
};

}  // namespace siesta
