// fp32 reference kernels for the CPU model.
//
// Determinism is the point: every output element is computed by one thread in
// a fixed order of operations that depends only on that element's own inputs
// (its row of x, its row of W, its attention window). How rows are batched,
// how a prompt is chunked, and how work is split across threads never change
// a result bit. Reductions use a fixed 16-lane accumulator and a fixed final
// tree, which the compiler vectorises without reassociating anything (no
// -ffast-math; ISO mode keeps -ffp-contract=off).
#pragma once

#include <cstddef>

namespace siesta {
class ThreadPool;
}

namespace siesta::cpu {

// Dot product of two length-n vectors with the fixed 16-lane order: lane l
// sums a[k] * b[k] over the k with k % kDotLanes == l, in increasing k,
// starting from +0; the lanes are then added in a fixed tree (dot_lanes_sum).
inline constexpr size_t kDotLanes = 16;
float dot(const float* a, const float* b, size_t n);

// dot's lanes, carried between calls: adds a[i] * b[i] for i < n to the lanes
// as elements k_begin + i of a longer dot product (lane (k_begin + i) %
// kDotLanes). Accumulating [0, m) and then [m, n) into zeroed lanes, for any
// m, leaves the lanes dot(a, b, n) ends with, bit for bit; dot_lanes_sum of
// them is dot's result. This is how a K split across tensor-parallel ranks
// keeps the unsplit order (cpu/tp_collective.h).
void dot_accumulate(float* lanes, const float* a, const float* b, size_t n, size_t k_begin);
float dot_lanes_sum(const float* lanes);

// y[r, j] = dot(x[r, :], w[j, :]) for r < rows, j < n_out. w is [n_out, k]
// (the Hugging Face Linear layout). Parallel over output columns.
void linear(const float* x, size_t rows, size_t k, const float* w, size_t n_out, float* y, ThreadPool& pool);

// linear's K split: for r < rows, j < n_out, dot_accumulate of x[r, :] and
// w[j, :] (both k long, elements k_begin.. of the whole K) into
// lanes[(r * n_out + j) * kDotLanes ...]. Parallel over output columns.
void linear_accumulate(const float* x, size_t rows, size_t k, size_t k_begin, const float* w, size_t n_out,
                       float* lanes, ThreadPool& pool);
// y[r, j] = dot_lanes_sum(lanes of (r, j)) for r < rows, j < n_out.
void linear_lanes_sum(const float* lanes, size_t rows, size_t n_out, float* y);

// out = x * rsqrt(mean(x^2) + eps) * weight, over rows of length n. In place allowed.
void rms_norm(const float* x, const float* weight, size_t rows, size_t n, float eps, float* out);

// Rotary embedding (rotate-half form, as HF Qwen3) on one head vector of length
// head_dim at position pos; inv_freq has head_dim / 2 entries.
void apply_rope(float* v, size_t head_dim, const float* inv_freq, int pos);

// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, size_t n, float* out);

}  // namespace siesta::cpu
