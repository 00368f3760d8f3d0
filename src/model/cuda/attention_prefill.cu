// Prefill attention: causal, variable-length, GQA, over the paged KV cache.
// (attention_prefill_wgmma.cu does the same on Hopper's warpgroup MMA for head_dim 128, and
// is what sm_90a builds take there; this kernel serves head_dim 64 and other builds.)
//
// Flash-attention style. A CTA serves one work item (a sequence and a tile of
// 64 query rows, kPrefillTileRows) for one query head, or for a pair of query
// heads that share a kv head (even GQA groups), so every K/V tile brought into
// shared memory serves 64 or 128 rows. Each warp computes kWarpRows rows of
// one head (AttentionArgs::prefill_warp_rows; the model takes 32 where a
// pass's CTAs fill every SM twice and in batch-invariant mode, 16 otherwise):
//  - 32 (FlashAttention-2's layout): two m16 row tiles per warp,
//    two warps per head, so every K and V fragment a warp loads with ldmatrix
//    feeds two MMAs. The loop is bound by shared-memory reads, not by the
//    tensor cores; this cuts those reads from 1/2 ldmatrix.x4 per MMA to 3/8
//    at head_dim 128 (to 1/4 at head_dim 64).
//  - 16 (the earlier kernel): one m16 tile per warp, four warps per head.
// Registers: o is a warp's rows x head_dim in fp32. Where that is 64 per
// thread (16 x 128, 32 x 64), Q fragments stay in registers and the online
// softmax takes a whole 64-key tile at a time. At 32 x 128 (128 per thread),
// Q fragments are read from shared memory at each k-step and the softmax
// takes 32 keys at a time (two steps per tile): a 32 x 64 fp32 score tile
// would need 64 more registers, and ptxas spills at its 255 limit.
// Key/value tiles of 64 positions are gathered from the cache blocks with
// cp.async (double-buffered; rows padded by 16 bytes so ldmatrix rows land in
// distinct banks) and both products run on tensor cores (bf16 inputs, fp32
// accumulators); the softmax is online, in fp32, in the log2 domain (SFU
// exp2); probabilities enter the second product as bf16, as in FlashAttention.
//
// A row's arithmetic depends only on its own position: the softmax steps
// always start at key 0, in steps of kKeyStep keys (fixed per kernel), and
// steps past a row's position contribute exact zeros. So a row's output does
// not depend on which other rows (or sequences) share its CTA, its warp, its
// m16 tile, its pass, or how its prompt was chunked. (The 16- and 32-row
// kernels agree bit for bit at head_dim 64, where both take 64-key steps; at
// head_dim 128 they differ by rounding.) In detail, for a row at position pos:
//  - its scores are its own MMA row (other rows of its m16 tile, the warp's
//    other m16 tile, or zero rows past the chunk never enter it), summed over
//    the same k16 steps in the same order; the same key steps from key 0;
//  - the keys it masks are exactly those past pos, which include every key at
//    or past kv_len (> pos): the same set whether kv_len is pos + 1 (the row
//    is its chunk's last, or alone: a 1-row tile) or a later chunk end; the
//    masked keys' probabilities are exactly 0 and their V is finite (a token
//    of this chunk, or a zero fill), so they add exact zeros to P V;
//  - a step is masked unless no key in it is past the warp's first row, so
//    skipping the mask changes nothing;
//  - a step wholly past pos (present only when later rows share the warp) has
//    max -inf, so alpha is exactly 1 and every p is 0: o, l, m unchanged;
//  - a warp skips the steps wholly past all of its rows (a warp with no rows
//    in the chunk skips them all, and only helps to load the tiles): by the
//    point above, that changes nothing for its rows either.
// Batch-invariant mode relies on this: a decode token gets the row arithmetic
// of a 1-row tile (row 0 of warp 0) from attention_decode_invariant.cu, which
// reproduces it op for op (or, with step_plan.h's one_token_as_prefill, from
// this kernel itself), and the same token at any row of any warp inside a
// prefill chunk gets bit-identical attention outputs.
// Padding rows (kv_len 0, from a decode graph's padded batch) write zeros and
// read nothing.
#include <cuda_bf16.h>

