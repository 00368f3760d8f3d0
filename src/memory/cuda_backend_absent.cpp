// Compiled instead of cuda_backend.cpp when the build has no CUDA toolkit.
#include "memory/cuda_backend.h"

namespace siesta::memory {

const char* offload_mode_name(OffloadMode mode) { return mode == OffloadMode::kStaged ? "staged" : "pinned"; }

Result<std::unique_ptr<MemoryBackend>> make_cuda_backend(CudaBackendOptions /*options*/) {
  return unavailable("this siesta build has no CUDA support (nvcc was not found when it was configured); rebuild on "
                     "a machine with the CUDA toolkit to use the CUDA memory backend");
}

}  // namespace siesta::memory
