// make-model: the checkpoint it writes loads back as the same model, the weights are a
// function of the seed, and large checkpoints are sharded the way HF shards them.
#include "model/make_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "temp_dir.h"
#include "test_data.h"
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

namespace siesta {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kSource = siesta::testing::test_data_root();
const fs::path kTiny = kSource / "models" / "tiny-qwen3";

// Each test's scratch directory.
class TempDir : public siesta::testing::TempDir {
 public:
  TempDir() : siesta::testing::TempDir("siesta_make_model_test") {}
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

MakeModelOptions tiny_options(const fs::path& out, uint64_t seed) {
  MakeModelOptions o;
  o.shape = "tiny";
  o.out_dir = out;
  o.seed = seed;
  o.tokenizer = kTiny / "tokenizer.json";
  o.threads = 2;
  return o;
}

std::vector<uint16_t> raw_bf16(const TensorStore& store, const TensorSpec& spec) {
  auto v = store.get(spec.name, spec.shape, {DType::kBF16});
  EXPECT_TRUE(v) << v.error().message;
  if (!v) return {};
  std::vector<uint16_t> out(static_cast<size_t>(v->numel()));
  std::memcpy(out.data(), v->data, v->nbytes);
  return out;
}

TEST(MakeModel, TinyLoadsBackAsTheEmbeddedTinyModel) {
  TempDir tmp;
  const fs::path out = tmp.path() / "tiny";
  ASSERT_TRUE(make_model(tiny_options(out, 1)));

  auto made = ModelConfig::load(out);
  ASSERT_TRUE(made) << made.error().message;
  auto embedded = ModelConfig::load(kTiny);
  ASSERT_TRUE(embedded);
  EXPECT_EQ(*made, *embedded);
  EXPECT_EQ(*made, model_shape("tiny")->config);

  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_EQ(read_file(out / "tokenizer.json"), read_file(kTiny / "tokenizer.json"));
  EXPECT_EQ(read_file(out / "tokenizer_config.json"), read_file(kTiny / "tokenizer_config.json"));

  auto store = TensorStore::open(out);
  ASSERT_TRUE(store) << store.error().message;
  auto reference = TensorStore::open(kTiny);
  ASSERT_TRUE(reference);
  EXPECT_EQ(store->names(), reference->names());  // exactly HF's tensor names
  for (const TensorSpec& spec : qwen3_tensor_specs(*made)) {
    auto v = store->get(spec.name, spec.shape, {DType::kBF16});
    EXPECT_TRUE(v) << v.error().message;
  }
}

TEST(MakeModel, WeightsLookLikeAnInitialisedModel) {
  TempDir tmp;
  ASSERT_TRUE(make_model(tiny_options(tmp.path() / "m", 5)));
  auto store = TensorStore::open(tmp.path() / "m");
  ASSERT_TRUE(store);
  auto w = store->get_f32("model.layers.0.mlp.up_proj.weight", {768, 256});
  ASSERT_TRUE(w);
  double sum = 0, sq = 0;
  for (float x : *w) {
    sum += x;
    sq += double(x) * x;
  }
  const double mean = sum / w->size(), std = std::sqrt(sq / w->size() - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-3);
  EXPECT_NEAR(std, 0.02, 1e-3);
  auto norm = store->get_f32("model.layers.2.self_attn.k_norm.weight", {64});
  ASSERT_TRUE(norm);
  for (float x : *norm) EXPECT_NEAR(x, 1.0f, 0.08f);
}

TEST(MakeModel, SameSeedSameWeightsOtherSeedOtherWeights) {
  TempDir tmp;
  ASSERT_TRUE(make_model(tiny_options(tmp.path() / "a", 7)));
  MakeModelOptions again = tiny_options(tmp.path() / "b", 7);
  again.threads = 3;  // the thread count must not change a single value
  ASSERT_TRUE(make_model(again));
  ASSERT_TRUE(make_model(tiny_options(tmp.path() / "c", 8)));
  EXPECT_EQ(read_file(tmp.path() / "a" / "model.safetensors"), read_file(tmp.path() / "b" / "model.safetensors"));

  auto a = TensorStore::open(tmp.path() / "a");
  auto b = TensorStore::open(tmp.path() / "b");
  auto c = TensorStore::open(tmp.path() / "c");
  ASSERT_TRUE(a && b && c);
  for (const TensorSpec& spec : qwen3_tensor_specs(model_shape("tiny")->config)) {
    const auto va = raw_bf16(*a, spec), vb = raw_bf16(*b, spec), vc = raw_bf16(*c, spec);
    EXPECT_EQ(va, vb) << spec.name;
    EXPECT_NE(va, vc) << spec.name;
  }
  // Different tensors of one model differ too (the name is part of the key).
  EXPECT_NE(raw_bf16(*a, {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {768, 256}}),
            raw_bf16(*a, {"model.layers.0.mlp.gate_proj.weight", DType::kBF16, {768, 256}}));
}

TEST(MakeModel, ShardsLikeHuggingFace) {
  TempDir tmp;
  MakeModelOptions o = tiny_options(tmp.path() / "sharded", 3);
  o.max_shard_bytes = 1 << 20;  // the embedding (2 MiB) gets a shard of its own
  ASSERT_TRUE(make_model(o));
  ASSERT_TRUE(make_model(tiny_options(tmp.path() / "single", 3)));

  const fs::path dir = tmp.path() / "sharded";
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  auto index = nlohmann::json::parse(read_file(dir / "model.safetensors.index.json"));
  const auto& weight_map = index["weight_map"];
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map.items()) files.insert(file.get<std::string>());
  ASSERT_GT(files.size(), 2u);
  const std::string n = std::to_string(files.size());
  EXPECT_EQ(*files.begin(), "model-00001-of-0000" + n + ".safetensors");
  EXPECT_EQ(*files.rbegin(), "model-0000" + n + "-of-0000" + n + ".safetensors");
  uint64_t total = 0;
  for (const auto& f : files) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
    auto store = TensorStore::open_file(dir / f);
    ASSERT_TRUE(store);
    for (const auto& name : store->names()) total += store->find(name)->nbytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);

