// Weights pushed in float16 or float32 rounded to the model's bf16 on the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "model/cuda/kernels.h"

namespace siesta::cuda {
namespace {

// Element by element (sources need only be aligned to their element size):
// f16 -> f32 is exact, then f32 -> bf16 rounds to nearest even, as the
// host's conversion of a checkpoint (f32_to_bf16) does.
template <typename T>
__global__ void to_bf16_kernel(const T* src, bf16* dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v;
    if constexpr (sizeof(T) == 2)
      v = __half2float(src[i]);
    else
      v = src[i];
    dst[i] = __float2bfloat16_rn(v);
  }
}

}  // namespace

cudaError_t launch_convert_to_bf16(const void* src, int src_bytes_per_element, bf16* dst, size_t n,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 4096));
  switch (src_bytes_per_element) {
    case 2:
      to_bf16_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const __half*>(src), dst, n);
      break;
    case 4:
      to_bf16_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(src), dst, n);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace siesta::cuda
