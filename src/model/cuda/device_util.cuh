// Device-side helpers shared by the kernels (.cu files only).
#pragma once

#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "model/cuda/kernels.h"

namespace siesta::cuda {

// Launches kernel as `launch` says (kernels.h: LaunchConfig), in thread-block
// clusters of `cluster` CTAs along x where cluster > 1 (grid.x a multiple of
// it), then reports the launch error.
template <class... KernelArgs, class... Args>
cudaError_t launch_kernel_cluster(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                                  const LaunchConfig& launch, int cluster, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = launch.stream;
  cudaLaunchAttribute attrs[2] = {};
  unsigned n = 0;
  if (cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = static_cast<unsigned>(cluster);
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (launch.overlap) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = n > 0 ? attrs : nullptr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}
template <class... KernelArgs, class... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                          const LaunchConfig& launch, Args&&... args) {
  return launch_kernel_cluster(kernel, grid, block, smem, launch, 1, std::forward<Args>(args)...);
}

// The current device's SM count, read once per device.
inline int sm_count() {
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

}  // namespace siesta::cuda

namespace siesta::cuda::dev {

// Programmatic dependent launch (sm_90): let the next kernel in the stream
// start launching; and wait until every earlier kernel has finished and its
// writes are visible. Both are no-ops for a kernel launched without overlap.
__device__ __forceinline__ void allow_next_kernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// The common prologue of a kernel with nothing to prefetch.
__device__ __forceinline__ void begin_dependent_kernel() {
  allow_next_kernel();
  wait_for_previous_kernel();
}

// Timeline marks (kernels.h: kTraceCtas); no-ops without a trace buffer.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* trace_words(unsigned long long* trace) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return trace && cta < kTraceCtas ? trace + static_cast<size_t>(cta) * kTraceCtaWords : nullptr;
}
// Thread 0 of each CTA: its start, or its passing the wait for the previous kernel.
__device__ __forceinline__ void trace_start(unsigned long long* trace) {
  if constexpr (kTraceCompiled)
    if (threadIdx.x == 0)
      if (unsigned long long* w = trace_words(trace)) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        w[0] = global_ns();
        w[2] = sm + 1;  // 0: not recorded
      }
}
__device__ __forceinline__ void trace_waited(unsigned long long* trace) {
  if constexpr (kTraceCompiled)
    if (threadIdx.x == 0)
      if (unsigned long long* w = trace_words(trace)) w[1] = global_ns();
}
// Lane 0 of each warp (of the first eight) that gets there: mark 3 to kTraceEnd.
__device__ __forceinline__ void trace_mark(unsigned long long* trace, int mark) {
  if constexpr (kTraceCompiled) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0 && warp < 8)
      if (unsigned long long* w = trace_words(trace)) w[8 + 8 * (mark - 3) + warp] = global_ns();
  }
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The L2 policy of streamed weights, read once per pass: their lines are the
// first to leave L2 (evict_first), before what the pass's kernels write and
// read back (activations, the KV cache).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
// 16 bytes of read-only weights under an L2 policy (l2_evict_first_policy).
__device__ __forceinline__ uint4 load_weight16(const uint4* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// SiLU in fp32, x / (1 + e^-x), with the exponential and the division on the
// special-function unit (ex2.approx, rcp.approx): a few fp32 ulp from the
// IEEE expression, so the bf16 it is rounded to differs from HF's in rare last
// bits. Every SiLU of the model goes through here (the SiLU-mul kernel and the
// GEMV's SiLU-mul staging and epilogue), which keeps them equal to each other.
// The exact form's expf and IEEE division cost the prefill's SiLU-mul pass
// more time than its bytes.
__device__ __forceinline__ float silu(float x) {
  return __fdividef(x, 1.0f + __expf(-x));
}

// Larger key = larger float; a strict total order on non-NaN floats.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_order_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// A logit and its id as one word whose maximum is the sampler's first maximum:
// the larger value (NaN as -inf, +inf as FLT_MAX), ties to the lower id. Never 0.
__device__ __forceinline__ unsigned long long argmax_key(float v, int id) {
  if (isnan(v)) v = -INFINITY;
  else if (v == INFINITY) v = 3.402823466e+38f;
  return (static_cast<unsigned long long>(order_key(v)) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}

// 8 bf16 from a 16-byte aligned address, as floats.
__device__ __forceinline__ void load8(const bf16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// Rounds 8 floats to bf16 and stores them at a 16-byte aligned address.
__device__ __forceinline__ void store8(bf16* p, const float (&f)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Butterfly reductions: every lane ends with the same value, computed in the
// same order whatever the data, so results are reproducible bit for bit.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum / max in a fixed order (warp butterflies, then the warp
// totals in warp order). blockDim.x must be a multiple of 32; scratch holds 32
// floats. Every thread gets the result. Safe to call repeatedly.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < warps; ++i) total += scratch[i];
  return total;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = scratch[0];
  for (int i = 1; i < warps; ++i) m = fmaxf(m, scratch[i]);
  return m;
}

// Shared-memory addresses, mbarriers and bulk copies (sm_90).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// After a thread's mbar_init calls: the barriers are visible to the bulk copies (the
// async proxy) and, after a CTA barrier, to every thread.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Element offset of (block, layer, kind) in the block-major cache.
__device__ __forceinline__ size_t kv_offset(const KvCacheDesc& kv, int block, int layer, int kind) {
  return ((static_cast<size_t>(block) * kv.num_layers + layer) * 2 + kind) * static_cast<size_t>(kKvBlockSize) *
         kv.num_kv_heads * kv.head_dim;
}

// Address of (position's slot, kv head) for K (kind 0) or V (kind 1).
__device__ __forceinline__ bf16* kv_slot(const KvCacheDesc& kv, int block, int slot_in_block, int layer, int kind,
                                         int head) {
  return kv.base + kv_offset(kv, block, layer, kind) +
         (static_cast<size_t>(slot_in_block) * kv.num_kv_heads + head) * kv.head_dim;
}

}  // namespace siesta::cuda::dev
