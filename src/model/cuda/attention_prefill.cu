// Prefill attention: causal, variable-length, GQA, over the paged KV cache.
//
// Flash-attention style: one CTA per (pair of query heads that share a kv head,
// work item = sequence and a tile of 64 query rows), four warps of 16 rows per
// head, so every K/V tile brought into shared memory serves 128 rows. Key/value tiles of 64
// positions are gathered from the cache blocks with cp.async (double-buffered)
// and both products run on tensor cores (bf16 inputs, fp32 accumulators); the
// softmax is online, in fp32, in the log2 domain (SFU exp2); probabilities enter the
// second product as bf16, as in FlashAttention.
//
// A row's arithmetic depends only on its own position: key tiles always start
// at position 0 in steps of 64, and tiles past a row's position contribute
// exact zeros. So a row's output does not depend on which other rows (or
// sequences) share its CTA, its pass, or how its prompt was chunked.
// In detail, for a row at position pos:
//  - its scores are its own MMA row (other rows of the tile, or zero rows
//    past the chunk, never enter it); the same 64-key tiles from key 0;
//  - the keys it masks are exactly those past pos (key > pos, and keys at or
//    past kv_len > pos): the same set whether kv_len is pos + 1 (the row is
//    its chunk's last, or alone: a 1-row tile) or a later chunk end; the
//    masked keys' probabilities are exactly 0 and their V is finite (a token
//    of this chunk, or a zero fill), so they add exact zeros to P V;
//  - need_mask only skips masking where it would change nothing;
//  - a tile wholly past pos (present only when later rows share the CTA) has
//    max -inf, so alpha is exactly 1 and every p is 0: o, l, m unchanged.
// Batch-invariant mode relies on this to route one-token chunks here too
// (step_plan.h: one_token_as_prefill), so a decode token and the same token
// inside a prefill chunk get bit-identical attention outputs.
// Padding rows (kv_len 0, from a decode graph's padded batch) write zeros and
// read nothing.
#include <cuda_bf16.h>

#include <cmath>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"

