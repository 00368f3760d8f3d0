// Token selection on the device: one CTA of 1024 threads per row of logits.
//
// Mirrors the engine sampler (src/engine/sampler.cpp) so that a row gives the
// same token on either side: NaN counts as -inf and +inf as FLT_MAX; greedy is
// the first maximum; otherwise temperature, min-p, top-k (ties to the lower
// id), top-p over the survivors sorted by (logit desc, id asc), and the draw
// inverted through the cumulative mass in fp64 — in sorted order when top-k
// or top-p is on (summed sequentially, as the host does), else in id order.
// Every reduction has a fixed order, so the choice never depends on the batch.
// The first maximum can come from the LM head GEMV (dev::argmax_key words),
// which saves a pass over the row: a greedy row then costs one read.
#include <cuda_bf16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"

namespace siesta::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
static_assert(kDeviceSortCapacity == kThreads, "the bitonic sort gives each thread one element");

using dev::order_key;

struct Shared {
  int32_t banned[kMaxBannedPerRow];
  int32_t hist[256];
  int32_t int_scratch[kWarps];
  double dbl_scratch[kWarps];
  float f_scratch[kWarps];
  int32_t i_scratch[kWarps];
  float sort_v[kThreads];
  int32_t sort_id[kThreads];
  double sort_e[kThreads];
  int32_t bcast[4];
  double dbcast[2];
};

// Exclusive prefix sum of one int per thread, thread order; also the total.
__device__ int block_exclusive_scan(int v, Shared& sh, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) sh.int_scratch[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += sh.int_scratch[w];
    all += sh.int_scratch[w];
  }
  *total = all;
  return before + x - v;
}

// Exclusive prefix sum of one double per thread, thread order; also the total.
__device__ double block_exclusive_scan(double v, Shared& sh, double* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) sh.dbl_scratch[warp] = x;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += sh.dbl_scratch[w];
    all += sh.dbl_scratch[w];
  }
  *total = all;
  return before + (x - v);
}

__device__ int block_sum_int(int v, Shared& sh) {
  int total = 0;
  (void)block_exclusive_scan(v, sh, &total);
  return total;
}

__device__ int block_max_int(int v, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.int_scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  int m = sh.int_scratch[0];
  for (int w = 1; w < kWarps; ++w) m = max(m, sh.int_scratch[w]);
  return m;
}

__device__ __forceinline__ bool found_any(int lowest) { return lowest != INT32_MAX; }

// (value, id) with the larger value, ties to the lower id; id < 0 is empty.
__device__ __forceinline__ bool better_pair(float v, int id, float bv, int bid) {
  if (bid < 0) return id >= 0;
  if (id < 0) return false;
  return v > bv || (v == bv && id < bid);
}

