// Megatron-style tensor parallelism of a Qwen3 checkpoint: which part of each
// Hugging Face tensor rank r of a TP group of `tp` holds. QKV and gate/up are
// split by output rows (heads, intermediate columns), O and down by input
// columns, each followed by one all-reduce; the embedding and the LM head by
// vocabulary rows (vocab-parallel, as vLLM's VocabParallelEmbedding and
// ParallelLMHead); norms are replicated. KV heads follow their query heads:
// with more ranks than KV heads, each KV head is replicated on tp /
// num_kv_heads ranks. The same layout says which KV heads a rank's cache
// holds, for transfers between TP groups of different sizes.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace siesta {

struct TensorParallelLayout {
  int tp = 1;
  int q_heads = 0;         // per rank
  int kv_heads = 0;        // per rank
  int kv_replicas = 1;     // ranks that hold each KV head (tp / num_kv_heads where tp > num_kv_heads)
  int intermediate = 0;    // per rank
  int vocab = 0;           // per rank: ceil(vocab_size / tp); the last rank's share may be shorter

  int q_head_begin(int rank) const { return rank * q_heads; }
  int kv_head_begin(int rank) const { return rank / kv_replicas * kv_heads; }
  int64_t vocab_begin(int rank, int vocab_size) const;  // clamped to vocab_size
  int64_t vocab_end(int rank, int vocab_size) const;
};

// The layout for `tp` ranks, or an error naming what does not divide.
Result<TensorParallelLayout> plan_tensor_parallel(const ModelConfig& cfg, int tp);

// Rank r's part of the Hugging Face tensor `name` (shape [rows, cols] as the
// checkpoint stores it): rows [begin, end) for dim 0, columns for dim 1, or
// the whole tensor (dim -1: replicated). Unknown names are an error.
struct TensorShard {
  int dim = -1;
  int64_t begin = 0;
  int64_t end = 0;
};
Result<TensorShard> tensor_shard(const TensorParallelLayout& layout, const ModelConfig& cfg, std::string_view name,
                                 int rank);

// P/D between TP groups: the KV heads decode rank d_rank owns, as pieces to
// pull from prefill ranks. Piece i: `count` consecutive KV heads from global
// head `head`, held by P rank p_rank at its local head p_local (the head's
// index in that rank's cache), landing at the D rank's local head d_local.
// Together the pieces cover each KV head of the D rank exactly once. Where P
// replicates a head on several ranks, D ranks take the replicas in turn
// (d_rank's share of the copies), so no P rank serves every D rank alone.
struct KvHeadPiece {
  int p_rank = 0;
  int head = 0;
  int count = 0;
  int p_local = 0;
  int d_local = 0;
};
std::vector<KvHeadPiece> kv_head_pieces(const TensorParallelLayout& p, const TensorParallelLayout& d, int d_rank);

}  // namespace siesta