#include <cmath>

#include "model/cuda/attention_prefill.cuh"
#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"

namespace siesta::cuda {
namespace {

using dev::fast_exp2;
using dev::kLog2e;

constexpr int kBM = kPrefillTileRows;  // query rows per head per CTA
constexpr int kBN = 64;                // keys per tile

template <int kHeadDim>
constexpr int smem_row() {
  return kHeadDim + 8;  // +16 bytes per row: ldmatrix rows land in distinct banks
}
template <int kHeadDim, int kHeads>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(kHeads * kBM + 4 * kBN) * smem_row<kHeadDim>() * sizeof(bf16);
}
template <int kHeads, int kWarpRows>
constexpr int cta_threads() {
  return 32 * (kBM / kWarpRows) * kHeads;
}

// kHeads query heads (of one kv head) per CTA, kBM / kWarpRows warps each.
template <int kHeadDim, int kHeads, int kWarpRows>
__global__ __launch_bounds__(cta_threads<kHeads, kWarpRows>()) void prefill_attention_kernel(AttentionArgs a) {
  static_assert(kWarpRows == 16 || kWarpRows == 32, "one or two m16 row tiles per warp");
  constexpr int kThreads = cta_threads<kHeads, kWarpRows>();
  constexpr int kWarpsPerHead = kBM / kWarpRows;
  constexpr int kMTiles = kWarpRows / 16;  // m16 row tiles per warp
  dev::begin_dependent_kernel();
  constexpr int LD = smem_row<kHeadDim>();
  constexpr int kChunks = kHeadDim / 8;   // 16-byte chunks per row
  constexpr int kKSteps = kHeadDim / 16;  // k16 steps of Q K^T
  constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of the output
  // o at 32 x 128 fp32 (128 registers): Q fragments from shared memory at each k-step, and
  // 32-key softmax steps (the header says why); otherwise Q in registers and 64-key steps.
  constexpr bool kWideO = kMTiles * kHeadDim > 128;
  constexpr bool kQInRegisters = !kWideO;
  constexpr int kKeyStep = kWideO ? kBN / 2 : kBN;  // keys per online-softmax step
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [kHeads * kBM][LD]: head-major
  bf16* Ks = Qs + kHeads * kBM * LD;             // [2][kBN][LD]
  bf16* Vs = Ks + 2 * kBN * LD;                  // [2][kBN][LD]

  const int h0 = blockIdx.x * kHeads;
  const dev::PrefillTile pt = dev::prefill_tile(a, blockIdx.y);
  if (pt.kv_len <= 0) {  // padding: defined output, no cache reads (whole CTA returns)
    dev::prefill_padding_zeros(a, pt, h0, kHeads);
    return;
  }
  const int kv_len = pt.kv_len, q_start = pt.q_start, start_pos = pt.start_pos;
  const int r0 = pt.r0, rows = pt.rows;
  const int kvh = h0 / (a.num_heads / a.num_kv_heads);
  const int ntiles = (pt.key_end + kBN - 1) / kBN;
  const int* table = pt.table;
  const int tid = threadIdx.x, lane = tid & 31;
  const int head_local = (tid >> 5) / kWarpsPerHead;  // this warp's head
  const int warp_row0 = ((tid >> 5) % kWarpsPerHead) * kWarpRows;  // its first row in the tile
  const int h = h0 + head_local;
  // Keys [0, warp_key_end) are visible to some row of this warp (none when it has no rows).
  const int warp_rows = min(kWarpRows, rows - warp_row0);
  const int warp_key_end = warp_rows > 0 ? start_pos + r0 + warp_row0 + warp_rows : 0;

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
  // This thread's rows: g and g + 8 of each m16 tile (positions pos0 + mt * 16 and + 8).
  const int warp_pos0 = start_pos + r0 + warp_row0;  // the position of the warp's first row
  const int pos0 = warp_pos0 + g;
  const float qscale = a.scale * kLog2e;
  // ldmatrix row address of this lane within an m16 x k16 A tile of Q.
  const bf16* q_lane = Qs + (head_local * kBM + warp_row0 + (lane & 15)) * LD + (lane >> 4) * 8;

  uint32_t qf[kQInRegisters ? kMTiles : 1][kQInRegisters ? kKSteps : 1][4];
  float o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.0f;
  float m_run[kMTiles][2], l_run[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.0f;
  }

  for (int j = 0; j < ntiles; ++j) {
    const int st = j & 1;
    if (j + 1 < ntiles) load_kv(j + 1, st ^ 1);
    dev::cp_async_commit();
    dev::cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int step = 0; step < kBN / kKeyStep; ++step) {
      const int key0 = j * kBN + step * kKeyStep;
      if (key0 >= warp_key_end) break;  // warp-uniform: no row of the warp sees these keys
      if constexpr (kQInRegisters) {
        if (key0 == 0) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) dev::ldmatrix_x4(qf[mt][kk], q_lane + mt * 16 * LD + kk * 16);
        }
      }
      const bf16* ks = Ks + (st * kBN + step * kKeyStep) * LD;
      const bf16* vs = Vs + (st * kBN + step * kKeyStep) * LD;

