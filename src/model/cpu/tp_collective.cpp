#include "model/cpu/tp_collective.h"

#include <algorithm>
#include <cstring>

#include "common/thread_pool.h"
#include "model/cpu/kernels.h"

namespace siesta::cpu {

size_t TpCollective::chain_numel(size_t n_out) { return kChainRows * n_out * (kDotLanes + 1); }

TpCollective::TpCollective(int tp, ThreadPool& threads, std::span<float> chain)
    : tp_(tp), threads_(threads), chain_(chain) {}

void TpCollective::embed(std::span<const EmbeddingRow> rows, size_t hidden, std::span<float* const> residuals) const {
  for (size_t i = 0; i < rows.size(); ++i)
    for (int r = 0; r < tp_; ++r) std::memcpy(residuals[r] + i * hidden, rows[i].row, hidden * sizeof(float));
}

void TpCollective::row_parallel_add(std::span<const RowParallelPart> parts, size_t rows, size_t n_out,
                                    std::span<float* const> residuals) {
  float* lanes = chain_.data();
  float* y = lanes + kChainRows * n_out * kDotLanes;
  for (size_t r0 = 0; r0 < rows; r0 += kChainRows) {
    const size_t tile = std::min(kChainRows, rows - r0);
    // Rank 0 starts the lanes from zero, as dot() does; each later rank
    // continues them where the one before left them.
    std::fill(lanes, lanes + tile * n_out * kDotLanes, 0.0f);
    for (const RowParallelPart& p : parts)
      linear_accumulate(p.x + r0 * p.k, tile, p.k, p.k_begin, p.w, n_out, lanes, threads_);
    // The last rank sums the lanes with dot()'s tree and broadcasts.
    linear_lanes_sum(lanes, tile, n_out, y);
    for (int r = 0; r < tp_; ++r) {
      float* x = residuals[r] + r0 * n_out;
      for (size_t i = 0; i < tile * n_out; ++i) x[i] += y[i];
    }
  }
}

void TpCollective::gather_columns(std::span<const Slice> slices, size_t rows, size_t vocab, float* logits) {
  for (const Slice& s : slices)
    for (size_t i = 0; i < rows; ++i)
      std::memcpy(logits + i * vocab + s.begin, s.data + i * s.width, s.width * sizeof(float));
}

}  // namespace siesta::cpu
