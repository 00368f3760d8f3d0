// Decode attention: one query token per sequence over its paged KV cache.
//
// One CTA per (kv head, partition of kP tokens, sequence) serves
// the whole GQA group of that kv head, so K and V are read once per group.
// Memory-bound, so plain fp32 FMAs: lane-per-token dot products for the scores,
// a fixed-order softmax over the partition, and lane-per-dimension weighted sums
// of V (coalesced rows). Sequences longer than one partition write normalised
// partial outputs with their (max, sum) and a second kernel combines them in
// partition order. Every order depends only on the sequence's own length.
#include <cuda_bf16.h>

#include <cmath>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"

namespace siesta::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim, int kGroup, int kP>
__global__ __launch_bounds__(kThreads) void decode_attention_kernel(AttentionArgs a) {
  dev::begin_dependent_kernel();
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per K row
  __shared__ __align__(16) float q_s[kGroup][kHeadDim];
  __shared__ float p_s[kGroup][kP];
  __shared__ __align__(16) float red_s[kWarps][kGroup][kHeadDim];
  __shared__ float stat_s[kGroup][2];
  __shared__ float group_s[kWarps][kGroup];

  const int dslot = blockIdx.z;
  const int seq = a.decode_seqs[dslot];
  const int kvh = blockIdx.x, part = blockIdx.y;
  const int kv_len = a.seq_kv_len[seq];
  const int row = a.seq_q_start[seq];
  const int h0 = kvh * kGroup;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  bf16* out_row = a.out + static_cast<size_t>(row) * a.num_heads * kHeadDim;

  if (kv_len <= 0) {  // padding: defined output, no cache reads
    if (part == 0)
      for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) out_row[h0 * kHeadDim + i] = __float2bfloat16(0.0f);
    return;
  }
  const int nparts = (kv_len + kP - 1) / kP;
  if (part >= nparts) return;

  // Scores are kept in the log2 domain: q is pre-scaled by scale * log2(e).
  const float qscale = a.scale * kLog2e;
  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    q_s[g][d] = __bfloat162float(a.q[(static_cast<size_t>(row) * a.num_heads + h0 + g) * kHeadDim + d]) * qscale;
  }
  __syncthreads();

  const int p0 = part * kP;
  const int n = min(kv_len, p0 + kP) - p0;
  const int* table = a.block_tables + a.seq_table_start[seq];

  // Scores: lane j of a warp takes token c*32 + j; all its K loads go out first.
  for (int c = warp; c * 32 < n; c += kWarps) {
    const int j = c * 32 + lane;
    if (j < n) {
      const int t = p0 + j;
      const uint4* kp = reinterpret_cast<const uint4*>(
          dev::kv_slot(a.kv, table[t / kKvBlockSize], t % kKvBlockSize, a.layer, 0, kvh));
      uint4 kr[kChunks];
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) kr[ch] = kp[ch];
      float s[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) s[g] = 0.0f;
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) {
        float kf[8];
        dev::unpack8(kr[ch], kf);
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][ch * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][ch * 8 + 4]);
          s[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                  qb.z * kf[6] + qb.w * kf[7];
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) p_s[g][j] = s[g];
    }
  }
  __syncthreads();

  // Softmax over the partition, all heads of the group at once, in a fixed order.
  {
    float m[kGroup], l[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      m[g] = -INFINITY;
      for (int j = threadIdx.x; j < n; j += kThreads) m[g] = fmaxf(m[g], p_s[g][j]);
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
      for (int w = 1; w < kWarps; ++w) m[g] = fmaxf(m[g], group_s[w][g]);
      l[g] = 0.0f;
      for (int j = threadIdx.x; j < n; j += kThreads) {
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
      for (int w = 0; w < kWarps; ++w) sum += group_s[w][g];
      stat_s[g][1] = sum;
    }
    if (threadIdx.x == 0)
#pragma unroll
      for (int g = 0; g < kGroup; ++g) stat_s[g][0] = m[g];
  }
  __syncthreads();

  // P V: a V row is kHeadDim / 8 lanes of 16 bytes, so a warp covers
  // kTokensPerStep tokens per load and keeps kUnroll loads in flight per lane.
  constexpr int kLanesPerToken = kHeadDim / 8;
  constexpr int kTokensPerStep = 32 / kLanesPerToken;
  constexpr int kUnroll = 8;
  const int sub = lane / kLanesPerToken, dim0 = (lane % kLanesPerToken) * 8;
  float o[kGroup][8];
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[g][e] = 0.0f;
  constexpr int kStride = kWarps * kTokensPerStep;
  for (int j0 = warp * kTokensPerStep + sub; j0 < n; j0 += kStride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * kStride;
      if (j < n) {
        const int t = p0 + j;
        v[u] = *reinterpret_cast<const uint4*>(
            dev::kv_slot(a.kv, table[t / kKvBlockSize], t % kKvBlockSize, a.layer, 1, kvh) + dim0);
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

  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red_s[w][g][d];
    const float val = sum / stat_s[g][1];
    if (nparts == 1) {
      out_row[(h0 + g) * kHeadDim + d] = __float2bfloat16(val);
    } else {
      const size_t base = (static_cast<size_t>(dslot) * a.num_heads + h0 + g) * a.partial_parts + part;
      a.partial_out[base * kHeadDim + d] = val;
      if (d == 0) {
        a.partial_ml[base * 2] = stat_s[g][0];
        a.partial_ml[base * 2 + 1] = stat_s[g][1];
      }
    }
  }
}

// Combines the partitions of each (sequence, head) in partition order.
template <int kHeadDim, int kP>
__global__ __launch_bounds__(kHeadDim) void decode_reduce_kernel(AttentionArgs a) {
  dev::begin_dependent_kernel();
  const int dslot = blockIdx.y, h = blockIdx.x;
  const int seq = a.decode_seqs[dslot];
  const int kv_len = a.seq_kv_len[seq];
  const int nparts = (kv_len + kP - 1) / kP;
  if (nparts <= 1) return;
  const size_t base = (static_cast<size_t>(dslot) * a.num_heads + h) * a.partial_parts;
  float m = -INFINITY;
  for (int p = 0; p < nparts; ++p) m = fmaxf(m, a.partial_ml[(base + p) * 2]);
  float num = 0.0f, den = 0.0f;
  for (int p = 0; p < nparts; ++p) {
    const float w = a.partial_ml[(base + p) * 2 + 1] * exp2f(a.partial_ml[(base + p) * 2] - m);
    num += w * a.partial_out[(base + p) * kHeadDim + threadIdx.x];
    den += w;
  }
  const int row = a.seq_q_start[seq];
  a.out[(static_cast<size_t>(row) * a.num_heads + h) * kHeadDim + threadIdx.x] = __float2bfloat16(num / den);
}

template <int kHeadDim, int kGroup, int kP>
cudaError_t launch_with(const AttentionArgs& a, int num_decode, int max_partitions, const LaunchConfig& launch) {
  const dim3 grid(a.num_kv_heads, max_partitions, num_decode);
  const cudaError_t err = launch_kernel(decode_attention_kernel<kHeadDim, kGroup, kP>, grid, kThreads, 0, launch, a);
  if (err != cudaSuccess || max_partitions <= 1) return err;
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

template <int kHeadDim>
cudaError_t launch_for_head_dim(const AttentionArgs& a, int num_decode, int max_partitions, const LaunchConfig& launch) {
  switch (a.num_heads / a.num_kv_heads) {
    case 1: return launch_for<kHeadDim, 1>(a, num_decode, max_partitions, launch);
    case 2: return launch_for<kHeadDim, 2>(a, num_decode, max_partitions, launch);
    case 4: return launch_for<kHeadDim, 4>(a, num_decode, max_partitions, launch);
    case 8: return launch_for<kHeadDim, 8>(a, num_decode, max_partitions, launch);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool decode_partition_supported(int tokens) { return tokens == 64 || tokens == 128 || tokens == 256; }

bool attention_supported(int num_heads, int num_kv_heads, int head_dim) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return false;
  const int group = num_heads / num_kv_heads;
  return (head_dim == 64 || head_dim == 128) && (group == 1 || group == 2 || group == 4 || group == 8);
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
