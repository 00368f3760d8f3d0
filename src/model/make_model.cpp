#include "model/make_model.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "common/thread_pool.h"

namespace siesta {
namespace {

using nlohmann::json;

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

constexpr size_t kChunkElems = size_t{1} << 22;  // 8 MB of bf16 per write
constexpr float kWeightStd = 0.02f;              // HF's initializer_range for Qwen3

uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

// Counter-based generator: element i of a tensor is a function of (seed, name, i) alone,
// so chunks can be generated in any order on any number of threads.
class WeightStream {
 public:
  WeightStream(uint64_t seed, std::string_view name, float mean)
      : key_(mix64(seed ^ mix64(fnv1a(name)))), mean_(mean) {}

  // Irwin-Hall: the sum of four 16-bit uniforms, centred and scaled to std 0.02. Close to a
  // normal, bounded at 3.5 sigma, and far cheaper than Box-Muller for billions of values.
  float operator()(uint64_t i) const {
    uint64_t r = mix64(key_ + (i + 1) * 0x9e3779b97f4a7c15ull);
    int64_t s = static_cast<int64_t>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
    constexpr float kSumStd = 37837.23f;  // sqrt(4 * (65536^2 - 1) / 12)
    return mean_ + static_cast<float>(s - 131070) * (kWeightStd / kSumStd);
  }

 private:
  uint64_t key_;
  float mean_;
};

bool is_norm(std::string_view name) {
  return name.ends_with("norm.weight");  // input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm
}

Result<void> write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return io_error(fmt::format("{}: write failed", path.string()));
  return {};
}

Result<json> read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(fmt::format("{}: cannot open", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    return corrupt(fmt::format("{}: not valid JSON: {}", path.string(), e.what()));
  }
}

// The tokenizer must fit the shape: every token id below vocab_size, and the special
// tokens the configs name must exist. Returns the added tokens' id -> text.
Result<std::map<int64_t, std::string>> check_tokenizer(const std::filesystem::path& path, const ModelShape& shape) {
  SIESTA_ASSIGN_OR_RETURN(json tok, read_json(path));
  std::map<int64_t, std::string> added;
  int64_t max_id = -1;
  try {
    for (const auto& [text, id] : tok.at("model").at("vocab").items()) max_id = std::max(max_id, id.get<int64_t>());
    for (const json& t : tok.at("added_tokens")) {
      added[t.at("id").get<int64_t>()] = t.at("content").get<std::string>();
      max_id = std::max(max_id, t.at("id").get<int64_t>());
    }
  } catch (const json::exception& e) {
    return corrupt(fmt::format("{}: not a Hugging Face tokenizer.json (model.vocab, added_tokens): {}", path.string(), e.what()));
  }
  const ModelConfig& c = shape.config;
  if (max_id >= c.vocab_size)
    return invalid_argument(fmt::format("{}: has token id {}, but shape {} has vocab_size {}; pass a tokenizer for this shape",
                                        path.string(), max_id, shape.name, c.vocab_size));
  std::vector<int64_t> special(c.eos_token_ids.begin(), c.eos_token_ids.end());
  special.insert(special.end(), shape.generation_eos_token_ids.begin(), shape.generation_eos_token_ids.end());
  if (c.bos_token_id >= 0) special.push_back(c.bos_token_id);
  for (int64_t id : special)
    if (!added.count(id))
      return invalid_argument(fmt::format("{}: has no special token with id {}, which shape {} uses as bos/eos",
                                          path.string(), id, shape.name));
  return added;
}

Result<void> check_out_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return {};
  if (!std::filesystem::is_directory(dir, ec)) return conflict(fmt::format("{}: exists and is not a directory", dir.string()));
  if (!std::filesystem::is_empty(dir, ec) || ec)
    return conflict(fmt::format("{}: exists and is not empty; give a new or empty directory", dir.string()));
  return {};
}

// Splits the tensors into files of at most max_bytes, in order, as HF's save_pretrained does.
std::vector<std::vector<TensorSpec>> plan_shards(const std::vector<TensorSpec>& specs, uint64_t max_bytes) {
  std::vector<std::vector<TensorSpec>> shards(1);
  uint64_t current = 0;
  for (const TensorSpec& t : specs) {
    uint64_t n = t.nbytes().value();
    if (!shards.back().empty() && current + n > max_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(t);
    current += n;
  }
  return shards;
}

Result<void> write_tensor(SafetensorsWriter& writer, const TensorSpec& spec, uint64_t seed, ThreadPool& pool,
                          std::vector<uint16_t>& buf) {
  const WeightStream stream(seed, spec.name, is_norm(spec.name) ? 1.0f : 0.0f);
  SIESTA_ASSIGN_OR_RETURN(size_t nbytes, spec.nbytes());
  const size_t numel = nbytes / sizeof(uint16_t);
  for (size_t begin = 0; begin < numel; begin += kChunkElems) {
    const size_t n = std::min(kChunkElems, numel - begin);
    pool.parallel_for(
        n,
        [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) buf[i] = f32_to_bf16(stream(begin + i));
        },
        size_t{1} << 16);
    SIESTA_TRY(writer.append(std::as_bytes(std::span<const uint16_t>(buf.data(), n))));
  }
  return {};
}

