#include "model/cuda/cublaslt_gemm.h"

#include <string>

#include "model/cuda/cuda_check.h"

namespace siesta::cuda {

Result<std::unique_ptr<CublasLtGemm>> CublasLtGemm::create(void* workspace, size_t workspace_bytes) {
  std::unique_ptr<CublasLtGemm> g(new CublasLtGemm());
  SIESTA_CUBLAS_TRY(cublasLtCreate(&g->handle_), "creating the cuBLASLt handle");
  g->workspace_ = workspace;
  g->workspace_bytes_ = workspace_bytes;
  return g;
}

CublasLtGemm::~CublasLtGemm() {
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  if (handle_) cublasLtDestroy(handle_);
}

Result<CublasLtGemm::Plan*> CublasLtGemm::plan(int M, int N, int K, bool out_f32) {
  const auto key = std::make_tuple(M, N, K, out_f32);
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;

  // Column-major view of the row-major problem: y^T [N, M] = w [N, K] (as
  // the transpose of the stored K x N) times x^T [K, M].
  Plan p;
  SIESTA_CUBLAS_TRY(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cuBLASLt matmul descriptor");
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  SIESTA_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)),
                    "cuBLASLt transa");
  SIESTA_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)),
                    "cuBLASLt transb");
  SIESTA_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, K, N, K), "cuBLASLt layout of w");
  SIESTA_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, K, M, K), "cuBLASLt layout of x");
  SIESTA_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p.c, out_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, N),
                    "cuBLASLt layout of y");

  cublasLtMatmulPreference_t pref = nullptr;
  SIESTA_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref), "cuBLASLt preference");
  const size_t ws = workspace_bytes_;
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
    return internal_error("cuBLASLt has no bf16 algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                          " K=" + std::to_string(K) + (st != CUBLAS_STATUS_SUCCESS
                                                           ? std::string(": ") + cublasLtGetStatusString(st)
                                                           : std::string()));
  }
  p.algo = result.algo;
  return &plans_.emplace(key, p).first->second;
}

Result<void> CublasLtGemm::run(const bf16* x, const bf16* w, void* y, bool out_f32, int M, int N, int K,
                               cudaStream_t stream) {
  if (M <= 0) return {};
  SIESTA_ASSIGN_OR_RETURN(Plan * p, plan(M, N, K, out_f32));
  const float alpha = 1.0f, beta = 0.0f;
  SIESTA_CUBLAS_TRY(cublasLtMatmul(handle_, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y, p->c, &p->algo,
                                   workspace_, workspace_bytes_, stream),
                    "cuBLASLt matmul");
  return {};
}

}  // namespace siesta::cuda