namespace siesta::cuda {
namespace {

constexpr int kBM = kPrefillTileRows;  // query rows per head per CTA
constexpr int kBN = 64;                // keys per tile
constexpr float kLog2e = 1.4426950408889634f;

// 2^x with the SFU's approximation (relative error ~2^-22); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kHeadDim>
constexpr int smem_row() {
  return kHeadDim + 8;  // +16 bytes per row: ldmatrix rows land in distinct banks
}
template <int kHeadDim, int kHeads>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(kHeads * kBM + 4 * kBN) * smem_row<kHeadDim>() * sizeof(bf16);
}

// kHeads query heads (of one kv head) per CTA, 4 warps each.
template <int kHeadDim, int kHeads>
__global__ __launch_bounds__(128 * kHeads) void prefill_attention_kernel(AttentionArgs a) {
  constexpr int kThreads = 128 * kHeads;
  dev::begin_dependent_kernel();
  constexpr int LD = smem_row<kHeadDim>();
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kKSteps = kHeadDim / 16;  // k16 steps of Q K^T
  constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of the output
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [kHeads * kBM][LD]: head-major
  bf16* Ks = Qs + kHeads * kBM * LD;             // [2][kBN][LD]
  bf16* Vs = Ks + 2 * kBN * LD;                  // [2][kBN][LD]

  const int h0 = blockIdx.x * kHeads, item = blockIdx.y;
  const int seq = a.prefill_items[2 * item], tile = a.prefill_items[2 * item + 1];
  const int q_len = a.seq_q_len[seq], kv_len = a.seq_kv_len[seq], q_start = a.seq_q_start[seq];
  if (kv_len <= 0) {  // padding: defined output, no cache reads (whole CTA returns)
    const int pad_rows = min(kBM, q_len - tile * kBM), width = kHeads * kHeadDim;
    for (int i = threadIdx.x; i < pad_rows * width; i += kThreads) {
      const int r = i / width, c = i % width;
      a.out[static_cast<size_t>(q_start + tile * kBM + r) * a.num_heads * kHeadDim + h0 * kHeadDim + c] =
          __float2bfloat16(0.0f);
    }
    return;
  }
  const int start_pos = kv_len - q_len;
  const int kvh = h0 / (a.num_heads / a.num_kv_heads);
  const int r0 = tile * kBM;
  const int rows = min(kBM, q_len - r0);
  const int key_end = start_pos + r0 + rows;  // keys [0, key_end) are visible to some row
  const int ntiles = (key_end + kBN - 1) / kBN;
  const int* table = a.block_tables + a.seq_table_start[seq];
  const int tid = threadIdx.x, lane = tid & 31;
  const int head_local = (tid >> 5) / 4, warp = (tid >> 5) % 4;  // this warp's head, and its 16-row block
  const int h = h0 + head_local;

  // Q tiles of every head; rows past the sequence are zero.
  for (int i = tid; i < kHeads * kBM * kChunks; i += kThreads) {
    const int hr = i / kChunks, c = i % kChunks;  // hr = head * kBM + row
    const int r = hr % kBM;
    const bool ok = r < rows;
    const bf16* src =
        ok ? a.q + (static_cast<size_t>(q_start + r0 + r) * a.num_heads + h0 + hr / kBM) * kHeadDim + c * 8 : a.q;
    dev::cp_async16(Qs + hr * LD + c * 8, src, ok);
  }
  // K/V tile j into stage st; positions at or past kv_len are zero (the cache
  // there may hold anything, and 0 * NaN would poison the sums).
  auto load_kv = [&](int j, int st) {
    bf16* ks = Ks + st * kBN * LD;
    bf16* vs = Vs + st * kBN * LD;
    for (int i = tid; i < kBN * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int key = j * kBN + r;
      const bool ok = key < kv_len;
      const bf16* ksrc = a.kv.base;
      const bf16* vsrc = a.kv.base;
      if (ok) {
        const int block = table[key / kKvBlockSize], slot = key % kKvBlockSize;
        ksrc = dev::kv_slot(a.kv, block, slot, a.layer, 0, kvh) + c * 8;
        vsrc = dev::kv_slot(a.kv, block, slot, a.layer, 1, kvh) + c * 8;
      }
      dev::cp_async16(ks + r * LD + c * 8, ksrc, ok);
      dev::cp_async16(vs + r * LD + c * 8, vsrc, ok);
    }
  };
  load_kv(0, 0);
  dev::cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int row_a = r0 + warp * 16 + g;  // this thread's two rows, within the sequence
  const int pos_a = start_pos + row_a, pos_b = pos_a + 8;
  const float qscale = a.scale * kLog2e;

  uint32_t qf[kKSteps][4];
  float o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};

  for (int j = 0; j < ntiles; ++j) {
    const int st = j & 1;
    if (j + 1 < ntiles) load_kv(j + 1, st ^ 1);
    dev::cp_async_commit();
    dev::cp_async_wait<1>();
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk)
        dev::ldmatrix_x4(qf[kk], Qs + (head_local * kBM + warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
    }
    const bf16* ks = Ks + st * kBN * LD;
    const bf16* vs = Vs + st * kBN * LD;

    // S = Q K^T for this warp's 16 rows x 64 keys.
    float s[kBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int np = 0; np < kBN / 16; ++np) {
        uint32_t b[4];
        dev::ldmatrix_x4(b, ks + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
        dev::mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
        dev::mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }

    // Mask future and absent positions (raw scores; the scale is folded into the exponent).
    const bool need_mask = (j + 1) * kBN - 1 > start_pos + r0 || (j + 1) * kBN > kv_len;
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * kBN + nt * 8 + 2 * t4 + (e & 1);
          const int pos = e < 2 ? pos_a : pos_b;
          if (key > pos || key >= kv_len) s[nt][e] = -INFINITY;
        }
      }
    }

    // Online softmax; the 4 lanes of a quad share a row. p = 2^(s * scale * log2(e) - m').
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * rh], s[nt][2 * rh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // Tile 0 always holds position 0, visible to every row: m_new is finite.
      const float m_new = fmaxf(m_run[rh], mx);
      // Exactly 1 when the max did not move, so tiles past a row's position change nothing.
      const float alpha = m_new == m_run[rh] ? 1.0f : fast_exp2((m_run[rh] - m_new) * qscale);
      m_run[rh] = m_new;
      const float offset = -m_new * qscale;
      float rs = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
        const float p0 = fast_exp2(fmaf(s[nt][2 * rh], qscale, offset));
        const float p1 = fast_exp2(fmaf(s[nt][2 * rh + 1], qscale, offset));
        s[nt][2 * rh] = p0;
        s[nt][2 * rh + 1] = p1;
        rs += p0 + p1;
      }
      l_run[rh] = l_run[rh] * alpha + rs;
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        o[d][2 * rh] *= alpha;
        o[d][2 * rh + 1] *= alpha;
      }
    }

    // O += P V: the S accumulators are already the A fragments of P.