      // S = Q K^T for this warp's rows x kKeyStep keys; each K fragment serves every m16 tile.
      float s[kMTiles][kKeyStep / 8][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kKeyStep / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t qa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if constexpr (kQInRegisters) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[mt][e] = qf[mt][kk][e];
          } else {
            dev::ldmatrix_x4(qa[mt], q_lane + mt * 16 * LD + kk * 16);
          }
        }
#pragma unroll
        for (int np = 0; np < kKeyStep / 16; ++np) {
          uint32_t b[4];
          dev::ldmatrix_x4(b, ks + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            dev::mma_bf16(s[mt][2 * np], qa[mt], b[0], b[1]);
            dev::mma_bf16(s[mt][2 * np + 1], qa[mt], b[2], b[3]);
          }
        }
      }

      // Mask the keys past each row's position (raw scores; the scale is folded into the
      // exponent). Those include every key at or past kv_len, as a row's position is below it.
      if (key0 + kKeyStep - 1 > warp_pos0) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kKeyStep / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = key0 + nt * 8 + 2 * t4 + (e & 1);
              if (key > pos0 + mt * 16 + (e < 2 ? 0 : 8)) s[mt][nt][e] = -INFINITY;
            }
      }

      // Online softmax; the 4 lanes of a quad share a row. p = 2^(s * scale * log2(e) - m'),
      // summed in fp32 and packed to bf16 as the A fragments of P (pk[mt][kc]: keys 16 kc ..).
      uint32_t pk[kMTiles][kKeyStep / 16][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kKeyStep / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * rh], s[mt][nt][2 * rh + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          // The first step always holds position 0, visible to every row: m_new is finite.
          const float m_new = fmaxf(m_run[mt][rh], mx);
          // Exactly 1 when the max did not move, so steps past a row's position change nothing.
          const float alpha = m_new == m_run[mt][rh] ? 1.0f : fast_exp2((m_run[mt][rh] - m_new) * qscale);
          m_run[mt][rh] = m_new;
          const float offset = -m_new * qscale;
          float rs = 0.0f;
#pragma unroll
          for (int nt = 0; nt < kKeyStep / 8; ++nt) {
            const float p0 = fast_exp2(fmaf(s[mt][nt][2 * rh], qscale, offset));
            const float p1 = fast_exp2(fmaf(s[mt][nt][2 * rh + 1], qscale, offset));
            rs += p0 + p1;
            pk[mt][nt / 2][(nt & 1) * 2 + rh] = dev::pack_bf16(p0, p1);
          }
          l_run[mt][rh] = fmaf(l_run[mt][rh], alpha, rs);  // one rounding (decode_attention_invariant's too)
#pragma unroll
          for (int d = 0; d < kDTiles; ++d) {
            o[mt][d][2 * rh] *= alpha;
            o[mt][d][2 * rh + 1] *= alpha;
          }
        }

      // O += P V; each V fragment serves every m16 tile.
