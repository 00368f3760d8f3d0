// The fused decode step: every layer of a decode step of up to 8 sequences in
// one launch of one CTA per SM, with grid barriers between the stages where
// every CTA needs every other's output.
//
// Per layer (each "|" a grid barrier):
//   A: RMSNorm + QKV GEMV | B: q/k norm + RoPE + KV write + attention |
//   C: O GEMV + residual  | E: RMSNorm + gate/up GEMV + SiLU-mul      | F: down GEMV + residual |
// Each CTA owns a fixed range of output rows of every projection. Its weight
// rows, layer after layer, are one stream of bulk copies (the copy engine,
// cp.async.bulk) into a ring of shared-memory slots, issued as soon as a slot
// is free: while the CTA waits at a barrier or works on attention, the next
// projections' weights are already on their way. That keeps HBM busy across
// the ~170 dependent steps that separate kernels would each pay a launch for.
//
// Opt-in (CudaModelOptions::fused_decode): on the H200 it is slower than the
// per-layer kernels with programmatic launch (bench/results/cuda_notes.md).
//
// The arithmetic of every value is that of the separate kernels (the GEMV of
// gemv.cu with its norm and SiLU-mul staging, qk_norm_rope_kv, and
// decode_attention_item with 64-token partitions), so a decode step gives the
// same bits either way.
//
// Synchronisation state lives in the step image (zeroed by every upload): the
// grid barrier's arrival counter and one counter per (sequence, kv head) whose
// last partition to finish combines the partitions. Data that other CTAs of
// this launch wrote is read through L2 (ld.global.cg), never from a possibly
// stale L1 line.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "model/cuda/attention_decode.cuh"
#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/norm_rope.cuh"

namespace siesta::cuda {
namespace {

constexpr int kThreads = 256;             // the consumer warps: all compute
constexpr int kWarps = kThreads / 32;
constexpr int kBlockThreads = kThreads + 32;  // + one producer warp: the weight stream
constexpr int kMaxRowsPerWarp = 2;        // rows a warp's dot products interleave
constexpr int kP = 64;          // attention partition (tokens)
constexpr int kMaxSlots = 16;   // weight slots in shared memory
constexpr int kBarBytes = 2 * kMaxSlots * 8;  // their full / empty mbarriers, first in dynamic shared memory
constexpr int kPhases = 4;      // QKV, O, gate/up, down
constexpr int kSyncCounters = 32;  // sync[kSyncCounters + dslot * kv_heads + kv head]
constexpr int kRowPad = dev::kKvRowPad;  // bf16 after each K/V row in shared memory

using dev::bulk_copy;
using dev::mbar_arrive;
using dev::mbar_expect_tx;
using dev::mbar_init;
using dev::mbar_wait;
using dev::round_bf16;
using dev::smem_addr;

// The consumer warps' barrier (the producer warp runs on its own).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 2, %0;" ::"n"(kThreads) : "memory"); }

// Block-wide sum over the consumer warps in dev::block_sum's order.
__device__ __forceinline__ float consumer_sum(float v, float* scratch) {
  v = dev::warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  consumer_sync();
  if (lane == 0) scratch[warp] = v;
  consumer_sync();
  float total = 0.0f;
  for (int i = 0; i < kWarps; ++i) total += scratch[i];
  return total;
}

// ---- the grid barrier ----

// Every CTA adds one to the arrival counter; barrier number k (counted by
// `target`, the same in every thread) is passed when it reaches k * CTAs. The
// release add (after the CTA's barrier) publishes the CTA's writes; the
// acquire load (before the CTA's barrier) makes the others' visible.
// Consumer threads only. Split in two so that a CTA can start work that does
// not depend on the others (prefetches) between arriving and waiting.
__device__ __forceinline__ void grid_arrive(uint32_t* arrivals, uint32_t& target) {
  consumer_sync();
  target += gridDim.x;
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrivals) : "memory");
}
__device__ __forceinline__ void grid_wait(uint32_t* arrivals, uint32_t target) {
  if (threadIdx.x == 0) {
    uint32_t seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrivals) : "memory");
    } while (static_cast<int32_t>(seen - target) < 0);
  }
  consumer_sync();
}
__device__ __forceinline__ void grid_sync(uint32_t* arrivals, uint32_t& target) {
  grid_arrive(arrivals, target);
  grid_wait(arrivals, target);
}

__device__ __forceinline__ void ldcg8(const bf16* p, float (&f)[8]) {
  dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(p)), f);
}

// ---- optional per-stage timing (FusedDecodeArgs::profile) ----

