// Decode attention as device functions: the work item of one CTA (a kv head's
// query group over one partition of a sequence's context), in fp32 over the
// cache or on tensor cores over rows staged in shared memory, and the reduction
// of a head's partitions. The decode attention kernel runs one item per CTA.
// .cu files only.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"

namespace siesta::cuda::dev {

inline constexpr int kDecodeThreads = 128;  // threads of one work item
inline constexpr int kDecodeWarps = kDecodeThreads / 32;
inline constexpr float kLog2e = 1.4426950408889634f;

// K and V rows of one kv head of a sequence, in the paged cache.
struct CacheRows {
  static constexpr int kKBatch = 16;  // 16-byte K loads in flight per lane
  static constexpr int kVBatch = 8;   // and V loads
  KvCacheDesc kv;
  const int32_t* table;  // the sequence's block table
  int layer, kvh;
  __device__ const bf16* k(int t) const { return kv_slot(kv, table[t / kKvBlockSize], t % kKvBlockSize, layer, 0, kvh); }
  __device__ const bf16* v(int t) const { return kv_slot(kv, table[t / kKvBlockSize], t % kKvBlockSize, layer, 1, kvh); }
};
__device__ inline CacheRows cache_rows(const AttentionArgs& a, int dslot, int kvh) {
  return {a.kv, a.block_tables + a.seq_table_start[a.decode_seqs[dslot]], a.layer, kvh};
}

// A partition's K and V rows copied to shared memory: rows of head_dim + kKvRowPad bf16.
inline constexpr int kKvRowPad = 8;  // bf16 after each row: MMA fragment reads without bank conflicts

// Starts copying rows [p0, p0 + n) of `rows` to k_s / v_s (rows of head_dim + kKvRowPad)
// with cp.async, threads 0 .. threads-1 (a multiple of head_dim / 8); one commit
// group. Thread i copies 16-byte chunk i % (head_dim / 8) of every
// threads / (head_dim / 8)-th row, K and V: one block-table read and no
// division per row (a 256-row partition is 64 copies per thread of 128).
template <int kHeadDim>
__device__ __forceinline__ void stage_kv_rows(const CacheRows& rows, int p0, int n, bf16* k_s, bf16* v_s,
                                              int threads) {
  constexpr int kRowChunks = kHeadDim / 8;
  const int c = threadIdx.x % kRowChunks, step = threads / kRowChunks;
  // V of a slot is this far after its K (the cache's [block][layer][K|V][slot] layout).
  const size_t v_delta = static_cast<size_t>(kKvBlockSize) * rows.kv.num_kv_heads * kHeadDim;
  for (int j = threadIdx.x / kRowChunks; j < n; j += step) {
    const bf16* src = rows.k(p0 + j) + c * 8;
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(k_s + j * (kHeadDim + kKvRowPad) + c * 8));
    const unsigned dst_v = static_cast<unsigned>(__cvta_generic_to_shared(v_s + j * (kHeadDim + kKvRowPad) + c * 8));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst_v), "l"(src + v_delta) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int kHeadDim, int kGroup, int kP>
struct DecodeAttentionSmem {
  __align__(16) float q[kGroup][kHeadDim];
  float p[kGroup][kP];
  __align__(16) float red[kDecodeWarps][kGroup][kHeadDim];
  float stat[kGroup][2];
  float group[kDecodeWarps][kGroup];
};

// A decode slot's sequence as the step metadata gives it: its query token's
// row and its context length. The kernel reads it before it waits for the
// previous one (the metadata is uploaded before the pass's first kernel), so
// that the work items do not start with two dependent loads.
struct DecodeSeq {
  int row, kv_len;
};
__device__ __forceinline__ DecodeSeq decode_seq(const AttentionArgs& a, int dslot) {
  const int seq = a.decode_seqs[dslot];
  return {a.seq_q_start[seq], a.seq_kv_len[seq]};
}

// A work item's sequence: the output row of its query token, its context
// length and partition count (0: padding, whose output partition 0 sets to
// zeros without reading the cache).
struct PartitionSeq {
  bf16* out_row;
  int kv_len, nparts;
};
template <int kHeadDim, int kGroup, int kP, int kThreads = kDecodeThreads>
__device__ PartitionSeq partition_seq(const AttentionArgs& a, const DecodeSeq& seq, int kvh, int part) {
  const int kv_len = seq.kv_len;
  bf16* out_row = a.out + static_cast<size_t>(seq.row) * a.num_heads * kHeadDim;
  if (kv_len <= 0 && part == 0)
    for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads)
      out_row[kvh * kGroup * kHeadDim + i] = __float2bfloat16(0.0f);
  return {out_row, kv_len, kv_len > 0 ? (kv_len + kP - 1) / kP : 0};
}

