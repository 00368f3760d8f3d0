// q/k RMSNorm + RoPE of one head vector, shared by the q/k norm kernel and
// decode attention's own q/k norm (.cu files only).
#pragma once

#include <cuda_bf16.h>

#include "model/cuda/device_util.cuh"

namespace siesta::cuda::dev {

// One warp per head vector (src read through L2: another CTA of the same
// kernel may have written it). Lane l holds the rotation pairs (i, i + half) for
// i = 2 l + 64 j and the one after it (bf16x2 loads and stores), so RoPE needs
// no data exchange; the norm is one warp sum.
template <int kHeadDim>
__device__ void norm_rope_head(const bf16* src, const bf16* norm_w, const __nv_bfloat162* rope, float eps,
                               bf16* dst) {
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kSteps = (kHalf + 63) / 64;  // lanes cover 64 pairs per step
  const int lane = threadIdx.x & 31;
  float2 a[kSteps], b[kSteps];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const int i = 2 * lane + 64 * j;
    if (i < kHalf) {
      a[j] = __bfloat1622float2(__ldcg(reinterpret_cast<const __nv_bfloat162*>(src + i)));
      b[j] = __bfloat1622float2(__ldcg(reinterpret_cast<const __nv_bfloat162*>(src + i + kHalf)));
      ss += a[j].x * a[j].x + a[j].y * a[j].y + b[j].x * b[j].x + b[j].y * b[j].y;
    }
  }
  ss = warp_sum(ss);
  const float rs = rsqrtf(ss / static_cast<float>(kHeadDim) + eps);
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const int i = 2 * lane + 64 * j;
    if (i < kHalf) {
      const float2 wa = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(norm_w + i));
      const float2 wb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(norm_w + i + kHalf));
      const float x1[2] = {round_bf16(wa.x * round_bf16(a[j].x * rs)), round_bf16(wa.y * round_bf16(a[j].y * rs))};
      const float x2[2] = {round_bf16(wb.x * round_bf16(b[j].x * rs)), round_bf16(wb.y * round_bf16(b[j].y * rs))};
      float lo[2], hi[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // As HF: cos/sin rounded to bf16 (the table), each product and the sum rounded.
        const float2 cs = __bfloat1622float2(rope[i + e]);
        lo[e] = round_bf16(x1[e] * cs.x) + round_bf16(-x2[e] * cs.y);
        hi[e] = round_bf16(x2[e] * cs.x) + round_bf16(x1[e] * cs.y);
      }
      *reinterpret_cast<__nv_bfloat162*>(dst + i) = __floats2bfloat162_rn(lo[0], lo[1]);
      *reinterpret_cast<__nv_bfloat162*>(dst + i + kHalf) = __floats2bfloat162_rn(hi[0], hi[1]);
    }
  }
}

}  // namespace siesta::cuda::dev
