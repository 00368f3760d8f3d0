// config.json parsing: both rope forms, HF defaults, and errors that name the field and file.
#include "model/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "temp_dir.h"
#include "test_data.h"
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace siesta {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;

const fs::path kSource = siesta::testing::test_data_root();

// Each test's scratch directory.
class TempDir : public siesta::testing::TempDir {
 public:
  TempDir() : siesta::testing::TempDir("siesta_config_test") {}
};

void write_file(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// The config.json of Qwen/Qwen3-0.6B as transformers 4.51 wrote it (top-level rope_theta).
json qwen3_06b_old() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

// The newer form: rope_parameters instead of rope_theta.
json qwen3_06b_new() {
  json j = qwen3_06b_old();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  return j;
}

std::string error_of(const Result<ModelConfig>& r) {
  EXPECT_FALSE(r.has_value());
  return r ? std::string() : r.error().message;
}

TEST(ModelConfig, ReadsTopLevelRopeTheta) {
  auto c = ModelConfig::from_json(qwen3_06b_old());
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->model_type, "qwen3");
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->hidden_size, 1024);
  EXPECT_EQ(c->intermediate_size, 3072);
  EXPECT_EQ(c->num_layers, 28);
  EXPECT_EQ(c->num_heads, 16);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->q_dim(), 2048);
  EXPECT_EQ(c->kv_dim(), 1024);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{151645});
}

TEST(ModelConfig, BothRopeFormsAgree) {
  auto old_form = ModelConfig::from_json(qwen3_06b_old());
  auto new_form = ModelConfig::from_json(qwen3_06b_new());
  ASSERT_TRUE(old_form && new_form);
  EXPECT_EQ(*old_form, *new_form);

  json both = qwen3_06b_new();
  both["rope_theta"] = 5.0;  // rope_parameters is what newer transformers reads
  EXPECT_DOUBLE_EQ(ModelConfig::from_json(both)->rope_theta, 1e6);
}

TEST(ModelConfig, RefusesScaledRope) {
  json yarn = qwen3_06b_new();
  yarn["rope_parameters"] = {{"rope_theta", 1e6}, {"rope_type", "yarn"}, {"factor", 4.0}};
  const std::string msg = error_of(ModelConfig::from_json(yarn, "/m/config.json"));
  EXPECT_THAT(msg, HasSubstr("/m/config.json"));
  EXPECT_THAT(msg, HasSubstr("rope_parameters.rope_type"));
  EXPECT_THAT(msg, HasSubstr("yarn"));

  json old_yarn = qwen3_06b_old();
  old_yarn["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  EXPECT_THAT(error_of(ModelConfig::from_json(old_yarn)), HasSubstr("rope_scaling.type"));

  json no_type = qwen3_06b_new();
  no_type["rope_parameters"].erase("rope_type");
  EXPECT_TRUE(ModelConfig::from_json(no_type));
}

TEST(ModelConfig, MissingRequiredFieldIsNamed) {
  for (const char* field : {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "max_position_embeddings"}) {
    json j = qwen3_06b_new();
    j.erase(field);
    const std::string msg = error_of(ModelConfig::from_json(j, "/models/x/config.json"));
    EXPECT_EQ(msg, std::string("/models/x/config.json: missing required field \"") + field + "\"");
  }
  json no_rope = qwen3_06b_new();
  no_rope.erase("rope_parameters");
  EXPECT_THAT(error_of(ModelConfig::from_json(no_rope, "f")), HasSubstr("\"rope_theta\""));
}

TEST(ModelConfig, WrongTypesAndValuesAreNamed) {
  json s = qwen3_06b_new();
  s["hidden_size"] = "1024";
  EXPECT_THAT(error_of(ModelConfig::from_json(s, "f")), HasSubstr("\"hidden_size\" must be an integer"));
  json neg = qwen3_06b_new();
  neg["num_hidden_layers"] = 0;
  EXPECT_THAT(error_of(ModelConfig::from_json(neg, "f")), HasSubstr("\"num_hidden_layers\" must be positive"));
  json type = qwen3_06b_new();
  type["model_type"] = "llama";
  EXPECT_THAT(error_of(ModelConfig::from_json(type, "f")), HasSubstr("qwen3"));
  json bias = qwen3_06b_new();
  bias["attention_bias"] = true;
  EXPECT_THAT(error_of(ModelConfig::from_json(bias, "f")), HasSubstr("attention_bias"));
  json eos = qwen3_06b_new();
  eos["eos_token_id"] = 200000;
  EXPECT_THAT(error_of(ModelConfig::from_json(eos, "f")), HasSubstr("vocab_size"));
  EXPECT_THAT(error_of(ModelConfig::from_json(json::array(), "f")), HasSubstr("JSON object"));
}

TEST(ModelConfig, GroupedQueryAttentionMustDivide) {
  json j = qwen3_06b_new();
  j["num_key_value_heads"] = 6;
  const std::string msg = error_of(ModelConfig::from_json(j, "f"));
  EXPECT_THAT(msg, HasSubstr("num_key_value_heads"));
  EXPECT_THAT(msg, HasSubstr("16"));
  json absent = qwen3_06b_new();
  absent.erase("num_key_value_heads");  // HF: one KV head per query head
  EXPECT_EQ(ModelConfig::from_json(absent)->num_kv_heads, 16);
}

TEST(ModelConfig, HfDefaults) {
  json j = qwen3_06b_new();
  j.erase("head_dim");
  j.erase("tie_word_embeddings");
  j.erase("rms_norm_eps");
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = {151645, 151643, 151645};
  auto c = ModelConfig::from_json(j);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->head_dim, 64);  // hidden_size / num_attention_heads
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{151645, 151643}));
}