// The softmax over a partition's n scores per query head (sm.p, in the log2
// domain), all heads of the group at once, in a fixed order: sm.p becomes
// exp2(score - max) and sm.stat[g] = (max, sum). Every thread of the CTA calls
// it; it ends with a barrier.
template <int kHeadDim, int kGroup, int kP>
__device__ void partition_softmax(DecodeAttentionSmem<kHeadDim, kGroup, kP>& sm, int n) {
  auto& p_s = sm.p;
  auto& stat_s = sm.stat;
  auto& group_s = sm.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float m[kGroup], l[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m[g] = -INFINITY;
    for (int j = threadIdx.x; j < n; j += kDecodeThreads) m[g] = fmaxf(m[g], p_s[g][j]);
    m[g] = dev::warp_max(m[g]);
  }
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < kGroup; ++g) group_s[warp][g] = m[g];
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m[g] = group_s[0][g];
#pragma unroll
    for (int w = 1; w < kDecodeWarps; ++w) m[g] = fmaxf(m[g], group_s[w][g]);
    l[g] = 0.0f;
    for (int j = threadIdx.x; j < n; j += kDecodeThreads) {
      const float e = exp2f(p_s[g][j] - m[g]);
      p_s[g][j] = e;
      l[g] += e;
    }
    l[g] = dev::warp_sum(l[g]);
  }
  __syncthreads();  // every thread has read group_s
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < kGroup; ++g) group_s[warp][g] = l[g];
  __syncthreads();
  if (threadIdx.x < kGroup) {
    const int g = threadIdx.x;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) sum += group_s[w][g];
    stat_s[g][1] = sum;
  }
  if (threadIdx.x == 0)
#pragma unroll
    for (int g = 0; g < kGroup; ++g) stat_s[g][0] = m[g];
  __syncthreads();
}

// Value (g, d) of a partition's normalised output: the sequence's output row
// when it has one partition; else its partial, with the head's (max, sum)
// beside d == 0, in partial_smem / stat_smem when given (decode_attention_item
// says where those are), or in partial_out / partial_ml.
template <int kHeadDim, int kGroup, int kP>
__device__ __forceinline__ void store_partition_value(const AttentionArgs& a,
                                                      const DecodeAttentionSmem<kHeadDim, kGroup, kP>& sm,
                                                      bf16* out_row, int dslot, int h0, int part, int nparts, int g,
                                                      int d, float val, float* partial_smem, float* stat_smem) {
  if (nparts == 1) {
    out_row[(h0 + g) * kHeadDim + d] = __float2bfloat16(val);
  } else if (partial_smem != nullptr) {
    partial_smem[g * kHeadDim + d] = val;
    if (d == 0) {
      stat_smem[2 * g] = sm.stat[g][0];
      stat_smem[2 * g + 1] = sm.stat[g][1];
    }
  } else {
    const size_t base = (static_cast<size_t>(dslot) * a.num_heads + h0 + g) * a.partial_parts + part;
    a.partial_out[base * kHeadDim + d] = val;
    if (d == 0) {
      a.partial_ml[base * 2] = sm.stat[g][0];
      a.partial_ml[base * 2 + 1] = sm.stat[g][1];
    }
  }
}

