// CublasLtGemm: the projections outside batch-invariant mode, through cuBLASLt.
//
//   SIESTA_ASSIGN_OR_RETURN(auto gemm, CublasLtGemm::create(workspace, workspace_bytes));
//   SIESTA_TRY(gemm->run(x, w, y, /*out_f32=*/false, M, N, K, stream));   // y = x w^T
//
// x is [M, K] and w [N, K], row-major bf16 (HF Linear layout); y is [M, N]
// bf16 or fp32; accumulation in fp32 (CUBLAS_COMPUTE_32F). Descriptors and the
// heuristic's algorithm are cached per (M, N, K, output type), so a call after
// the first does no host-side search and is safe inside CUDA graph capture.
// One instance per stream/thread.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <tuple>

#include "common/status.h"
#include "model/cuda/kernels.h"

namespace siesta::cuda {

class CublasLtGemm {
 public:
  static Result<std::unique_ptr<CublasLtGemm>> create(void* workspace, size_t workspace_bytes);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  Result<void> run(const bf16* x, const bf16* w, void* y, bool out_f32, int M, int N, int K, cudaStream_t stream);

 private:
  CublasLtGemm() = default;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Result<Plan*> plan(int M, int N, int K, bool out_f32);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int, int, bool>, Plan> plans_;
};

}  // namespace siesta::cuda
