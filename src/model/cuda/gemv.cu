// Small-batch projections (decode): y[m, n] = sum_k a[m, k] * w[n, k], M <= 8.
//
// At these sizes the weights are the whole cost, so the CTAs stream the weight
// rows with 16-byte loads (8 to 12 in flight per lane) against the M input rows
// staged once per CTA in shared memory, and multiply on tensor cores. The
// staging step applies the preceding RMSNorm or SiLU-mul, and the store can add
// into the residual stream, which saves three launches per layer in decode. As
// the LM head it can also leave each row's first maximum for sampling
// (GemvArgs::argmax), so that greedy sampling does not read the logits again.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"

namespace siesta::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
static_assert(kWarps == kProjectionSegments, "canonical: a warp's slice of K is one segment");
// CTAs of the largest-T kernel that fit on an SM at once (128 registers per thread).
constexpr int kCtasPerSm = 2;
// Dynamic shared memory of a CTA (two share an SM): M input rows and a norm row
// of up to 6144 bf16 at M = 8 (Qwen3-1.7B's intermediate size).
constexpr size_t kMaxSmem = 112 * 1024;
// bf16 after each staged input row: the 8 rows that an MMA step reads take the
// fewest shared-memory wavefronts (the canonical order's two 8-byte reads per
// lane span 32 bytes of a row, the other order's 16-byte read 64).
__host__ __device__ constexpr int row_pad(bool canonical) { return canonical ? 16 : 32; }

using dev::load8;
using dev::round_bf16;
using dev::store8;

// Dynamic shared memory: the M staged input rows of K + row_pad, then (RMSNorm
// input) the norm weights, copied there before the kernel waits for the
// previous one; at the end the warps' sums, in the staged rows' place (or,
// when the CTA loops over weight rows, after them).
__host__ __device__ inline size_t gemv_stage_bytes(const GemvArgs& a) {
  const size_t staged =
      (static_cast<size_t>(a.M) * (a.K + row_pad(a.canonical)) + (a.input_kind == GemvInput::kRmsNorm ? a.K : 0)) *
      sizeof(bf16);
  return (staged + 15) / 16 * 16;
}
size_t gemv_smem(const GemvArgs& a, bool loop) {
  const size_t red = static_cast<size_t>(kWarps) * a.M * 8 * 3 * sizeof(float);
  return loop ? gemv_stage_bytes(a) + red : std::max(gemv_stage_bytes(a), red);
}

// Block-wide sums of M values at once, each in dev::block_sum's order (warp
// butterflies, then the warp totals in warp order), behind one barrier.
template <int M>
__device__ __forceinline__ void block_sums(float (&v)[M]) {
  __shared__ float scratch[M][kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < M; ++m) v[m] = dev::warp_sum(v[m]);
  if (lane == 0)
#pragma unroll
    for (int m = 0; m < M; ++m) scratch[m][warp] = v[m];
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[m][w];
    v[m] = total;
  }
}

