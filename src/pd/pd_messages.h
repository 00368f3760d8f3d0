// The P/D protocol between a consumer (D) and a producer (P): JSON payloads
// of the transfer engine's opaque MESSAGE frames and of the notification that
// follows a WRITE. Every message names its request and carries "v" (the
// protocol version) and "op". Decoders refuse wrong types, missing fields and
// out-of-range values with a one-line Status; they never throw.
//
//   D -> P  write       WRITE mode: "after your prefill, write the KV of
//                       (x_request_id, choice) into my blocks"; answered at
//                       once: ok, or refused with the reason (P aborted,
//                       expired or finished that send, or the prompt differs)
//   D -> P  read_start  READ mode: "I am about to read the blocks of your
//                       request R": ok {region, epoch, lease_ms}, or refused
//   D -> P  read_done   READ mode: "I read them; release them": ok {held}:
//                       whether the hold lasted the whole read
//   D -> P  cancel      the consumer's request ended or will not load:
//                       ok {writing}: whether a write of P's is still in flight
//   P -> D  load_failed WRITE mode: P will not write (aborted, failed)
//   P -> D  written     (the notification of the WRITE, after its data),
//                       with P's logits of the prompt's last position
//
// A reply is {"v", "ok": true, ...} or {"v", "ok": false, "reason": "..."};
// read_done's {held: true} carries P's logits of the prompt's last position.
//
// Logits travel as a binary attachment after the JSON text: the text (which
// never holds a NUL: JSON escapes it), one NUL byte, then either the whole row
// ("logits": n, n float32 values) or its best entries ("logits_top": n,
// "vocab": V, n pairs of int32 id and float32 value, by value descending then
// id ascending; every other id counts as -inf), little-endian. D samples the
// first token from them, as a colocated engine samples it after its own
// prefill, so the prompt's last token is not computed twice with different
// kernels. D asks for the best entries alone (`logits_top` in write /
// read_done) when they decide its sample: a greedy request without
// log-probabilities or min_tokens needs the best one only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "engine/sampled_token.h"

namespace siesta::pd {

inline constexpr int kProtocolVersion = 2;
// The most entries a peer may ask for in logits_top.
inline constexpr int32_t kMaxLogitsTop = 64;

// What both sides must agree on before KV moves between them.
struct PromptCheck {
  int32_t num_tokens = 0;
  uint64_t hash = 0;          // prompt_hash() of the prompt's token ids
  std::string layout;         // kv_layout_fingerprint of the KV cache
  uint64_t block_bytes = 0;
  friend bool operator==(const PromptCheck&, const PromptCheck&) = default;
};

// FNV-1a over the token ids.
uint64_t prompt_hash(const std::vector<int32_t>& tokens);

struct WriteRequest {
  std::string x_request_id;
  int32_t choice = 0;
  std::string consumer_request;   // D's request id, named in `written`
  std::string consumer_engine;
  std::string consumer_address;   // D's side channel
  uint64_t region = 0;            // D's KV cache region at `epoch`
  uint64_t epoch = 0;
  int32_t first_block = 0;        // blocks before it are in D's prefix cache
  std::vector<int32_t> blocks;    // D's blocks for prompt blocks first_block, first_block + 1, ...
  PromptCheck prompt;
  int64_t deadline_unix_ms = 0;   // P starts no write after it (wall clock)
  int32_t logits_top = 0;         // the best entries of P's logits D needs (0: the whole row)
  // The engine D's lookup of P's URL named (empty: any). A producer with
  // another engine id (a new process at the old address) refuses the write
  // and names itself, so that D never waits for a write whose notification
  // it would not recognise.
  std::string producer_engine;
};

struct CancelRequest {
  std::string x_request_id;       // names a WRITE-mode send (with choice) ...
  int32_t choice = 0;
  std::string producer_request;   // ... or P's request id (READ mode)
};

struct ReadStart {
  std::string producer_request;
  int32_t first_block = 0;
  std::vector<int32_t> blocks;    // P's blocks D will read (from first_block), as kv_transfer_params named them
  PromptCheck prompt;
};

struct ReadDone {
  std::string producer_request;
  int32_t logits_top = 0;         // as WriteRequest::logits_top
};

struct LoadFailed {
  std::string consumer_request;
  std::string reason;
};

struct Written {
  std::string consumer_request;
  uint64_t bytes = 0;
  LogitsRow logits;               // P's logits of the prompt's last position (null: none)
  int32_t logits_top = 0;         // encode: send the best entries only (0: the whole row)
};

using PdMessage = std::variant<WriteRequest, CancelRequest, ReadStart, ReadDone, LoadFailed>;

std::string encode(const WriteRequest& m);
std::string encode(const CancelRequest& m);
std::string encode(const ReadStart& m);
std::string encode(const ReadDone& m);
std::string encode(const LoadFailed& m);
std::string encode(const Written& m);

Result<PdMessage> decode_message(std::string_view payload);
Result<Written> decode_written(std::string_view payload);

// Replies.
struct Reply {
  bool ok = false;
  std::string reason;      // when refused
  nlohmann::json body;     // the whole reply object
  LogitsRow logits;        // the attachment, when the reply has one
};
// logits_top: attach only the best entries of `logits` (0: the whole row).
std::string encode_ok(nlohmann::json fields = nlohmann::json::object(), const LogitsRow& logits = nullptr,
                      int32_t logits_top = 0);
std::string encode_refusal(const std::string& reason, nlohmann::json fields = nlohmann::json::object());
Result<Reply> decode_reply(std::string_view payload);

// Typed fields of a reply body (kCorrupt naming the field when absent or mistyped).
Result<bool> reply_bool(const Reply& r, const char* key);
Result<uint64_t> reply_u64(const Reply& r, const char* key);
Result<int64_t> reply_i64(const Reply& r, const char* key);

}  // namespace siesta::pd