// Thread 0 of each CTA adds the SM cycles of each stage to its row (sums kept
// in shared memory, not in registers that every thread would reserve).
struct Prof {
  unsigned long long* row;  // null: off
  unsigned long long* acc;  // [kFusedDecodeProfileStages + 2] in shared memory: sums, start, last lap
  __device__ Prof(unsigned long long* r, unsigned long long* sums) : row(r), acc(sums) {
    if (row && threadIdx.x == 0) {
      for (int i = 0; i < kFusedDecodeProfileStages; ++i) acc[i] = 0;
      acc[kFusedDecodeProfileStages] = acc[kFusedDecodeProfileStages + 1] = clock64();
    }
  }
  __device__ __forceinline__ void lap(int stage) {
    if (row && threadIdx.x == 0) {
      const unsigned long long now = clock64();
      acc[stage] += now - acc[kFusedDecodeProfileStages + 1];
      acc[kFusedDecodeProfileStages + 1] = now;
    }
  }
  __device__ void flush(unsigned long long ns, unsigned long long wait_cycles) {
    if (!row || threadIdx.x != 0) return;
    for (int i = 0; i < kFusedDecodeProfileStages; ++i) atomicAdd(row + i, acc[i]);
    atomicAdd(row + kFusedDecodeProfileStages, wait_cycles);
    atomicAdd(row + kFusedDecodeProfileStages + 1, clock64() - acc[kFusedDecodeProfileStages]);
    atomicAdd(row + kFusedDecodeProfileStages + 2, ns);
  }
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// ---- the weight stream ----

// One projection of a layer as the stream sees it: rows of `row_elems` bf16
// from `base` (layer 0; layer l at + l * layer_stride), and for gate/up a
// second row per logical row, `pair_offset` elements further.
struct PhaseDesc {
  const bf16* base;
  int rows;       // logical rows
  int row_elems;  // K
  size_t pair_offset;  // 0: one weight row per logical row
  int chunk_rows;
};

// A consumer thread's place in the stream.
struct Cursor {
  int consumed = 0;  // chunks taken so far
  bool timed = false;
  unsigned long long wait_cycles = 0;  // thread 0, when timed
};

// This CTA's weight rows, layer after layer, phase after phase, in chunks of
// up to chunk_rows rows: the producer warp copies chunk k into slot k % slots
// once every consumer warp has released chunk k - slots (the `empty`
// mbarriers); the consumers take chunk k when it has landed (`full`).
struct Stream {
  PhaseDesc ph[kPhases];
  size_t layer_stride;
  int layers;
  int per_cta[kPhases];  // logical rows per CTA
  int chunks[kPhases];   // this CTA's chunks per phase
  unsigned char* slots;
  uint64_t* full;
  uint64_t* empty;
  int slot_bytes, num_slots;

  __device__ int first_row(int p) const { return blockIdx.x * per_cta[p]; }
  __device__ int rows_of(int p) const { return max(0, min(ph[p].rows, first_row(p) + per_cta[p]) - first_row(p)); }

  // The producer warp's lane 0: every chunk of every layer, in order.
  __device__ void produce() const {
    int k = 0;
    for (int l = 0; l < layers; ++l) {
      for (int p = 0; p < kPhases; ++p) {
        const PhaseDesc& d = ph[p];
        const int r_begin = first_row(p), r_end = r_begin + rows_of(p);
        for (int r = r_begin; r < r_end; r += d.chunk_rows, ++k) {
          const int slot = k % num_slots;
          if (k >= num_slots) mbar_wait(&empty[slot], ((k / num_slots) - 1) & 1);
          const int n = min(d.chunk_rows, r_end - r);
          const unsigned bytes = static_cast<unsigned>(n) * d.row_elems * sizeof(bf16);
          unsigned char* dst = slots + static_cast<size_t>(slot) * slot_bytes;
          const bf16* src = d.base + l * layer_stride + static_cast<size_t>(r) * d.row_elems;
          mbar_expect_tx(&full[slot], d.pair_offset ? 2 * bytes : bytes);
          bulk_copy(dst, src, bytes, &full[slot]);
          if (d.pair_offset) bulk_copy(dst + bytes, src + d.pair_offset, bytes, &full[slot]);
        }
      }
    }
  }