// One CTA per (kv head, partition of kP tokens, sequence) serves the whole GQA
// group of that kv head, so K and V are read once per group. Memory-bound, so
// plain fp32 FMAs: lane-per-token dot products for the scores, a fixed-order
// softmax over the partition, and lane-per-dimension weighted sums of V
// (coalesced rows). A sequence of one partition gets its output rows; longer
// ones write normalised partial outputs with their (max, sum), combined in
// partition order (reduce_partitions, or partition 0 of a cluster). Every
// order depends only on the sequence's own length.
//
// Every thread of the CTA (kDecodeThreads) calls it. q_group:
// the group's query heads [kGroup][kHeadDim], after q norm + RoPE (global or
// shared memory). rows.k(t) / rows.v(t): the K / V row of the kv head at
// position t in the cache (CacheRows). Returns
// the sequence's partition count (0: padding).
// partial_smem / stat_smem: a partition of a longer sequence leaves its
// normalised output there ([kGroup][kHeadDim]) with its (max, sum) per head
// ([kGroup][2]) instead of in partial_out / partial_ml: shared memory of this
// CTA or, through distributed shared memory, of another CTA of its cluster.
// partial_smem may be &sm.red[0][0][0] (each thread rewrites only values it
// has read).
template <int kHeadDim, int kGroup, int kP, class Rows>
__device__ int decode_attention_item(const AttentionArgs& a, int dslot, const DecodeSeq& seq, int kvh, int part,
                                     const bf16* q_group, const Rows& rows,
                                     DecodeAttentionSmem<kHeadDim, kGroup, kP>& sm, float* partial_smem = nullptr,
                                     float* stat_smem = nullptr) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per K row
  auto& q_s = sm.q;
  auto& p_s = sm.p;
  auto& red_s = sm.red;
  auto& stat_s = sm.stat;

  const PartitionSeq ps = partition_seq<kHeadDim, kGroup, kP>(a, seq, kvh, part);
  const int kv_len = ps.kv_len, nparts = ps.nparts, h0 = kvh * kGroup;
  bf16* const out_row = ps.out_row;
  if (part >= nparts) return nparts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  // Scores are kept in the log2 domain: q is pre-scaled by scale * log2(e).
  const float qscale = a.scale * kLog2e;
  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kDecodeThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    q_s[g][d] = __bfloat162float(q_group[g * kHeadDim + d]) * qscale;
  }
  __syncthreads();

  const int p0 = part * kP;
  const int n = min(kv_len, p0 + kP) - p0;

  // Scores: lane j of a warp takes token c*32 + j; all its K loads go out first.
  for (int c = warp; c * 32 < n; c += kDecodeWarps) {
    const int j = c * 32 + lane;
    if (j < n) {
      const int t = p0 + j;
      const uint4* kp = reinterpret_cast<const uint4*>(rows.k(t));
      float s[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) s[g] = 0.0f;
      // The K row in batches of Rows::kKBatch 16-byte loads (each a round trip
      // to the cache); the same sums whatever the batch.
      constexpr int kBatch = Rows::kKBatch < kChunks ? Rows::kKBatch : kChunks;
#pragma unroll
      for (int c0 = 0; c0 < kChunks; c0 += kBatch) {
        uint4 kr[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) kr[i] = kp[c0 + i];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int ch = c0 + i;
          float kf[8];
          dev::unpack8(kr[i], kf);
#pragma unroll
          for (int g = 0; g < kGroup; ++g) {
            const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][ch * 8]);
            const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][ch * 8 + 4]);
            s[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                    qb.z * kf[6] + qb.w * kf[7];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) p_s[g][j] = s[g];
    }
  }
  __syncthreads();

  partition_softmax(sm, n);

  // P V: a V row is kHeadDim / 8 lanes of 16 bytes, so a warp covers
  // kTokensPerStep tokens per load and keeps kUnroll loads in flight per lane.
  constexpr int kLanesPerToken = kHeadDim / 8;
  constexpr int kTokensPerStep = 32 / kLanesPerToken;
  constexpr int kUnroll = Rows::kVBatch;  // V loads in flight per lane (the visiting order is the same)
  const int sub = lane / kLanesPerToken, dim0 = (lane % kLanesPerToken) * 8;
  float o[kGroup][8];
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[g][e] = 0.0f;
  constexpr int kStride = kDecodeWarps * kTokensPerStep;
  for (int j0 = warp * kTokensPerStep + sub; j0 < n; j0 += kStride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * kStride;
      if (j < n) {
        const int t = p0 + j;
        v[u] = *reinterpret_cast<const uint4*>(rows.v(t) + dim0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * kStride;
      if (j < n) {
        float vf[8];
        dev::unpack8(v[u], vf);
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          const float pj = p_s[g][j];
#pragma unroll
          for (int e = 0; e < 8; ++e) o[g][e] += pj * vf[e];
        }
      }
    }
  }
  // Lanes that share dimensions (different token slots) combine, in a fixed order.
#pragma unroll
  for (int off = kLanesPerToken; off < 32; off <<= 1)
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] += __shfl_xor_sync(0xffffffffu, o[g][e], off);
  if (sub == 0)
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) red_s[warp][g][dim0 + e] = o[g][e];
  __syncthreads();

  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kDecodeThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) sum += red_s[w][g][d];
    // Only this thread reads or writes (g, d) in this loop (partial_smem may be sm.red).
    store_partition_value(a, sm, out_row, dslot, h0, part, nparts, g, d, sum / stat_s[g][1], partial_smem, stat_smem);
  }
  return nparts;
}

