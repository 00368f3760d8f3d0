#include "model/config.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "common/json_depth.h"

namespace siesta {
namespace {

using nlohmann::json;

// Reads typed fields of one JSON object; every error names the field and the file.
class FieldReader {
 public:
  FieldReader(const json& obj, const std::string& source) : obj_(obj), source_(source) {}

  Status missing(std::string_view field) const {
    return invalid_argument(fmt::format("{}: missing required field \"{}\"", source_, field));
  }
  Status bad(std::string_view field, std::string_view what) const {
    return invalid_argument(fmt::format("{}: field \"{}\" {}", source_, field, what));
  }

  // nullptr when the field is absent or null (HF writes null for "not set").
  const json* find(const char* field) const {
    auto it = obj_.find(field);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Result<int> integer(const char* field, const json& v) const {
    if (!v.is_number_integer()) return bad(field, fmt::format("must be an integer, got {}", v.dump()));
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int>::max()))
        return bad(field, fmt::format("is out of range: {}", v.dump()));
    } else {
      auto x = v.get<int64_t>();
      if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
        return bad(field, fmt::format("is out of range: {}", v.dump()));
    }
    return v.get<int>();
  }

  Result<int> required_positive(const char* field) const {
    const json* v = find(field);
    if (!v) return missing(field);
    SIESTA_ASSIGN_OR_RETURN(int x, integer(field, *v));
    if (x <= 0) return bad(field, fmt::format("must be positive, got {}", x));
    return x;
  }

  Result<std::optional<int>> optional_positive(const char* field) const {
    const json* v = find(field);
    if (!v) return std::optional<int>{};
    SIESTA_ASSIGN_OR_RETURN(int x, integer(field, *v));
    if (x <= 0) return bad(field, fmt::format("must be positive, got {}", x));
    return std::optional<int>{x};
  }

  Result<double> positive_number(const char* field, const json& v) const {
    if (!v.is_number()) return bad(field, fmt::format("must be a number, got {}", v.dump()));
    double x = v.get<double>();
    if (!(x > 0)) return bad(field, fmt::format("must be positive, got {}", v.dump()));
    return x;
  }

  Result<bool> boolean(const char* field, bool fallback) const {
    const json* v = find(field);
    if (!v) return fallback;
    if (!v->is_boolean()) return bad(field, fmt::format("must be true or false, got {}", v->dump()));
    return v->get<bool>();
  }

  // A token id field that may be an int, a list of ints, or absent/null.
  Result<std::vector<int32_t>> token_ids(const char* field) const {
    std::vector<int32_t> ids;
    const json* v = find(field);
    if (!v) return ids;
    auto one = [&](const json& x) -> Result<void> {
      SIESTA_ASSIGN_OR_RETURN(int id, integer(field, x));
      if (id < 0) return bad(field, fmt::format("must be a token id >= 0, got {}", id));
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
      return {};
    };
    if (v->is_array()) {
      for (const json& x : *v) SIESTA_TRY(one(x));
    } else {
      SIESTA_TRY(one(*v));
    }
    return ids;
  }

 private:
  const json& obj_;
  const std::string& source_;
};

// rope_theta from either form; the newer "rope_parameters" wins when both are present
// (transformers >= 4.56 writes it and keeps reading the old one).
Result<double> read_rope_theta(const FieldReader& r) {
  // Older configs carry scaling in "rope_scaling"; anything but the plain rotation is refused.
  for (const char* field : {"rope_parameters", "rope_scaling"}) {
    const json* p = r.find(field);
    if (!p) continue;
    if (!p->is_object()) return r.bad(field, fmt::format("must be an object, got {}", p->dump()));
    for (const char* type_key : {"rope_type", "type"}) {
      auto it = p->find(type_key);
      if (it == p->end() || it->is_null()) continue;
      if (!it->is_string() || it->get<std::string>() != "default")
        return r.bad(fmt::format("{}.{}", field, type_key),
                     fmt::format("is {}: only \"default\" rotary embeddings are supported (no yarn, linear, "
                                 "dynamic or other scaling)",
                                 it->dump()));
    }
  }
  if (const json* p = r.find("rope_parameters")) {
    auto it = p->find("rope_theta");
    if (it != p->end() && !it->is_null()) return r.positive_number("rope_parameters.rope_theta", *it);
  }
  if (const json* v = r.find("rope_theta")) return r.positive_number("rope_theta", *v);
  return r.missing("rope_theta");  // in neither rope_parameters nor the top level
}