Result<void> write_weights(const MakeModelOptions& opts, const ModelShape& shape) {
  const auto specs = qwen3_tensor_specs(shape.config, DType::kBF16);
  const auto shards = plan_shards(specs, opts.max_shard_bytes);
  const size_t threads = opts.threads ? opts.threads : std::max<size_t>(2, std::thread::hardware_concurrency());
  ThreadPool pool(threads);
  std::vector<uint16_t> buf(kChunkElems);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};

  json weight_map = json::object();
  uint64_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file =
        shards.size() == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    SIESTA_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::create(opts.out_dir / file, shards[s], metadata));
    for (const TensorSpec& spec : shards[s]) {
      SIESTA_TRY(write_tensor(writer, spec, opts.seed, pool, buf));
      weight_map[spec.name] = file;
    }
    SIESTA_TRY(writer.finish());
    total += writer.data_bytes();
    if (opts.progress) opts.progress(fmt::format("wrote {} ({:.2f} GiB)", file, writer.data_bytes() / double(1ull << 30)));
  }
  if (shards.size() > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    SIESTA_TRY(write_text(opts.out_dir / "model.safetensors.index.json", index.dump(2) + "\n"));
  }
  return {};
}

Result<void> write_tokenizer(const MakeModelOptions& opts, const ModelShape& shape,
                             const std::map<int64_t, std::string>& added) {
  std::error_code ec;
  std::filesystem::copy_file(opts.tokenizer, opts.out_dir / "tokenizer.json", ec);
  if (ec) return io_error(fmt::format("copying {}: {}", opts.tokenizer.string(), ec.message()));
  const auto sibling = opts.tokenizer.parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(sibling, ec)) {
    std::filesystem::copy_file(sibling, opts.out_dir / "tokenizer_config.json", ec);
    if (ec) return io_error(fmt::format("copying {}: {}", sibling.string(), ec.message()));
    return {};
  }
  // No tokenizer_config.json to copy: write the fields HF's AutoTokenizer needs.
  const ModelConfig& c = shape.config;
  json cfg = {{"tokenizer_class", "Qwen2Tokenizer"},
              {"eos_token", added.at(c.eos_token_ids.at(0))},
              {"model_max_length", c.max_position_embeddings},
              {"add_bos_token", false}};
  cfg["pad_token"] = shape.pad_token_id >= 0 ? json(added.at(shape.pad_token_id)) : json(nullptr);
  return write_text(opts.out_dir / "tokenizer_config.json", cfg.dump(2) + "\n");
}

json generation_config(const ModelShape& shape) {
  const auto& eos = shape.generation_eos_token_ids;
  json g = {{"bos_token_id", shape.config.bos_token_id},
            {"eos_token_id", eos.size() == 1 ? json(eos[0]) : json(eos)}};
  if (shape.pad_token_id >= 0) g["pad_token_id"] = shape.pad_token_id;
  return g;
}

}  // namespace

std::vector<std::string> model_shape_names() {
  return {"tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"};
}

