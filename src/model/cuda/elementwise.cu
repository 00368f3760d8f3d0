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
// (x + delta rounded to bf16 is what the first pass stores anyway). For rows
// wider than 1024; add_rms_norm_warp_kernel below takes the narrower ones.
constexpr int kNormWarpRows = 8;
constexpr int kNormWarpMinRows = 1024;

// The sum of squares of a warp-per-row norm in add_rms_norm_kernel's order, so
// that a row's norm does not depend on how many rows its pass has: lane l's
// chunk l + 32 j is that kernel's thread l + 32 (j % 8)'s, in its warp j % 8.
// part[p]: lane l's chain over the chunks j with j % 8 == p, in ascending j
// (the thread's own chain); each part's warp sum is a warp total there, and
// the totals are added in warp order from zero (the warps without chunks add
// zeros, which leave the non-negative total as it is).
constexpr int norm_parts(int chunks) { return chunks < 8 ? chunks : 8; }
template <int kParts>
__device__ __forceinline__ float block_order_total(const float (&part)[kParts]) {
  float total = 0.0f;
#pragma unroll
  for (int p = 0; p < kParts; ++p) total += dev::warp_sum(part[p]);
  return total;
}

// One 16-byte chunk of a warp-per-row norm. The residual add: f (x) becomes
// bf16(f + d), v takes its bf16 bits, and with store they go back to x (dst).
__device__ __forceinline__ void add_delta8(uint4& v, const float (&d)[8], float (&f)[8], bool store, bf16* dst) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = round_bf16(f[e] + d[e]);
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
  if (store) *reinterpret_cast<uint4*>(dst) = v;
}
// The normalised chunk: out = w * bf16(x * rs).
__device__ __forceinline__ void norm_store8(const float (&x)[8], const float (&w)[8], float rs, bf16* out) {
  float o[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = w[e] * round_bf16(x[e] * rs);
  store8(out, o);
}

template <int kChunks>
__global__ __launch_bounds__(32 * kNormWarpRows) void add_rms_norm_wide_warp_kernel(bf16* x, const bf16* delta,
                                                                                    const bf16* weight, int rows,
                                                                                    int hidden, float eps,
                                                                                    const int32_t* row_index,
                                                                                    bf16* out) {
  dev::begin_dependent_kernel();
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kNormWarpRows + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int src_row = row_index ? row_index[r] : r;
  bf16* xr = x + static_cast<size_t>(src_row) * hidden;
  const int chunks = hidden / 8;
  uint4 v[kChunks];
  float ss[norm_parts(kChunks)] = {};
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
        add_delta8(v[j], d, f, !row_index, xr + c * 8);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss[j % 8] += f[e] * f[e];
    }
  }
  const float rs = rsqrtf(block_order_total(ss) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      float f[8], w[8];
      dev::unpack8(v[j], f);
      load8(weight + c * 8, w);
      norm_store8(f, w, rs, out + static_cast<size_t>(r) * hidden + c * 8);
    }
  }
}

// Rows of up to 1024 elements (kNormWarpChunks 16-byte chunks per lane), a
// warp each, with the wide kernel's arithmetic and its loads batched: every x
// and delta chunk of the row is loaded before the first store, and every
// weight chunk before the warp sum. (In the wide kernel each chunk's loads
// wait for the previous chunk's store, of x in the first pass and of out in
// the second, as the compiler cannot rule out that the buffers overlap: a lane
// waits for up to 2 kChunks memory round trips in turn, here for two.) 63
// registers for sm_90a: four CTAs per SM, so 4096 rows fit at once on 132 SMs.
constexpr int kNormWarpChunks = 4;

