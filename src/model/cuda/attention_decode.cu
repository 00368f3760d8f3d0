// Decode attention: one query token per sequence over its paged KV cache.
// One CTA per (kv head, partition, sequence) runs a work item
// (attention_decode.cuh: on tensor cores over K/V rows staged in shared memory,
// dev::decode_attention_item_mma for 64-token partitions and
// dev::decode_attention_item_wide for 128- and 256-token ones of small decode steps;
// dev::decode_attention_item in fp32 otherwise); sequences longer than one
// partition are combined in partition order: within a thread-block cluster of
// their CTAs (2 to 8 partitions, 64-token or staged), by the last of
// their CTAs to finish, or by a second kernel. In pure decode passes the kernel also does q/k norm + RoPE and the KV
// write.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "model/cuda/attention_decode.cuh"
#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/norm_rope.cuh"

namespace siesta::cuda {
namespace {

namespace cg = cooperative_groups;
constexpr int kMaxClusterPartitions = 8;  // the portable cluster size

// Whether the kernel copies its partition's K/V rows to shared memory (the
// cached ones before waiting for the previous kernel) and attends to them on
// tensor cores (dev::decode_attention_item_mma): short partitions, where they
// fit beside the other shared memory in the 48 KB of a static allocation.
template <int kHeadDim, int kGroup, int kP>
constexpr bool kStageKv = kP == 64 && sizeof(dev::DecodeAttentionSmem<kHeadDim, kGroup, kP>) + kGroup * kHeadDim * 2 +
                                          3 * kHeadDim * 2 + 2 * kP * (kHeadDim + dev::kKvRowPad) * 2 <= 48 * 1024;

// Dynamic shared memory: the cluster inbox (below), then, in the wide
// instances (kWide: 256-token partitions staged, dev::decode_attention_item_wide),
// the partition's K and V rows.
template <int kHeadDim, int kGroup>
constexpr size_t kInboxBytes = ((kMaxClusterPartitions - 1) * kGroup * (kHeadDim + 2) * sizeof(float) + 15) / 16 * 16;
template <int kHeadDim, int kP>
constexpr size_t kWideStageBytes = 2 * kP * (kHeadDim + dev::kKvRowPad) * sizeof(bf16);
// Warps of the wide instances (dev::decode_attention_item_wide): sixteen, each
// taking 16 of the 256 tokens. Against four (a warp per 64 tokens; 0.6B shape,
// H200, two A/B calls, ms per step): batch 1 0.624 -> 0.605 and 0.643 -> 0.627,
// batch 2 0.686 -> 0.662 and 0.696 -> 0.666, batch 8 0.791 -> 0.800 and
// 0.866 -> 0.843. Each phase of the item is a chain of dependent steps (shared
// memory loads, MMAs, shuffles) that one warp per scheduler could not hide.
constexpr int kWideWarps = 16;
// The wide instances' warps for a partition of kP tokens: 16 tokens a warp
// (256-token partitions: kWideWarps; 128-token ones: 8). 128-token partitions
// (InstrumentationOptions::decode_partition_tokens) staged on 8 warps, a context of
// 129-256 tokens as a cluster of two CTAs per kv head, measured as fast as the
// default's one 256-token CTA at batch 1 (0.555 and 0.554 against 0.557 and
// 0.553 ms per token, 0.6B shape, H200) and slower at 2-8 (batch 8 0.788
// against 0.760), so the default stays 256; the fp32 item they took before
// ran batch 1 at 0.770.
template <int kP>
constexpr int kWideWarpsFor = kP / 16;

// kCluster: the kernel runs as clusters of the partitions of one (kv head,
// sequence) (cluster dims 1 x max_partitions x 1): partitions 1 .. store their
// partials into partition 0's shared memory (distributed shared memory), and
// after one cluster barrier partition 0 combines them from there. No partial
// outputs in global memory, no counter.
// kWarps: the CTA's warps; four, or kWideWarps in the wide instances.
// (At most 170 registers on four warps: unbounded, ptxas spills the head_dim
// 64, group 5 instance; at 128, the head_dim 128, group 1 instance for sm_100.
// On sixteen, at most 128: sm_90a's wide instances take 88-94.)
template <int kHeadDim, int kGroup, int kP, bool kCluster, bool kWide = false, int kWarps = dev::kDecodeWarps>
__global__ __launch_bounds__(32 * kWarps, kWarps == dev::kDecodeWarps ? 3 : 1) void decode_attention_kernel(
    AttentionArgs a) {
  static_assert(kWide || kWarps == dev::kDecodeWarps, "only the wide item takes another warp count");
  constexpr int kThreads = 32 * kWarps;
  constexpr bool kStage = kWide || kStageKv<kHeadDim, kGroup, kP>;
  constexpr int kStride = kHeadDim + dev::kKvRowPad;
  static_assert(!kWide || dev::kWideCombineFloats<kHeadDim, kGroup, kWarps> * sizeof(float) <=
                              kP * kStride * sizeof(bf16),
                "the wide item's combine fits where its K rows were");
  __shared__ dev::DecodeAttentionSmem<kHeadDim, kGroup, kP> sm;
  __shared__ __align__(16) bf16 q_normed[kGroup * kHeadDim];
  __shared__ __align__(16) bf16 kv_static[kStage && !kWide ? 2 * kP * kStride : 8];
  // The RoPE row of the token's position, then the q and k norm weights.
  __shared__ __align__(16) bf16 consts_s[3 * kHeadDim];
  // kCluster, in the CTA of partition 0: the partials of partitions 1 ..
  // max_partitions - 1, which their CTAs store here ([p - 1][kGroup][kHeadDim]),
  // then their (max, sum) ([p - 1][kGroup][2] after kMaxClusterPartitions - 1
  // partials).
  extern __shared__ __align__(16) float inbox[];
  float* const inbox_stat = inbox + (kMaxClusterPartitions - 1) * kGroup * kHeadDim;
  bf16* const kv_s =
      kWide ? reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(inbox) + kInboxBytes<kHeadDim, kGroup>)
            : kv_static;
  const int dslot = blockIdx.z, kvh = blockIdx.x, part = blockIdx.y;
  // A CTA may store to another's shared memory once that one has started: the
  // cluster barrier's arrival here, its wait after the previous kernel's.
  if constexpr (kCluster) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  bf16* const k_s = kv_s;
  bf16* const v_s = kv_s + (kStage ? kP * kStride : 0);
  // This CTA's normalised partial, [kGroup][kHeadDim] (kCluster, partition 0):
  // the wide item leaves it where its K rows were.
  float* const own_partial = kWide ? reinterpret_cast<float*>(k_s) : &sm.red[0][0][0];
  // The timeline (kernels.h: kTraceCtas) of the staged partitions that small
  // decode batches take; not compiled for the others (registers).
  unsigned long long* const trace = kP == 64 || kWide ? a.trace : nullptr;
  dev::trace_start(trace);
  // Before waiting for the previous kernel, what does not depend on it: the
  // step metadata (uploaded before the pass's first kernel), the RoPE row and
  // norm weights, and the cached rows of this partition (every position but
  // the step's new one, written by earlier steps).
  const dev::DecodeSeq dseq = dev::decode_seq(a, dslot);
  const int row = dseq.row, len = dseq.kv_len;
  const int nparts_here = (len + kP - 1) / kP;
  const bool qk_here = a.qkv && len > 0 && part < nparts_here;
  const int slot = qk_here ? a.slots[row] : -1;
  if (qk_here && threadIdx.x < 3 * kHeadDim / 8) {
    constexpr int kRowChunks = kHeadDim / 8;
    const int which = threadIdx.x / kRowChunks, c = threadIdx.x % kRowChunks;
    const bf16* src = which == 0 ? reinterpret_cast<const bf16*>(a.rope_table + static_cast<size_t>(a.positions[row]) *
                                                                                    (kHeadDim / 2))
                      : which == 1 ? a.q_norm
                                   : a.k_norm;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(
                     consts_s + threadIdx.x * 8))),
                 "l"(src + c * 8)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");  // group 1: the constants
  int staged = 0;
  if constexpr (kStage) {  // group 2: the K/V rows
    staged = max(0, min(len - 1, (part + 1) * kP) - part * kP);
    dev::stage_kv_rows<kHeadDim>(dev::cache_rows(a, dslot, kvh), part * kP, staged, k_s, v_s, kThreads);
  } else {
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  dev::wait_for_previous_kernel();
  if constexpr (kStage) {
    // Unless this kernel writes the new token's row itself (qkv, and a slot), attention reads
    // that row from the cache, where without qkv the previous kernel wrote it: copied only now.
    if (len > 0 && part == nparts_here - 1 && (!a.qkv || slot < 0)) {
      dev::stage_kv_rows<kHeadDim>(dev::cache_rows(a, dslot, kvh), len - 1, 1, k_s + staged * kStride,
                                   v_s + staged * kStride, kThreads);
      ++staged;
    }
  }
  if constexpr (kCluster) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA has started
  dev::trace_waited(trace);
  const bf16* q_group = a.q + (static_cast<size_t>(row) * a.num_heads + kvh * kGroup) * kHeadDim;
  if (a.qkv) {
    // q/k norm + RoPE here (qk_norm_rope_kv's arithmetic): the group's query
    // heads into shared memory, and from the CTA of the last partition (the
    // only one that reads it) the new token's K and V into the cache, and
    // beside the staged rows, so that attention does not read them back.
    if (qk_here) {
      asm volatile("cp.async.wait_group 1;" ::: "memory");
      __syncthreads();  // the RoPE row and norm weights (group 1), for every thread
      const int q_dim = a.num_heads * kHeadDim, kv_dim = a.num_kv_heads * kHeadDim;
      const bf16* qkv_row = a.qkv + static_cast<size_t>(row) * (q_dim + 2 * kv_dim);
      const __nv_bfloat162* rope = reinterpret_cast<const __nv_bfloat162*>(consts_s);
      const bf16* q_norm = consts_s + kHeadDim;
      const bf16* k_norm = consts_s + 2 * kHeadDim;
      const bool writes_kv = part == nparts_here - 1 && slot >= 0;
      const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
      for (int u = warp; u < kGroup + (writes_kv ? 2 : 0); u += kWarps) {
        if (u < kGroup) {
          dev::norm_rope_head<kHeadDim>(qkv_row + (kvh * kGroup + u) * kHeadDim, q_norm, rope, a.eps,
                                        q_normed + u * kHeadDim);
          continue;
        }
        const int kind = u - kGroup;  // 0: K, 1: V
        uint4* cache = reinterpret_cast<uint4*>(
            dev::kv_slot(a.kv, slot / kKvBlockSize, slot % kKvBlockSize, a.layer, kind, kvh));
        bf16* local = kStage ? (kind == 0 ? k_s : v_s) + staged * kStride : nullptr;
        if (kind == 0) {
          dev::norm_rope_head<kHeadDim>(qkv_row + q_dim + kvh * kHeadDim, k_norm, rope, a.eps,
                                        kStage ? local : reinterpret_cast<bf16*>(cache));
        } else {
          const uint4* src = reinterpret_cast<const uint4*>(qkv_row + q_dim + kv_dim + kvh * kHeadDim);
          for (int c = lane; c < kHeadDim / 8; c += 32) (kStage ? reinterpret_cast<uint4*>(local) : cache)[c] = src[c];
        }
        if constexpr (kStage) {
          __syncwarp();
          for (int c = lane; c < kHeadDim / 8; c += 32) cache[c] = reinterpret_cast<const uint4*>(local)[c];
        }
      }
      if (kStage && writes_kv) ++staged;  // the new row follows the staged ones
    }
    q_group = q_normed;
  }
  // The next kernel (the O projection, whose CTAs start by loading all their
  // weights) may start only now: started with this kernel, its loads delay
  // this one's reads of the QKV output and the cache (batch 1, 0.6B shape:
  // 0.78 ms per token released at the start, 0.75 released here).
  dev::allow_next_kernel();
  dev::trace_mark(trace, 3);
  int nparts = 0;
  float* partial_smem = nullptr;
  float* stat_smem = nullptr;
  if constexpr (kCluster) {  // the partial goes to partition 0's CTA (rank 0 of the cluster)
    cg::cluster_group cluster = cg::this_cluster();
    partial_smem = own_partial;
    stat_smem = &sm.stat[0][0];
    if (part > 0) {
      partial_smem = cluster.map_shared_rank(inbox + (part - 1) * kGroup * kHeadDim, 0);
      stat_smem = cluster.map_shared_rank(inbox_stat + (part - 1) * kGroup * 2, 0);
    }
  }
  if constexpr (kWide) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();  // the staged rows and the new K/V row, for every thread
    nparts = dev::decode_attention_item_wide<kHeadDim, kGroup, kP, kWarps>(
        a, dslot, dseq, kvh, part, q_group, k_s, v_s, kStride, sm, own_partial, partial_smem, stat_smem);
  } else if constexpr (kStage) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();  // the staged rows and the new K/V row, for every thread
    nparts = dev::decode_attention_item_mma<kHeadDim, kGroup, kP>(a, dslot, dseq, kvh, part, q_group, k_s, v_s,
                                                                  kStride, sm, partial_smem, stat_smem);
  } else {
    __syncthreads();  // the new K/V row written above, for every thread
    nparts = dev::decode_attention_item<kHeadDim, kGroup, kP>(a, dslot, dseq, kvh, part, q_group,
                                                              dev::cache_rows(a, dslot, kvh), sm,
                                                              partial_smem, stat_smem);
  }
  dev::trace_mark(trace, 4);
  bf16* out_row = a.out + static_cast<size_t>(row) * a.num_heads * kHeadDim;
  if constexpr (kCluster) {
    // Every CTA of the cluster reaches the barrier (none returns early), which
    // publishes the partials stored in partition 0's shared memory; partition
    // 0 combines them in partition order, the others are done.
    cg::this_cluster().sync();
    if (part == 0 && nparts > 1) {
      for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
        const int g = i / kHeadDim, d = i % kHeadDim;
        const float val = dev::combine_partitions(
            nparts, [&](int p, int k) { return p == 0 ? sm.stat[g][k] : inbox_stat[((p - 1) * kGroup + g) * 2 + k]; },
            [&](int p) {
              return p == 0 ? own_partial[g * kHeadDim + d] : inbox[((p - 1) * kGroup + g) * kHeadDim + d];
            });
        out_row[(kvh * kGroup + g) * kHeadDim + d] = __float2bfloat16(val);
      }
    }
    dev::trace_mark(trace, 5);
    dev::trace_mark(trace, kTraceEnd);
    return;
  }
  if (a.partition_done == nullptr || nparts <= 1 || part >= nparts) {
    dev::trace_mark(trace, kTraceEnd);
    return;
  }
  // The last CTA of (sequence, kv head) to finish combines the partitions. The
  // count's release publishes this CTA's partial outputs (written before the
  // barrier), its acquire makes the others' visible; reduce_partitions reads
  // them through L2.
  __shared__ bool last;
  __syncthreads();
  uint32_t* done = a.partition_done + dslot * a.num_kv_heads + kvh;
  if (threadIdx.x == 0) {
    uint32_t before = 0;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(done) : "memory");
    last = before == static_cast<uint32_t>(nparts - 1);
  }
  __syncthreads();
  dev::trace_mark(trace, 5);
  if (!last) {
    dev::trace_mark(trace, kTraceEnd);
    return;
  }
  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    out_row[(kvh * kGroup + g) * kHeadDim + d] =
        __float2bfloat16(dev::reduce_partitions<kHeadDim>(a, dslot, kvh * kGroup + g, nparts, d));
  }
  if (threadIdx.x == 0) *done = 0;  // for the next layer (the kernel's end orders it before)
  dev::trace_mark(trace, kTraceEnd);
}