#pragma unroll
      for (int kc = 0; kc < kKeyStep / 16; ++kc) {
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          uint32_t b[4];
          dev::ldmatrix_x4_trans(b,
                                 vs + (kc * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            dev::mma_bf16(o[mt][2 * dp], pk[mt][kc], b[0], b[1]);
            dev::mma_bf16(o[mt][2 * dp + 1], pk[mt][kc], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // the next iteration refills the other stage's twin
  }

  const size_t out_stride = static_cast<size_t>(a.num_heads) * kHeadDim;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      l_run[mt][rh] += __shfl_xor_sync(0xffffffffu, l_run[mt][rh], 1);
      l_run[mt][rh] += __shfl_xor_sync(0xffffffffu, l_run[mt][rh], 2);
    }
    const int local_a = warp_row0 + mt * 16 + g;  // this thread's rows local_a and local_a + 8
    const float inv_a = 1.0f / l_run[mt][0], inv_b = 1.0f / l_run[mt][1];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      const int col = h * kHeadDim + d * 8 + 2 * t4;
      if (local_a < rows)
        *reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<size_t>(q_start + r0 + local_a) * out_stride + col) =
            __floats2bfloat162_rn(o[mt][d][0] * inv_a, o[mt][d][1] * inv_a);
      if (local_a + 8 < rows)
        *reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<size_t>(q_start + r0 + local_a + 8) * out_stride +
                                           col) = __floats2bfloat162_rn(o[mt][d][2] * inv_b, o[mt][d][3] * inv_b);
    }
  }
}

template <int kHeadDim, int kHeads, int kWarpRows>
cudaError_t launch_for(const AttentionArgs& a, int num_items, const LaunchConfig& launch) {
  constexpr size_t bytes = smem_bytes<kHeadDim, kHeads>();
  auto* kernel = prefill_attention_kernel<kHeadDim, kHeads, kWarpRows>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (attr != cudaSuccess) return attr;
  return launch_kernel(kernel, dim3(a.num_heads / kHeads, num_items), cta_threads<kHeads, kWarpRows>(), bytes,
                       launch, a);
}

template <int kHeadDim, int kWarpRows>
cudaError_t launch_for(const AttentionArgs& a, int num_items, const LaunchConfig& launch) {
  // Pairs of query heads share a CTA when they share a kv head (even GQA groups).
  if (prefill_heads_per_cta(a.num_heads, a.num_kv_heads, a.prefill_heads_per_cta) == 2)
    return launch_for<kHeadDim, 2, kWarpRows>(a, num_items, launch);
  return launch_for<kHeadDim, 1, kWarpRows>(a, num_items, launch);
}

template <int kHeadDim>
cudaError_t launch_for(const AttentionArgs& a, int num_items, const LaunchConfig& launch) {
  return a.prefill_warp_rows == 16 ? launch_for<kHeadDim, 16>(a, num_items, launch)
                                   : launch_for<kHeadDim, 32>(a, num_items, launch);
}

}  // namespace

bool prefill_warp_rows_supported(int rows) { return rows == 16 || rows == 32; }

int prefill_heads_per_cta(int num_heads, int num_kv_heads, int option) {
  return (num_heads / num_kv_heads) % 2 == 0 && option != 1 ? 2 : 1;
}

cudaError_t launch_prefill_attention(const AttentionArgs& args, int num_items, LaunchConfig launch) {
  if (num_items <= 0) return cudaSuccess;
  if (!attention_supported(args.num_heads, args.num_kv_heads, args.head_dim) || num_items > 65535 ||
      !prefill_warp_rows_supported(args.prefill_warp_rows))
    return cudaErrorInvalidValue;
  return args.head_dim == 64 ? launch_for<64>(args, num_items, launch) : launch_for<128>(args, num_items, launch);
}

}  // namespace siesta::cuda
