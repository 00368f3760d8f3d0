// ModelConfig: the parts of a Hugging Face Qwen3 config.json that siesta uses.
//
//   Result<ModelConfig> cfg = ModelConfig::load(model_dir);   // reads DIR/config.json
//   Result<ModelConfig> cfg = ModelConfig::from_json(json);   // already parsed
//
// Accepts both rope forms: top-level "rope_theta" (older transformers) and
// "rope_parameters": {"rope_theta", "rope_type": "default"} (newer). head_dim
// defaults to hidden_size / num_attention_heads when absent. Missing or
// inconsistent fields give a one-line error naming the field and the file.
// rope_type other than "default" (yarn, linear, ...), attention biases and
// sliding-window attention are refused: the forward does not implement them.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta {

struct ModelConfig {
  std::string model_type;        // "qwen3"
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;            // num_hidden_layers
  int num_heads = 0;             // num_attention_heads
  int num_kv_heads = 0;          // num_key_value_heads (GQA: num_heads % num_kv_heads == 0)
  int head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 0;
  int bos_token_id = -1;                 // -1 when absent or null
  std::vector<int32_t> eos_token_ids;    // config.json (int or list) + generation_config.json
  // The checkpoint's dtype ("dtype" or the older "torch_dtype"): "bfloat16",
  // "float16" or "float32" (the default when absent, as transformers loads).
  std::string dtype = "float32";

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }

  static Result<ModelConfig> from_json(const nlohmann::json& j, const std::string& source = "config.json");
  // Reads DIR/config.json, and DIR/generation_config.json for extra eos ids if present.
  static Result<ModelConfig> load(const std::filesystem::path& model_dir);
  nlohmann::json to_json() const;  // the HF layout, as make-model writes it

  bool operator==(const ModelConfig&) const = default;
};

// The fields an in-place weight update (reload_weights) must not change, as
// "name NEXT (loaded: LOADED)" joined by ", "; empty when the shapes match.
std::string architecture_differences(const ModelConfig& loaded, const ModelConfig& next);

}  // namespace siesta
