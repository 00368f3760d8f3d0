// CudaDriver: the CUDA driver API functions the CUDA backend calls, loaded at
// run time (dlopen of libcuda.so.1, then cuGetProcAddress for the versions that
// match the headers we compiled against).
//
// Why not link libcuda: every siesta binary links the memory library, and a
// binary linked against libcuda does not even start on a machine without the
// NVIDIA driver (CI, the development machines). Loaded at run time, the same
// binary runs everywhere; only make_cuda_backend fails, with a message.
//
// Private to src/memory (it includes cuda.h, which public headers must not).
#pragma once

#include <cuda.h>

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace siesta::memory {

// X(name) for every function used. The names are the API names; cuda.h maps
// some to versioned symbols (cuMemGetInfo -> cuMemGetInfo_v2), which the
// member declarations follow and cuGetProcAddress resolves from the base name.
#define SIESTA_CUDA_DRIVER_FUNCTIONS(X)                                                                     \
  X(cuInit) X(cuDriverGetVersion) X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGetCount) X(cuDeviceGet) \
  X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDeviceTotalMem) X(cuDevicePrimaryCtxRetain)                \
  X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxSynchronize) X(cuMemGetInfo)                       \
  X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate)                \
  X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemExportToShareableHandle)               \
  X(cuMemImportFromShareableHandle) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemcpyHtoD) X(cuMemcpyDtoH)      \
  X(cuMemsetD8)

struct CudaDriver {
#define SIESTA_CUDA_DECLARE_(name) decltype(&::name) name = nullptr;
  SIESTA_CUDA_DRIVER_FUNCTIONS(SIESTA_CUDA_DECLARE_)
#undef SIESTA_CUDA_DECLARE_

  int driver_version = 0;  // e.g. 13000

  // Loads the driver and calls cuInit. kUnavailable when there is no driver
  // or no device, with a message that says which.
  static Result<std::unique_ptr<CudaDriver>> load();

  // "CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
  std::string error_text(CUresult result) const;

  // Ok, or a Status "<what>: <error text>": kOutOfMemory for out-of-memory
  // results, kIo for other refusals by the driver.
  Ok check(CUresult result, std::string_view what) const;
};

}  // namespace siesta::memory