// Combines the partitions of each (sequence, head) in partition order.
template <int kHeadDim, int kP>
__global__ __launch_bounds__(kHeadDim) void decode_reduce_kernel(AttentionArgs a) {
  dev::begin_dependent_kernel();
  const int dslot = blockIdx.y, h = blockIdx.x;
  const int seq = a.decode_seqs[dslot];
  const int nparts = (a.seq_kv_len[seq] + kP - 1) / kP;
  if (nparts <= 1) return;
  const int row = a.seq_q_start[seq];
  a.out[(static_cast<size_t>(row) * a.num_heads + h) * kHeadDim + threadIdx.x] =
      __float2bfloat16(dev::reduce_partitions<kHeadDim>(a, dslot, h, nparts, threadIdx.x));
}

// The partitions of a (kv head, sequence) as one cluster (launch_kernel's
// launch with a cluster dimension as well).
template <int kHeadDim, int kGroup, int kP, bool kWide = false, int kWarps = dev::kDecodeWarps>
cudaError_t launch_clusters(const AttentionArgs& a, int num_decode, int max_partitions, const LaunchConfig& launch) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(a.num_kv_heads, max_partitions, num_decode);
  cfg.blockDim = 32 * kWarps;
  cfg.stream = launch.stream;
  // The kernel's layout: the inbox (for kMaxClusterPartitions), then kWide's rows.
  static constexpr size_t kDynamicSmem = kInboxBytes<kHeadDim, kGroup> + (kWide ? kWideStageBytes<kHeadDim, kP> : 0);
  auto* const kernel = decode_attention_kernel<kHeadDim, kGroup, kP, true, kWide, kWarps>;
  // A grid of at most half as many CTAs as the device has SMs (batch 1 and 2 of
  // a model with 8 kv heads and up to 256 tokens) runs one CTA per SM: its
  // dynamic shared memory is sized so that no second one fits beside it (the
  // GEMVs' CTAs still do). 0.6B shape, H200, one A/B call with 140 KB per CTA:
  // batch 2 0.79 -> 0.72 ms per step, batch 1 0.68 -> 0.67; at batch 4 (128
  // CTAs) one per SM measured 0.84 -> 0.93, hence the half.
  static const size_t spread_smem = [&] {
    int device = 0, per_sm = 0, reserved = 0;
    cudaFuncAttributes fa{};
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, kernel) != cudaSuccess)
      return kDynamicSmem;
    const long over_half = per_sm / 2 + 16 - static_cast<long>(fa.sharedSizeBytes) - reserved;
    return std::max(kDynamicSmem, static_cast<size_t>(std::max(0L, over_half) + 15) / 16 * 16);
  }();
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(spread_smem));
  if (attr != cudaSuccess) return attr;
  const int ctas = a.num_kv_heads * max_partitions * num_decode;
  cfg.dynamicSmemBytes = 2 * ctas <= sm_count() ? spread_smem : kDynamicSmem;
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 1;
  attrs[0].val.clusterDim.y = max_partitions;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = launch.overlap ? 2 : 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, a);
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <int kHeadDim, int kGroup, int kP>
cudaError_t launch_with(const AttentionArgs& a, int num_decode, int max_partitions, const LaunchConfig& launch) {
  // Short contexts split into up to kMaxClusterPartitions partitions combine in
  // a cluster; longer ones by their last CTA (partition_done) or a second kernel.
  constexpr bool kCanWide = kP == 256 || kP == 128;
  const bool wide = kCanWide && a.staged_partitions;
  const bool cluster = a.cluster_partitions && max_partitions > 1 && max_partitions <= kMaxClusterPartitions;
  if constexpr (kP == 64) {
    if (cluster) return launch_clusters<kHeadDim, kGroup, kP>(a, num_decode, max_partitions, launch);
  }
  if constexpr (kCanWide) {
    if (wide && cluster)
      return launch_clusters<kHeadDim, kGroup, kP, true, kWideWarpsFor<kP>>(a, num_decode, max_partitions, launch);
  }
  const dim3 grid(a.num_kv_heads, max_partitions, num_decode);
  cudaError_t err = cudaSuccess;
  if constexpr (kCanWide) {
    if (wide) {
      auto* const kernel = decode_attention_kernel<kHeadDim, kGroup, kP, false, true, kWideWarpsFor<kP>>;
      constexpr size_t smem = kInboxBytes<kHeadDim, kGroup> + kWideStageBytes<kHeadDim, kP>;
      static const cudaError_t attr =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      err = attr != cudaSuccess ? attr : launch_kernel(kernel, grid, 32 * kWideWarpsFor<kP>, smem, launch, a);
    }
  }
  if (!wide)
    err = launch_kernel(decode_attention_kernel<kHeadDim, kGroup, kP, false>, grid, dev::kDecodeThreads, 0, launch, a);
  if (err != cudaSuccess || max_partitions <= 1 || a.partition_done != nullptr) return err;
  return launch_kernel(decode_reduce_kernel<kHeadDim, kP>, dim3(a.num_heads, num_decode), kHeadDim, 0, launch, a);
}