Result<json> read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(fmt::format("{}: cannot open", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return io_error(fmt::format("{}: read failed", path.string()));
  Result<json> j = parse_json(ss.str());
  if (!j) return Status{j.error().code, fmt::format("{}: {}", path.string(), j.error().message)};
  return j;
}

}  // namespace

Result<ModelConfig> ModelConfig::from_json(const json& j, const std::string& source) {
  if (!j.is_object()) return invalid_argument(fmt::format("{}: expected a JSON object", source));
  FieldReader r(j, source);
  ModelConfig c;

  const json* type = r.find("model_type");
  if (!type) return r.missing("model_type");
  if (!type->is_string() || type->get<std::string>() != "qwen3")
    return r.bad("model_type", fmt::format("is {}: siesta serves \"qwen3\" checkpoints only", type->dump()));
  c.model_type = "qwen3";

  SIESTA_ASSIGN_OR_RETURN(c.vocab_size, r.required_positive("vocab_size"));
  SIESTA_ASSIGN_OR_RETURN(c.hidden_size, r.required_positive("hidden_size"));
  SIESTA_ASSIGN_OR_RETURN(c.intermediate_size, r.required_positive("intermediate_size"));
  SIESTA_ASSIGN_OR_RETURN(c.num_layers, r.required_positive("num_hidden_layers"));
  SIESTA_ASSIGN_OR_RETURN(c.num_heads, r.required_positive("num_attention_heads"));
  SIESTA_ASSIGN_OR_RETURN(c.max_position_embeddings, r.required_positive("max_position_embeddings"));

  // As in HF Qwen3Config: no num_key_value_heads means one KV head per query head.
  SIESTA_ASSIGN_OR_RETURN(auto kv_heads, r.optional_positive("num_key_value_heads"));
  c.num_kv_heads = kv_heads.value_or(c.num_heads);
  if (c.num_heads % c.num_kv_heads != 0)
    return r.bad("num_key_value_heads",
                 fmt::format("({}) must divide num_attention_heads ({}) for grouped-query attention",
                             c.num_kv_heads, c.num_heads));

  SIESTA_ASSIGN_OR_RETURN(auto head_dim, r.optional_positive("head_dim"));
  if (head_dim) {
    c.head_dim = *head_dim;
  } else {
    if (c.hidden_size % c.num_heads != 0)
      return r.bad("head_dim", fmt::format("is absent and hidden_size {} is not a multiple of num_attention_heads {}",
                                           c.hidden_size, c.num_heads));
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0) return r.bad("head_dim", fmt::format("must be even for rotary embeddings, got {}", c.head_dim));

  if (const json* eps = r.find("rms_norm_eps")) {
    SIESTA_ASSIGN_OR_RETURN(c.rms_norm_eps, r.positive_number("rms_norm_eps", *eps));
  }
  SIESTA_ASSIGN_OR_RETURN(c.rope_theta, read_rope_theta(r));
  SIESTA_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.boolean("tie_word_embeddings", false));

  // Features the forward does not implement: refuse rather than compute something else.
  SIESTA_ASSIGN_OR_RETURN(bool attention_bias, r.boolean("attention_bias", false));
  if (attention_bias) return r.bad("attention_bias", "is true: attention biases are not supported");
  SIESTA_ASSIGN_OR_RETURN(bool sliding, r.boolean("use_sliding_window", false));
  if (sliding) return r.bad("use_sliding_window", "is true: sliding-window attention is not supported");
  if (const json* act = r.find("hidden_act"); act && (!act->is_string() || act->get<std::string>() != "silu"))
    return r.bad("hidden_act", fmt::format("is {}: only \"silu\" is supported", act->dump()));

  for (const char* key : {"dtype", "torch_dtype"}) {
    const json* d = r.find(key);
    if (d == nullptr || d->is_null()) continue;
    if (!d->is_string()) return r.bad(key, fmt::format("is {}: expected a dtype name", d->dump()));
    const std::string name = d->get<std::string>();
    if (name != "bfloat16" && name != "float16" && name != "float32")
      return r.bad(key, fmt::format("is \"{}\": expected bfloat16, float16 or float32", name));
    c.dtype = name;
    break;
  }

  SIESTA_ASSIGN_OR_RETURN(auto bos, r.token_ids("bos_token_id"));
  if (bos.size() > 1) return r.bad("bos_token_id", "must be a single token id");
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  SIESTA_ASSIGN_OR_RETURN(c.eos_token_ids, r.token_ids("eos_token_id"));
  for (int32_t id : c.eos_token_ids)
    if (id >= c.vocab_size)
      return r.bad("eos_token_id", fmt::format("{} is not below vocab_size {}", id, c.vocab_size));
  if (c.bos_token_id >= c.vocab_size)
    return r.bad("bos_token_id", fmt::format("{} is not below vocab_size {}", c.bos_token_id, c.vocab_size));
  return c;
}