__global__ __launch_bounds__(kThreads) void sample_kernel(const float* logits, int vocab,
                                                          const SamplingRowParams* params, const int32_t* banned,
                                                          int32_t* tokens, const unsigned long long* argmax_keys) {
  dev::begin_dependent_kernel();
  __shared__ Shared sh;
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* lg = logits + static_cast<size_t>(row) * vocab;
  const SamplingRowParams p = params[row];
  const int nb = min(p.banned_end - p.banned_begin, kMaxBannedPerRow);
  if (tid < nb) sh.banned[tid] = banned[p.banned_begin + tid];
  __syncthreads();

  // Each thread owns a contiguous id range, so "in id order" is thread order.
  const int per = (vocab + kThreads - 1) / kThreads;
  const int i0 = min(vocab, tid * per), i1 = min(vocab, i0 + per);
  auto value = [&](int i) {
    float v = lg[i];
    if (isnan(v)) v = -INFINITY;
    else if (v == INFINITY) v = FLT_MAX;
    for (int b = 0; b < nb; ++b)
      if (sh.banned[b] == i) v = -INFINITY;
    return v;
  };

  // 1. The first maximum: from the LM head's keys, or a pass over the row.
  // Strided (coalesced) reads: a thread's ids ascend, so keeping only
  // strictly larger values keeps its first maximum.
  if (argmax_keys && nb == 0) {
    if (tid == 0) {
      const unsigned long long key = argmax_keys[row];
      sh.bcast[0] = static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
      sh.dbcast[0] = dev::from_order_key(static_cast<uint32_t>(key >> 32));
    }
    __syncthreads();
  } else {
    float best_v = -INFINITY;
    int best_i = -1;
    for (int i = tid; i < vocab; i += kThreads) {
      const float v = value(i);
      if (best_i < 0 || v > best_v) {
        best_v = v;
        best_i = i;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (better_pair(ov, oi, best_v, best_i)) {
        best_v = ov;
        best_i = oi;
      }
    }
    if (lane == 0) {
      sh.f_scratch[warp] = best_v;
      sh.i_scratch[warp] = best_i;
    }
    __syncthreads();
    if (tid == 0) {
      float bv = sh.f_scratch[0];
      int bi = sh.i_scratch[0];
      for (int w = 1; w < kWarps; ++w)
        if (better_pair(sh.f_scratch[w], sh.i_scratch[w], bv, bi)) {
          bv = sh.f_scratch[w];
          bi = sh.i_scratch[w];
        }
      sh.bcast[0] = bi;
      sh.dbcast[0] = bv;
    }
    __syncthreads();
  }
  const int argmax = sh.bcast[0];
  const float max_v = static_cast<float>(sh.dbcast[0]);
  if (p.temperature < 1e-5 || max_v == -INFINITY) {
    if (tid == 0) tokens[row] = argmax;
    return;
  }

  // 2. Temperature and min-p.
  const double inv_t = 1.0 / p.temperature;
  const double max_scaled = static_cast<double>(max_v) * inv_t;
  const double floor_s = p.min_p > 0.0 ? max_scaled + log(p.min_p) : -INFINITY;
  auto survives = [&](float v) { return v != -INFINITY && static_cast<double>(v) * inv_t >= floor_s; };
  int my_surv = 0;
  for (int i = i0; i < i1; ++i) my_surv += survives(value(i));
  const int n_surv = block_sum_int(my_surv, sh);

  const bool top_k_on = p.top_k > 0 && p.top_k < n_surv;
  const bool top_p_on = p.top_p < 1.0;

  if (!top_k_on && !top_p_on) {
    // 3a. Cumulative mass in id order.
    double mine = 0.0;
    for (int i = i0; i < i1; ++i) {
      const float v = value(i);
      if (survives(v)) mine += exp(static_cast<double>(v) * inv_t - max_scaled);
    }
    double total = 0.0;
    const double before = block_exclusive_scan(mine, sh, &total);
    int last = -1;
    for (int i = i0; i < i1; ++i)
      if (survives(value(i))) last = i;
    const int last_surv = block_max_int(last, sh);
    // The thread whose range holds the target finds the token. Rounding can
    // make two neighbouring ranges both claim it: the lower id wins.
    const double target = p.uniform * total;
    int found = -1;
    if (target >= before && target < before + mine) {
      double cum = before;
      for (int i = i0; i < i1 && found < 0; ++i) {
        const float v = value(i);
        if (!survives(v)) continue;
        cum += exp(static_cast<double>(v) * inv_t - max_scaled);
        if (target < cum) found = i;
      }
    }
    const int lowest = -block_max_int(found >= 0 ? -found : INT32_MIN + 1, sh);
    if (tid == 0) tokens[row] = found_any(lowest) ? lowest : last_surv;  // none: the last survivor, as the host
    return;
  }

  // 3b. The candidates to sort: the top k, or (top-p alone) the top kThreads.
  const int want = top_k_on ? p.top_k : min(n_surv, kThreads);
  if (want > kThreads) {
    if (tid == 0) tokens[row] = kSampleOnHost;
    return;
  }
  // Radix select of the want-th largest key among survivors, 8 bits at a time.
  uint32_t prefix = 0, mask = 0;
  int remaining = want;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    for (int i = i0; i < i1; ++i) {
      const float v = value(i);
      if (!survives(v)) continue;
      const uint32_t k = order_key(v);
      if ((k & mask) == prefix) atomicAdd(&sh.hist[(k >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0, b = 255;
      for (; b > 0; --b) {
        if (above + sh.hist[b] >= remaining) break;
        above += sh.hist[b];
      }
      sh.bcast[2] = b;
      sh.bcast[3] = remaining - above;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.bcast[2]) << shift;
    mask |= 255u << shift;
    remaining = sh.bcast[3];
    __syncthreads();
  }
  // Keep keys above the threshold, and the first `remaining` ties in id order.
  const uint32_t threshold = prefix;
  int my_ties = 0;
  for (int i = i0; i < i1; ++i) {
    const float v = value(i);
    my_ties += survives(v) && order_key(v) == threshold;
  }
  int all_ties = 0;
  const int ties_before = block_exclusive_scan(my_ties, sh, &all_ties);
  const int ties_allowed = max(0, min(my_ties, remaining - ties_before));
  int my_kept = 0;
  {
    int tie_seen = 0;
    for (int i = i0; i < i1; ++i) {
      const float v = value(i);
      if (!survives(v)) continue;
      const uint32_t k = order_key(v);
      if (k > threshold) ++my_kept;
      else if (k == threshold && tie_seen++ < ties_allowed) ++my_kept;
    }
  }
  int n_kept = 0;
  int slot = block_exclusive_scan(my_kept, sh, &n_kept);
  {
    int tie_seen = 0;
    for (int i = i0; i < i1; ++i) {
      const float v = value(i);
      if (!survives(v)) continue;
      const uint32_t k = order_key(v);
      if (k > threshold || (k == threshold && tie_seen++ < ties_allowed)) {
        sh.sort_v[slot] = v;
        sh.sort_id[slot] = i;
        ++slot;
      }
    }
  }
  if (tid >= n_kept) {
    sh.sort_v[tid] = -INFINITY;
    sh.sort_id[tid] = INT32_MAX;
  }
  __syncthreads();

  // Bitonic sort into (logit desc, id asc).
  for (int k = 2; k <= kThreads; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int other = tid ^ j;
      if (other > tid) {
        const float av = sh.sort_v[tid], bv = sh.sort_v[other];
        const int ai = sh.sort_id[tid], bi = sh.sort_id[other];
        const bool a_first = av > bv || (av == bv && ai < bi);
        const bool ascending_block = (tid & k) == 0;  // this block wants the better one first
        if (ascending_block ? !a_first : a_first) {
          sh.sort_v[tid] = bv;
          sh.sort_v[other] = av;
          sh.sort_id[tid] = bi;
          sh.sort_id[other] = ai;
        }
      }
      __syncthreads();
    }
  }

  // Unnormalised probabilities of the sorted candidates.
  sh.sort_e[tid] = tid < n_kept ? exp(static_cast<double>(sh.sort_v[tid]) * inv_t - max_scaled) : 0.0;
  // Top-p alone with more survivors than were sorted: the rest's mass counts toward the total.
  double rest = 0.0;
  if (!top_k_on && n_surv > n_kept) {
    const float cut = sh.sort_v[n_kept - 1];
    const int cut_id = sh.sort_id[n_kept - 1];
    double mine = 0.0;
    for (int i = i0; i < i1; ++i) {
      const float v = value(i);
      if (!survives(v)) continue;
      const bool sorted = v > cut || (v == cut && i <= cut_id);
      if (!sorted) mine += exp(static_cast<double>(v) * inv_t - max_scaled);
    }
    (void)block_exclusive_scan(mine, sh, &rest);
  }
  __syncthreads();

  if (tid == 0) {
    double total = 0.0;
    for (int i = 0; i < n_kept; ++i) total += sh.sort_e[i];
    total += rest;
    int keep = n_kept;
    if (top_p_on) {
      const double limit = p.top_p * total;
      double mass = 0.0;
      keep = 0;
      while (keep < n_kept && (keep == 0 || mass < limit)) mass += sh.sort_e[keep++];
      total = mass;
      if (mass < limit && n_surv > n_kept) {
        tokens[row] = kSampleOnHost;  // the nucleus reaches past what was sorted
        return;
      }
    }
    const double target = p.uniform * total;
    double cum = 0.0;
    int chosen = sh.sort_id[keep - 1];
    for (int i = 0; i < keep; ++i) {
      cum += sh.sort_e[i];
      if (target < cum) {
        chosen = sh.sort_id[i];
        break;
      }
    }
    tokens[row] = chosen;
  }
}

}  // namespace

cudaError_t launch_sample_tokens(const float* logits, int rows, int vocab, const SamplingRowParams* params,
                                 const int32_t* banned_ids, int32_t* tokens, LaunchConfig launch,
                                 const unsigned long long* argmax_keys) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0) return cudaErrorInvalidValue;
  return launch_kernel(sample_kernel, rows, kThreads, 0, launch, logits, vocab, params, banned_ids, tokens,
                       argmax_keys);
}

}  // namespace siesta::cuda