#pragma unroll
    for (int kc = 0; kc < kBN / 16; ++kc) {
      uint32_t pa[4];
      pa[0] = dev::pack_bf16(s[2 * kc][0], s[2 * kc][1]);
      pa[1] = dev::pack_bf16(s[2 * kc][2], s[2 * kc][3]);
      pa[2] = dev::pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      pa[3] = dev::pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t b[4];
        dev::ldmatrix_x4_trans(b, vs + (kc * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
        dev::mma_bf16(o[2 * dp], pa, b[0], b[1]);
        dev::mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration refills the other stage's twin
  }

#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 1);
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 2);
  }
  const int local_a = warp * 16 + g;
  const size_t out_stride = static_cast<size_t>(a.num_heads) * kHeadDim;
  const float inv_a = 1.0f / l_run[0], inv_b = 1.0f / l_run[1];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
    const int col = h * kHeadDim + d * 8 + 2 * t4;
    if (local_a < rows)
      *reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<size_t>(q_start + r0 + local_a) * out_stride + col) =
          __floats2bfloat162_rn(o[d][0] * inv_a, o[d][1] * inv_a);
    if (local_a + 8 < rows)
      *reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<size_t>(q_start + r0 + local_a + 8) * out_stride + col) =
          __floats2bfloat162_rn(o[d][2] * inv_b, o[d][3] * inv_b);
  }
}

template <int kHeadDim, int kHeads>
cudaError_t launch_for(const AttentionArgs& a, int num_items, const LaunchConfig& launch) {
  constexpr size_t bytes = smem_bytes<kHeadDim, kHeads>();
  static const cudaError_t attr = cudaFuncSetAttribute(prefill_attention_kernel<kHeadDim, kHeads>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(bytes));
  if (attr != cudaSuccess) return attr;
  return launch_kernel(prefill_attention_kernel<kHeadDim, kHeads>, dim3(a.num_heads / kHeads, num_items),
                       128 * kHeads, bytes, launch, a);
}

template <int kHeadDim>
cudaError_t launch_for(const AttentionArgs& a, int num_items, const LaunchConfig& launch) {
  // Pairs of query heads share a CTA when they share a kv head (even GQA groups).
  if ((a.num_heads / a.num_kv_heads) % 2 == 0 && a.prefill_heads_per_cta != 1)
    return launch_for<kHeadDim, 2>(a, num_items, launch);
  return launch_for<kHeadDim, 1>(a, num_items, launch);
}

}  // namespace

cudaError_t launch_prefill_attention(const AttentionArgs& args, int num_items, LaunchConfig launch) {
  if (num_items <= 0) return cudaSuccess;
  if (!attention_supported(args.num_heads, args.num_kv_heads, args.head_dim) || num_items > 65535)
    return cudaErrorInvalidValue;
  return args.head_dim == 64 ? launch_for<64>(args, num_items, launch) : launch_for<128>(args, num_items, launch);
}

}  // namespace siesta::cuda