TEST(ModelConfig, LoadsTinyModelAndMergesGenerationConfig) {
  auto tiny = ModelConfig::load(kSource / "models" / "tiny-qwen3");
  ASSERT_TRUE(tiny) << tiny.error().message;
  EXPECT_EQ(tiny->hidden_size, 256);
  EXPECT_EQ(tiny->num_layers, 4);
  EXPECT_EQ(tiny->num_kv_heads, 2);
  EXPECT_EQ(tiny->head_dim, 64);
  EXPECT_TRUE(tiny->tie_word_embeddings);
  EXPECT_EQ(tiny->eos_token_ids, std::vector<int32_t>{4093});

  TempDir dir;
  write_file(dir.path() / "config.json", qwen3_06b_old().dump());
  write_file(dir.path() / "generation_config.json", R"({"eos_token_id": [151645, 151643], "temperature": 0.6})");
  auto c = ModelConfig::load(dir.path());
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{151645, 151643}));

  write_file(dir.path() / "generation_config.json", "{oops");
  auto bad_gen = ModelConfig::load(dir.path());
  ASSERT_FALSE(bad_gen);
  EXPECT_THAT(bad_gen.error().message, HasSubstr((dir.path() / "generation_config.json").string()));
}

TEST(ModelConfig, LoadErrorsNameTheFile) {
  TempDir dir;
  const std::string path = (dir.path() / "config.json").string();
  EXPECT_THAT(error_of(ModelConfig::load(dir.path())), HasSubstr(path));
  write_file(dir.path() / "config.json", "{\"hidden_size\": ");
  const std::string msg = error_of(ModelConfig::load(dir.path()));
  EXPECT_THAT(msg, HasSubstr(path));
  EXPECT_THAT(msg, HasSubstr("not valid JSON"));
  json j = qwen3_06b_new();
  j.erase("vocab_size");
  write_file(dir.path() / "config.json", j.dump());
  EXPECT_EQ(error_of(ModelConfig::load(dir.path())), path + ": missing required field \"vocab_size\"");
}

TEST(ModelConfig, ToJsonIsHfLayoutAndRoundTrips) {
  auto c = ModelConfig::from_json(qwen3_06b_old());
  ASSERT_TRUE(c);
  json j = c->to_json();
  EXPECT_EQ(j["architectures"], json::array({"Qwen3ForCausalLM"}));
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_EQ(j["rope_parameters"]["rope_type"], "default");
  EXPECT_EQ(j["rope_parameters"]["rope_theta"], 1e6);
  EXPECT_EQ(j["rope_theta"], 1e6);
  EXPECT_EQ(j["num_key_value_heads"], 8);
  EXPECT_EQ(j["eos_token_id"], 151645);
  EXPECT_EQ(j["layer_types"].size(), 28u);
  auto back = ModelConfig::from_json(j);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, *c);

  c->eos_token_ids = {1, 2};
  c->bos_token_id = -1;
  j = c->to_json();
  EXPECT_EQ(j["eos_token_id"], json::array({1, 2}));
  EXPECT_TRUE(j["bos_token_id"].is_null());
  EXPECT_EQ(*ModelConfig::from_json(j), *c);
}

}  // namespace
}  // namespace siesta
