// Embedding, residual add + RMSNorm, q/k RMSNorm + RoPE + KV-cache write, SiLU-mul.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "model/cuda/device_util.cuh"
#include "model/cuda/norm_rope.cuh"
#include "model/cuda/kernels.h"

namespace siesta::cuda {
namespace {

using dev::load8;
using dev::round_bf16;
using dev::store8;

__global__ void embed_kernel(const int32_t* tokens, const bf16* table, int hidden, bf16* x) {
  dev::begin_dependent_kernel();
  const int t = blockIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(table + static_cast<size_t>(tokens[t]) * hidden);
  uint4* dst = reinterpret_cast<uint4*>(x + static_cast<size_t>(t) * hidden);
  for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) dst[c] = src[c];
}

constexpr int kNormThreads = 256;
constexpr int kNormMaxChunks = 4;  // 16-byte chunks per thread: hidden <= 256 * 8 * 4 = 8192

__global__ __launch_bounds__(kNormThreads) void add_rms_norm_kernel(bf16* x, const bf16* delta, const bf16* weight,
                                                                     int hidden, float eps, const int32_t* row_index,
                                                                     bf16* out) {
  dev::begin_dependent_kernel();
  __shared__ float scratch[32];
  const int r = blockIdx.x;
  const int src_row = row_index ? row_index[r] : r;
  bf16* xr = x + static_cast<size_t>(src_row) * hidden;
  const int chunks = hidden / 8;
  float v[kNormMaxChunks][8];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormMaxChunks; ++j) {
    const int c = threadIdx.x + j * kNormThreads;
    if (c < chunks) {
      load8(xr + c * 8, v[j]);
      if (delta) {
        float d[8];
        load8(delta + static_cast<size_t>(src_row) * hidden + c * 8, d);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[j][e] = round_bf16(v[j][e] + d[e]);
        if (!row_index) store8(xr + c * 8, v[j]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += v[j][e] * v[j][e];
    }
  }
  ss = dev::block_sum(ss, scratch);
  const float rs = rsqrtf(ss / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int j = 0; j < kNormMaxChunks; ++j) {
    const int c = threadIdx.x + j * kNormThreads;
    if (c < chunks) {
      float w[8], o[8];
      load8(weight + c * 8, w);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = w[e] * round_bf16(v[j][e] * rs);
      store8(out + static_cast<size_t>(r) * hidden + c * 8, o);
    }
  }
}

// The same with one warp per row, for rows of up to 32 * 8 * kChunks
// elements (kChunks 16-byte chunks per lane): no block-wide reduction, eight
// rows per CTA. The row stays in registers as bf16 between the two passes
// (x + delta rounded to bf16 is what the first pass stores anyway).
constexpr int kNormWarpRows = 8;
constexpr int kNormWarpMinRows = 1024;

template <int kChunks>
__global__ __launch_bounds__(32 * kNormWarpRows) void add_rms_norm_warp_kernel(bf16* x, const bf16* delta,
                                                                               const bf16* weight, int rows, int hidden,
                                                                               float eps, const int32_t* row_index,
                                                                               bf16* out) {
  dev::begin_dependent_kernel();
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kNormWarpRows + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int src_row = row_index ? row_index[r] : r;
  bf16* xr = x + static_cast<size_t>(src_row) * hidden;
  const int chunks = hidden / 8;
  uint4 v[kChunks];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      v[j] = *reinterpret_cast<const uint4*>(xr + c * 8);
      float f[8];
      dev::unpack8(v[j], f);
      if (delta) {
        float d[8];
        load8(delta + static_cast<size_t>(src_row) * hidden + c * 8, d);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = round_bf16(f[e] + d[e]);
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v[j]);
#pragma unroll
        for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
        if (!row_index) *reinterpret_cast<uint4*>(xr + c * 8) = v[j];
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
  }
  const float rs = rsqrtf(dev::warp_sum(ss) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      float f[8], w[8], o[8];
      dev::unpack8(v[j], f);
      load8(weight + c * 8, w);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = w[e] * round_bf16(f[e] * rs);
      store8(out + static_cast<size_t>(r) * hidden + c * 8, o);
    }
  }
}