  // Consumer threads: waits for the next chunk; returns its weights.
  __device__ const bf16* wait_next(Cursor& c) const {
    const int slot = c.consumed % num_slots;
    const unsigned long long t = c.timed ? clock64() : 0;
    mbar_wait(&full[slot], (c.consumed / num_slots) & 1);
    if (c.timed && threadIdx.x == 0) c.wait_cycles += clock64() - t;
    return reinterpret_cast<const bf16*>(slots + static_cast<size_t>(slot) * slot_bytes);
  }
  // Consumer threads, once their warp is done with the chunk: frees its slot.
  __device__ void release(Cursor& c) const {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[c.consumed % num_slots]);
    ++c.consumed;
  }
};

// ---- GEMV stages (the arithmetic of gemv.cu) ----

// s_a[m] = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) for the M rows of x (or,
// when `rows` is set, of table[rows[m]]), as gemv.cu's kRmsNorm staging. One
// row of up to kThreads 8-element chunks is read once (kept in registers for
// the second pass).
template <int kMaxM>
__device__ __noinline__ void stage_norm(const bf16* x, const int32_t* rows, const bf16* norm_w, int M, int K, float eps, bf16* s_a,
                           float* scratch) {
  const int chunks = K / 8;
  auto row_ptr = [&](int m) { return rows ? x + static_cast<size_t>(rows[m]) * K : x + static_cast<size_t>(m) * K; };
  const int c0 = threadIdx.x;
  // (Not for 8 rows: the registers would spill in the widest instances.)
  const bool once = kMaxM == 1 && chunks <= kThreads;
  uint4 held[kMaxM];
  if (once && c0 < chunks) {
#pragma unroll
    for (int m = 0; m < kMaxM; ++m)
      if (m < M) held[m] = __ldcg(reinterpret_cast<const uint4*>(row_ptr(m) + c0 * 8));
  }
  auto chunk_of = [&](int m, int c, float(&f)[8]) {
    if (once) dev::unpack8(held[m], f);
    else ldcg8(row_ptr(m) + c * 8, f);
  };
  float ss[kMaxM];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m) ss[m] = 0.0f;
  for (int c = c0; c < chunks; c += kThreads) {
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m < M) {
        float f[8];
        chunk_of(m, c, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[m] += f[e] * f[e];
      }
    }
  }
  float rs[kMaxM];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m)
    rs[m] = m < M ? rsqrtf(consumer_sum(ss[m], scratch) / static_cast<float>(K) + eps) : 0.0f;
  for (int c = c0; c < chunks; c += kThreads) {
    float w[8];
    dev::load8(norm_w + c * 8, w);
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m < M) {
        float f[8];
        chunk_of(m, c, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = w[e] * round_bf16(f[e] * rs[m]);
        dev::store8(s_a + m * K + c * 8, f);
      }
    }
  }
  consumer_sync();
}

__device__ void stage_plain(const bf16* x, int M, int K, bf16* s_a) {
  const int chunks = K / 8;
  for (int i = threadIdx.x; i < M * chunks; i += kThreads) {
    const int m = i / chunks, c = i % chunks;
    reinterpret_cast<uint4*>(s_a + m * K)[c] = __ldcg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * K) + c);
  }
  consumer_sync();
}

// 16 bytes from shared memory (a generic pointer into it) in one 128-bit load.
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(p)));
  return v;
}

// acc[r][m] = sum_k w[r][k] * s_a[m, k] for up to kR weight rows at once, each
// in gemv.cu's order (lane-strided 8-element chunks, then a butterfly; the
// rows only share the loop, for loads in flight): every lane ends with every sum.
template <int kMaxM, int kR>
__device__ void rows_dot(const bf16* const (&w)[kR], int nr, const bf16* s_a, int M, int K, float (&acc)[kR][kMaxM]) {
  const int lane = threadIdx.x & 31, chunks = K / 8;
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) acc[r][m] = 0.0f;
  for (int ch = lane; ch < chunks; ch += 32) {
    float wf[kR][8];
#pragma unroll
    for (int r = 0; r < kR; ++r)
      if (r < nr) dev::unpack8(lds128(w[r] + ch * 8), wf[r]);
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m < M) {
        float x[8];
        dev::unpack8(lds128(s_a + m * K + ch * 8), x);
#pragma unroll
        for (int r = 0; r < kR; ++r)
          if (r < nr)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][m] += wf[r][e] * x[e];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) acc[r][m] = dev::warp_sum(acc[r][m]);
}

enum class Out { kStore, kAddResidual, kSiluMul };

// The residual stream's rows that this CTA updates (the O and down
// projections share their row range): a copy in shared memory, so that adding
// to them needs no read of global memory. Layer 0 adds to the embedding rows.
struct Residual {
  bf16* own;                 // [M][per_cta] in shared memory
  int per_cta, first;        // this CTA's rows [first, first + per_cta) of hidden
  const bf16* embed;         // layer 0: the embedding table, else null
  const int32_t* tokens;
  int hidden;
  __device__ float get(int m, int n) const {
    return embed ? __bfloat162float(embed[static_cast<size_t>(tokens[m]) * hidden + n])
                 : __bfloat162float(own[m * per_cta + n - first]);
  }
};

