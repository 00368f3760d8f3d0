#include "cli/device_flags.h"

#include <cctype>
#include <cstdint>
#include <exception>

#include <fmt/format.h>

namespace siesta::cli {

void DeviceFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--device", device,
                 "Where the model runs: cpu (fp32 reference), cuda (bf16, GPU 0) or cuda:N (GPU N)")
      ->check([](const std::string& text) -> std::string {
        auto spec = parse_device_spec(text);
        if (spec) return {};
        std::string why = spec.error().message;  // CLI11 names the option itself
        return why.rfind("--device: ", 0) == 0 ? why.substr(10) : why;
      })
      ->capture_default_str();
  utilization_option = cmd.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                                      "--device cuda: fraction of the GPU's memory to use; the KV cache gets what "
                                      "weights and activations leave")
                           ->capture_default_str();
  kv_bytes_option = cmd.add_option("--kv-cache-memory-bytes", kv_cache_memory,
                                   "KV cache size in bytes (K, M, G suffixes: powers of 1024); takes precedence over "
                                   "--gpu-memory-utilization (CPU default 4G)");
  cmd.add_flag("--batch-invariant,!--no-batch-invariant", batch_invariant,
               "--device cuda: a request's tokens do not depend on what else is batched with it (the default; "
               "--no-batch-invariant: cuBLASLt and split-KV decode attention, faster at some shapes, results that "
               "change with the batch); the CPU model always is");
  cmd.add_option("--tensor-parallel-size", tensor_parallel_size,
                 "Ranks the model is sharded over (also -tp; vLLM's layout: each rank holds its shard of every "
                 "tensor). --device cpu: the ranks run in this process over one KV cache and give the logits of 1; "
                 "--device cuda: 1 only (not built yet)")
      ->capture_default_str();
}

Result<void> DeviceFlags::apply(EngineOptions& options) const {
  SIESTA_ASSIGN_OR_RETURN(DeviceSpec spec, parse_device_spec(device));
  options.device = spec.device;
  options.cuda_device = spec.cuda_device;
  SIESTA_TRY(validate_gpu_memory_utilization(gpu_memory_utilization));
  if (options.device == Device::kCpu && utilization_option != nullptr && utilization_option->count() > 0)
    return invalid_argument("--gpu-memory-utilization applies to --device cuda only; on the CPU size the KV cache "
                            "with --kv-cache-memory-bytes");
  options.gpu_memory_utilization = gpu_memory_utilization;
  if (!kv_cache_memory.empty()) {
    SIESTA_ASSIGN_OR_RETURN(uint64_t bytes, parse_byte_count("--kv-cache-memory-bytes", kv_cache_memory));
    options.kv_cache_memory_bytes = bytes;
  }
  options.batch_invariant = batch_invariant;
  if (tensor_parallel_size < 1 || tensor_parallel_size > INT32_MAX)
    return invalid_argument(fmt::format("--tensor-parallel-size must be at least 1, got {}", tensor_parallel_size));
  options.tensor_parallel_size = static_cast<int32_t>(tensor_parallel_size);
  return validate_tensor_parallel_size(options);
}

std::vector<std::string> expand_short_tensor_parallel(int argc, const char* const* argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && a == "-tp") a = "--tensor-parallel-size";
    else if (i > 0 && a.rfind("-tp=", 0) == 0) a = "--tensor-parallel-size=" + a.substr(4);
    args.push_back(std::move(a));
  }
  return args;
}

Result<uint64_t> parse_byte_count(const std::string& flag, const std::string& text) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    return invalid_argument(flag + ": expected a byte count such as 4294967296 or 4G, got '" + text + "'");
  }
  std::string unit = text.substr(pos);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() > 1 && unit.back() == 'B') unit.pop_back();
  if (unit.size() > 1 && unit.back() == 'I') unit.pop_back();
  double scale = 1;
  if (unit == "K") scale = 1024.0;
  else if (unit == "M") scale = 1024.0 * 1024;
  else if (unit == "G") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (!unit.empty() && unit != "B")
    return invalid_argument(flag + ": unknown unit '" + text.substr(pos) + "' (use K, M, G or T)");
  if (!(v > 0)) return invalid_argument(flag + " must be positive, got '" + text + "'");
  return static_cast<uint64_t>(v * scale);
}

}  // namespace siesta::cli
