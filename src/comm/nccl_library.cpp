#include "comm/nccl_library.h"

#include <dlfcn.h>

#include <cstdlib>

#include <fmt/format.h>

#include "common/log.h"

namespace siesta::comm {

Result<std::unique_ptr<NcclLibrary>> NcclLibrary::load(const std::string& path) {
  // Kept loaded for the life of the process, like the driver.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return unavailable(fmt::format("NCCL is not installed here (dlopen {}: {}); tensor parallelism and weights "
                                   "over NCCL need it (the CUDA toolkit's libnccl.so.2 on the loader's path)",
                                   path, why ? why : "unknown error"));
  }
  auto nccl = std::make_unique<NcclLibrary>();
  nccl->path = path;
#define SIESTA_NCCL_RESOLVE_(name)                                                                    \
  nccl->name = reinterpret_cast<decltype(&::name)>(dlsym(lib, #name));                                \
  if (nccl->name == nullptr)                                                                          \
    return unavailable(fmt::format("{} has no {}: NCCL {}.{} or newer is needed", path, #name, NCCL_MAJOR, \
                                   NCCL_MINOR));
  SIESTA_NCCL_FUNCTIONS(SIESTA_NCCL_RESOLVE_)
#undef SIESTA_NCCL_RESOLVE_
  nccl->has_comm_suspend = dlsym(lib, "ncclCommSuspend") != nullptr && dlsym(lib, "ncclCommResume") != nullptr;
  SIESTA_TRY(nccl->check(nccl->ncclGetVersion(&nccl->version), "ncclGetVersion"));
  if (nccl->version / 10000 != NCCL_MAJOR)
    return unavailable(fmt::format("{} is NCCL {}, built against NCCL {}.{}: the major versions differ", path,
                                   nccl->version_text(), NCCL_MAJOR, NCCL_MINOR));
  return nccl;
}

std::string NcclLibrary::version_text() const {
  return fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100);
}

Ok NcclLibrary::check(ncclResult_t result, std::string_view what) const {
  if (result == ncclSuccess) return {};
  const char* text = ncclGetErrorString ? ncclGetErrorString(result) : nullptr;
  const char* last = ncclGetLastError ? ncclGetLastError(nullptr) : nullptr;
  return io_error(fmt::format("{}: NCCL error {} ({}){}{}", what, static_cast<int>(result),
                              text ? text : "no description", last && *last ? ": " : "", last ? last : ""));
}

std::string disable_nvls() {
  const char* was = std::getenv("NCCL_NVLS_ENABLE");
  std::string before = was ? was : "";
  if (before != "0") {
    if (!before.empty())
      SIESTA_LOG_WARN("NCCL_NVLS_ENABLE={} overridden to 0: siesta never lets NCCL create multicast objects", before);
    setenv("NCCL_NVLS_ENABLE", "0", 1);
  }
  return before;
}

}  // namespace siesta::comm