Result<ModelShape> model_shape(std::string_view name) {
  if (name == "tiny")  // the shape of models/tiny-qwen3
    return ModelShape{.name = "tiny",
                      .config = {.model_type = "qwen3", .vocab_size = 4096, .hidden_size = 256,
                                 .intermediate_size = 768, .num_layers = 4, .num_heads = 4, .num_kv_heads = 2,
                                 .head_dim = 64, .rms_norm_eps = 1e-6, .rope_theta = 1e6,
                                 .tie_word_embeddings = true, .max_position_embeddings = 4096,
                                 .bos_token_id = 4093, .eos_token_ids = {4093}, .dtype = "bfloat16"},
                      .generation_eos_token_ids = {4093}};
  // The Qwen/Qwen3 dense models (their config.json): eos <|im_end|>; generation also stops at
  // <|endoftext|>; head_dim 128 and 8 KV heads throughout.
  ModelShape qwen{.name = std::string(name),
                  .config = {.model_type = "qwen3", .vocab_size = 151936, .head_dim = 128, .rms_norm_eps = 1e-6,
                             .rope_theta = 1e6, .max_position_embeddings = 40960, .bos_token_id = 151643,
                             .eos_token_ids = {151645}, .dtype = "bfloat16"},
                  .generation_eos_token_ids = {151645, 151643},
                  .pad_token_id = 151643};
  ModelConfig& c = qwen.config;
  c.num_kv_heads = 8;
  auto dense = [&](int hidden, int intermediate, int layers, int heads, bool tied) {
    c.hidden_size = hidden;
    c.intermediate_size = intermediate;
    c.num_layers = layers;
    c.num_heads = heads;
    c.tie_word_embeddings = tied;
    return qwen;
  };
  if (name == "qwen3-0.6b") return dense(1024, 3072, 28, 16, true);
  if (name == "qwen3-1.7b") return dense(2048, 6144, 28, 16, true);
  if (name == "qwen3-4b") return dense(2560, 9728, 36, 32, true);
  if (name == "qwen3-8b") return dense(4096, 12288, 36, 32, false);
  if (name == "qwen3-14b") return dense(5120, 17408, 40, 40, false);  // GQA group 5
  if (name == "qwen3-32b") return dense(5120, 25600, 64, 64, false);
  std::string known;
  for (const std::string& n : model_shape_names()) known += (known.empty() ? "" : ", ") + n;
  return invalid_argument(fmt::format("unknown model shape \"{}\" (known: {})", name, known));
}

std::vector<TensorSpec> qwen3_tensor_specs(const ModelConfig& cfg, DType dtype) {
  const int64_t h = cfg.hidden_size, q = cfg.q_dim(), kv = cfg.kv_dim(), ff = cfg.intermediate_size;
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", dtype, {cfg.vocab_size, h}});
  for (int i = 0; i < cfg.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    specs.push_back({p + "self_attn.q_proj.weight", dtype, {q, h}});
    specs.push_back({p + "self_attn.k_proj.weight", dtype, {kv, h}});
    specs.push_back({p + "self_attn.v_proj.weight", dtype, {kv, h}});
    specs.push_back({p + "self_attn.o_proj.weight", dtype, {h, q}});
    specs.push_back({p + "self_attn.q_norm.weight", dtype, {cfg.head_dim}});
    specs.push_back({p + "self_attn.k_norm.weight", dtype, {cfg.head_dim}});
    specs.push_back({p + "mlp.gate_proj.weight", dtype, {ff, h}});
    specs.push_back({p + "mlp.up_proj.weight", dtype, {ff, h}});
    specs.push_back({p + "mlp.down_proj.weight", dtype, {h, ff}});
    specs.push_back({p + "input_layernorm.weight", dtype, {h}});
    specs.push_back({p + "post_attention_layernorm.weight", dtype, {h}});
  }
  specs.push_back({"model.norm.weight", dtype, {h}});
  if (!cfg.tie_word_embeddings) specs.push_back({"lm_head.weight", dtype, {cfg.vocab_size, h}});
  return specs;
}

Result<void> make_model(const MakeModelOptions& opts) {
  SIESTA_ASSIGN_OR_RETURN(ModelShape shape, model_shape(opts.shape));
  if (opts.layers < 0) return invalid_argument(fmt::format("layers must be positive, got {}", opts.layers));
  if (opts.layers > 0) shape.config.num_layers = opts.layers;
  if (opts.out_dir.empty()) return invalid_argument("no output directory given");
  if (opts.tokenizer.empty()) return invalid_argument("no tokenizer.json given");
  if (opts.max_shard_bytes == 0) return invalid_argument("max_shard_bytes must be positive");
  SIESTA_TRY(check_out_dir(opts.out_dir));
  SIESTA_ASSIGN_OR_RETURN(auto added_tokens, check_tokenizer(opts.tokenizer, shape));

  std::error_code ec;
  std::filesystem::create_directories(opts.out_dir, ec);
  if (ec) return io_error(fmt::format("{}: cannot create: {}", opts.out_dir.string(), ec.message()));

  SIESTA_TRY(write_weights(opts, shape));
  SIESTA_TRY(write_tokenizer(opts, shape, added_tokens));
  SIESTA_TRY(write_text(opts.out_dir / "generation_config.json", generation_config(shape).dump(2) + "\n"));
  // config.json last: a directory left behind by a failure does not look like a model.
  SIESTA_TRY(write_text(opts.out_dir / "config.json", shape.config.to_json().dump(2) + "\n"));
  return {};
}

}  // namespace siesta
