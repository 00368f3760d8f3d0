#include "model/cpu/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/thread_pool.h"

namespace siesta::cpu {

namespace {
constexpr size_t kLanes = kDotLanes;

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

void dot_accumulate(float* lanes, const float* a, const float* b, size_t n, size_t k_begin) {
  float acc[kLanes];
  std::memcpy(acc, lanes, sizeof acc);
  // Up to the next multiple of kLanes one element at a time, then whole
  // blocks and the tail exactly as dot() runs them.
  size_t i = 0;
  const size_t head = std::min(n, (kLanes - k_begin % kLanes) % kLanes);
  for (; i < head; ++i) acc[(k_begin + i) % kLanes] += a[i] * b[i];
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (size_t j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  std::memcpy(lanes, acc, sizeof acc);
}

float dot_lanes_sum(const float* lanes) {
  float acc[kLanes];
  std::memcpy(acc, lanes, sizeof acc);
  return reduce_lanes(acc);
}

void linear_accumulate(const float* x, size_t rows, size_t k, size_t k_begin, const float* w, size_t n_out,
                       float* lanes, ThreadPool& pool) {
  pool.parallel_for(
      n_out,
      [&](size_t begin, size_t end) {
        for (size_t j = begin; j < end; ++j) {
          const float* wj = w + j * k;
          for (size_t r = 0; r < rows; ++r) dot_accumulate(lanes + (r * n_out + j) * kLanes, x + r * k, wj, k, k_begin);
        }
      },
      /*min_chunk=*/16);
}

void linear_lanes_sum(const float* lanes, size_t rows, size_t n_out, float* y) {
  for (size_t i = 0; i < rows * n_out; ++i) y[i] = dot_lanes_sum(lanes + i * kLanes);
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
