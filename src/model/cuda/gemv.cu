// Small-batch projections (decode): y[m, n] = sum_k a[m, k] * w[n, k], M <= 8.
//
// At these sizes the weights are the whole cost, so each warp streams whole
// weight rows with 16-byte loads (several in flight per lane) against the M
// input rows staged once per CTA in shared memory. The staging step applies
// the preceding RMSNorm or SiLU-mul, and the store can add into the residual
// stream, which saves three launches per layer in decode. As the LM head it can
// also leave each row's first maximum for sampling (GemvArgs::argmax), so that
// greedy sampling does not read the logits again.
#include <cuda_bf16.h>

#include <atomic>
#include <cmath>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"

namespace siesta::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// 16-byte weight loads in flight per lane and column: with one column per
// warp, a whole row of up to 3072 bf16 (the decode projections of Qwen3-0.6B)
// is requested at once, before the kernel waits for its input.
template <int C>
constexpr int unroll_for() {
  return C == 1 ? 12 : 4;
}
// CTAs of the largest-C kernel that fit on an SM at once (128 registers per thread).
constexpr int kCtasPerSm = 2;
// Dynamic shared memory of a CTA (two share an SM): M input rows and a norm row
// of up to 6144 bf16 at M = 8 (Qwen3-1.7B's intermediate size).
constexpr size_t kMaxSmem = 112 * 1024;

using dev::load8;
using dev::round_bf16;
using dev::store8;

// Dynamic shared memory: the M staged input rows, then (RMSNorm input) the
// norm weights, copied there before the kernel waits for the previous one.
size_t gemv_smem(const GemvArgs& a) {
  return (static_cast<size_t>(a.M) + (a.input_kind == GemvInput::kRmsNorm ? 1 : 0)) * a.K * sizeof(bf16);
}

template <int M>
__device__ void stage_input(const GemvArgs& a, bf16* s_a) {
  __shared__ float scratch[32];
  const int K = a.K, chunks = K / 8;
  if (a.input_kind == GemvInput::kRmsNorm) {
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
    float rs[M];
#pragma unroll
    for (int m = 0; m < M; ++m) rs[m] = rsqrtf(dev::block_sum(ss[m], scratch) / static_cast<float>(K) + a.eps);
    const bf16* s_norm = s_a + M * K;  // copied before the wait (gemv_kernel)
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
        store8(s_a + m * K + c * 8, f);
      }
    }
  } else if (a.input_kind == GemvInput::kSiluMul) {
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float g[8], u[8];
        load8(a.input + static_cast<size_t>(m) * 2 * K + c * 8, g);
        load8(a.input + static_cast<size_t>(m) * 2 * K + K + c * 8, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = round_bf16(g[e] / (1.0f + expf(-g[e]))) * u[e];
        store8(s_a + m * K + c * 8, g);
      }
    }
  } else {
    for (int c = threadIdx.x; c < chunks; c += kThreads)
#pragma unroll
      for (int m = 0; m < M; ++m)
        reinterpret_cast<uint4*>(s_a + m * K)[c] = reinterpret_cast<const uint4*>(a.input + static_cast<size_t>(m) * K)[c];
  }
  __syncthreads();
}

// Whether the kernel reads its residual values right after the wait (they fit
// in the registers of every (M, C) but the largest).
template <int M, int C>
constexpr bool kEarlyResidual = M * C <= 16;

// resid: lane m's out[m, n0 + c] before the kernel (kAddBf16), loaded early.
template <int M, int C>
__device__ __forceinline__ void store_rows(const GemvArgs& a, int n0, int lane, float (&acc)[C][M],
                                           const float (&resid)[C]) {
  unsigned long long best = 0;  // lane m: the largest argmax key of row m among the warp's columns
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int n = n0 + c;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = dev::warp_sum(acc[c][m]);
      if (lane == m && n < a.N) {
        const size_t idx = static_cast<size_t>(m) * a.N + n;
        if (a.output_kind == GemvOutput::kLogits) {
          const float logit = round_bf16(v);
          static_cast<float*>(a.out)[idx] = logit;
          best = max(best, dev::argmax_key(logit, n));
        } else if (a.output_kind == GemvOutput::kAddBf16) {
          bf16* y = static_cast<bf16*>(a.out);
          const float r = kEarlyResidual<M, C> ? resid[c] : __bfloat162float(y[idx]);
          y[idx] = __float2bfloat16(r + round_bf16(v));
        } else {
          static_cast<bf16*>(a.out)[idx] = __float2bfloat16(v);
        }
      }
    }
  }
  // Most warps find a larger key already there: one L2 read, no atomic.
  if (a.argmax && lane < M && best > __ldcg(a.argmax + lane)) atomicMax(a.argmax + lane, best);
}