template <int kHeadDim>
__global__ void qk_norm_rope_kv_kernel(const bf16* qkv, const int32_t* positions, const int32_t* slots,
                                       const bf16* q_norm, const bf16* k_norm, const __nv_bfloat162* rope_table,
                                       int num_heads, int num_kv_heads, float eps, bf16* q_out, KvCacheDesc kv,
                                       int layer) {
  dev::begin_dependent_kernel();
  const int t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int q_dim = num_heads * kHeadDim, kv_dim = num_kv_heads * kHeadDim;
  const bf16* row = qkv + static_cast<size_t>(t) * (q_dim + 2 * kv_dim);
  const __nv_bfloat162* rope = rope_table + static_cast<size_t>(positions[t]) * (kHeadDim / 2);
  const int slot = slots[t];
  const int units = num_heads + 2 * num_kv_heads;
  for (int u = warp; u < units; u += warps) {
    if (u < num_heads) {
      dev::norm_rope_head<kHeadDim>(row + u * kHeadDim, q_norm, rope, eps,
                               q_out + (static_cast<size_t>(t) * num_heads + u) * kHeadDim);
    } else if (slot >= 0) {
      const int block = slot / kKvBlockSize, in_block = slot % kKvBlockSize;
      if (u < num_heads + num_kv_heads) {
        const int h = u - num_heads;
        dev::norm_rope_head<kHeadDim>(row + q_dim + h * kHeadDim, k_norm, rope, eps,
                                 dev::kv_slot(kv, block, in_block, layer, 0, h));
      } else {
        const int h = u - num_heads - num_kv_heads;
        const uint4* src = reinterpret_cast<const uint4*>(row + q_dim + kv_dim + h * kHeadDim);
        uint4* dst = reinterpret_cast<uint4*>(dev::kv_slot(kv, block, in_block, layer, 1, h));
        for (int c = lane; c < kHeadDim / 8; c += 32) dst[c] = src[c];
      }
    }
  }
}

__global__ void rope_table_kernel(const float* inv_freq, int half, int max_pos, __nv_bfloat162* table) {
  dev::begin_dependent_kernel();
  const size_t n = static_cast<size_t>(max_pos) * half;
  for (size_t k = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int pos = static_cast<int>(k / half), i = static_cast<int>(k % half);
    const float angle = static_cast<float>(pos) * inv_freq[i];  // fp32, as HF
    table[k] = __floats2bfloat162_rn(cosf(angle), sinf(angle));
  }
}

__global__ void silu_mul_kernel(const bf16* gate_up, int T, int inter, bf16* out) {
  dev::begin_dependent_kernel();
  const size_t chunks_per_row = inter / 8;
  const size_t total = static_cast<size_t>(T) * chunks_per_row;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t t = i / chunks_per_row, c = i % chunks_per_row;
    float g[8], u[8], o[8];
    load8(gate_up + t * 2 * inter + c * 8, g);
    load8(gate_up + t * 2 * inter + inter + c * 8, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float silu = round_bf16(g[e] / (1.0f + expf(-g[e])));
      o[e] = silu * u[e];
    }
    store8(out + t * inter + c * 8, o);
  }
}

__global__ void fill_random_kernel(bf16* out, size_t n, uint64_t seed, float scale) {
  dev::begin_dependent_kernel();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;  // splitmix64 finaliser
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

__global__ void round_to_bf16_kernel(float* x, size_t n) {
  dev::begin_dependent_kernel();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[i] = round_bf16(x[i]);
}

}  // namespace

cudaError_t launch_round_to_bf16(float* x, size_t n, LaunchConfig launch) {
  if (n == 0) return cudaSuccess;
  const size_t blocks = std::min<size_t>((n + 255) / 256, 132 * 16);
  return launch_kernel(round_to_bf16_kernel, static_cast<unsigned>(blocks), 256, 0, launch, x, n);
}

cudaError_t launch_fill_random_bf16(bf16* out, size_t n, uint64_t seed, float scale, LaunchConfig launch) {
  if (n == 0) return cudaSuccess;
  return launch_kernel(fill_random_kernel, 1024, 256, 0, launch, out, n, seed, scale);
}