// Runs phase p of layer l for this CTA's rows, chunk by chunk from the stream.
//   kStore:       out[m, n] = bf16(acc)                                 (QKV)
//   kAddResidual: out[m, n] = bf16(res[m, n] + bf16(acc))                (O, down; also into res.own)
//   kSiluMul:     out[m, i] = bf16(bf16(silu(bf16(gate))) * bf16(up))   (gate/up)
template <int kMaxM, Out kOut>
__device__ void gemv_phase(const Stream& st, Cursor& cur, int p, int M, const bf16* s_a, bf16* out, int out_cols,
                           const Residual* res) {
  constexpr int kR = kMaxM == 1 ? kMaxRowsPerWarp : 2;        // dot products in flight per warp
  constexpr int kDots = kOut == Out::kSiluMul ? 2 : 1;        // per logical row: gate and up
  constexpr int kRowsAtOnce = kR / kDots;
  const PhaseDesc& d = st.ph[p];
  const int K = d.row_elems;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r_begin = st.first_row(p), r_end = r_begin + st.rows_of(p);
  for (int r0 = r_begin; r0 < r_end; r0 += d.chunk_rows) {
    const bf16* w = st.wait_next(cur);
    const int n_rows = min(d.chunk_rows, r_end - r0);
    for (int i0 = warp; i0 < n_rows; i0 += kWarps * kRowsAtOnce) {
      const bf16* wr[kR];
      int nr = 0;
#pragma unroll
      for (int j = 0; j < kRowsAtOnce; ++j) {
        const int i = min(i0 + j * kWarps, n_rows - 1);
        if (i0 + j * kWarps < n_rows) nr = (j + 1) * kDots;
        wr[j * kDots] = w + static_cast<size_t>(i) * K;
        if constexpr (kDots == 2) wr[j * kDots + 1] = w + static_cast<size_t>(n_rows + i) * K;
      }
      float acc[kR][kMaxM];
      rows_dot<kMaxM, kR>(wr, nr, s_a, M, K, acc);
#pragma unroll
      for (int j = 0; j < kRowsAtOnce; ++j) {
        const int n = r0 + i0 + j * kWarps;
        if (j * kDots >= nr) break;
#pragma unroll
        for (int m = 0; m < kMaxM; ++m) {
          if (m < M && lane == m) {
            const size_t idx = static_cast<size_t>(m) * out_cols + n;
            if constexpr (kOut == Out::kSiluMul) {
              const float g = round_bf16(acc[j * kDots][m]), u = round_bf16(acc[j * kDots + 1][m]);
              out[idx] = __float2bfloat16(round_bf16(g / (1.0f + expf(-g))) * u);
            } else if constexpr (kOut == Out::kAddResidual) {
              const bf16 v = __float2bfloat16(res->get(m, n) + round_bf16(acc[j][m]));
              out[idx] = v;
              res->own[m * res->per_cta + n - res->first] = v;
            } else {
              out[idx] = __float2bfloat16(acc[j][m]);
            }
          }
        }
      }
    }
    st.release(cur);
  }
}

// ---- attention inputs ----

// Work item `item` of the attention stage: (decode slot, kv head, partition).
struct Item {
  int dslot, kvh, part, nparts;
};
__device__ Item item_of(const AttentionArgs& a, int item) {
  Item it{0, 0, 0, 1};
  for (int rest = item;; ++it.dslot) {
    const int len = a.seq_kv_len[a.decode_seqs[it.dslot]];
    it.nparts = len > 0 ? (len + kP - 1) / kP : 1;
    if (rest < a.num_kv_heads * it.nparts) {
      it.kvh = rest / it.nparts;
      it.part = rest % it.nparts;
      return it;
    }
    rest -= a.num_kv_heads * it.nparts;
  }
}

// K/V rows for decode_attention_item: a shared-memory copy of the item's
// partition (prefetched; the new token written there too), or the cache.
// Starts copying the cached K and V rows of the item's partition (all but the
// new token, which this step writes) into k_s / v_s. Nothing of this step
// writes them, so the copy can overlap the stages before attention.
template <int kHeadDim>
__device__ __noinline__ void prefetch_kv(const AttentionArgs& a, const Item& it, int layer, bf16* k_s, bf16* v_s) {
  const int len = a.seq_kv_len[a.decode_seqs[it.dslot]];
  const int p0 = it.part * kP;
  const int n = max(0, min(len - 1, p0 + kP) - p0);
  dev::CacheRows rows = dev::cache_rows(a, it.dslot, it.kvh);
  rows.layer = layer;
  dev::stage_kv_rows<kHeadDim>(rows, p0, n, k_s, v_s, kThreads);
}