__global__ __launch_bounds__(32 * kNormWarpRows) void add_rms_norm_warp_kernel(bf16* x, const bf16* delta,
                                                                               const bf16* weight, int rows, int hidden,
                                                                               float eps, const int32_t* row_index,
                                                                               bf16* out) {
  constexpr int kChunks = kNormWarpChunks;
  dev::begin_dependent_kernel();
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kNormWarpRows + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int src_row = row_index ? row_index[r] : r;
  bf16* xr = x + static_cast<size_t>(src_row) * hidden;
  const bf16* dr = delta ? delta + static_cast<size_t>(src_row) * hidden : nullptr;
  const int chunks = hidden / 8;
  uint4 v[kChunks], dv[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      v[j] = *reinterpret_cast<const uint4*>(xr + c * 8);
      if (delta) dv[j] = *reinterpret_cast<const uint4*>(dr + c * 8);
    }
  }
  float ss[norm_parts(kChunks)] = {};
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      float f[8];
      dev::unpack8(v[j], f);
      if (delta) {
        float d[8];
        dev::unpack8(dv[j], d);
        add_delta8(v[j], d, f, !row_index, xr + c * 8);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss[j % 8] += f[e] * f[e];
    }
  }
  uint4 w[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) w[j] = *reinterpret_cast<const uint4*>(weight + c * 8);
  }
  const float rs = rsqrtf(block_order_total(ss) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
      float f[8], wf[8];
      dev::unpack8(v[j], f);
      dev::unpack8(w[j], wf);
      norm_store8(f, wf, rs, out + static_cast<size_t>(r) * hidden + c * 8);
    }
  }
}

// q/k norm + RoPE + KV write (prefill and mixed passes), with many loads in
// flight per warp. A token's row [q | k | v] is cut into warp jobs: norm jobs of kQkJobHeads q or k heads
// (contiguous in the row), then v jobs of kQkCopyChunks 16-byte chunks. A norm
// job loads all its heads (lane l holds the pairs of dev::norm_rope_head:
// elements 2 l, 2 l + 1 and the same + half), then normalises and rotates
// each head with norm_rope_head's arithmetic, op for op and in its order; a v
// job copies two chunks per lane, both loads before the stores. k and v are
// loaded whatever the slot: only their stores wait for it. A CTA is blockDim.y
// tokens of one warp per job. At most 48 registers (ptxas would take 54 for
// sm_90a), so that five CTAs of eight warps fit an SM. (One warp per head,
// one head after another, measured 0.92 ms per 4096-token prefill of
// Qwen3-0.6B on the H200; this kernel 0.78.)
constexpr int kQkJobHeads = 4;
constexpr int kQkCopyChunks = 64;
constexpr int kQkCtaWarps = 8;  // warps per CTA where a token has fewer jobs (more tokens per CTA)
constexpr int kQkMaxJobs = 32;  // one CTA of 1024 threads for one token

int qk_norm_jobs(int num_heads, int num_kv_heads, int head_dim) {
  return (num_heads + num_kv_heads + kQkJobHeads - 1) / kQkJobHeads +
         (num_kv_heads * head_dim / 8 + kQkCopyChunks - 1) / kQkCopyChunks;
}

