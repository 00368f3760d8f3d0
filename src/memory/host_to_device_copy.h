// HostToDeviceCopy: how host->device copies out of pinned host memory run:
// the CUDA backend's restores at wake (kept offload buffers, the staging
// ring's slots) and the CUDA model's checkpoint reads (its pinned slots).
//
//   kKernel      the SMs copy (the gather kernel, gather/gather_copy.h),
//                reading the host memory through its device mapping
//   kCopyEngine  cuMemcpyHtoDAsync / cudaMemcpyAsync (the copy engines)
//
// Why the kernel by default: on the H200 machine, host->device copies by the
// copy engines run at ~29-33 GB/s for seconds after a large device range
// (the KV cache) was released and mapped again, as every wake does, against
// ~55 GB/s idle; SM loads of the same pinned host memory run at ~51 GB/s
// either way (bench/probes/h2d_remap_probe.cpp,
// bench/results/h2d_remap_probe_h200.txt). Device->host copies (sleep) stay
// on the copy engines, which keep ~55 GB/s there.
//
// Where a caller does not choose (the engine does not), the environment
// variable SIESTA_HOST_TO_DEVICE_COPY does ("kernel" or "copy_engine"), so
// that a benchmark can compare the two through a whole engine; unset, the
// kernel.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "common/status.h"

namespace siesta::memory {

enum class HostToDeviceCopy : uint8_t {
  kKernel = 0,
  kCopyEngine = 1,
};

inline constexpr const char* kHostToDeviceCopyEnv = "SIESTA_HOST_TO_DEVICE_COPY";

// "kernel", "copy_engine".
const char* host_to_device_copy_name(HostToDeviceCopy copy);

// The inverse of host_to_device_copy_name; another name is kInvalidArgument
// with a message that lists both.
Result<HostToDeviceCopy> parse_host_to_device_copy(std::string_view name);

// `chosen` if set, else SIESTA_HOST_TO_DEVICE_COPY if set (a value that does
// not parse is logged, once, and ignored), else kKernel.
HostToDeviceCopy resolve_host_to_device_copy(std::optional<HostToDeviceCopy> chosen = std::nullopt);

}  // namespace siesta::memory