// ---- the kernel ----

template <int kMaxM, int kHeadDim, int kGroup>
__global__ __launch_bounds__(kBlockThreads, 1) void fused_decode_kernel(const __grid_constant__ FusedDecodeArgs f) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ dev::DecodeAttentionSmem<kHeadDim, kGroup, kP> att;
  __shared__ __align__(16) bf16 q_s[kGroup * kHeadDim];
  __shared__ float scratch[32];
  __shared__ int last_s;
  __shared__ __align__(8) uint64_t norm_bar[2];

  const AttentionArgs& a = f.attn;
  const int M = f.M, H = f.hidden, I = f.inter, L = f.num_layers;
  const int heads = a.num_heads, kv_heads = a.num_kv_heads;
  const int q_dim = heads * kHeadDim, qkv_cols = (heads + 2 * kv_heads) * kHeadDim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  __shared__ Stream st;
  if (threadIdx.x == 0) {
    st.ph[0] = {f.qkv_w, qkv_cols, H, 0, f.chunk_rows[0]};
    st.ph[1] = {f.o_w, H, q_dim, 0, f.chunk_rows[1]};
    st.ph[2] = {f.gate_up_w, I, H, static_cast<size_t>(I) * H, f.chunk_rows[2]};
    st.ph[3] = {f.down_w, H, I, 0, f.chunk_rows[3]};
    st.layer_stride = f.layer_stride;
    st.layers = L;
    for (int p = 0; p < kPhases; ++p) {
      st.per_cta[p] = (st.ph[p].rows + gridDim.x - 1) / gridDim.x;
      st.chunks[p] = (st.rows_of(p) + st.ph[p].chunk_rows - 1) / st.ph[p].chunk_rows;
    }
    st.full = reinterpret_cast<uint64_t*>(smem);
    st.empty = st.full + kMaxSlots;
    st.slots = smem + f.off_slots;
    st.slot_bytes = f.slot_bytes;
    st.num_slots = f.num_slots;
  }
  // Dynamic shared memory (launch_fused_decode's plan): slot mbarriers, the
  // norm weights of two layers, staged inputs, this CTA's residual rows, a
  // partition of K and V, then the weight slots.
  const int norm_elems = 2 * H + 2 * kHeadDim;  // input, post-attention, q, k
  bf16* norms = reinterpret_cast<bf16*>(smem + f.off_norms);
  bf16* s_a = reinterpret_cast<bf16*>(smem + f.off_stage);
  bf16* k_s = reinterpret_cast<bf16*>(smem + f.off_kv);
  bf16* v_s = k_s + kP * (kHeadDim + kRowPad);

  // Thread 0: the norm weights of `layer` into buffer layer % 2.
  auto fetch_norms = [&](int layer) {
    if (layer >= L) return;
    const size_t lo = static_cast<size_t>(layer) * f.layer_stride;
    bf16* dst = norms + (layer & 1) * norm_elems;
    uint64_t* bar = &norm_bar[layer & 1];
    mbar_expect_tx(bar, norm_elems * sizeof(bf16));
    bulk_copy(dst, f.input_norm + lo, H * sizeof(bf16), bar);
    bulk_copy(dst + H, f.post_norm + lo, H * sizeof(bf16), bar);
    bulk_copy(dst + 2 * H, a.q_norm + lo, kHeadDim * sizeof(bf16), bar);
    bulk_copy(dst + 2 * H + kHeadDim, a.k_norm + lo, kHeadDim * sizeof(bf16), bar);
  };

  // The step image (uploaded before this launch) holds the zeroed counters.
  dev::wait_for_previous_kernel();
  if (threadIdx.x == 0) {
    for (int s = 0; s < f.num_slots; ++s) {
      mbar_init(&st.full[s], 1);
      mbar_init(&st.empty[s], kWarps);
    }
    mbar_init(&norm_bar[0], 1);
    mbar_init(&norm_bar[1], 1);
    dev::mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kThreads) {  // the producer warp
    if (threadIdx.x == kThreads) st.produce();
    return;
  }
  __shared__ Residual res;  // (shared memory: fewer live registers)
  if (threadIdx.x == 0) res = {reinterpret_cast<bf16*>(smem + f.off_own), st.per_cta[1], st.first_row(1), f.embed, f.tokens, H};
  Cursor cur;
  if (threadIdx.x == 0) fetch_norms(0);

  __shared__ unsigned long long prof_sums[kFusedDecodeProfileStages + 2];
  Prof prof(f.profile ? f.profile + static_cast<size_t>(blockIdx.x) * kFusedDecodeProfileWords : nullptr, prof_sums);
  cur.timed = f.profile != nullptr;
  const unsigned long long ns0 = f.profile ? global_ns() : 0;
  uint32_t* arrivals = f.sync;
  uint32_t* part_done = f.sync + kSyncCounters;
  uint32_t target = 0;

  // Attention work items: (decode slot, kv head, partition), in that order.
  int items = 0;
  for (int m = 0; m < M; ++m) {
    const int len = a.seq_kv_len[a.decode_seqs[m]];
    items += kv_heads * (len > 0 ? (len + kP - 1) / kP : 1);
  }
  const bool has_item = static_cast<int>(blockIdx.x) < items;
  __shared__ Item first_item;
  if (threadIdx.x == 0) first_item = has_item ? item_of(a, blockIdx.x) : Item{};
  consumer_sync();
  // Layer l's K/V of the CTA's first attention item are copied to shared
  // memory ahead of time (while the CTA waits at the barrier after layer
  // l - 1's attention), so attention starts on data already there.
  if (has_item) prefetch_kv<kHeadDim>(a, first_item, 0, k_s, v_s);

  for (int l = 0; l < L; ++l) {
    const bf16* nw = norms + (l & 1) * norm_elems;
    mbar_wait(&norm_bar[l & 1], (l >> 1) & 1);

    // A: input RMSNorm + QKV.
    stage_norm<kMaxM>(l == 0 ? f.embed : f.x, l == 0 ? f.tokens : nullptr, nw, M, H, a.eps, s_a, scratch);
    prof.lap(0);
    // (AttentionArgs keeps the QKV rows const: attention only reads them; this stage writes them.)
    gemv_phase<kMaxM, Out::kStore>(st, cur, 0, M, s_a, const_cast<bf16*>(a.qkv), qkv_cols, nullptr);
    prof.lap(1);
    grid_sync(arrivals, target);
    prof.lap(2);

    // B: q/k norm + RoPE (+ the new token's K and V into the cache) and attention.
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const bool first = item == static_cast<int>(blockIdx.x);
      const Item it = first ? first_item : item_of(a, item);
      const int seq = a.decode_seqs[it.dslot];
      const int row = a.seq_q_start[seq];
      const int len = a.seq_kv_len[seq];
      const int p0 = it.part * kP;
      const bf16* qkv_row = a.qkv + static_cast<size_t>(row) * qkv_cols;
      const __nv_bfloat162* rope = a.rope_table + static_cast<size_t>(a.positions[row]) * (kHeadDim / 2);
      const int slot = a.slots[row];
      const bool writes_kv = len > 0 && it.part == it.nparts - 1 && slot >= 0;
      const int units = kGroup + (writes_kv ? 2 : 0);
      for (int u = warp; u < units; u += kWarps) {
        if (u < kGroup) {
          dev::norm_rope_head<kHeadDim>(qkv_row + (it.kvh * kGroup + u) * kHeadDim, nw + 2 * H, rope, a.eps,
                                        q_s + u * kHeadDim);
        } else {
          const int block = slot / kKvBlockSize, in_block = slot % kKvBlockSize;
          const int kind = u - kGroup;
          bf16* cache = dev::kv_slot(a.kv, block, in_block, l, kind, it.kvh);
          bf16* local = (kind == 0 ? k_s : v_s) + (len - 1 - p0) * (kHeadDim + kRowPad);
          bf16* dst = first ? local : cache;
          if (kind == 0) {
            dev::norm_rope_head<kHeadDim>(qkv_row + q_dim + it.kvh * kHeadDim, nw + 2 * H + kHeadDim, rope, a.eps,
                                          dst);
          } else {
            const uint4* src = reinterpret_cast<const uint4*>(qkv_row + q_dim + kv_heads * kHeadDim + it.kvh * kHeadDim);
            for (int c = lane; c < kHeadDim / 8; c += 32) reinterpret_cast<uint4*>(dst)[c] = __ldcg(src + c);
          }
          if (first) {  // the shared-memory row to the cache as well
            __syncwarp();
            for (int c = lane; c < kHeadDim / 8; c += 32)
              reinterpret_cast<uint4*>(cache)[c] = reinterpret_cast<const uint4*>(local)[c];
          }
        }
      }
      if (first) asm volatile("cp.async.wait_all;" ::: "memory");
      consumer_sync();
      prof.lap(3);
      if (threadIdx.x < dev::kDecodeThreads) {
        dev::CacheRows cache = dev::cache_rows(a, it.dslot, it.kvh);
        cache.layer = l;
        // The first item's whole partition is in shared memory (the new token written there too).
        const dev::StagedRows rows{cache, k_s, v_s, p0, first ? kP : 0, kHeadDim + kRowPad};
        dev::decode_attention_item<kHeadDim, kGroup, kP>(a, it.dslot, it.kvh, it.part, q_s, rows, att, [] {
          asm volatile("bar.sync 1, %0;" ::"n"(dev::kDecodeThreads) : "memory");
        });
      }
      consumer_sync();
      prof.lap(4);
      if (len > 0 && it.nparts > 1) {
        // The last partition of (sequence, kv head) to finish combines them:
        // the count's release publishes this CTA's partial outputs (written
        // before the barrier above), its acquire makes the others' visible.
        if (threadIdx.x == 0) {
          uint32_t done = 0;
          asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                       : "=r"(done)
                       : "l"(&part_done[it.dslot * kv_heads + it.kvh])
                       : "memory");
          last_s = done == static_cast<uint32_t>(it.nparts - 1);
        }
        consumer_sync();
        if (last_s) {
          bf16* out_row = a.out + static_cast<size_t>(row) * heads * kHeadDim;
          for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
            const int g = i / kHeadDim, dd = i % kHeadDim;
            out_row[(it.kvh * kGroup + g) * kHeadDim + dd] =
                __float2bfloat16(dev::reduce_partitions<kHeadDim>(a, it.dslot, it.kvh * kGroup + g, it.nparts, dd));
          }
          if (threadIdx.x == 0) part_done[it.dslot * kv_heads + it.kvh] = 0;  // for the next layer
        }
        consumer_sync();
      }
      prof.lap(5);
    }
    grid_arrive(arrivals, target);
    // While the others finish: the next layer's K/V for attention, and its
    // norm weights (their buffer's last reader was layer l - 1).
    if (has_item && l + 1 < L) prefetch_kv<kHeadDim>(a, first_item, l + 1, k_s, v_s);
    if (threadIdx.x == 0) fetch_norms(l + 1);
    grid_wait(arrivals, target);
    prof.lap(6);

    // C: O projection into the residual stream.
    if (threadIdx.x == 0) res.embed = l == 0 ? f.embed : nullptr;  // (ordered by the stage's barrier)
    stage_plain(a.out, M, q_dim, s_a);
    prof.lap(7);
    gemv_phase<kMaxM, Out::kAddResidual>(st, cur, 1, M, s_a, f.x, H, &res);
    prof.lap(8);
    grid_sync(arrivals, target);
    prof.lap(9);

    // E: post-attention RMSNorm + gate/up + SiLU-mul.
    stage_norm<kMaxM>(f.x, nullptr, nw + H, M, H, a.eps, s_a, scratch);
    prof.lap(10);
    gemv_phase<kMaxM, Out::kSiluMul>(st, cur, 2, M, s_a, f.act, I, nullptr);
    prof.lap(11);
    grid_sync(arrivals, target);
    prof.lap(12);

    // F: down projection into the residual stream.
    if (l + 1 == L) dev::allow_next_kernel();
    if (threadIdx.x == 0) res.embed = nullptr;
    stage_plain(f.act, M, I, s_a);
    prof.lap(13);
    gemv_phase<kMaxM, Out::kAddResidual>(st, cur, 3, M, s_a, f.x, H, &res);
    prof.lap(14);
    if (l + 1 < L) grid_sync(arrivals, target);
    prof.lap(15);
  }
  prof.flush(f.profile ? global_ns() - ns0 : 0, cur.wait_cycles);
}