template <int kHeadDim>
__global__ __maxnreg__(48) void qk_norm_rope_kv_kernel(const bf16* qkv, int T, const int32_t* positions,
                                                       const int32_t* slots, const bf16* q_norm, const bf16* k_norm,
                                                       const __nv_bfloat162* rope_table, int num_heads,
                                                       int num_kv_heads, float eps, bf16* q_out, KvCacheDesc kv,
                                                       int layer) {
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kUnits = kQkJobHeads;
  constexpr int kHeadChunks = kHeadDim / 8;
  static_assert(kHalf <= 64 && kQkCopyChunks == 64, "one bf16x2 pair per lane and half; two chunks per lane");
  const int lane = threadIdx.x & 31, job = threadIdx.x >> 5;
  const int i = 2 * lane;
  const bool pair = i < kHalf;  // lanes that hold a rotation pair (all at head_dim 128)
  const int norm_units = num_heads + num_kv_heads;
  const int norm_jobs = (norm_units + kUnits - 1) / kUnits;
  // The norm weights do not depend on the previous kernel.
  dev::allow_next_kernel();
  __nv_bfloat162 wa_q, wb_q, wa_k, wb_k;
  if (job < norm_jobs && pair) {
    wa_q = *reinterpret_cast<const __nv_bfloat162*>(q_norm + i);
    wb_q = *reinterpret_cast<const __nv_bfloat162*>(q_norm + i + kHalf);
    wa_k = *reinterpret_cast<const __nv_bfloat162*>(k_norm + i);
    wb_k = *reinterpret_cast<const __nv_bfloat162*>(k_norm + i + kHalf);
  }
  dev::wait_for_previous_kernel();
  const int t = blockIdx.x * blockDim.y + threadIdx.y;
  if (t >= T) return;
  const int q_dim = num_heads * kHeadDim, kv_dim = num_kv_heads * kHeadDim;
  const bf16* row = qkv + static_cast<size_t>(t) * (q_dim + 2 * kv_dim);
  const int slot = slots[t];
  if (job >= norm_jobs) {
    const int c0 = (job - norm_jobs) * kQkCopyChunks + lane;
    const uint4* src = reinterpret_cast<const uint4*>(row + q_dim + kv_dim);
    uint4 v[2];
#pragma unroll
    for (int k = 0; k < 2; ++k)
      if (c0 + 32 * k < kv_dim / 8) v[k] = src[c0 + 32 * k];
    if (slot < 0) return;
    bf16* dst = dev::kv_slot(kv, slot / kKvBlockSize, slot % kKvBlockSize, layer, 1, 0);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int c = c0 + 32 * k;
      if (c < kv_dim / 8)
        *reinterpret_cast<uint4*>(dst + static_cast<size_t>(c / kHeadChunks) * kv.head_dim + (c % kHeadChunks) * 8) =
            v[k];
    }
    return;
  }
  const int u0 = job * kUnits;
  const bf16* src = row + u0 * kHeadDim + i;
  __nv_bfloat162 ra[kUnits], rb[kUnits], rope[2];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    if (pair && u0 + k < norm_units) {
      ra[k] = __ldcg(reinterpret_cast<const __nv_bfloat162*>(src + k * kHeadDim));
      rb[k] = __ldcg(reinterpret_cast<const __nv_bfloat162*>(src + k * kHeadDim + kHalf));
    }
  }
  if (pair) {
    const __nv_bfloat162* r = rope_table + static_cast<size_t>(positions[t]) * kHalf + i;
    rope[0] = r[0];
    rope[1] = r[1];
  }
  // Without a slot only q is written.
  const int out_units = slot >= 0 ? norm_units : num_heads;
  bf16* const q_dst = q_out + static_cast<size_t>(t) * q_dim + i;
  bf16* const k_dst = slot >= 0 ? dev::kv_slot(kv, slot / kKvBlockSize, slot % kKvBlockSize, layer, 0, 0) + i : nullptr;
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int u = u0 + k;
    if (u >= out_units) break;  // warp-uniform: every lane takes part in the warp sum
    float2 a = {}, b = {};
    float ss = 0.0f;
    if (pair) {
      a = __bfloat1622float2(ra[k]);
      b = __bfloat1622float2(rb[k]);
      ss += a.x * a.x + a.y * a.y + b.x * b.x + b.y * b.y;
    }
    ss = dev::warp_sum(ss);
    const float rs = rsqrtf(ss / static_cast<float>(kHeadDim) + eps);
    if (!pair) continue;
    const bool is_q = u < num_heads;
    bf16* dst = is_q ? q_dst + u * kHeadDim : k_dst + static_cast<size_t>(u - num_heads) * kv.head_dim;
    const float2 wa = __bfloat1622float2(is_q ? wa_q : wa_k), wb = __bfloat1622float2(is_q ? wb_q : wb_k);
    const float x1[2] = {round_bf16(wa.x * round_bf16(a.x * rs)), round_bf16(wa.y * round_bf16(a.y * rs))};
    const float x2[2] = {round_bf16(wb.x * round_bf16(b.x * rs)), round_bf16(wb.y * round_bf16(b.y * rs))};
    float lo[2], hi[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float2 cs = __bfloat1622float2(rope[e]);
      lo[e] = round_bf16(x1[e] * cs.x) + round_bf16(-x2[e] * cs.y);
      hi[e] = round_bf16(x2[e] * cs.x) + round_bf16(x1[e] * cs.y);
    }
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(lo[0], lo[1]);
    *reinterpret_cast<__nv_bfloat162*>(dst + kHalf) = __floats2bfloat162_rn(hi[0], hi[1]);
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

