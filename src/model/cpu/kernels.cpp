#include "model/cpu/kernels.h"

#include <cmath>

#include "common/thread_pool.h"

namespace siesta::cpu {

namespace {
constexpr size_t kLanes = 16;

float reduce_lanes(const float (&acc)[kLanes]) {
  // Fixed pairwise tree: (0+8, 1+9, ...), then halves again.
  float a8[8];
  for (size_t i = 0; i < 8; ++i) a8[i] = acc[i] + acc[i + 8];
  float a4[4];
  for (size_t i = 0; i < 4; ++i) a4[i] = a8[i] + a8[i + 4];
  return (a4[0] + a4[2]) + (a4[1] + a4[3]);
}
}  // namespace

float dot(const float* a, const float* b, size_t n) {
  float acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (size_t j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  return reduce_lanes(acc);
}

void linear(const float* x, size_t rows, size_t k, const float* w, size_t n_out, float* y, ThreadPool& pool) {
  // Each task owns a range of output columns; inside it, one weight row is
  // applied to every input row while it is hot in cache.
  pool.parallel_for(
      n_out,
      [&](size_t begin, size_t end) {
        for (size_t j = begin; j < end; ++j) {
          const float* wj = w + j * k;
          for (size_t r = 0; r < rows; ++r) y[r * n_out + j] = dot(x + r * k, wj, k);
        }
      },
      /*min_chunk=*/16);
}

void rms_norm(const float* x, const float* weight, size_t rows, size_t n, float eps, float* out) {
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    const float mean_sq = dot(xr, xr, n) / static_cast<float>(n);
    const float scale = 1.0f / std::sqrt(mean_sq + eps);
    for (size_t i = 0; i < n; ++i) o[i] = weight[i] * (xr[i] * scale);
  }
}

void apply_rope(float* v, size_t head_dim, const float* inv_freq, int pos) {
  const size_t half = head_dim / 2;
  for (size_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
    const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
    const float x1 = v[i];
    const float x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
  }
}

void silu_mul(const float* gate, const float* up, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = (g / (1.0f + std::exp(-g))) * up[i];
  }
}

}  // namespace siesta::cpu