  auto sharded = TensorStore::open(dir);
  auto single = TensorStore::open(tmp.path() / "single");
  ASSERT_TRUE(sharded) << sharded.error().message;
  ASSERT_TRUE(single);
  EXPECT_EQ(sharded->names(), single->names());
  for (const TensorSpec& spec : qwen3_tensor_specs(model_shape("tiny")->config))
    EXPECT_EQ(raw_bf16(*sharded, spec), raw_bf16(*single, spec)) << spec.name;
}

TEST(MakeModel, RefusesNonEmptyOutputDirectory) {
  TempDir tmp;
  std::ofstream(tmp.path() / "notes.txt") << "mine";
  auto r = make_model(tiny_options(tmp.path(), 1));
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message, HasSubstr(tmp.path().string()));
  EXPECT_THAT(r.error().message, HasSubstr("not empty"));
  EXPECT_EQ(read_file(tmp.path() / "notes.txt"), "mine");
  // An existing empty directory is fine.
  fs::create_directories(tmp.path() / "empty");
  EXPECT_TRUE(make_model(tiny_options(tmp.path() / "empty", 1)));
}

TEST(MakeModel, RefusesATokenizerThatDoesNotFitTheShape) {
  TempDir tmp;
  const fs::path tok = tmp.path() / "big-tokenizer.json";
  std::ofstream(tok) << R"({"model": {"vocab": {"a": 0, "b": 9000}},
                            "added_tokens": [{"id": 4093, "content": "<|endoftext|>"}]})";
  MakeModelOptions o = tiny_options(tmp.path() / "out", 1);
  o.tokenizer = tok;
  auto r = make_model(o);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message, HasSubstr("9000"));
  EXPECT_THAT(r.error().message, HasSubstr("vocab_size 4096"));
  EXPECT_FALSE(fs::exists(tmp.path() / "out"));

  std::ofstream(tok, std::ios::trunc) << R"({"model": {"vocab": {"a": 0}}, "added_tokens": []})";
  r = make_model(o);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message, HasSubstr("4093"));

  o.tokenizer = tmp.path() / "missing.json";
  r = make_model(o);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message, HasSubstr("missing.json"));
}