// One row with two columns per warp (decode at batch 1: the QKV projection of
// Qwen3-0.6B) fits in 80 registers: then an SM keeps room beside two of its
// CTAs for the next kernel's (decode attention), which start their own copies
// before this kernel ends (0.80 -> 0.765 ms per token at batch 1 on the H200).
// The other shapes spill at 80 and keep 128.
template <int M, int C>
__global__ __launch_bounds__(kThreads, M == 1 && C == 2 ? 3 : 2) void gemv_kernel(GemvArgs a) {
  constexpr int kUnroll = unroll_for<C>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* s_a = reinterpret_cast<bf16*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * kWarps + warp) * C;
  const int K = a.K, chunks = K / 8;  // chunks % 32 == 0 (K % 256 == 0)
  const uint4* wrow[C];
#pragma unroll
  for (int c = 0; c < C; ++c)
    wrow[c] = reinterpret_cast<const uint4*>(a.weight + static_cast<size_t>(min(n0 + c, a.N - 1)) * K);

  // The first weight loads do not depend on the previous kernel: issue them
  // before waiting for it, so they overlap its tail (and the launch gap).
  if (!a.release_after_wait) dev::allow_next_kernel();
  dev::trace_start(a.trace);
  uint4 w[C][kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int ch = lane + 32 * u;
#pragma unroll
    for (int c = 0; c < C; ++c) w[c][u] = ch < chunks ? __ldg(wrow[c] + ch) : make_uint4(0, 0, 0, 0);
  }
  if (a.input_kind == GemvInput::kRmsNorm) {  // the norm weights, to shared memory
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(s_a + M * K + c * 8));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(a.norm_weight + c * 8) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  dev::wait_for_previous_kernel();
  if (a.release_after_wait) dev::allow_next_kernel();
  dev::trace_waited(a.trace);
  // The residual values this warp adds into, read now: the read overlaps the
  // staging (where registers allow; else store_rows reads them).
  float resid[C];
#pragma unroll
  for (int c = 0; c < C; ++c)
    resid[c] = kEarlyResidual<M, C> && a.output_kind == GemvOutput::kAddBf16 && lane < M && n0 + c < a.N
                   ? __bfloat162float(static_cast<const bf16*>(a.out)[static_cast<size_t>(lane) * a.N + n0 + c])
                   : 0.0f;
  stage_input<M>(a, s_a);
  if (n0 >= a.N) return;

  float acc[C][M];
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;

  for (int base = lane;;) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int ch = base + 32 * u;
      if (ch < chunks) {
        float wf[C][8];
#pragma unroll
        for (int c = 0; c < C; ++c) dev::unpack8(w[c][u], wf[c]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float x[8];
          dev::unpack8(reinterpret_cast<const uint4*>(s_a + m * K)[ch], x);
#pragma unroll
          for (int c = 0; c < C; ++c)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[c][m] += wf[c][e] * x[e];
        }
      }
    }
    base += 32 * kUnroll;
    if (base >= chunks) break;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int ch = base + 32 * u;
#pragma unroll
      for (int c = 0; c < C; ++c) w[c][u] = ch < chunks ? __ldg(wrow[c] + ch) : make_uint4(0, 0, 0, 0);
    }
  }

  store_rows<M, C>(a, n0, lane, acc, resid);
  dev::trace_mark(a.trace, kTraceEnd);
}

template <int M, int C>
cudaError_t launch_mc(const GemvArgs& a, const LaunchConfig& launch) {
  const int cols_per_cta = kWarps * C;
  const int grid = (a.N + cols_per_cta - 1) / cols_per_cta;
  const size_t smem = gemv_smem(a);
  static const cudaError_t attr = cudaFuncSetAttribute(gemv_kernel<M, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(kMaxSmem));
  if (attr != cudaSuccess) return attr;
  return launch_kernel(gemv_kernel<M, C>, grid, kThreads, smem, launch, a);
}

int sm_count() {
  static std::atomic<int> counts[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) return 132;
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

template <int M>
cudaError_t launch_m(const GemvArgs& a, const LaunchConfig& launch) {
  // Columns per warp: as few as keep every CTA resident at once (one wave), so
  // that every weight load of the kernel can go out before it waits for the
  // previous one; a second wave would start its loads only after the first.
  // Beyond three (the LM head) the kernel runs in waves of two columns per warp.
  const int slots = kCtasPerSm * sm_count() * kWarps;
  if (a.N <= slots) return launch_mc<M, 1>(a, launch);
  if (a.N <= 2 * slots || a.N > 3 * slots) return launch_mc<M, 2>(a, launch);
  return launch_mc<M, 3>(a, launch);
}

}  // namespace

bool gemv_supported(int M, int K) {
  return M >= 1 && M <= kGemvMaxRows && K > 0 && K % 256 == 0 &&
         static_cast<size_t>(M + 1) * K * sizeof(bf16) <= kMaxSmem;
}

cudaError_t launch_gemv(const GemvArgs& a, LaunchConfig launch) {
  if (!gemv_supported(a.M, a.K) || a.N <= 0) return cudaErrorInvalidValue;
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