// Scores of staged tokens t0 .. t0 + 8 kTiles - 1 (K rows in k_s at `stride`)
// on tensor cores: mma.m16n8k16 over head_dim in k16 steps, the group's query
// heads as rows 0 .. kGroup - 1 of A (the rest zero) and 8 tokens' K rows as B.
// Lane (g, q) ends with head g's scores of tokens t0 + 8 i + 2 q (+1) in acc[i][0..1].
template <int kHeadDim, int kGroup, int kTiles>
__device__ __forceinline__ void score_tiles(const bf16* q_group, const bf16* k_s, int stride, int t0,
                                            float (&acc)[kTiles][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const bool head = g < kGroup;
  const bf16* qrow = q_group + min(g, kGroup - 1) * kHeadDim + 2 * q;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t qa[4] = {head ? *reinterpret_cast<const uint32_t*>(qrow + 16 * ks) : 0u, 0u,
                            head ? *reinterpret_cast<const uint32_t*>(qrow + 16 * ks + 8) : 0u, 0u};
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const bf16* krow = k_s + (t0 + 8 * i + g) * stride + 16 * ks + 2 * q;
      mma_bf16(acc[i], qa, *reinterpret_cast<const uint32_t*>(krow), *reinterpret_cast<const uint32_t*>(krow + 8));
    }
  }
}

// decode_attention_item's contract for a partition whose K and V rows are all
// in shared memory (k_s / v_s: rows p0 .. p0 + n - 1 at `stride` bf16, n <= kP),
// on tensor cores: the scores as mma.m16n8k16 with the group's query heads as
// the rows of A (rows kGroup.. zero) and 8 tokens' K rows as B, a warp taking
// 16 tokens; the softmax as decode_attention_item's, in the same fixed order;
// then P V with the probabilities rounded to bf16 as A (as the prefill kernels
// and HF's bf16 attention round them) and V through ldmatrix.trans as B, a warp
// taking kHeadDim / 4 dimensions over all the tokens, so no warp sums meet.
template <int kHeadDim, int kGroup, int kP>
__device__ int decode_attention_item_mma(const AttentionArgs& a, int dslot, const DecodeSeq& seq, int kvh, int part,
                                         const bf16* q_group, const bf16* k_s, const bf16* v_s, int stride,
                                         DecodeAttentionSmem<kHeadDim, kGroup, kP>& sm, float* partial_smem,
                                         float* stat_smem) {
  static_assert(kP == 16 * kDecodeWarps, "a warp's scores are 16 tokens");
  static_assert(kGroup <= 8, "the group's heads are rows 0..7 of A");
  auto& p_s = sm.p;
  auto& stat_s = sm.stat;
  const PartitionSeq ps = partition_seq<kHeadDim, kGroup, kP>(a, seq, kvh, part);
  const int kv_len = ps.kv_len, nparts = ps.nparts, h0 = kvh * kGroup;
  bf16* const out_row = ps.out_row;
  if (part >= nparts) return nparts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int n = min(kv_len, (part + 1) * kP) - part * kP;
  const float qscale = a.scale * kLog2e;  // scores in the log2 domain

  // Scores of tokens [16 warp, 16 warp + 16): two n8 tiles, K over head_dim in k16 steps.
  const int t0 = 16 * warp;
  if (t0 < n) {
    float acc[2][4] = {};
    const bool head = g < kGroup;
    score_tiles<kHeadDim, kGroup>(q_group, k_s, stride, t0, acc);  // rows past n: read, never used
    if (head)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int j = t0 + 8 * i + 2 * q;
        if (j < n) p_s[g][j] = acc[i][0] * qscale;
        if (j + 1 < n) p_s[g][j + 1] = acc[i][1] * qscale;
      }
  }
  __syncthreads();

  partition_softmax(sm, n);

  // P V: dimensions [warp kHeadDim / 4, +kHeadDim / 4) in n8 tiles, two per ldmatrix.x4.trans.
  constexpr int kDims = kHeadDim / kDecodeWarps, kTiles = kDims / 8;
  static_assert(kTiles % 2 == 0, "V tiles in pairs");
  const int d0 = warp * kDims;
  float o[kTiles][4] = {};
  const bool head = g < kGroup;
  const float* prow = p_s[min(g, kGroup - 1)];
  for (int s = 0; s * 16 < n; ++s) {
    const int j = 16 * s + 2 * q;
    const uint32_t pa[4] = {head ? pack_bf16(j < n ? prow[j] : 0.0f, j + 1 < n ? prow[j + 1] : 0.0f) : 0u, 0u,
                            head ? pack_bf16(j + 8 < n ? prow[j + 8] : 0.0f, j + 9 < n ? prow[j + 9] : 0.0f) : 0u,
                            0u};
    // Lanes 8i..8i+7 address matrix i: tokens 16 s + 8 (i & 1) + r, dimensions + 8 (i >> 1).
    const int mi = lane >> 3, r = lane & 7;
    const int tok = min(16 * s + 8 * (mi & 1) + r, n - 1);  // past n: a valid row, times zero
#pragma unroll
    for (int t = 0; t < kTiles; t += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_s + tok * stride + d0 + 8 * t + 8 * (mi >> 1));
      mma_bf16(o[t], pa, b[0], b[1]);
      mma_bf16(o[t + 1], pa, b[2], b[3]);
    }
  }
  if (head) {
    const float inv_l = 1.0f / stat_s[g][1];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        store_partition_value(a, sm, out_row, dslot, h0, part, nparts, g, d0 + 8 * t + 2 * q + e, o[t][e] * inv_l,
                              partial_smem, stat_smem);
      }
  }
  return nparts;
}