Result<ModelConfig> ModelConfig::load(const std::filesystem::path& model_dir) {
  const auto config_path = model_dir / "config.json";
  SIESTA_ASSIGN_OR_RETURN(json j, read_json_file(config_path));
  SIESTA_ASSIGN_OR_RETURN(ModelConfig c, from_json(j, config_path.string()));

  // generation_config.json may name more stop tokens (Qwen3: <|im_end|> and <|endoftext|>).
  const auto gen_path = model_dir / "generation_config.json";
  std::error_code ec;
  if (std::filesystem::exists(gen_path, ec)) {
    SIESTA_ASSIGN_OR_RETURN(json g, read_json_file(gen_path));
    if (!g.is_object()) return invalid_argument(fmt::format("{}: expected a JSON object", gen_path.string()));
    const std::string gen_source = gen_path.string();
    FieldReader r(g, gen_source);
    SIESTA_ASSIGN_OR_RETURN(auto eos, r.token_ids("eos_token_id"));
    for (int32_t id : eos) {
      if (id >= c.vocab_size)
        return r.bad("eos_token_id", fmt::format("{} is not below vocab_size {}", id, c.vocab_size));
      if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
        c.eos_token_ids.push_back(id);
    }
  }
  return c;
}

json ModelConfig::to_json() const {
  json layer_types = json::array();
  for (int i = 0; i < num_layers; ++i) layer_types.push_back("full_attention");
  json eos = eos_token_ids.size() == 1 ? json(eos_token_ids[0]) : json(eos_token_ids);
  if (eos_token_ids.empty()) eos = nullptr;
  return json{
      {"architectures", json::array({"Qwen3ForCausalLM"})},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"bos_token_id", bos_token_id >= 0 ? json(bos_token_id) : json(nullptr)},
      {"dtype", dtype},
      {"torch_dtype", dtype},  // the name transformers < 4.56 reads
      {"eos_token_id", eos},
      {"head_dim", head_dim},
      {"hidden_act", "silu"},
      {"hidden_size", hidden_size},
      {"initializer_range", 0.02},
      {"intermediate_size", intermediate_size},
      {"layer_types", layer_types},
      {"max_position_embeddings", max_position_embeddings},
      {"max_window_layers", num_layers},
      {"model_type", "qwen3"},
      {"num_attention_heads", num_heads},
      {"num_hidden_layers", num_layers},
      {"num_key_value_heads", num_kv_heads},
      {"rms_norm_eps", rms_norm_eps},
      {"rope_parameters", {{"rope_theta", rope_theta}, {"rope_type", "default"}}},
      {"rope_scaling", nullptr},
      {"rope_theta", rope_theta},  // for readers older than rope_parameters
      {"sliding_window", nullptr},
      {"tie_word_embeddings", tie_word_embeddings},
      {"use_cache", true},
      {"use_sliding_window", false},
      {"vocab_size", vocab_size},
  };
}

std::string architecture_differences(const ModelConfig& loaded, const ModelConfig& next) {
  std::string out;
  auto field = [&](const char* name, auto a, auto b) {
    if (a == b) return;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {} (loaded: {})", name, b, a);
  };
  field("model_type", loaded.model_type, next.model_type);
  field("vocab_size", loaded.vocab_size, next.vocab_size);
  field("hidden_size", loaded.hidden_size, next.hidden_size);
  field("intermediate_size", loaded.intermediate_size, next.intermediate_size);
  field("num_hidden_layers", loaded.num_layers, next.num_layers);
  field("num_attention_heads", loaded.num_heads, next.num_heads);
  field("num_key_value_heads", loaded.num_kv_heads, next.num_kv_heads);
  field("head_dim", loaded.head_dim, next.head_dim);
  field("tie_word_embeddings", loaded.tie_word_embeddings, next.tie_word_embeddings);
  field("rms_norm_eps", loaded.rms_norm_eps, next.rms_norm_eps);
  field("rope_theta", loaded.rope_theta, next.rope_theta);
  field("dtype", loaded.dtype, next.dtype);
  return out;
}

}  // namespace siesta
