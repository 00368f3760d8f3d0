// Compiled instead of engine_model_cuda.cpp when the build has no CUDA toolkit.
#include "engine/engine_model.h"

namespace siesta {

Result<EngineModel> load_cuda_engine_model(const EngineOptions& /*options*/,
                                           std::unique_ptr<memory::MemoryPool> /*pool*/) {
  return unavailable("--device cuda: this siesta build has no CUDA support (nvcc was not found when it was "
                     "configured); rebuild on a machine with the CUDA toolkit, or use --device cpu");
}

}  // namespace siesta