// Stages the M input rows into s_a (rows `stride` bf16 apart), transformed by
// the input kind; the norm weights, if any, are at s_a + M * stride. kSilu:
// whether the instance takes GemvInput::kSiluMul (the looping one does not:
// its next weights are already held in registers while it stages).
template <int M, bool kSilu>
__device__ void stage_input(const GemvArgs& a, bf16* s_a, int stride) {
  const int K = a.K, chunks = K / 8;
  if (M == 1 && a.input_kind == GemvInput::kRmsNorm && chunks <= kThreads) {
    // One row of at most 8 kThreads values (Qwen3-0.6B's hidden size is 1024):
    // a chunk per thread, held in registers from its one load to its store, so
    // that the norm does not read the row a second time, which L1 had not kept
    // (timings: bench/results/cuda_choices.md). The same arithmetic.
    const int c = threadIdx.x;
    const uint4 raw = c < chunks ? reinterpret_cast<const uint4*>(a.input)[c] : make_uint4(0, 0, 0, 0);
    float ss[1] = {0.0f};
    float f[8];
    dev::unpack8(raw, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss[0] += f[e] * f[e];
    block_sums<1>(ss);
    const float rs = rsqrtf(ss[0] / static_cast<float>(K) + a.eps);
    const bf16* s_norm = s_a + stride;  // copied before the wait (gemv_kernel)
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    if (c < chunks) {
      float w[8];
      load8(s_norm + c * 8, w);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = w[e] * round_bf16(f[e] * rs);
      store8(s_a + c * 8, f);
    }
  } else if (a.input_kind == GemvInput::kRmsNorm) {
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float f[8];
        load8(a.input + static_cast<size_t>(m) * K + c * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[m] += f[e] * f[e];
      }
    }
    block_sums<M>(ss);
    float rs[M];
#pragma unroll
    for (int m = 0; m < M; ++m) rs[m] = rsqrtf(ss[m] / static_cast<float>(K) + a.eps);
    const bf16* s_norm = s_a + M * stride;  // copied before the wait (gemv_kernel)
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      float w[8];
      load8(s_norm + c * 8, w);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float f[8];
        load8(a.input + static_cast<size_t>(m) * K + c * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = w[e] * round_bf16(f[e] * rs[m]);
        store8(s_a + m * stride + c * 8, f);
      }
    }
  } else if (kSilu && a.input_kind == GemvInput::kSiluMul && M == 1) {
    // One row (the down projection at batch 1, K = 3072 in Qwen3-0.6B): both
    // chunks of a thread are loaded before either is stored, one round trip to
    // the cache instead of two (timings: bench/results/cuda_choices.md). The same arithmetic per
    // value as the loop below.
    for (int c0 = threadIdx.x; c0 < chunks; c0 += 2 * kThreads) {
      const int c1 = c0 + kThreads;
      const uint4* in = reinterpret_cast<const uint4*>(a.input);
      const uint4 g0 = in[c0], u0 = in[K / 8 + c0];
      uint4 g1 = make_uint4(0, 0, 0, 0), u1 = g1;
      if (c1 < chunks) {
        g1 = in[c1];
        u1 = in[K / 8 + c1];
      }
      auto act = [&](const uint4& gr, const uint4& ur, int c) {
        float g[8], u[8];
        dev::unpack8(gr, g);
        dev::unpack8(ur, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = round_bf16(dev::silu(g[e])) * u[e];
        store8(s_a + c * 8, g);
      };
      act(g0, u0, c0);
      if (c1 < chunks) act(g1, u1, c1);
    }
  } else if (kSilu && a.input_kind == GemvInput::kSiluMul) {
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float g[8], u[8];
        load8(a.input + static_cast<size_t>(m) * 2 * K + c * 8, g);
        load8(a.input + static_cast<size_t>(m) * 2 * K + K + c * 8, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = round_bf16(dev::silu(g[e])) * u[e];
        store8(s_a + m * stride + c * 8, g);
      }
    }
  } else {
    for (int c = threadIdx.x; c < chunks; c += kThreads)
#pragma unroll
      for (int m = 0; m < M; ++m)
        reinterpret_cast<uint4*>(s_a + m * stride)[c] = reinterpret_cast<const uint4*>(a.input + static_cast<size_t>(m) * K)[c];
  }
  __syncthreads();
}

