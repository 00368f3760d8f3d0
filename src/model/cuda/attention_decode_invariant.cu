// Batch-invariant decode attention: one query token per sequence over its
// paged KV cache, with the prefill kernel's row arithmetic, so that a decode
// row gets the bits that the prefill kernel gives the same query at the same
// position (as a 1-row tile, or inside any longer chunk).
//
// One CTA (four or eight warps) per (kv head, sequence) serves the kv head's whole GQA
// group: its query heads are rows 0 .. group-1 of one m16 MMA tile (rows past
// the group are zero and never stored), so K and V are read once per kv head.
// The context is walked in the prefill kernel's softmax steps from key 0, and
// each step computes what the prefill kernel's warp computes for a row of its
// tile, op for op:
//  - S = Q K^T for the step's keys: per n8 block of keys one chain of
//    mma.m16n8k16 over head_dim in k16 steps from zero, K rows as B from
//    shared memory through ldmatrix. (The wgmma prefill kernel issues the same
//    chains as m64n64k16: a k16 block gives the same bits on either instruction
//    and chains alike, as the fixed GEMM's kernels show: cuda_kernels_test,
//    FixedGemmWgmmaGivesTheMmaKernelsBitsForEveryTileAndSplit);
//  - the keys past the row's position masked to -inf (raw scores; the scale is
//    folded into the exponent), keys at or past kv_len zero-filled as there;
//  - the step's row maximum (an exact maximum: any order gives its bits), the
//    running max, alpha = 1 exactly when the max did not move, else
//    exp2((m - m') * scale * log2e) on the SFU, p = exp2(fma(s, scale * log2e,
//    -m' * scale * log2e)), p rounded to bf16 as the A fragments of P;
//  - the row sum l = fma(l, alpha, rs) where rs adds the pairs p0 + p1 of each
//    quad lane in the prefill kernel's grouping (one chain over the step's n8
//    blocks for the mma.sync kernel; an even and an odd chain for the wgmma
//    kernel), the four lanes' sums added at the end as a butterfly;
//  - o *= alpha, then O += P V as one chain of k16 blocks in key order per n8
//    block of head_dim (mma.m16n8k16, V through ldmatrix.trans), continuing
//    from the rescaled o;
//  - out = bf16(o * (1 / l)).
// The warps split each step's work without changing any of those chains: warp
// w computes the scores of its n8 blocks of keys (all of head_dim's k16 steps),
// the warps meet in shared memory for the step's maximum and again for P (bf16
// pairs, and the fp32 pair sums, laid out by quad lane, so every warp forms the
// prefill kernel's sums itself), then warp w accumulates its share of
// head_dim's n8 blocks over all of the step's keys.
//
// Softmax steps (kStep keys, kChains sum chains) per prefill kernel:
// attention_prefill_wgmma.cu: 64 and 2; attention_prefill.cu: 64 and 1, or 32
// and 1 with 32 query rows per warp at head_dim 128. A step wholly past the
// row is skipped there as here.
//
// K/V tiles of 64 keys pass through a ring of kStages shared-memory stages
// (cp.async, rows padded by 16 bytes as in the mma.sync prefill kernel); the
// first kStages tiles are requested before the wait for the previous kernel
// (they hold only positions earlier steps wrote). The new token's K/V row is
// never copied from the cache before that wait: in a pure decode pass
// (AttentionArgs::qkv) the kernel computes it (q/k norm + RoPE with
// launch_qk_norm_rope_kv's arithmetic, dev::norm_rope_head), writes it to the
// cache and keeps it in shared memory; otherwise it reads it, with q, from what
// launch_qk_norm_rope_kv wrote. It enters its tile's stage before that tile's
// barrier.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "model/cuda/attention_prefill.cuh"
#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"
#include "model/cuda/norm_rope.cuh"