template <int kHeadDim, int kGroup>
cudaError_t launch_for(const AttentionArgs& a, int num_decode, int max_partitions, const LaunchConfig& launch) {
  switch (a.partition_tokens) {
    case 64: return launch_with<kHeadDim, kGroup, 64>(a, num_decode, max_partitions, launch);
    case 128: return launch_with<kHeadDim, kGroup, 128>(a, num_decode, max_partitions, launch);
    case 256: return launch_with<kHeadDim, kGroup, 256>(a, num_decode, max_partitions, launch);
    default: return cudaErrorInvalidValue;
  }
}

// f(std::integral_constant<int, group>{}) for a GQA group of 1 to 8 (the
// compiled instances), else `otherwise`.
template <class F, class R>
R with_group(int group, R otherwise, F&& f) {
  switch (group) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return otherwise;
  }
}

template <int kHeadDim>
cudaError_t launch_for_head_dim(const AttentionArgs& a, int num_decode, int max_partitions, const LaunchConfig& launch) {
  return with_group(a.num_heads / a.num_kv_heads, cudaErrorInvalidValue, [&](auto group) {
    return launch_for<kHeadDim, decltype(group)::value>(a, num_decode, max_partitions, launch);
  });
}

}  // namespace

bool decode_partition_supported(int tokens) { return tokens == 64 || tokens == 128 || tokens == 256; }