// The projection on tensor cores: mma.m16n8k16 with the input rows as A
// (rows 0..M-1 of 16) and eight weight rows as B. A CTA takes 8 * T weight
// rows over the whole of K; its warp w takes k in [w K / 8, (w + 1) K / 8) of
// every one of them, 32 k per step: lane (g, q) = (lane / 4, lane % 4) loads
// the 16 bytes of weight row g at k + 8q, which are the B fragments of two
// MMAs as they are (the k order inside an MMA is a free choice, made the same
// for A), and the input row g at the same k from shared memory. So the input
// is read from shared memory once per 8 weight rows, not once per row, and no
// weight is converted to fp32: two MMAs per 16 weight bytes of each lane, where
// fp32 FMAs with one weight row per warp took ~140 instructions at M = 8
// (timings: bench/results/cuda_choices.md). The warps' partial sums meet in shared memory and are
// added in warp order. A value depends on its row of A, its weight row, K and
// whether T is 1 (one tile sums in two chains, below, unless canonical) only:
// not on M or the grid.
// T follows from N alone, so a projection's values do not change with the batch.
//
// Canonical (GemvArgs::canonical; kernels.h: kProjectionSegments): each k16
// MMA takes one natural k16 block. Lane q's 16 bytes at k + 8q hold k in
// [8q, 8q + 8) of the 32-k step, so lanes q and q ^ 2 exchange half of them (two
// shuffles): the first MMA gets k 0-3, 8-11 (lanes 0, 1, their own), 4-7, 12-15
// (lanes 2, 3, received), the second k 16-31 the same way, and each lane reads
// its input at those k, two 8-byte reads. A warp's slice of K is one segment,
// one chain (at T = 1 too), and the warps' sums are added in warp order.
//
// GemvOutput::kSiluMul: the CTA's 8 T weight rows are gate rows j0 .. j0 + 4T - 1
// and then the up rows of the same j, so that it writes act[m, j] itself
// (instead of every CTA of the down projection computing all of act in its
// staging, GemvInput::kSiluMul).
//
// At M = 1, T = 2 (the QKV projection of Qwen3-0.6B at batch 1) it fits in
// 80 registers: then an SM keeps room beside two of its CTAs for the next
// kernel's (decode attention), which start their own copies before this one ends.
//
// kLoop (the LM head from 2 rows on, whose grid would take many waves): a grid
// of one wave, each CTA stages its input rows once and takes every gridDim.x-th
// group of 8 T weight rows, loading the next group's weights before it reduces
// and stores the current one's. The same arithmetic per value.
template <int M, int T, bool kLoop, bool kCanon>
__device__ __forceinline__ void gemv_body(const GemvArgs& a) {
  // 32-k steps per batch of loads (T * kSteps 16-byte loads in flight per
  // lane); 4 steps are a warp's whole slice at K = 1024 (Qwen3-0.6B's hidden size).
  constexpr int kSteps = T == 1 ? 12 : 4;
  constexpr int kCols = 8 * T;
  static_assert(M * kCols <= kThreads, "one output per thread");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int K = a.K, stride = K + row_pad(kCanon);
  bf16* s_a = reinterpret_cast<bf16*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const bool silu = a.output_kind == GemvOutput::kSiluMul;
  constexpr int kPairs = 4 * T;                         // kSiluMul: (gate, up) column pairs of a CTA
  const int half = a.N / 2;                             // kSiluMul: rows of gate, and of up
  int n0 = blockIdx.x * (silu ? kPairs : kCols);  // kSiluMul: j0
  const int k0 = warp * (K / kWarps), steps = K / kWarps / 32;  // K % 256 == 0
  const uint4* wrow[T];  // lane (g, q)'s 16 bytes of tile t at step s: wrow[t] + 4 s
  auto point_weights = [&](int first) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int c = 8 * t + g;  // the CTA's column
      const int n =
          !silu ? min(first + c, a.N - 1) : c < kPairs ? min(first + c, half - 1) : half + min(first + c - kPairs, half - 1);
      wrow[t] = reinterpret_cast<const uint4*>(a.weight + static_cast<size_t>(n) * K + k0 + 8 * q);
    }
  };
  point_weights(n0);

  // The timeline (kernels.h: kTraceCtas), recorded at batch 1 only; not
  // compiled for more rows (registers).
  unsigned long long* const trace = M == 1 ? a.trace : nullptr;
  // The first weight loads do not depend on the previous kernel: issue them
  // before waiting for it, so they overlap its tail (and the launch gap). The
  // next kernel may start now as well (with the O and down projections at
  // batch 1 in 96 registers, earlier than after the wait: bench/results/cuda_choices.md).
  dev::allow_next_kernel();
  dev::trace_start(trace);
  uint4 w[T][kSteps];
  // The weights leave L2 first: each pass reads them once, and L2 keeps what
  // the kernels write and read back. Keeping the LM head in L2 across steps
  // and prefetching the next kernels' weights measured slower
  // (bench/results/cuda_choices.md).
  const uint64_t l2_policy = dev::l2_evict_first_policy();
  auto load_weights = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u)