// The kernel for (M, head_dim, group), or null.
template <int kMaxM, int kHeadDim>
const void* kernel_for_group(int group) {
  switch (group) {
    case 1: return reinterpret_cast<const void*>(fused_decode_kernel<kMaxM, kHeadDim, 1>);
    case 2: return reinterpret_cast<const void*>(fused_decode_kernel<kMaxM, kHeadDim, 2>);
    case 4: return reinterpret_cast<const void*>(fused_decode_kernel<kMaxM, kHeadDim, 4>);
    case 8: return reinterpret_cast<const void*>(fused_decode_kernel<kMaxM, kHeadDim, 8>);
    default: return nullptr;
  }
}
template <int kMaxM>
const void* kernel_for(int head_dim, int group) {
  if (head_dim == 64) return kernel_for_group<kMaxM, 64>(group);
  if (head_dim == 128) return kernel_for_group<kMaxM, 128>(group);
  return nullptr;
}

const void* select_kernel(int M, int head_dim, int group) {
  return M == 1 ? kernel_for<1>(head_dim, group) : kernel_for<kFusedDecodeMaxRows>(head_dim, group);
}

}  // namespace

bool fused_decode_supported(int num_heads, int num_kv_heads, int head_dim, int hidden, int inter, int M) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || M < 1 || M > kFusedDecodeMaxRows) return false;
  if (kSyncCounters + M * num_kv_heads > kFusedDecodeSyncWords) return false;
  if (select_kernel(M, head_dim, num_heads / num_kv_heads) == nullptr) return false;
  return hidden % 256 == 0 && inter % 256 == 0 && (num_heads * head_dim) % 256 == 0;
}