namespace {
// Whether the staged 256-token instance for this shape fits the device's shared
// memory per block (it takes ~200 KB at head_dim 128, group 8).
template <int kHeadDim, int kGroup>
bool wide_fits() {
  int device = 0, optin = 0;
  cudaFuncAttributes fa{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, decode_attention_kernel<kHeadDim, kGroup, 256, true, true, kWideWarps>) != cudaSuccess)
    return false;
  return fa.sharedSizeBytes + kInboxBytes<kHeadDim, kGroup> + kWideStageBytes<kHeadDim, 256> <=
         static_cast<size_t>(optin);
}
}  // namespace

bool decode_staged_partitions_supported(int num_heads, int num_kv_heads, int head_dim) {
  if (!attention_supported(num_heads, num_kv_heads, head_dim)) return false;
  return with_group(num_heads / num_kv_heads, false, [&](auto group) {
    constexpr int kGroup = decltype(group)::value;
    return head_dim == 64 ? wide_fits<64, kGroup>() : wide_fits<128, kGroup>();
  });
}

bool attention_supported(int num_heads, int num_kv_heads, int head_dim) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return false;
  const int group = num_heads / num_kv_heads;  // Qwen3-14B: 5; Qwen3-32B: 8
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= kMaxGqaGroup;
}

cudaError_t launch_decode_attention(const AttentionArgs& args, int num_decode, int max_partitions,
                                    LaunchConfig launch) {
  if (num_decode <= 0) return cudaSuccess;
  if (!attention_supported(args.num_heads, args.num_kv_heads, args.head_dim) ||
      !decode_partition_supported(args.partition_tokens) || max_partitions < 1 ||
      (max_partitions > 1 && max_partitions > args.partial_parts) || max_partitions > 65535 || num_decode > 65535)
    return cudaErrorInvalidValue;
  return args.head_dim == 64 ? launch_for_head_dim<64>(args, num_decode, max_partitions, launch)
                             : launch_for_head_dim<128>(args, num_decode, max_partitions, launch);
}

}  // namespace siesta::cuda