#pragma unroll
      for (int t = 0; t < T; ++t)
        w[t][u] = s0 + u < steps ? dev::load_weight16(wrow[t] + 4 * (s0 + u), l2_policy) : make_uint4(0, 0, 0, 0);
  };
  load_weights(0);
  if (a.input_kind == GemvInput::kRmsNorm) {  // the norm weights, to shared memory
    for (int c = threadIdx.x; c < K / 8; c += kThreads) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(s_a + M * stride + c * 8));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(a.norm_weight + c * 8) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  dev::wait_for_previous_kernel();
  dev::trace_waited(trace);
  // Thread i stores output (i / cols, n0 + i % cols); its residual value is
  // read now, beside the staging (kLoop: no residual).
  const int cols = silu ? kPairs : kCols, out_width = silu ? half : a.N;
  const int out_m = threadIdx.x / cols, out_c = threadIdx.x % cols;
  // Kept as bf16 until the store: converted where it was loaded, the
  // conversion made every thread wait for that load before its staging.
  const size_t first_idx = static_cast<size_t>(out_m) * out_width + n0 + out_c;
  bf16 resid{};
  if (!kLoop && out_m < M && n0 + out_c < out_width && a.output_kind == GemvOutput::kAddBf16)
    resid = static_cast<const bf16*>(a.out)[first_idx];
  stage_input<M, !kLoop>(a, s_a, stride);
  dev::trace_mark(trace, 3);  // staged
  // The warps' sums, [warp][m][column]: over the staged input (every warp is
  // done with it after a barrier), or after it when the CTA loops.
  float* red = reinterpret_cast<float*>(smem_raw + (kLoop ? gemv_stage_bytes(a) : 0));
  __shared__ unsigned long long best[kGemvMaxRows];  // each row's largest argmax key in this CTA
  if (a.argmax && threadIdx.x < M) best[threadIdx.x] = 0;
  // Lanes of rows g >= M read row M - 1: valid data, whose results are not stored.
  const bf16* xrow = s_a + min(g, M - 1) * stride + k0 + 8 * q;
  // Canonical: the k of lane q in the step's first and second k16 block.
  const bf16* xrow_lo = s_a + min(g, M - 1) * stride + k0 + (q < 2 ? 8 * q : 8 * (q - 2) + 4);
  const bf16* xrow_hi = xrow_lo + 16;

  for (;;) {
    // One weight tile (T = 1): the low and high halves of each 16-byte step in
    // two accumulators, added at the end, so that the MMAs form two dependent
    // chains instead of one (the O and down projections at batch 1 take one
    // tile; timings: bench/results/cuda_choices.md).
    // More tiles are independent chains already (and their registers are spent).
    constexpr bool kTwoChains = T == 1 && !kCanon;
    float acc[T][4], acc_hi[T][4];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][e] = acc_hi[t][e] = 0.0f;
    for (int s0 = 0;;) {
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        if (s0 + u < steps) {
          if constexpr (kCanon) {
            const uint2 xl = *reinterpret_cast<const uint2*>(xrow_lo + (s0 + u) * 32);
            const uint2 xh = *reinterpret_cast<const uint2*>(xrow_hi + (s0 + u) * 32);
            const uint32_t lo[4] = {xl.x, 0u, xl.y, 0u}, hi[4] = {xh.x, 0u, xh.y, 0u};
            const bool low = q < 2;
#pragma unroll
            for (int t = 0; t < T; ++t) {
              const uint4 v = w[t][u];
              const uint32_t r0 = __shfl_xor_sync(0xffffffffu, low ? v.z : v.x, 2);
              const uint32_t r1 = __shfl_xor_sync(0xffffffffu, low ? v.w : v.y, 2);
              dev::mma_bf16(acc[t], lo, low ? v.x : r0, low ? v.y : r1);
              dev::mma_bf16(acc[t], hi, low ? r0 : v.z, low ? r1 : v.w);
            }
          } else {
            const uint4 x = *reinterpret_cast<const uint4*>(xrow + (s0 + u) * 32);
            const uint32_t lo[4] = {x.x, 0u, x.y, 0u}, hi[4] = {x.z, 0u, x.w, 0u};
#pragma unroll
            for (int t = 0; t < T; ++t) {
              dev::mma_bf16(acc[t], lo, w[t][u].x, w[t][u].y);
              dev::mma_bf16(kTwoChains ? acc_hi[t] : acc[t], hi, w[t][u].z, w[t][u].w);
            }
          }
        }
      }
      s0 += kSteps;
      if (s0 >= steps) break;
      load_weights(s0);
    }
    // kLoop: the next group's first loads go out before this group's reduction.
    const int next = n0 + gridDim.x * kCols;
    if (kLoop && next < a.N) {
      point_weights(next);
      load_weights(0);
    }
    if constexpr (kTwoChains)