// SiLU-mul over a 2D grid, blockIdx.x the row and blockIdx.y a span of
// kSiluChunks * blockDim.x 16-byte chunks of it (no index division), each
// thread loading its kSiluChunks gate and up chunks before computing.
constexpr int kSiluChunks = 2;

__global__ void silu_mul_kernel(const bf16* gate_up, int inter, bf16* out) {
  dev::begin_dependent_kernel();
  const int chunks_per_row = inter / 8;
  const int c0 = blockIdx.y * kSiluChunks * blockDim.x + threadIdx.x;
  const bf16* gate = gate_up + static_cast<size_t>(blockIdx.x) * 2 * inter;
  bf16* dst = out + static_cast<size_t>(blockIdx.x) * inter;
  float g[kSiluChunks][8], u[kSiluChunks][8];
#pragma unroll
  for (int k = 0; k < kSiluChunks; ++k) {
    const int c = c0 + k * blockDim.x;
    if (c < chunks_per_row) {
      load8(gate + c * 8, g[k]);
      load8(gate + inter + c * 8, u[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kSiluChunks; ++k) {
    const int c = c0 + k * blockDim.x;
    if (c < chunks_per_row) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float silu = round_bf16(dev::silu(g[k][e]));
        o[e] = silu * u[k][e];
      }
      store8(dst + c * 8, o);
    }
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
  if (lane_chunks <= kNormWarpChunks)
    return launch_kernel(add_rms_norm_warp_kernel, warp_ctas, 32 * kNormWarpRows, 0, launch, x, delta, weight, rows,
                         hidden, eps, row_index, out);
  if (lane_chunks <= 8)
    return launch_kernel(add_rms_norm_wide_warp_kernel<8>, warp_ctas, 32 * kNormWarpRows, 0, launch, x, delta, weight, rows,
                         hidden, eps, row_index, out);
  if (lane_chunks <= 16)
    return launch_kernel(add_rms_norm_wide_warp_kernel<16>, warp_ctas, 32 * kNormWarpRows, 0, launch, x, delta, weight,
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
  const int jobs = qk_norm_jobs(num_heads, num_kv_heads, head_dim);
  if (jobs > kQkMaxJobs) return cudaErrorInvalidValue;
  const int tokens = std::max(1, kQkCtaWarps / jobs);
  const dim3 block(32 * jobs, tokens);
  const unsigned grid = static_cast<unsigned>((T + tokens - 1) / tokens);
  switch (head_dim) {
    case 64:
      return launch_kernel(qk_norm_rope_kv_kernel<64>, grid, block, 0, launch, qkv, T, positions, slots, q_norm, k_norm,
                           rope_table, num_heads, num_kv_heads, eps, q_out, kv, layer);
    case 128:
      return launch_kernel(qk_norm_rope_kv_kernel<128>, grid, block, 0, launch, qkv, T, positions, slots, q_norm,
                           k_norm, rope_table, num_heads, num_kv_heads, eps, q_out, kv, layer);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_silu_mul(const bf16* gate_up, int T, int inter, bf16* out, LaunchConfig launch) {
  if (T <= 0) return cudaSuccess;
  if (inter % 8 != 0) return cudaErrorInvalidValue;
  // A row per CTA column: the fewest spans of at most 256 threads, then the
  // fewest warps that cover the row.
  const int chunks_per_row = inter / 8;
  const int spans = (chunks_per_row + kSiluChunks * 256 - 1) / (kSiluChunks * 256);
  if (spans > 65535) return cudaErrorInvalidValue;
  const int threads = (chunks_per_row + kSiluChunks * 32 * spans - 1) / (kSiluChunks * 32 * spans) * 32;
  return launch_kernel(silu_mul_kernel, dim3(T, spans), threads, 0, launch, gate_up, inter, out);
}

}  // namespace siesta::cuda
