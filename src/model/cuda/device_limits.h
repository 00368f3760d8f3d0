// What the GPU itself can do, measured in the same run as a benchmark, so a
// result is read against this machine's ceilings (bench/cuda_qwen3_bench).
//
//   SIESTA_ASSIGN_OR_RETURN(DeviceInfo info, device_info(0));
//   SIESTA_ASSIGN_OR_RETURN(double gbps, measure_copy_bandwidth(alloc));       // (read + write) bytes / s
//   SIESTA_ASSIGN_OR_RETURN(double tflops, measure_bf16_gemm_tflops(alloc));   // cuBLASLt, random data
#pragma once

#include <cstddef>
#include <string>

#include "common/status.h"
#include "model/cuda/device_allocator.h"

namespace siesta::cuda {

struct DeviceInfo {
  std::string name;
  int sm_count = 0;
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;
  int driver_version = 0;   // e.g. 13000
  int runtime_version = 0;
  int compute_capability = 0;  // 90 for sm_90
};

Result<DeviceInfo> device_info(int device);

// Median over `iters` device-to-device copies of `bytes`, counting the bytes
// read plus the bytes written, in GB/s (1e9).
Result<double> measure_copy_bandwidth(DeviceAllocator& alloc, size_t bytes = size_t{2} << 30, int iters = 20);

// Median rate of an n x n x n bf16 GEMM (fp32 accumulation) through cuBLASLt on
// random inputs, in TFLOP/s (1e12).
Result<double> measure_bf16_gemm_tflops(DeviceAllocator& alloc, int n = 8192, int iters = 20);

}  // namespace siesta::cuda