cudaError_t launch_fused_decode(FusedDecodeArgs f, int sm_count, LaunchConfig launch) {
  const AttentionArgs& a = f.attn;
  if (!fused_decode_supported(a.num_heads, a.num_kv_heads, a.head_dim, f.hidden, f.inter, f.M) ||
      a.partition_tokens != kP || f.layer_stride % 8 != 0 || sm_count < 1)
    return cudaErrorInvalidValue;
  const void* kernel = select_kernel(f.M, a.head_dim, a.num_heads / a.num_kv_heads);
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaFuncAttributes attr{};
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;

  // Shared memory: mbarriers, norm weights (two layers), the staged input
  // rows, the CTA's residual rows, one partition of K and V, then the weight slots.
  auto align = [](int v) { return (v + 127) / 128 * 128; };
  const int q_dim = a.num_heads * a.head_dim;
  const int max_k = std::max({f.hidden, q_dim, f.inter});
  const int rows_cap = f.M == 1 ? 1 : kFusedDecodeMaxRows;
  const int per_cta_hidden = (f.hidden + sm_count - 1) / sm_count;
  f.off_norms = kBarBytes;
  f.off_stage = f.off_norms + align(2 * (2 * f.hidden + 2 * a.head_dim) * static_cast<int>(sizeof(bf16)));
  f.off_own = f.off_stage + align(rows_cap * max_k * static_cast<int>(sizeof(bf16)));
  f.off_kv = f.off_own + align(rows_cap * per_cta_hidden * static_cast<int>(sizeof(bf16)));
  f.off_slots = f.off_kv + align(2 * kP * (a.head_dim + kRowPad) * static_cast<int>(sizeof(bf16)));
  const int avail = optin - static_cast<int>(attr.sharedSizeBytes) - f.off_slots;
  // Row bytes per phase (gate/up: a gate row and an up row).
  const int qkv_cols = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim;
  const int rows[kPhases] = {qkv_cols, f.hidden, f.inter, f.hidden};
  const int row_bytes[kPhases] = {f.hidden * 2, q_dim * 2, 2 * f.hidden * 2, f.inter * 2};
  const int widest = *std::max_element(row_bytes, row_bytes + kPhases);
  f.slot_bytes = 0;
  for (int kb : {48, 40, 32, 24, 16}) {
    const int bytes = kb * 1024;
    if (bytes >= widest && avail / bytes >= 3) {
      f.slot_bytes = bytes;
      break;
    }
  }
  if (f.slot_bytes == 0 && avail / widest >= 2) f.slot_bytes = widest;
  if (f.slot_bytes == 0) return cudaErrorInvalidValue;
  f.num_slots = std::min(kMaxSlots, avail / f.slot_bytes);
  for (int p = 0; p < kPhases; ++p) {
    const int per_cta = (rows[p] + sm_count - 1) / sm_count;
    int r = std::min(per_cta, f.slot_bytes / row_bytes[p]);
    if (r >= kWarps) r = r / kWarps * kWarps;
    f.chunk_rows[p] = std::max(r, 1);
  }
  const int dynamic = f.off_slots + f.num_slots * f.slot_bytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic);
  if (err != cudaSuccess) return err;

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(sm_count));
  cfg.blockDim = dim3(kBlockThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(dynamic);
  cfg.stream = launch.stream;
  // Every CTA must be resident at once (the grid barriers): a cooperative launch.
  cudaLaunchAttribute attrs[1]{};
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  void* args[] = {&f};
  err = cudaLaunchKernelExC(&cfg, kernel, args);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace siesta::cuda