// Shared memory of decode_attention_item_wide's combine, in floats: each warp's
// output [kWarps][kGroup][kHeadDim].
template <int kHeadDim, int kGroup, int kWarps>
inline constexpr int kWideCombineFloats = kWarps * kGroup * kHeadDim;

// decode_attention_item_mma's contract (rows in shared memory, tensor cores)
// for long partitions, run by kWarps warps (32 kWarps threads, every one of
// them calls it) that each take kP / kWarps consecutive tokens on their own:
// the scores as in decode_attention_item_mma, 8 tokens per n8 tile; a softmax
// within the warp (the lanes of a head are one quad: two shuffles); P V with
// the score accumulators, rounded to bf16, as the A fragments as they are (no
// shared memory between the products) and V through ldmatrix.trans, over every
// dimension. The warps' (max, sum, output) then combine in warp order behind
// two barriers: their (max, sum) in sm.p, their outputs in `comb`
// (kWideCombineFloats, which may be where k_s and v_s are: every warp is done
// with them at the first barrier). So a context of up to kP tokens is one CTA
// with no cluster, and the only barriers are the combine's. The warp count
// sets the grouping of the softmax, so results depend on it (and on nothing
// else but the sequence).
template <int kHeadDim, int kGroup, int kP, int kWarps>
__device__ int decode_attention_item_wide(const AttentionArgs& a, int dslot, const DecodeSeq& seq, int kvh, int part,
                                          const bf16* q_group, const bf16* k_s, const bf16* v_s, int stride,
                                          DecodeAttentionSmem<kHeadDim, kGroup, kP>& sm, float* comb,
                                          float* partial_smem, float* stat_smem) {
  constexpr int kThreads = 32 * kWarps;
  constexpr int kTok = kP / kWarps;  // a warp's tokens
  constexpr int kScoreTiles = kTok / 8, kDimTiles = kHeadDim / 8;
  static_assert(kTok % 16 == 0, "a warp's tokens are whole k16 steps of P V");
  static_assert(kGroup <= 8, "the group's heads are rows 0..7 of A");
  static_assert(2 * kWarps <= kP, "the warps' (max, sum) fit in sm.p");
  float* const red = comb;                             // [kWarps][kGroup][kHeadDim]
  float* const warp_max = &sm.p[0][0];                 // [kWarps][kGroup]
  float* const warp_sum = warp_max + kWarps * kGroup;  // [kWarps][kGroup]
  const PartitionSeq ps = partition_seq<kHeadDim, kGroup, kP, kThreads>(a, seq, kvh, part);
  const int kv_len = ps.kv_len, nparts = ps.nparts, h0 = kvh * kGroup;
  if (part >= nparts) return nparts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int n = min(kv_len, (part + 1) * kP) - part * kP;
  const float qscale = a.scale * kLog2e;  // scores in the log2 domain
  const int t0 = warp * kTok;
  const bool head = g < kGroup;
  float m = -INFINITY, l = 0.0f;  // this warp's, for head g (warps past n keep these)
  float o[kDimTiles][4] = {};
  if (t0 < n) {
    float s[kScoreTiles][4] = {};
    score_tiles<kHeadDim, kGroup>(q_group, k_s, stride, t0, s);  // rows past n: read, masked below
    // Lane (g, q) holds head g's scores of tokens t0 + 8 i + 2 q (+1) in s[i][0..1].
#pragma unroll
    for (int i = 0; i < kScoreTiles; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[i][e] = t0 + 8 * i + 2 * q + e < n ? s[i][e] * qscale : -INFINITY;
        m = fmaxf(m, s[i][e]);
      }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
#pragma unroll
    for (int i = 0; i < kScoreTiles; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[i][e] = exp2f(s[i][e] - m);
        l += s[i][e];
      }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // P V, 16 tokens per k step: A is two score tiles; lanes 8i..8i+7 address
    // ldmatrix matrix i: tokens 16 ks + 8 (i & 1) + r, dimensions + 8 (i >> 1).
    const int mi = lane >> 3, r = lane & 7;
#pragma unroll
    for (int ks = 0; ks < kTok / 16; ++ks) {
      const uint32_t pa[4] = {head ? pack_bf16(s[2 * ks][0], s[2 * ks][1]) : 0u, 0u,
                              head ? pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]) : 0u, 0u};
      const int tok = min(t0 + 16 * ks + 8 * (mi & 1) + r, n - 1);  // past n: a valid row, times zero
#pragma unroll
      for (int t = 0; t < kDimTiles; t += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + tok * stride + 8 * t + 8 * (mi >> 1));
        mma_bf16(o[t], pa, b[0], b[1]);
        mma_bf16(o[t + 1], pa, b[2], b[3]);
      }
    }
  }
  // The warps combine in warp order: each scales its output to the group's
  // maximum (warp 0 always has tokens, so it is finite) and the sums add.
  if (head && q == 0) {
    warp_max[warp * kGroup + g] = m;
    warp_sum[warp * kGroup + g] = l;
  }
  __syncthreads();  // and every warp is done with k_s and v_s (comb may be there)
  if (head) {
    float mx = warp_max[g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, warp_max[w * kGroup + g]);
    const float scale = t0 < n ? exp2f(m - mx) : 0.0f;
    float* const mine = red + (warp * kGroup + g) * kHeadDim;
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t)
      *reinterpret_cast<float2*>(mine + 8 * t + 2 * q) = make_float2(o[t][0] * scale, o[t][1] * scale);
    if (warp == 0 && q == 0) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += warp_sum[w * kGroup + g] * exp2f(warp_max[w * kGroup + g] - mx);
      sm.stat[g][0] = mx;
      sm.stat[g][1] = sum;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
    const int gi = i / kHeadDim, d = i % kHeadDim;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[(w * kGroup + gi) * kHeadDim + d];
    // Only this thread reads or writes (gi, d) here (partial_smem may be comb).
    store_partition_value(a, sm, ps.out_row, dslot, h0, part, nparts, gi, d, sum / sm.stat[gi][1], partial_smem,
                          stat_smem);
  }
  return nparts;
}

