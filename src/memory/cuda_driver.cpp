#include "memory/cuda_driver.h"

#include <dlfcn.h>

#include <fmt/format.h>

namespace siesta::memory {

Result<std::unique_ptr<CudaDriver>> CudaDriver::load() {
  // Kept loaded for the life of the process: unloading the driver under live
  // contexts is not supported.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return unavailable(fmt::format("the NVIDIA driver is not installed here (dlopen libcuda.so.1: {}); the CUDA "
                                   "memory backend needs a GPU machine, use the host backend (--device cpu) otherwise",
                                   why ? why : "unknown error"));
  }
  auto get_proc = reinterpret_cast<decltype(&::cuGetProcAddress)>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    return unavailable("the NVIDIA driver is too old (no cuGetProcAddress_v2; CUDA 12 or newer is needed)");
  }
  auto driver = std::make_unique<CudaDriver>();
  auto resolve = [&](const char* name, int version, void** slot) -> Ok {
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = get_proc(name, slot, version, CU_GET_PROC_ADDRESS_DEFAULT, &found);
    if (r != CUDA_SUCCESS || found != CU_GET_PROC_ADDRESS_SUCCESS || *slot == nullptr) {
      return unavailable(fmt::format("the NVIDIA driver lacks {} (ABI of CUDA {}.{}; result {}, lookup {}); "
                                     "update the driver",
                                     name, version / 1000, version % 1000 / 10, static_cast<int>(r),
                                     static_cast<int>(found)));
    }
    return {};
  };
#define SIESTA_CUDA_RESOLVE_(name, version) SIESTA_TRY(resolve(#name, version, reinterpret_cast<void**>(&driver->name)));
  SIESTA_CUDA_DRIVER_FUNCTIONS(SIESTA_CUDA_RESOLVE_)
#undef SIESTA_CUDA_RESOLVE_

  CUresult init = driver->cuInit(0);
  if (init != CUDA_SUCCESS) {
    return unavailable(fmt::format("cuInit failed: {}; no usable CUDA device here (check nvidia-smi and "
                                   "CUDA_VISIBLE_DEVICES)",
                                   driver->error_text(init)));
  }
  SIESTA_TRY(driver->check(driver->cuDriverGetVersion(&driver->driver_version), "cuDriverGetVersion"));
  return driver;
}

std::string CudaDriver::error_text(CUresult result) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName) cuGetErrorName(result, &name);
  if (cuGetErrorString) cuGetErrorString(result, &text);
  return fmt::format("{} ({})", name ? name : fmt::format("CUresult {}", static_cast<int>(result)),
                     text ? text : "no description");
}

Ok CudaDriver::check(CUresult result, std::string_view what) const {
  if (result == CUDA_SUCCESS) return {};
  std::string message = fmt::format("{}: {}", what, error_text(result));
  if (result == CUDA_ERROR_OUT_OF_MEMORY) return out_of_memory(std::move(message));
  return io_error(std::move(message));
}

}  // namespace siesta::memory
