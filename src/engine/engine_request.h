// What a caller gives the Engine (EngineRequest) and what it gets back, piece
// by piece (RequestDelta, ending with a RequestFinish). Plain values.
//
//   EngineRequest r{.id = "cmpl-1-0", .prompt_tokens = ids, .params = params};
//   OutputStream s = engine.submit({r}).value();
//   RequestDelta d = ...;                 // from s.next(deadline)
//   d.text, d.token_ids, d.logprobs       // new since the last delta
//   if (d.finish) d.finish->reason        // kStop / kLength / kAbort, usage counts
//
// Text is detokenized incrementally (whole UTF-8 characters only) and stop
// strings are applied: text that could still become a stop string is held
// back until it cannot. As in vLLM, the text of the token that ends a request
// on eos or a stop token id is left out (unless include_stop_str_in_output),
// while token_ids always hold every generated token.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/status.h"
#include "engine/request.h"
#include "engine/sampled_token.h"
#include "engine/sampling_params.h"

namespace siesta {

struct EngineRequest {
  RequestId id;
  std::vector<int32_t> prompt_tokens;
  SamplingParams params;
  std::string cache_salt;              // requests with different salts share no KV
  bool skip_special_tokens = true;     // special tokens give no text
  // P/D (vLLM's kv_transfer_params): read by the KvConnector; null when absent.
  nlohmann::json kv_transfer_params;
  // P/D: how the other engine of a disaggregated pair names this request:
  // the HTTP request's X-Request-Id (both legs carry the same; empty when
  // none) and the choice's index within that HTTP request.
  std::string x_request_id;
  int32_t choice_index = 0;
};

enum class FinishReason : uint8_t { kStop, kLength, kAbort };

// OpenAI's finish_reason: "stop", "length", "abort".
const char* finish_reason_name(FinishReason reason);

struct RequestFinish {
  FinishReason reason = FinishReason::kStop;
  // vLLM's stop_reason: the stop token id or the stop string that ended the
  // request; none for eos, length or abort.
  std::variant<std::monostate, int32_t, std::string> stop_reason;
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;
  int32_t num_cached_tokens = 0;       // prompt tokens served by the prefix cache
  // Set when the engine ended the request because of a failure (reason kAbort):
  // the forward failed, the engine shut down, the scheduler refused it.
  std::optional<Status> error;
  nlohmann::json kv_transfer_params;   // from the KvConnector (null when none)
};

struct RequestDelta {
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobs> logprobs;   // one per token id when SamplingParams::logprobs is set
  // SamplingParams::prompt_logprobs: with the first token, one entry per
  // prompt token after the first.
  std::optional<std::vector<TokenLogprobs>> prompt_logprobs;
  std::optional<RequestFinish> finish;   // the last delta of the request

  bool empty() const { return text.empty() && token_ids.empty() && !finish && !prompt_logprobs; }
  // Appends a later delta to this one.
  void append(RequestDelta&& later);
};

}  // namespace siesta
