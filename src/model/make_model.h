// make-model: writes a random-weight Qwen3 checkpoint in the Hugging Face layout,
// so that benchmarks and tests can run full-size models without downloading one.
//
//   MakeModelOptions opts{.shape = "qwen3-8b", .out_dir = dir, .seed = 7, .tokenizer = tok_json};
//   Result<void> r = make_model(opts);
//
// DIR gets config.json, generation_config.json, tokenizer.json (+ tokenizer_config.json),
// and bf16 weights: model.safetensors, or model-0000N-of-0000M.safetensors shards plus
// model.safetensors.index.json once the weights pass max_shard_bytes. Weights are a pure
// function of (seed, tensor name, element index): the same seed gives the same bytes on
// any machine and any thread count. They are generated and written a chunk at a time, so
// an 8B checkpoint needs tens of MB of memory, not 16 GB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace siesta {

// A named model shape: what config.json and generation_config.json say.
struct ModelShape {
  std::string name;
  ModelConfig config;                           // eos_token_ids as config.json writes them
  std::vector<int32_t> generation_eos_token_ids;  // generation_config.json's list
  int pad_token_id = -1;                        // -1: none
};

// "tiny" (the shape of models/tiny-qwen3), and the Qwen/Qwen3 dense models' shapes: "qwen3-0.6b",
// "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b" (GQA group 5), "qwen3-32b".
std::vector<std::string> model_shape_names();
Result<ModelShape> model_shape(std::string_view name);

// Every tensor of a Qwen3 checkpoint with its HF name and shape, in HF's state-dict order:
// model.embed_tokens.weight, per layer the attention, MLP and norms, model.norm.weight, and
// lm_head.weight unless the embeddings are tied.
std::vector<TensorSpec> qwen3_tensor_specs(const ModelConfig& cfg, DType dtype = DType::kBF16);

struct MakeModelOptions {
  std::string shape = "tiny";
  std::filesystem::path out_dir;   // must not exist, or be an empty directory
  uint64_t seed = 0;
  int layers = 0;                   // > 0: this many decoder layers instead of the shape's (smaller tests)
  std::filesystem::path tokenizer;  // a tokenizer.json; a tokenizer_config.json beside it is copied too
  uint64_t max_shard_bytes = 4ull << 30;  // a file holds at most this much (one larger tensor gets its own)
  size_t threads = 0;                     // generator threads; 0 = every core, at least 2
  std::function<void(std::string_view line)> progress;  // told after each file is written
};

Result<void> make_model(const MakeModelOptions& options);

}  // namespace siesta