namespace siesta::cuda {
namespace {

using dev::fast_exp2;
using dev::kLog2e;

constexpr int kTileKeys = 64;  // keys per K/V tile (the prefill kernels' key tiles)
constexpr int kMaxRows = 8;    // query heads of a group: rows 0..7 of the m16 tile
static_assert(kMaxGqaGroup <= kMaxRows, "a group's heads are rows 0..7 of A (rows 8..15 zero)");

template <int kHeadDim>
constexpr int kLd = kHeadDim + 8;  // bf16 per shared-memory row: ldmatrix rows in distinct banks
// One ring stage: a tile's K rows, then its V rows.
template <int kHeadDim>
constexpr size_t kStageBytes = static_cast<size_t>(2 * kTileKeys * kLd<kHeadDim>) * sizeof(bf16);

template <int kHeadDim, int kStep, int kWarps>
struct InvariantDecodeSmem {
  __align__(16) bf16 q[kMaxRows][kLd<kHeadDim>];  // the group's query heads, after q norm + RoPE
  __align__(16) bf16 new_k[kHeadDim];             // the new token's K and V rows
  __align__(16) bf16 new_v[kHeadDim];
  __align__(16) bf16 consts[3 * kHeadDim];  // the RoPE row of the position, the q and k norm weights
  float step_max[kWarps][kMaxRows];         // each warp's row maxima of a step
  uint32_t p[kStep / 8][32];                // P as bf16 pairs: [n8 block of keys][lane (row g, pair t)]
  float pair_sum[kStep / 8][32];            // p0 + p1 of the same pairs, in fp32
};

// kStep, kChains: the softmax steps and row-sum chains of the prefill kernel matched (header).
// kWarps: 4, or 8 (one n8 block of a 64-key step's scores and two of head_dim 128's P V per
// warp: twice the warps to hide each step's dependent chains, the same chains).
template <int kHeadDim, int kStep, int kChains, int kStages, int kWarps>
__global__ __launch_bounds__(32 * kWarps) void decode_attention_invariant_kernel(AttentionArgs a) {
  constexpr int kThreads = 32 * kWarps;
  constexpr int LD = kLd<kHeadDim>;
  constexpr int kChunks = kHeadDim / 8;             // 16-byte chunks per row
  constexpr int kKSteps = kHeadDim / 16;            // k16 steps of Q K^T
  constexpr int kStepBlocks = kStep / 8;            // n8 blocks of keys per softmax step
  constexpr int kWarpBlocks = kStepBlocks / kWarps;  // of them per warp (scores)
  constexpr int kDimBlocks = kHeadDim / 8 / kWarps;  // n8 blocks of head_dim per warp (P V)
  constexpr int kStepsPerTile = kTileKeys / kStep;
  static_assert(kWarpBlocks * kWarps == kStepBlocks && (kWarpBlocks == 1 || kWarpBlocks == 2),
                "a warp's keys: one or two n8 blocks");
  static_assert(kDimBlocks % 2 == 0 && kKSteps % 2 == 0, "V and K fragments in pairs");
  static_assert(kChains == 1 || (kChains == 2 && kStepBlocks % 2 == 0), "one chain, or an even and an odd");
  static_assert(kStages >= 2, "a ring of at least two stages");
  extern __shared__ __align__(16) unsigned char ring_raw[];
  bf16* const ring = reinterpret_cast<bf16*>(ring_raw);  // [kStages][K, V][kTileKeys][LD]
  __shared__ InvariantDecodeSmem<kHeadDim, kStep, kWarps> sm;

  const int kvh = blockIdx.x, dslot = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int group = a.num_heads / a.num_kv_heads;
  dev::trace_start(a.trace);

  // Before waiting for the previous kernel: the step metadata (uploaded before the
  // pass's first kernel), the RoPE row and norm weights, and the first tiles' cached
  // rows (every position but the new one, which earlier steps wrote).
  const int seq = a.decode_seqs[dslot];
  const int row = a.seq_q_start[seq], kv_len = a.seq_kv_len[seq];
  const int pos = kv_len - 1;  // the query's position: its own key is the context's last
  const bool fused = a.qkv != nullptr;
  const int* const table = a.block_tables + a.seq_table_start[seq];
  if (fused && kv_len > 0 && tid < 3 * kChunks) {  // group 0: the constants
    const int which = tid / kChunks, c = tid % kChunks;
    const bf16* src = which == 0 ? reinterpret_cast<const bf16*>(a.rope_table + static_cast<size_t>(a.positions[row]) *
                                                                                    (kHeadDim / 2))
                      : which == 1 ? a.q_norm
                                   : a.k_norm;
    dev::cp_async16(sm.consts + tid * 8, src + c * 8, true);
  }
  dev::cp_async_commit();

  // Tile t into stage t % kStages: thread tid copies chunk tid % kChunks of rows
  // tid / kChunks + kRowStep n, K and V; keys at or past kv_len are zero (the cache
  // there may hold anything, and 0 * NaN would poison the sums), the new row is left
  // out (written below). The tile's cache blocks (blk: kTileBlocks table entries, the
  // same for every thread) are read a tile ahead, so a copy never waits for them.
  const int ntiles = kv_len > 0 ? (kv_len + kTileKeys - 1) / kTileKeys : 0;
  const int nblocks = (kv_len + kKvBlockSize - 1) / kKvBlockSize;
  constexpr int kTileBlocks = kTileKeys / kKvBlockSize;
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kRowsPerThread = kTileKeys / kRowStep;
  static_assert(kKvBlockSize % kRowStep == 0, "row my_row + kRowStep n: block kRowStep n / 16, slot my_row + ...");
  const int my_chunk = tid % kChunks, my_row = tid / kChunks;
  const size_t slot_elems = static_cast<size_t>(a.kv.num_kv_heads) * kHeadDim;
  const size_t block_elems = static_cast<size_t>(a.kv.num_layers) * 2 * kKvBlockSize * slot_elems;
  // K of (block 0, slot my_row) for this layer, kv head and chunk; V is kKvBlockSize slots further.
  const bf16* const k0 = a.kv.base + static_cast<size_t>(a.layer) * 2 * kKvBlockSize * slot_elems +
                         my_row * slot_elems + static_cast<size_t>(kvh) * kHeadDim + my_chunk * 8;
  const size_t v_delta = kKvBlockSize * slot_elems;
  auto tile_blocks = [&](int t, int (&blk)[kTileBlocks]) {
#pragma unroll
    for (int i = 0; i < kTileBlocks; ++i) blk[i] = t * kTileBlocks + i < nblocks ? table[t * kTileBlocks + i] : 0;
  };
  auto load_tile = [&](int t, const int (&blk)[kTileBlocks]) {
    if (t >= ntiles) return;
    bf16* const ks = ring + (t % kStages) * 2 * kTileKeys * LD;
    bf16* const vs = ks + kTileKeys * LD;
#pragma unroll
    for (int n = 0; n < kRowsPerThread; ++n) {
      const int r = my_row + kRowStep * n;
      const int key = t * kTileKeys + r;
      if (key == pos) continue;
      const bool ok = key < kv_len;
      const bf16* src = a.kv.base;
      if (ok)
        src = k0 + static_cast<size_t>(blk[kRowStep * n / kKvBlockSize]) * block_elems +
              (kRowStep * n % kKvBlockSize) * slot_elems;
      dev::cp_async16(ks + r * LD + my_chunk * 8, src, ok);
      dev::cp_async16(vs + r * LD + my_chunk * 8, ok ? src + v_delta : src, ok);
    }
  };
  // Groups 1 .. kStages: tiles 0 .. kStages - 1 (empty past the context); then one
  // group per tile from tile 1 on, so tile t is always group t + 1.
  int blk[kTileBlocks];
#pragma unroll
  for (int t = 0; t < kStages; ++t) {
    tile_blocks(t, blk);
    load_tile(t, blk);
    dev::cp_async_commit();
  }
  tile_blocks(kStages, blk);  // the first refill's
  dev::wait_for_previous_kernel();
  dev::trace_waited(a.trace);

  bf16* const out_row = a.out + static_cast<size_t>(row) * a.num_heads * kHeadDim +
                        static_cast<size_t>(kvh) * group * kHeadDim;
  if (kv_len <= 0) {  // padding (a decode graph's padded batch): zeros, no cache reads
    for (int i = tid; i < group * kHeadDim; i += kThreads) out_row[i] = __float2bfloat16(0.0f);
    return;
  }
  if (fused) {
    // q/k norm + RoPE of the group's query heads and of the new K row, a warp per
    // head vector; the new V row copied; K and V to the cache at the token's slot.
    dev::cp_async_wait<kStages>();  // the constants (group 0)
    __syncthreads();
    const int q_dim = a.num_heads * kHeadDim, kv_dim = a.num_kv_heads * kHeadDim;
    const bf16* const qkv_row = a.qkv + static_cast<size_t>(row) * (q_dim + 2 * kv_dim);
    const __nv_bfloat162* const rope = reinterpret_cast<const __nv_bfloat162*>(sm.consts);
    const int slot = a.slots[row];
    for (int u = warp; u < group + 2; u += kWarps) {
      if (u < group) {
        dev::norm_rope_head<kHeadDim>(qkv_row + (kvh * group + u) * kHeadDim, sm.consts + kHeadDim, rope, a.eps,
                                      &sm.q[u][0]);
        continue;
      }
      const int kind = u - group;  // 0: K, 1: V
      bf16* const local = kind == 0 ? sm.new_k : sm.new_v;
      if (kind == 0) {
        dev::norm_rope_head<kHeadDim>(qkv_row + q_dim + kvh * kHeadDim, sm.consts + 2 * kHeadDim, rope, a.eps, local);
      } else {
        const uint4* src = reinterpret_cast<const uint4*>(qkv_row + q_dim + kv_dim + kvh * kHeadDim);
        for (int c = lane; c < kChunks; c += 32) reinterpret_cast<uint4*>(local)[c] = __ldcg(src + c);
      }
      __syncwarp();
      if (slot >= 0) {
        uint4* const cache =
            reinterpret_cast<uint4*>(dev::kv_slot(a.kv, slot / kKvBlockSize, slot % kKvBlockSize, a.layer, kind, kvh));
        for (int c = lane; c < kChunks; c += 32) cache[c] = reinterpret_cast<const uint4*>(local)[c];
      }
    }
  } else {
    // q after launch_qk_norm_rope_kv (the previous kernel), and the new K/V row it wrote.
    const uint4* const q_src =
        reinterpret_cast<const uint4*>(a.q + (static_cast<size_t>(row) * a.num_heads + kvh * group) * kHeadDim);
    for (int i = tid; i < group * kChunks; i += kThreads)
      *reinterpret_cast<uint4*>(&sm.q[i / kChunks][(i % kChunks) * 8]) = __ldcg(q_src + i);
    if (tid < 2 * kChunks) {
      const int kind = tid / kChunks, c = tid % kChunks;
      const bf16* src = dev::kv_slot(a.kv, table[pos / kKvBlockSize], pos % kKvBlockSize, a.layer, kind, kvh);
      reinterpret_cast<uint4*>(kind == 0 ? sm.new_k : sm.new_v)[c] = __ldcg(reinterpret_cast<const uint4*>(src) + c);
    }
  }
  __syncthreads();  // q, new_k and new_v, for every thread
  // The next kernel (the O projection, whose CTAs start by loading their weights) may
  // start now, once the cache reads of this one are on their way (as decode attention).
  dev::allow_next_kernel();
  dev::trace_mark(a.trace, 3);

  // This lane's A fragments of Q: row g (a head of the group, else zero), k 2 t4 (+8) of each k16 step.
  const bool head = g < group;
  uint32_t qf[kKSteps][2];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    qf[kk][0] = head ? *reinterpret_cast<const uint32_t*>(&sm.q[g][kk * 16 + 2 * t4]) : 0u;
    qf[kk][1] = head ? *reinterpret_cast<const uint32_t*>(&sm.q[g][kk * 16 + 8 + 2 * t4]) : 0u;
  }

