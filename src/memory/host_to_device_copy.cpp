#include "memory/host_to_device_copy.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "common/log.h"

namespace siesta::memory {

const char* host_to_device_copy_name(HostToDeviceCopy copy) {
  switch (copy) {
    case HostToDeviceCopy::kKernel: return "kernel";
    case HostToDeviceCopy::kCopyEngine: return "copy_engine";
  }
  return "unknown";
}

Result<HostToDeviceCopy> parse_host_to_device_copy(std::string_view name) {
  if (name == "kernel") return HostToDeviceCopy::kKernel;
  if (name == "copy_engine") return HostToDeviceCopy::kCopyEngine;
  return invalid_argument(fmt::format("host-to-device copy '{}' is not known: use 'kernel' (the SMs read the pinned "
                                      "host memory) or 'copy_engine' (cuMemcpyHtoDAsync)",
                                      name));
}

HostToDeviceCopy resolve_host_to_device_copy(std::optional<HostToDeviceCopy> chosen) {
  if (chosen) return *chosen;
  const char* env = std::getenv(kHostToDeviceCopyEnv);
  if (env == nullptr || *env == '\0') return HostToDeviceCopy::kKernel;
  Result<HostToDeviceCopy> parsed = parse_host_to_device_copy(env);
  if (parsed) return *parsed;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    SIESTA_LOG_WARN("{}: {}; copying with the kernel", kHostToDeviceCopyEnv, parsed.error().message);
  return HostToDeviceCopy::kKernel;
}

}  // namespace siesta::memory
