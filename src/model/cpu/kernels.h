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

// Dot product of two length-n vectors with the fixed 16-lane order.
float dot(const float* a, const float* b, size_t n);

// y[r, j] = dot(x[r, :], w[j, :]) for r < rows, j < n_out. w is [n_out, k]
// (the Hugging Face Linear layout). Parallel over output columns.
void linear(const float* x, size_t rows, size_t k, const float* w, size_t n_out, float* y, ThreadPool& pool);

// out = x * rsqrt(mean(x^2) + eps) * weight, over rows of length n. In place allowed.
void rms_norm(const float* x, const float* weight, size_t rows, size_t n, float eps, float* out);

// Rotary embedding (rotate-half form, as HF Qwen3) on one head vector of length
// head_dim at position pos; inv_freq has head_dim / 2 entries.
void apply_rope(float* v, size_t head_dim, const float* inv_freq, int pos);

// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, size_t n, float* out);

}  // namespace siesta::cpu
