// The bodies of a request's two legs in vLLM's kv_transfer_params shape, and
// the check of the prefill instance's answer. Pure functions of JSON values,
// safe from any thread.
//
//   prefill leg:  the client's body, "max_tokens": 1 (and
//                 "max_completion_tokens": 1 for chat), "stream": false, no
//                 "stream_options" or "min_tokens", and
//                 kv_transfer_params {do_remote_decode: true, do_remote_prefill:
//                 false, remote_engine_id/block_ids/host/port: null}.
//   decode leg, sequential (READ) mode: the client's body with the
//                 kv_transfer_params that prefill returned, as returned.
//   decode leg, concurrent (WRITE) mode: the client's body with
//                 {do_remote_prefill: true, do_remote_decode: false, remote_*:
//                 null, remote_request_id: the X-Request-Id shared by both
//                 legs, remote_prefill_url: the prefill instance}; prefill's
//                 own parameters reach decode through the engines' side channel.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"

namespace siesta::proxy {

enum class Endpoint { kCompletions, kChatCompletions };
const char* endpoint_path(Endpoint endpoint);  // "/v1/completions" | "/v1/chat/completions"

nlohmann::json prefill_request_body(const nlohmann::json& client_body, Endpoint endpoint);

nlohmann::json decode_request_body_concurrent(const nlohmann::json& client_body, const std::string& request_id,
                                              const std::string& prefill_url);

nlohmann::json decode_request_body_sequential(const nlohmann::json& client_body,
                                              const nlohmann::json& prefill_kv_transfer_params);

// The kv_transfer_params of a prefill answer (HTTP 200, JSON body). Refused
// with a message naming what is wrong when they are missing, not an object,
// lack do_remote_prefill: true, or (when `need_address`, sequential mode) lack
// remote_engine_id, remote_block_ids, remote_host or remote_port.
// Whether P's answer (HTTP 200) says the request was aborted there
// (choices[0].finish_reason "abort": a pause or sleep with mode=abort).
bool prefill_answer_aborted(const std::string& answer_body);

Result<nlohmann::json> prefill_kv_transfer_params(const std::string& answer_body, bool need_address);

}  // namespace siesta::proxy