#pragma unroll
      for (int t = 0; t < T; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) acc[t][e] += acc_hi[t][e];
    dev::trace_mark(trace, 4);  // the products done
    const int out_n = n0 + out_c;
    const bool stores = out_m < M && out_n < out_width;
    const size_t out_idx = static_cast<size_t>(out_m) * out_width + out_n;
    __syncthreads();
    if (g < M)
#pragma unroll
      for (int t = 0; t < T; ++t) {
        red[(warp * M + g) * kCols + 8 * t + 2 * q] = acc[t][0];
        red[(warp * M + g) * kCols + 8 * t + 2 * q + 1] = acc[t][1];
      }
    __syncthreads();
    dev::trace_mark(trace, 5);  // the warps' sums in shared memory
    if (stores) {
      float v = 0.0f;
#pragma unroll
      for (int w8 = 0; w8 < kWarps; ++w8) v += red[(w8 * M + out_m) * kCols + out_c];
      if (silu) {
        float u = 0.0f;
#pragma unroll
        for (int w8 = 0; w8 < kWarps; ++w8) u += red[(w8 * M + out_m) * kCols + kPairs + out_c];
        const float gate = round_bf16(v);
        static_cast<bf16*>(a.out)[out_idx] = __float2bfloat16(round_bf16(dev::silu(gate)) * round_bf16(u));
      } else if (a.output_kind == GemvOutput::kLogits) {
        const float logit = round_bf16(v);
        static_cast<float*>(a.out)[out_idx] = logit;
        if (a.argmax) atomicMax(&best[out_m], dev::argmax_key(logit, out_n));
      } else if (a.output_kind == GemvOutput::kAddBf16) {
        static_cast<bf16*>(a.out)[out_idx] = __float2bfloat16(__bfloat162float(resid) + round_bf16(v));
      } else {
        static_cast<bf16*>(a.out)[out_idx] = __float2bfloat16(v);
      }
    }
    if (!kLoop || next >= a.N) break;
    n0 = next;
  }
  if (a.argmax) {
    __syncthreads();
    // Most CTAs find a larger key already there: one L2 read, no atomic.
    if (threadIdx.x < M && best[threadIdx.x] > __ldcg(a.argmax + threadIdx.x))
      atomicMax(a.argmax + threadIdx.x, best[threadIdx.x]);
  }
  dev::trace_mark(trace, kTraceEnd);
}

template <int M, int T, bool kLoop, bool kCanon>
__global__ __launch_bounds__(kThreads, M == 1 && T == 2 ? 3 : 2) void gemv_kernel(GemvArgs a) {
  gemv_body<M, T, kLoop, kCanon>(a);
}
// One row and one tile per CTA (the O and down projections at batch 1) in at
// most 96 registers: then two CTAs of the 80-register instance (the next
// layer's QKV projection) fit beside one of these in an SM's register file, so
// that all of them start, and load their weights, before this kernel ends.
template <bool kCanon>
__global__ __maxnreg__(96) void gemv_kernel_one_tile(GemvArgs a) {
  gemv_body<1, 1, false, kCanon>(a);
}