// The combination of a head's partitions at one dimension, in partition order,
// from ml(p, 0 or 1) (partition p's max and sum) and o(p) (its normalised
// output), wherever the partials are: global memory (reduce_partitions below)
// or the shared memory of a cluster's CTAs. Unrolled so that each group of
// loads goes out together (the loop is latency-bound); the order of the sums
// stays partition order.
template <class Ml, class O>
__device__ __forceinline__ float combine_partitions(int nparts, Ml ml, O o) {
  float m = -INFINITY;
#pragma unroll 8
  for (int p = 0; p < nparts; ++p) m = fmaxf(m, ml(p, 0));
  float num = 0.0f, den = 0.0f;
#pragma unroll 8
  for (int p = 0; p < nparts; ++p) {
    const float w = ml(p, 1) * exp2f(ml(p, 0) - m);
    num += w * o(p);
    den += w;
  }
  return num / den;
}

// The output of head h of decode slot dslot at dimension d, combined from its
// nparts partitions in partition order (read through L2: other CTAs of the
// same kernel may have written them).
template <int kHeadDim>
__device__ float reduce_partitions(const AttentionArgs& a, int dslot, int h, int nparts, int d) {
  const size_t base = (static_cast<size_t>(dslot) * a.num_heads + h) * a.partial_parts;
  return combine_partitions(
      nparts, [&](int p, int k) { return __ldcg(a.partial_ml + (base + p) * 2 + k); },
      [&](int p) { return __ldcg(a.partial_out + (base + p) * kHeadDim + d); });
}

}  // namespace siesta::cuda::dev
