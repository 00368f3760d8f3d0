// Turning CUDA and cuBLAS return codes into Status values (host code only).
//
//   SIESTA_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream), "uploading step metadata");
//   SIESTA_CUBLAS_TRY(cublasLtMatmul(...), "QKV projection");
//
// Every CUDA call in src/model/cuda goes through one of these: a failed call
// becomes an error naming what was being done and the CUDA error string.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "common/status.h"

namespace siesta::cuda {

inline Result<void> cuda_result(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return {};
  const ErrorCode code = err == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kInternal;
  return Status{code, std::string(what) + ": CUDA error " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

inline Result<void> cublas_result(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return {};
  return internal_error(std::string(what) + ": cuBLAS error " + cublasLtGetStatusName(st) + " (" +
                        cublasLtGetStatusString(st) + ")");
}

}  // namespace siesta::cuda

#define SIESTA_CUDA_TRY(expr, what) SIESTA_TRY(::siesta::cuda::cuda_result((expr), (what)))
#define SIESTA_CUBLAS_TRY(expr, what) SIESTA_TRY(::siesta::cuda::cublas_result((expr), (what)))
