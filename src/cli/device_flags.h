// The device flags `siesta generate` and `siesta serve` share:
//   --device cpu|cuda                 where the model runs (default cpu)
//   --gpu-memory-utilization F        CUDA: fraction of the device's memory this engine may take (default 0.9);
//                                     the KV cache gets what is left after weights and activations
//   --kv-cache-memory-bytes N         the KV cache's size; takes precedence over --gpu-memory-utilization
//   --[no-]batch-invariant            CUDA: tokens independent of the batch (default on; the CPU model always is)
//
//   DeviceFlags flags;  flags.add_to(*cmd);        // when the command is built
//   SIESTA_TRY(flags.apply(engine_options));       // after parsing: checks and fills EngineOptions
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/engine_options.h"

namespace siesta::cli {

struct DeviceFlags {
  std::string device = "cpu";
  double gpu_memory_utilization = kDefaultGpuMemoryUtilization;
  std::string kv_cache_memory;
  bool batch_invariant = true;
  CLI::Option* utilization_option = nullptr;
  CLI::Option* kv_bytes_option = nullptr;

  void add_to(CLI::App& cmd);
  // Fills options.device, gpu_memory_utilization, kv_cache_memory_bytes and
  // batch_invariant; errors name the flag.
  Result<void> apply(EngineOptions& options) const;
};

// "4294967296", "4G", "512M", "1.5GiB": K/M/G/T are powers of 1024 (with or
// without "iB"/"B"). Errors name `flag`.
Result<uint64_t> parse_byte_count(const std::string& flag, const std::string& text);

}  // namespace siesta::cli