  const float qscale = a.scale * kLog2e;
  const int dim0 = warp * (kHeadDim / kWarps);  // this warp's dimensions of P V
  float o[kDimBlocks][4];
#pragma unroll
  for (int d = 0; d < kDimBlocks; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;  // row g's, l for this lane's pairs (as in the prefill kernels)

  for (int t = 0; t < ntiles; ++t) {
    bf16* const ks = ring + (t % kStages) * 2 * kTileKeys * LD;
    bf16* const vs = ks + kTileKeys * LD;
    if (t == ntiles - 1 && tid < 2 * kChunks) {
      // The new row into its tile's stage: the stage's previous tile is done (every
      // warp passed a barrier after it), and no copy writes this row.
      const int kind = tid / kChunks, c = tid % kChunks;
      *reinterpret_cast<uint4*>((kind == 0 ? ks : vs) + (pos % kTileKeys) * LD + c * 8) =
          reinterpret_cast<const uint4*>(kind == 0 ? sm.new_k : sm.new_v)[c];
    }
    if (t == 0) {
      dev::cp_async_wait<kStages - 1>();  // tile 0 (group 1) has landed
    } else {
      dev::cp_async_wait<kStages - 2>();  // tile t (group t + 1)
    }
    __syncthreads();  // tile t, for every thread; and every warp is done with tile t - 1
    if (t >= 1) {
      load_tile(t - 1 + kStages, blk);  // into the stage of tile t - 1
      dev::cp_async_commit();
      tile_blocks(t + kStages, blk);  // the next refill's blocks, on their way during this tile
    }
#pragma unroll
    for (int st = 0; st < kStepsPerTile; ++st) {
      const int key0 = t * kTileKeys + st * kStep;  // the step's first key
      if (key0 > pos) break;                        // wholly past the row: the prefill kernel skips it too
      // Scores of this warp's n8 blocks of keys, each one chain over head_dim from zero.
      const int kb = st * kStep + warp * kWarpBlocks * 8;  // its first key in the tile
      float s[kWarpBlocks][4];
#pragma unroll
      for (int i = 0; i < kWarpBlocks; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
      if constexpr (kWarpBlocks == 2) {
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          uint32_t b[4];  // keys kb.. and kb + 8.., k16 step kk
          dev::ldmatrix_x4(b, ks + (kb + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
          const uint32_t qa[4] = {qf[kk][0], 0u, qf[kk][1], 0u};
          dev::mma_bf16(s[0], qa, b[0], b[1]);
          dev::mma_bf16(s[1], qa, b[2], b[3]);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < kKSteps; kk += 2) {
          uint32_t b[4];  // keys kb.., k16 steps kk and kk + 1
          dev::ldmatrix_x4(b, ks + (kb + (lane & 7)) * LD + kk * 16 + (lane >> 3) * 8);
          const uint32_t qa0[4] = {qf[kk][0], 0u, qf[kk][1], 0u};
          const uint32_t qa1[4] = {qf[kk + 1][0], 0u, qf[kk + 1][1], 0u};
          dev::mma_bf16(s[0], qa0, b[0], b[1]);
          dev::mma_bf16(s[0], qa1, b[2], b[3]);
        }
      }
      // Keys past the position (every key at or past kv_len among them), as raw scores.
      const int kabs = t * kTileKeys + kb;
      if (kabs + kWarpBlocks * 8 - 1 > pos) {
#pragma unroll
        for (int i = 0; i < kWarpBlocks; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (kabs + i * 8 + 2 * t4 + e > pos) s[i][e] = -INFINITY;
      }
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < kWarpBlocks; ++i) mx = fmaxf(mx, fmaxf(s[i][0], s[i][1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (t4 == 0) sm.step_max[warp][g] = mx;
      __syncthreads();  // every warp's maxima; and every warp is done with the previous step's P
      float m_step = sm.step_max[0][g];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m_step = fmaxf(m_step, sm.step_max[w][g]);
      // The first step holds position 0, which every row sees: m_new is finite.
      const float m_new = fmaxf(m_run, m_step);
      const float alpha = m_new == m_run ? 1.0f : fast_exp2((m_run - m_new) * qscale);
      m_run = m_new;
      const float offset = -m_new * qscale;
#pragma unroll
      for (int i = 0; i < kWarpBlocks; ++i) {
        const float p0 = fast_exp2(fmaf(s[i][0], qscale, offset));
        const float p1 = fast_exp2(fmaf(s[i][1], qscale, offset));
        sm.p[warp * kWarpBlocks + i][lane] = dev::pack_bf16(p0, p1);
        sm.pair_sum[warp * kWarpBlocks + i][lane] = p0 + p1;
      }
      __syncthreads();  // the step's P, for every warp
      // The row sum in the matched kernel's grouping, from zero.
      float rs;
      if constexpr (kChains == 2) {
        float r2[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < kStepBlocks; ++nt) r2[nt & 1] += sm.pair_sum[nt][lane];
        rs = r2[0] + r2[1];
      } else {
        rs = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kStepBlocks; ++nt) rs += sm.pair_sum[nt][lane];
      }
      l_run = fmaf(l_run, alpha, rs);
#pragma unroll
      for (int d = 0; d < kDimBlocks; ++d) {
        o[d][0] *= alpha;
        o[d][1] *= alpha;
      }
      // O += P V over the step's k16 blocks of keys, in order; this warp's n8 blocks of head_dim.
#pragma unroll
      for (int kc = 0; kc < kStep / 16; ++kc) {
        const uint32_t pa[4] = {sm.p[2 * kc][lane], 0u, sm.p[2 * kc + 1][lane], 0u};
#pragma unroll
        for (int dp = 0; dp < kDimBlocks / 2; ++dp) {
          uint32_t b[4];
          const int key = st * kStep + kc * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
          dev::ldmatrix_x4_trans(b, vs + key * LD + dim0 + dp * 16 + (lane >> 4) * 8);
          dev::mma_bf16(o[2 * dp], pa, b[0], b[1]);
          dev::mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
        }
      }
    }
  }

  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  const float inv = 1.0f / l_run;
  if (head) {
#pragma unroll
    for (int d = 0; d < kDimBlocks; ++d)
      *reinterpret_cast<__nv_bfloat162*>(out_row + g * kHeadDim + dim0 + d * 8 + 2 * t4) =
          __floats2bfloat162_rn(o[d][0] * inv, o[d][1] * inv);
  }
  dev::trace_mark(a.trace, kTraceEnd);
}

template <int kHeadDim, int kStep, int kChains, int kStages, int kWarps>
cudaError_t launch_with(const AttentionArgs& a, int num_decode, const LaunchConfig& launch) {
  constexpr size_t bytes = kStages * kStageBytes<kHeadDim>;
  auto* const kernel = decode_attention_invariant_kernel<kHeadDim, kStep, kChains, kStages, kWarps>;
  // All of the SM's unified memory as shared memory where two stages leave room for three CTAs.
  static const cudaError_t attr = [&] {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess || kStages > 2) return e;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  }();
  if (attr != cudaSuccess) return attr;
  return launch_kernel(kernel, dim3(a.num_kv_heads, num_decode), 32 * kWarps, bytes, launch, a);
}

// A grid of at most half as many CTAs as SMs (batch 8 at 8 kv heads) takes four
// stages (its first 256 keys requested before the wait; 139 KB at head_dim 128,
// one CTA per SM, with room for the next GEMV's CTAs, as the default decode
// kernel's clusters of that size take) and, at head_dim 128 with 64-key steps,
// eight warps (kDecodeInvariantWarps: one CTA per SM has the schedulers to
// spare); a larger one two stages and four warps, so that three CTAs share an
// SM. The same bits either way.
template <int kHeadDim, int kStep, int kChains>
cudaError_t launch_for(const AttentionArgs& a, int num_decode, int warps, const LaunchConfig& launch) {
  constexpr bool kEightWarps = kHeadDim == 128 && kStep == 64;
  const bool small = 2L * num_decode * a.num_kv_heads <= sm_count();
  if (warps == 0) warps = small && kEightWarps ? kDecodeInvariantWarps : 4;
  if (warps != 4 && (warps != 8 || !kEightWarps)) return cudaErrorInvalidValue;
  if constexpr (kEightWarps) {
    if (warps == 8)
      return small ? launch_with<kHeadDim, kStep, kChains, 4, 8>(a, num_decode, launch)
                   : launch_with<kHeadDim, kStep, kChains, 2, 8>(a, num_decode, launch);
  }
  return small ? launch_with<kHeadDim, kStep, kChains, 4, 4>(a, num_decode, launch)
               : launch_with<kHeadDim, kStep, kChains, 2, 4>(a, num_decode, launch);
}

}  // namespace

cudaError_t launch_decode_attention_invariant(const AttentionArgs& args, int num_decode, bool wgmma,
                                              LaunchConfig launch, int warps) {
  if (num_decode <= 0) return cudaSuccess;
  if (!attention_supported(args.num_heads, args.num_kv_heads, args.head_dim) || num_decode > 65535)
    return cudaErrorInvalidValue;
  if (wgmma) {
    if (!prefill_wgmma_supported(args.num_heads, args.num_kv_heads, args.head_dim)) return cudaErrorInvalidValue;
    return launch_for<128, 64, 2>(args, num_decode, warps, launch);
  }
  if (!prefill_warp_rows_supported(args.prefill_warp_rows)) return cudaErrorInvalidValue;
  if (args.head_dim == 64) return launch_for<64, 64, 1>(args, num_decode, warps, launch);
  // attention_prefill.cu: 32-key softmax steps where a warp's o is 32 x 128.
  return args.prefill_warp_rows == 32 ? launch_for<128, 32, 1>(args, num_decode, warps, launch)
                                      : launch_for<128, 64, 1>(args, num_decode, warps, launch);
}

}  // namespace siesta::cuda
