// The model-forward interface shared by the CPU and CUDA implementations.
//
// One call runs one engine step over a batch of sequences. Each sequence brings
// its new tokens (a whole prompt, a chunk of one, or one decode token), the
// position of its first new token (= tokens already in its KV cache) and its
// block table. Prefill, chunked prefill and decode are the same call.
//
//   KvCacheView kv{base, num_blocks, layout};       // memory owned by the caller (the pool)
//   SequenceChunk seq{tokens, start_pos, block_table, /*all_logits=*/false};
//   model.forward({&seq, 1}, kv, out);               // out.logits: [rows, vocab]
//
// The KV of the new tokens is written into the blocks the table names (slot
// p lives in block_table[p / block_size], offset p % block_size), then attention
// reads positions [0, start_pos + i] for new token i.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace siesta {

inline constexpr int kBlockSize = 16;

// Layout of the paged KV cache: block-major, so one block (all layers, K and V)
// is one contiguous byte range. That makes a block one descriptor for KV
// transfer and keeps block ids the only thing peers exchange.
//   block b, layer l, kind k (0 = K, 1 = V), slot s, kv head h, dim d at element
//   ((((b * L + l) * 2 + k) * block_size + s) * kv_heads + h) * head_dim + d
struct KvCacheLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = kBlockSize;
  size_t elem_bytes = sizeof(float);

  static KvCacheLayout for_model(const ModelConfig& cfg, size_t elem_bytes) {
    return KvCacheLayout{cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kBlockSize, elem_bytes};
  }
  size_t slot_elems() const { return static_cast<size_t>(num_kv_heads) * head_dim; }
  size_t kv_elems() const { return slot_elems() * block_size; }            // one K or V of one layer
  size_t block_elems() const { return kv_elems() * 2 * num_layers; }
  size_t block_bytes() const { return block_elems() * elem_bytes; }
  // Element offset of (block, layer, kind) from the cache base.
  size_t offset(size_t block, int layer, int kind) const {
    return (block * num_layers * 2 + static_cast<size_t>(layer) * 2 + kind) * kv_elems();
  }
};

struct KvCacheView {
  void* base = nullptr;
  int num_blocks = 0;
  KvCacheLayout layout;
};

struct SequenceChunk {
  std::span<const int32_t> tokens;       // new tokens this step (>= 1)
  int32_t start_pos = 0;                 // tokens already in the KV cache
  std::span<const int32_t> block_table;  // covers [0, start_pos + tokens.size())
  bool all_logits = false;               // logits for every new token, else the last only
};

struct ForwardOutput {
  int vocab_size = 0;
  std::vector<float> logits;        // [rows, vocab_size], fp32
  std::vector<size_t> first_row;    // per sequence: its first row in logits
  std::vector<size_t> num_rows;     // per sequence: 1, or tokens.size() with all_logits

  std::span<const float> row(size_t seq, size_t i = 0) const {
    return {logits.data() + (first_row[seq] + i) * vocab_size, static_cast<size_t>(vocab_size)};
  }
  // The logits of a sequence's last new token.
  std::span<const float> last(size_t seq) const { return row(seq, num_rows[seq] - 1); }
};

// How a model that chooses tokens on its device picks one sequence's next
// token (Model::forward_choose): the engine sampler's settings for the step
// and its draw (Sampler::device_choice). NaN counts as -inf, greedy is the
// first maximum, then temperature, min-p, top-k, top-p and the draw, as the
// engine sampler does them. on_host: the device chooses nothing for this
// sequence; its logits come back for the host (every row of an all_logits
// chunk, else its last) and the other fields are ignored.
struct TokenChoice {
  double temperature = 0.0;         // < 1e-5: greedy
  double top_p = 1.0;               // 1: off
  int32_t top_k = 0;                // <= 0: off
  double min_p = 0.0;               // 0: off
  double uniform = 0.0;             // the request's draw for this step, in [0, 1)
  std::span<const int32_t> banned;  // ids that may not be chosen (min_tokens)
  bool on_host = false;             // the host chooses: bring back the logits
};
inline constexpr int kMaxChoiceBannedTokens = 32;
// forward_choose's token for a sequence the host chooses: on_host, or a row
// the device could not decide.
inline constexpr int32_t kChooseOnHost = -1;

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual KvCacheLayout kv_layout() const = 0;
  // Checks every chunk (token ids < vocab, block table long enough, block ids
  // in range) before touching the cache: bad input is an error, never a write
  // out of bounds.
  virtual Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                               ForwardOutput& out) = 0;

  // Whether forward_choose works: the model picks tokens on its device and
  // brings back only them, not every sequence's row of logits.
  virtual bool chooses_tokens() const { return false; }
  // forward(), then each sequence's next token picked from its last row of
  // logits as choices[i] says (one per sequence; at most
  // kMaxChoiceBannedTokens banned ids each). One call serves sequences of
  // both kinds, and a sequence's token or logits do not depend on which
  // kind its batch-mates are.
  //   tokens[i]: the device's choice, or kChooseOnHost when choices[i].on_host
  //     or the device could not decide the row (the host sampler then picks
  //     it from the logits with the same draw).
  //   logits: the rows of the kChooseOnHost sequences, as forward() gives
  //     them, at first_row[i] for num_rows[i] rows: every row of an on_host
  //     all_logits chunk, else the last. Sequences chosen on the device have
  //     num_rows[i] == 0 (all_logits is ignored for them), so a step whose
  //     tokens were all chosen on the device copies no logits.
  virtual Result<void> forward_choose(std::span<const SequenceChunk> /*batch*/, const KvCacheView& /*kv*/,
                                      std::span<const TokenChoice> /*choices*/, std::vector<int32_t>& /*tokens*/,
                                      ForwardOutput& /*logits*/) {
    return invalid_argument("this model does not choose tokens on a device; call forward");
  }
};

// Checks a batch against a model config and cache; shared by every implementation.
Result<void> validate_batch(const ModelConfig& cfg, std::span<const SequenceChunk> batch, const KvCacheView& kv);

}  // namespace siesta
