// The device flags `siesta generate` and `siesta serve` share:
//   --device cpu|cuda                 where the model runs (default cpu)
//   --gpu-memory-utilization F        CUDA: fraction of the device's memory this engine may take (default 0.9);
//                                     the KV cache gets what is left after weights and activations
//   --kv-cache-memory-bytes N         the KV cache's size; takes precedence over --gpu-memory-utilization
//   --[no-]batch-invariant            CUDA: tokens independent of the batch (default on; the CPU model always is)
//   --tensor-parallel-size N, -tp N   ranks the model is sharded over (default 1); CPU only for N > 1
//
//   DeviceFlags flags;  flags.add_to(*cmd);        // when the command is built
//   SIESTA_TRY(flags.apply(engine_options));       // after parsing: checks and fills EngineOptions
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/engine_options.h"

namespace siesta::cli {

struct DeviceFlags {
  std::string device = "cpu";
  double gpu_memory_utilization = kDefaultGpuMemoryUtilization;
  std::string kv_cache_memory;
  bool batch_invariant = true;
  int64_t tensor_parallel_size = 1;
  CLI::Option* utilization_option = nullptr;
  CLI::Option* kv_bytes_option = nullptr;

  void add_to(CLI::App& cmd);
  // Fills options.device, gpu_memory_utilization, kv_cache_memory_bytes,
  // batch_invariant and tensor_parallel_size; errors name the flag.
  Result<void> apply(EngineOptions& options) const;
};

// vLLM's short spelling of --tensor-parallel-size: "-tp N" and "-tp=N"
// become "--tensor-parallel-size N" / "--tensor-parallel-size=N" (CLI11
// takes one-letter short names only). Other arguments are kept as they are.
std::vector<std::string> expand_short_tensor_parallel(int argc, const char* const* argv);

// "4294967296", "4G", "512M", "1.5GiB": K/M/G/T are powers of 1024 (with or
// without "iB"/"B"). Errors name `flag`.
Result<uint64_t> parse_byte_count(const std::string& flag, const std::string& text);

}  // namespace siesta::cli