template <int M, int T, bool kLoop, bool kCanon>
cudaError_t launch_grid(const GemvArgs& a, const LaunchConfig& launch, int grid) {
  auto* const kernel = [] {
    if constexpr (M == 1 && T == 1 && !kLoop)
      return gemv_kernel_one_tile<kCanon>;
    else
      return gemv_kernel<M, T, kLoop, kCanon>;
  }();
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMaxSmem));
  if (attr != cudaSuccess) return attr;
  return launch_kernel(kernel, grid, kThreads, gemv_smem(a, kLoop), launch, a);
}

template <int M, int T, bool kCanon>
cudaError_t launch_mt(const GemvArgs& a, const LaunchConfig& launch) {
  const int cols_per_cta = a.output_kind == GemvOutput::kSiluMul ? 4 * T : 8 * T;  // kSiluMul: 4T of gate, 4T of up
  const int cols = a.output_kind == GemvOutput::kSiluMul ? a.N / 2 : a.N;
  const int grid = (cols + cols_per_cta - 1) / cols_per_cta;
  // More CTAs than one wave (the LM head): from 2 rows on, one wave of CTAs
  // that loop; at batch 1 that measured slower (bench/results/cuda_choices.md).
  const int wave = kCtasPerSm * sm_count();
  if constexpr (T == 2 && M > 1) {
    if (grid > wave && (a.output_kind == GemvOutput::kLogits || a.output_kind == GemvOutput::kBf16) &&
        a.input_kind != GemvInput::kSiluMul && gemv_smem(a, true) <= kMaxSmem)
      return launch_grid<M, T, true, kCanon>(a, launch, wave);
  }
  return launch_grid<M, T, false, kCanon>(a, launch, grid);
}

template <int M, bool kCanon>
cudaError_t launch_mc(const GemvArgs& a, const LaunchConfig& launch) {
  // Weight rows per CTA (8 T): as few as keep every CTA resident at once (one
  // wave), so that every weight load of the kernel can go out before it waits
  // for the previous one; a second wave would start its loads only after the
  // first. Beyond three (the LM head) the kernel runs in waves of T = 2.
  const int rows = kCtasPerSm * sm_count() * 8;
  if (a.N <= rows) return launch_mt<M, 1, kCanon>(a, launch);
  if (a.N <= 2 * rows || a.N > 3 * rows) return launch_mt<M, 2, kCanon>(a, launch);
  return launch_mt<M, 3, kCanon>(a, launch);
}
template <int M>
cudaError_t launch_m(const GemvArgs& a, const LaunchConfig& launch) {
  return a.canonical ? launch_mc<M, true>(a, launch) : launch_mc<M, false>(a, launch);
}

}  // namespace

bool gemv_supported(int M, int K) {
  return M >= 1 && M <= kGemvMaxRows && K > 0 && K % 256 == 0 &&
         (static_cast<size_t>(M) * (K + row_pad(false)) + K) * sizeof(bf16) <= kMaxSmem;
}

cudaError_t launch_gemv(const GemvArgs& a, LaunchConfig launch) {
  if (!gemv_supported(a.M, a.K) || a.N <= 0 || (a.output_kind == GemvOutput::kSiluMul && a.N % 2 != 0))
    return cudaErrorInvalidValue;
  switch (a.M) {
    case 1: return launch_m<1>(a, launch);
    case 2: return launch_m<2>(a, launch);
    case 3: return launch_m<3>(a, launch);
    case 4: return launch_m<4>(a, launch);
    case 5: return launch_m<5>(a, launch);
    case 6: return launch_m<6>(a, launch);
    case 7: return launch_m<7>(a, launch);
    default: return launch_m<8>(a, launch);
  }
}

}  // namespace siesta::cuda