cudaError_t launch_embed(const int32_t* tokens, int T, const bf16* table, int hidden, bf16* x, LaunchConfig launch) {
  if (T <= 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  return launch_kernel(embed_kernel, T, 128, 0, launch, tokens, table, hidden, x);
}

cudaError_t launch_add_rms_norm(bf16* x, const bf16* delta, const bf16* weight, int rows, int hidden, float eps,
                                const int32_t* row_index, bf16* out, LaunchConfig launch) {
  if (rows <= 0) return cudaSuccess;
  if (hidden % 8 != 0 || hidden > kNormThreads * 8 * kNormMaxChunks)
    return cudaErrorInvalidValue;
  // A warp per row where there are rows for every SM's eight warps (4096
  // rows of 1024: 11 against 17 us on an H200); a CTA per row below, where
  // more threads per row finish a small batch sooner (128 rows: 7 against 5 us).
  const unsigned warp_ctas = static_cast<unsigned>((rows + kNormWarpRows - 1) / kNormWarpRows);
  const int lane_chunks = (hidden / 8 + 31) / 32;
  if (rows < kNormWarpMinRows) {
    return launch_kernel(add_rms_norm_kernel, rows, kNormThreads, 0, launch, x, delta, weight, hidden, eps, row_index,
                         out);
  }
  if (lane_chunks <= 4)
    return launch_kernel(add_rms_norm_warp_kernel<4>, warp_ctas, 32 * kNormWarpRows, 0, launch, x, delta, weight, rows,
                         hidden, eps, row_index, out);
  if (lane_chunks <= 8)
    return launch_kernel(add_rms_norm_warp_kernel<8>, warp_ctas, 32 * kNormWarpRows, 0, launch, x, delta, weight, rows,
                         hidden, eps, row_index, out);
  if (lane_chunks <= 16)
    return launch_kernel(add_rms_norm_warp_kernel<16>, warp_ctas, 32 * kNormWarpRows, 0, launch, x, delta, weight,
                         rows, hidden, eps, row_index, out);
  return launch_kernel(add_rms_norm_kernel, rows, kNormThreads, 0, launch, x, delta, weight, hidden, eps, row_index, out);
}

cudaError_t launch_rope_table(const float* inv_freq, int head_dim, int max_pos, __nv_bfloat162* table,
                              LaunchConfig launch) {
  if (max_pos <= 0) return cudaSuccess;
  return launch_kernel(rope_table_kernel, 1024, 256, 0, launch, inv_freq, head_dim / 2, max_pos, table);
}

cudaError_t launch_qk_norm_rope_kv(const bf16* qkv, int T, const int32_t* positions, const int32_t* slots,
                                   const bf16* q_norm, const bf16* k_norm, const __nv_bfloat162* rope_table,
                                   int num_heads, int num_kv_heads, int head_dim, float eps, bf16* q_out,
                                   KvCacheDesc kv, int layer, LaunchConfig launch) {
  if (T <= 0) return cudaSuccess;
  const int units = num_heads + 2 * num_kv_heads;
  const int threads = 32 * (units < 16 ? units : 16);
  switch (head_dim) {
    case 64:
      return launch_kernel(qk_norm_rope_kv_kernel<64>, T, threads, 0, launch, qkv, positions, slots, q_norm, k_norm,
                           rope_table, num_heads, num_kv_heads, eps, q_out, kv, layer);
    case 128:
      return launch_kernel(qk_norm_rope_kv_kernel<128>, T, threads, 0, launch, qkv, positions, slots, q_norm, k_norm,
                           rope_table, num_heads, num_kv_heads, eps, q_out, kv, layer);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_silu_mul(const bf16* gate_up, int T, int inter, bf16* out, LaunchConfig launch) {
  if (T <= 0) return cudaSuccess;
  if (inter % 8 != 0) return cudaErrorInvalidValue;
  const size_t total = static_cast<size_t>(T) * (inter / 8);
  const int threads = 256;
  const size_t blocks = (total + threads - 1) / threads;
  return launch_kernel(silu_mul_kernel, static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16), threads, 0,
                       launch, gate_up, T, inter, out);
}

}  // namespace siesta::cuda
