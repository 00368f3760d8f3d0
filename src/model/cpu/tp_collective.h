// TpCollective: the collectives of a CPU tensor-parallel group (CpuQwen3Tp),
// whose ranks live in one process.
//
//   TpCollective group(tp, threads, chain_buffer);    // chain_buffer: chain_numel(hidden) floats
//   group.embed(tokens, hidden, owners, residuals);     // vocab-parallel embedding, row broadcast
//   group.row_parallel_add(parts, rows, hidden, residuals);  // O and down: x_r += x W^T on every rank
//   TpCollective::gather_columns(slices, rows, logits);      // vocab-parallel LM head
//
// Execution: the ranks take turns. A collective runs each rank's part of it
// one rank after another on the calling thread, every part using the whole
// ThreadPool, and state passes from rank to rank through the collective's
// buffer. Nothing runs two ranks at once, so there are no barriers to get
// wrong, and the results do not depend on the thread count.
//
// Order. A row-parallel projection splits K over the ranks (rank r holds K
// columns [k_begin_r, k_begin_r + k_r)). TP=1 computes each output element
// with dot()'s 16 lane sums over all of K and then one fixed tree over the
// lanes (cpu/kernels.h). row_parallel_add is an ordered chain: rank 0 starts
// from zeroed lanes and accumulates its K columns, rank r continues the lanes
// rank r - 1 left, and after the last rank the lanes are summed by dot's tree
// and the result broadcast to every rank's residual. Each lane sees the same
// products in the same order as at TP=1, whatever the split points (a lane
// is chosen by the global K index), so the result is bit-identical for every
// group size plan_tensor_parallel accepts. The chain works on tiles of
// kChainRows rows, so its buffer does not grow with the batch.
//
// Thread safety: one thread at a time (the model's forward).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace siesta {
class ThreadPool;
}

namespace siesta::cpu {

// One rank's share of a row-parallel projection y = x W^T (W [n_out, K]):
// x's columns [k_begin, k_begin + k) as x [rows, k], and the same columns
// of W as w [n_out, k].
struct RowParallelPart {
  const float* x = nullptr;
  const float* w = nullptr;
  size_t k = 0;
  size_t k_begin = 0;
};

// A token's embedding row: the rank whose vocabulary rows hold it, and where
// in that rank's shard.
struct EmbeddingRow {
  int rank = 0;
  const float* row = nullptr;
};

class TpCollective {
 public:
  static constexpr size_t kChainRows = 64;
  // Floats of the chain buffer for projections of up to n_out outputs.
  static size_t chain_numel(size_t n_out);

  // chain: chain_numel(max n_out) floats (the model's scratch memory).
  TpCollective(int tp, ThreadPool& threads, std::span<float> chain);

  int size() const { return tp_; }

  // Every rank's residual row i = the embedding row of token i, copied from
  // the rank that holds it (a broadcast: no arithmetic touches the values).
  void embed(std::span<const EmbeddingRow> rows, size_t hidden, std::span<float* const> residuals) const;

  // residuals[r][i * n_out + j] += y[i, j] on every rank, y computed from the
  // parts (one per rank, in rank order) by the ordered chain above.
  void row_parallel_add(std::span<const RowParallelPart> parts, size_t rows, size_t n_out,
                        std::span<float* const> residuals);

  // Vocab-parallel output: slice r ([rows, width_r], columns [begin_r,
  // begin_r + width_r) of the full row) into logits [rows, vocab].
  struct Slice {
    const float* data = nullptr;
    size_t begin = 0;
    size_t width = 0;
  };
  static void gather_columns(std::span<const Slice> slices, size_t rows, size_t vocab, float* logits);

 private:
  int tp_;
  ThreadPool& threads_;
  std::span<float> chain_;
};

}  // namespace siesta::cpu