TEST(MakeModel, NamedShapes) {
  auto small = model_shape("qwen3-0.6b");
  ASSERT_TRUE(small);
  EXPECT_EQ(small->config.hidden_size, 1024);
  EXPECT_EQ(small->config.num_layers, 28);
  EXPECT_TRUE(small->config.tie_word_embeddings);
  EXPECT_EQ(small->generation_eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  // The shape's config.json passes our own reader.
  auto reread = ModelConfig::from_json(small->config.to_json());
  ASSERT_TRUE(reread);
  EXPECT_EQ(*reread, small->config);

  auto big = model_shape("qwen3-8b");
  ASSERT_TRUE(big);
  EXPECT_FALSE(big->config.tie_word_embeddings);
  const auto specs = qwen3_tensor_specs(big->config);
  EXPECT_EQ(specs.size(), 1u + 36 * 11 + 1 + 1);
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  uint64_t bytes = 0;
  for (const auto& s : specs) bytes += s.nbytes().value();
  EXPECT_EQ(bytes, 16381470720u);  // Qwen/Qwen3-8B's total_size
  EXPECT_EQ(qwen3_tensor_specs(small->config).size(), 1u + 28 * 11 + 1);

  // The other dense Qwen3 shapes: parameters as their model cards give them (total, non-embedding, in
  // billions to one decimal), tied embeddings up to 4B, GQA group 5 at 14B.
  struct Card {
    const char* name;
    double total, non_embedding;
    bool tied;
    int group;
  };
  for (const Card& card : {Card{"qwen3-0.6b", 0.6, 0.44, true, 2}, Card{"qwen3-1.7b", 1.7, 1.4, true, 2},
                           Card{"qwen3-4b", 4.0, 3.6, true, 4}, Card{"qwen3-8b", 8.2, 6.95, false, 4},
                           Card{"qwen3-14b", 14.8, 13.2, false, 5}, Card{"qwen3-32b", 32.8, 31.2, false, 8}}) {
    auto shape = model_shape(card.name);
    ASSERT_TRUE(shape) << card.name;
    const ModelConfig& c = shape->config;
    uint64_t numel = 0, embedding = 0;
    for (const auto& s : qwen3_tensor_specs(c)) {
      uint64_t n = 1;
      for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
      numel += n;
      if (s.name == "model.embed_tokens.weight" || s.name == "lm_head.weight") embedding += n;
    }
    const double digits = card.non_embedding == 6.95 || card.non_embedding == 0.44 ? 100 : 10;
    EXPECT_NEAR(numel / 1e9, card.total, 0.05) << card.name;
    EXPECT_EQ(std::round((numel - embedding) / 1e9 * digits) / digits, card.non_embedding) << card.name;
    EXPECT_EQ(c.tie_word_embeddings, card.tied) << card.name;
    EXPECT_EQ(c.num_heads / c.num_kv_heads, card.group) << card.name;
    EXPECT_EQ(c.head_dim, 128) << card.name;
  }

  auto bogus = model_shape("qwen3-72b");
  ASSERT_FALSE(bogus);
  EXPECT_THAT(bogus.error().message, HasSubstr("qwen3-0.6b"));
  EXPECT_THAT(bogus.error().message, HasSubstr("qwen3-14b"));
}

// --layers: the shape's widths, fewer decoder layers.
TEST(MakeModel, LayersOverrideKeepsTheWidths) {
  TempDir tmp;
  MakeModelOptions o = tiny_options(tmp.path() / "two", 3);
  o.layers = 2;
  ASSERT_TRUE(make_model(o));
  auto cfg = ModelConfig::load(tmp.path() / "two");
  ASSERT_TRUE(cfg) << cfg.error().message;
  ModelConfig want = model_shape("tiny")->config;
  want.num_layers = 2;
  EXPECT_EQ(*cfg, want);
  auto store = TensorStore::open(tmp.path() / "two");
  ASSERT_TRUE(store) << store.error().message;
  std::vector<std::string> names;
  for (const TensorSpec& spec : qwen3_tensor_specs(want)) names.push_back(spec.name);
  std::sort(names.begin(), names.end());
  auto have = store->names();
  std::sort(have.begin(), have.end());
  EXPECT_EQ(have, names);
  o = tiny_options(tmp.path() / "bad", 3);
  o.layers = -1;
  auto bad = make_model(o);
  ASSERT_FALSE(bad);
  EXPECT_THAT(bad.error().message, HasSubstr("layers"));
}

// The command line: defaults find the source tree's tiny tokenizer; errors are one line, exit 1.
TEST(MakeModelCommand, WritesTinyAndRefusesToOverwrite) {
  TempDir tmp;
  const fs::path out = tmp.path() / "cli";
  const std::string base =
      siesta::testing::siesta_binary().string() + " make-model --shape tiny --seed 7 --out " + out.string();
  ASSERT_EQ(std::system((base + " > " + (tmp.path() / "stdout").string() + " 2>&1").c_str()), 0)
      << read_file(tmp.path() / "stdout");
  MakeModelOptions o = tiny_options(tmp.path() / "lib", 7);
  ASSERT_TRUE(make_model(o));
  EXPECT_EQ(read_file(out / "model.safetensors"), read_file(tmp.path() / "lib" / "model.safetensors"));

  const int status = std::system((base + " 2> " + (tmp.path() / "stderr").string()).c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string err = read_file(tmp.path() / "stderr");
  EXPECT_THAT(err, HasSubstr("not empty"));
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

}  // namespace
}  // namespace siesta
