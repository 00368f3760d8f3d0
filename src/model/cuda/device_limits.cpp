#include "model/cuda/device_limits.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "model/cuda/cublaslt_gemm.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/kernels.h"

namespace siesta::cuda {

Result<DeviceInfo> device_info(int device) {
  cudaDeviceProp p{};
  SIESTA_CUDA_TRY(cudaGetDeviceProperties(&p, device), "reading device properties");
  DeviceInfo info;
  info.name = p.name;
  info.sm_count = p.multiProcessorCount;
  info.memory_bytes = p.totalGlobalMem;
  info.l2_bytes = static_cast<size_t>(p.l2CacheSize);
  info.compute_capability = p.major * 10 + p.minor;
  SIESTA_CUDA_TRY(cudaDriverGetVersion(&info.driver_version), "reading the driver version");
  SIESTA_CUDA_TRY(cudaRuntimeGetVersion(&info.runtime_version), "reading the runtime version");
  return info;
}

namespace {

// Median of `iters` timings (ms) of fn on a fresh stream, after one warm-up.
template <class Fn>
Result<double> median_ms(int iters, cudaStream_t stream, Fn&& fn) {
  cudaEvent_t a = nullptr, b = nullptr;
  SIESTA_CUDA_TRY(cudaEventCreate(&a), "creating a timing event");
  SIESTA_CUDA_TRY(cudaEventCreate(&b), "creating a timing event");
  std::vector<float> ms;
  Result<void> status = fn();
  for (int i = 0; status && i < iters; ++i) {
    cudaEventRecord(a, stream);
    status = fn();
    cudaEventRecord(b, stream);
    if (cudaEventSynchronize(b) != cudaSuccess) status = cuda_result(cudaGetLastError(), "timing");
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  SIESTA_TRY(status);
  std::sort(ms.begin(), ms.end());
  return static_cast<double>(ms[ms.size() / 2]);
}

}  // namespace

Result<double> measure_copy_bandwidth(DeviceAllocator& alloc, size_t bytes, int iters) {
  SIESTA_ASSIGN_OR_RETURN(DeviceBuffer src, DeviceBuffer::allocate(alloc, bytes, DeviceMemoryTag::kScratch));
  SIESTA_ASSIGN_OR_RETURN(DeviceBuffer dst, DeviceBuffer::allocate(alloc, bytes, DeviceMemoryTag::kScratch));
  cudaStream_t stream = nullptr;
  SIESTA_CUDA_TRY(cudaStreamCreate(&stream), "creating a stream");
  SIESTA_CUDA_TRY(launch_fill_random_bf16(src.as<bf16>(), bytes / 2, 1, 1.0f, stream), "filling the copy source");
  auto ms = median_ms(iters, stream, [&]() -> Result<void> {
    return cuda_result(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream), "copy");
  });
  cudaStreamDestroy(stream);
  SIESTA_TRY(ms);
  return 2.0 * static_cast<double>(bytes) / (*ms * 1e-3) / 1e9;
}

Result<double> measure_bf16_gemm_tflops(DeviceAllocator& alloc, int n, int iters) {
  const size_t elems = static_cast<size_t>(n) * n;
  SIESTA_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::allocate(alloc, elems * 2, DeviceMemoryTag::kScratch));
  SIESTA_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::allocate(alloc, elems * 2, DeviceMemoryTag::kScratch));
  SIESTA_ASSIGN_OR_RETURN(DeviceBuffer y, DeviceBuffer::allocate(alloc, elems * 2, DeviceMemoryTag::kScratch));
  const size_t ws_bytes = 32u << 20;
  SIESTA_ASSIGN_OR_RETURN(DeviceBuffer ws, DeviceBuffer::allocate(alloc, ws_bytes, DeviceMemoryTag::kScratch));
  cudaStream_t stream = nullptr;
  SIESTA_CUDA_TRY(cudaStreamCreate(&stream), "creating a stream");
  SIESTA_CUDA_TRY(launch_fill_random_bf16(a.as<bf16>(), elems, 2, 1.0f, stream), "filling GEMM inputs");
  SIESTA_CUDA_TRY(launch_fill_random_bf16(w.as<bf16>(), elems, 3, 0.05f, stream), "filling GEMM inputs");
  auto gemm = CublasLtGemm::create(ws.data(), ws_bytes);
  if (!gemm) {
    cudaStreamDestroy(stream);
    return gemm.error();
  }
  auto ms = median_ms(iters, stream, [&]() -> Result<void> {
    return (*gemm)->run(a.as<bf16>(), w.as<bf16>(), y.data(), false, n, n, n, stream);
  });
  gemm->reset();
  cudaStreamDestroy(stream);
  SIESTA_TRY(ms);
  return 2.0 * static_cast<double>(n) * n * n / (*ms * 1e-3) / 1e12;
}

}  // namespace siesta::cuda
