// The CPU model sharded over a tensor-parallel group (CpuQwen3Tp) against the
// unsharded CpuQwen3 on models/tiny-qwen3 (4 query heads, 2 KV heads: tp 1,
// 2 and 4, the last with each KV head on two ranks): logits bit-identical for
// prefill, chunked prefill, decode and mixed batches; greedy tokens as
// Hugging Face's; each rank holding only its shards; sleep levels 1 and 2
// (with a reload) and weight updates (a directory, pushed tensors) keeping
// the bits; sizes that do not divide refused by name.
#include "model/cpu/qwen3_cpu_tp.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "memory/host_backend.h"
#include "model/cpu/qwen3_cpu.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "model/weight_update.h"
#include "temp_dir.h"
#include "test_data.h"

namespace siesta {
namespace {

using memory::Tag;
using memory::TagSet;
namespace fs = std::filesystem;

const fs::path kSource = siesta::testing::test_data_root();
const fs::path kModelDir = kSource / "models/tiny-qwen3";
const fs::path kGolden = kSource / "tests/data/golden";
constexpr int kGroupSizes[] = {1, 2, 4};

struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> greedy;
};

std::vector<Prompt> golden_prompts() {
  std::ifstream f(kGolden / "tiny-qwen3_golden.json");
  nlohmann::json j = nlohmann::json::parse(f);
  std::vector<Prompt> out;
  for (const auto& p : j["prompts"])
    out.push_back({p["input_ids"].get<std::vector<int32_t>>(), p["greedy_24"].get<std::vector<int32_t>>()});
  return out;
}

// A KV cache whose blocks are handed out in a scrambled order (the same for
// the same seed, so two models given caches of one seed see the same tables).
class TestCache {
 public:
  TestCache(const KvCacheLayout& layout, int num_blocks, uint32_t seed) : layout_(layout) {
    data_.assign(static_cast<size_t>(num_blocks) * layout.block_elems(), std::nanf(""));
    free_.resize(num_blocks);
    std::iota(free_.begin(), free_.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
  KvCacheView view() { return {data_.data(), static_cast<int>(data_.size() / layout_.block_elems()), layout_}; }
  void grow(std::vector<int32_t>& table, size_t tokens) {
    while (table.size() * layout_.block_size < tokens) {
      table.push_back(free_.back());
      free_.pop_back();
    }
  }
  const std::vector<float>& data() const { return data_; }

 private:
  KvCacheLayout layout_;
  std::vector<float> data_;
  std::vector<int32_t> free_;
};

int32_t argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// One run of a fixed schedule: every golden prompt prefilled in one batch
// (more rows than one chain tile), then, in a second cache, the prompts in
// random chunks over several steps while the sequences whose prompts are
// done decode in the same steps (mixed batches), until each has decoded 6
// tokens. Returns every logit of every step, in order, and the final cache.
struct ScheduleRun {
  std::vector<float> logits;
  std::vector<float> cache;
  int steps = 0;
};

ScheduleRun run_schedule(Model& model) {
  const auto prompts = golden_prompts();
  ScheduleRun run;
  auto take = [&](const ForwardOutput& out) {
    run.logits.insert(run.logits.end(), out.logits.begin(), out.logits.end());
    ++run.steps;
  };
  {
    TestCache cache(model.kv_layout(), 128, 3);
    std::vector<std::vector<int32_t>> tables(prompts.size());
    std::vector<SequenceChunk> batch;
    for (size_t s = 0; s < prompts.size(); ++s) {
      cache.grow(tables[s], prompts[s].ids.size());
      batch.push_back({prompts[s].ids, 0, tables[s], true});
    }
    ForwardOutput out;
    auto r = model.forward(batch, cache.view(), out);
    EXPECT_TRUE(r) << r.error().message;
    take(out);
  }
  std::mt19937 rng(11);
  TestCache cache(model.kv_layout(), 256, 99);
  const size_t num = prompts.size();
  std::vector<std::vector<int32_t>> tables(num), tokens(num);
  std::vector<size_t> done(num, 0);
  std::vector<int> decoded(num, 0);
  for (size_t s = 0; s < num; ++s) tokens[s] = prompts[s].ids;
  while (true) {
    bool any_left = false;
    for (size_t s = 0; s < num; ++s) any_left |= decoded[s] < 6;
    if (!any_left) break;
    std::vector<SequenceChunk> batch;
    std::vector<size_t> which;
    for (size_t s = 0; s < num; ++s) {
      if (decoded[s] >= 6 || rng() % 4 == 0) continue;
      const size_t left = tokens[s].size() - done[s];
      const size_t len = done[s] < prompts[s].ids.size() ? std::min<size_t>(left, 1 + rng() % 19) : 1;
      cache.grow(tables[s], done[s] + len);
      const bool all = rng() % 2 == 0;
      batch.push_back({std::span<const int32_t>(tokens[s]).subspan(done[s], len), static_cast<int32_t>(done[s]),
                       tables[s], all});
      which.push_back(s);
    }
    if (batch.empty()) continue;
    ForwardOutput out;
    auto r = model.forward(batch, cache.view(), out);
    EXPECT_TRUE(r) << r.error().message;
    if (!r) break;
    take(out);
    for (size_t b = 0; b < batch.size(); ++b) {
      const size_t s = which[b];
      done[s] += batch[b].tokens.size();
      if (done[s] == tokens[s].size()) {  // the prompt (or the last decode) is in: its next token
        tokens[s].push_back(argmax(out.last(b)));
        ++decoded[s];
      }
    }
  }
  run.cache = cache.data();
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CpuTensorParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    threads_ = new ThreadPool(2);
    auto m = CpuQwen3::load(kModelDir, *threads_);
    ASSERT_TRUE(m) << m.error().message;
    reference_ = m->release();
    reference_run_ = new ScheduleRun(run_schedule(*reference_));
  }
  static void TearDownTestSuite() {
    delete reference_run_;
    delete reference_;
    delete threads_;
  }
  static std::unique_ptr<CpuQwen3Tp> load(int tp) {
    auto m = CpuQwen3Tp::load(kModelDir, tp, *threads_);
    EXPECT_TRUE(m) << m.error().message;
    return m ? std::move(*m) : nullptr;
  }
  static ThreadPool* threads_;
  static CpuQwen3* reference_;
  static ScheduleRun* reference_run_;
};
ThreadPool* CpuTensorParallel::threads_ = nullptr;
CpuQwen3* CpuTensorParallel::reference_ = nullptr;
ScheduleRun* CpuTensorParallel::reference_run_ = nullptr;

TEST_F(CpuTensorParallel, LogitsAndCacheEqualTp1ForPrefillChunkedDecodeAndMixedBatches) {
  ASSERT_GT(reference_run_->steps, 10);
  for (int tp : kGroupSizes) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    auto model = load(tp);
    ASSERT_TRUE(model);
    EXPECT_EQ(model->layout().tp, tp);
    const ScheduleRun run = run_schedule(*model);
    EXPECT_EQ(run.steps, reference_run_->steps);
    EXPECT_TRUE(same_bits(run.logits, reference_run_->logits)) << "logits differ from TP=1";
    // The one KV cache holds every head exactly as TP=1 wrote it (NaN where
    // nothing was written: compared as bytes).
    EXPECT_TRUE(same_bits(run.cache, reference_run_->cache)) << "KV cache differs from TP=1";
  }
}

TEST_F(CpuTensorParallel, GreedyTokensMatchTp1AndHuggingFace) {
  const auto prompts = golden_prompts();
  auto greedy = [](Model& model, const std::vector<int32_t>& prompt) {
    TestCache cache(model.kv_layout(), 64, 5);
    std::vector<int32_t> table, out, step(prompt);
    int32_t pos = 0;
    for (int i = 0; i < 24; ++i) {
      cache.grow(table, pos + step.size());
      SequenceChunk seq{step, pos, table, false};
      ForwardOutput fo;
      EXPECT_TRUE(model.forward({&seq, 1}, cache.view(), fo));
      out.push_back(argmax(fo.last(0)));
      pos += static_cast<int32_t>(step.size());
      step = {out.back()};
    }
    return out;
  };
  for (int tp : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    auto model = load(tp);
    ASSERT_TRUE(model);
    int all_24 = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto ours = greedy(*model, prompts[i].ids);
      EXPECT_EQ(ours, greedy(*reference_, prompts[i].ids)) << "prompt " << i;
      EXPECT_TRUE(std::equal(ours.begin(), ours.begin() + 8, prompts[i].greedy.begin())) << "prompt " << i;
      if (ours == prompts[i].greedy) ++all_24;
    }
    EXPECT_GE(all_24, 7);  // as the unsharded model (qwen3_cpu_test)
  }
}

// Floats rank r of a group of tp holds, from the shapes alone.
size_t expected_rank_floats(const ModelConfig& c, int tp) {
  const size_t H = c.hidden_size, hd = c.head_dim, V = c.vocab_size;
  const size_t q = c.q_dim() / tp, kv = (tp > c.num_kv_heads ? 1 : c.num_kv_heads / tp) * hd;
  const size_t inter = c.intermediate_size / tp;
  const size_t per_layer = 2 * H + 2 * hd + q * H + 2 * kv * H + H * q + 2 * inter * H + H * inter;
  const size_t vocab_rows = (V + tp - 1) / tp;
  return vocab_rows * H * (c.tie_word_embeddings ? 1 : 2) + c.num_layers * per_layer + H;
}

TEST_F(CpuTensorParallel, EachRankHoldsOnlyItsShardInThePool) {
  const ModelConfig& cfg = reference_->config();
  const size_t full = cpu::weights_numel(cfg);
  for (int tp : kGroupSizes) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    memory::MemoryPool pool(memory::make_host_backend().value());
    auto m = CpuQwen3Tp::load(kModelDir, tp, *threads_, pool, /*scratch_rows=*/64);
    ASSERT_TRUE(m) << m.error().message;
    size_t total = 0;
    int weight_allocations = 0;
    for (const memory::Allocation& a : pool.allocations()) {
      if (a.tag != Tag::kWeights) continue;
      ++weight_allocations;
      const int rank = std::stoi(a.name.substr(a.name.find("rank ") + 5));
      EXPECT_EQ(a.requested_bytes, expected_rank_floats(cfg, tp) * sizeof(float)) << a.name;
      EXPECT_EQ((*m)->rank_weights_numel(rank), expected_rank_floats(cfg, tp));
      total += a.requested_bytes / sizeof(float);
    }
    EXPECT_EQ(weight_allocations, tp);
    // Together: TP=1's floats, plus every rank but one holding the norms,
    // plus the KV heads' extra replicas.
    const size_t H = cfg.hidden_size, hd = cfg.head_dim;
    const size_t norms = cfg.num_layers * (2 * H + 2 * hd) + H;
    const size_t replicas = tp > cfg.num_kv_heads ? tp / cfg.num_kv_heads : 1;
    const size_t kv_copies = (replicas - 1) * cfg.num_layers * 2 * static_cast<size_t>(cfg.kv_dim()) * H;
    EXPECT_EQ(total, full + (tp - 1) * norms + kv_copies);
    if (tp > 1) {
      EXPECT_LT(expected_rank_floats(cfg, tp), full * 3 / 4);
    }
    // Activations per rank, and the chain buffer: all scratch.
    EXPECT_EQ(pool.usage()[Tag::kScratch].allocations, static_cast<uint64_t>(tp) + 1);
    EXPECT_EQ(pool.usage()[Tag::kWeights].total_bytes(), (*m)->weights_bytes());
    EXPECT_EQ(pool.usage()[Tag::kScratch].total_bytes(), (*m)->scratch_bytes());
  }
}

TEST_F(CpuTensorParallel, SleepLevelsOneAndTwoKeepTheBits) {
  const auto prompts = golden_prompts();
  auto prefill = [&](Model& model) {
    TestCache cache(model.kv_layout(), 64, 5);
    std::vector<int32_t> table;
    cache.grow(table, prompts[2].ids.size());
    SequenceChunk seq{prompts[2].ids, 0, table, true};
    ForwardOutput out;
    EXPECT_TRUE(model.forward({&seq, 1}, cache.view(), out));
    return out.logits;
  };
  const std::vector<float> want = prefill(*reference_);
  for (int tp : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    memory::MemoryPool pool(memory::make_host_backend().value());
    auto m = CpuQwen3Tp::load(kModelDir, tp, *threads_, pool, /*scratch_rows=*/256);
    ASSERT_TRUE(m) << m.error().message;
    CpuQwen3Tp& model = **m;
    ASSERT_TRUE(same_bits(prefill(model), want));

    // Level 1: the weights to host memory and back, everything else released.
    ASSERT_TRUE(pool.sleep(TagSet{Tag::kWeights}));
    EXPECT_EQ(pool.usage().total().resident_bytes, 0u);
    auto refused = model.reload_weights(kModelDir);
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.error().message.find("wake it up"), std::string::npos) << refused.error().message;
    ASSERT_TRUE(pool.wake(TagSet::all()));
    EXPECT_TRUE(same_bits(prefill(model), want)) << "after a level-1 sleep";

    // Level 2: the weights come back zero-filled until reloaded in place.
    ASSERT_TRUE(pool.sleep(TagSet{}));
    ASSERT_TRUE(pool.wake(TagSet::all()));
    EXPECT_FALSE(same_bits(prefill(model), want));
    ASSERT_TRUE(model.reload_weights(kModelDir));
    EXPECT_TRUE(same_bits(prefill(model), want)) << "after a level-2 sleep and reload_weights";
  }
}

// A memfd holding some tensors of a checkpoint in bf16 (full Hugging Face
// tensors, as a trainer pushes them).
class PushedBf16 {
 public:
  PushedBf16(const fs::path& checkpoint, const std::vector<std::string>& names) {
    auto store = TensorStore::open(checkpoint);
    EXPECT_TRUE(store) << store.error().message;
    auto cfg = ModelConfig::load(checkpoint);
    EXPECT_TRUE(cfg);
    std::vector<std::byte> bytes;
    for (const TensorSpec& spec : updatable_tensors(*cfg)) {
      if (std::find(names.begin(), names.end(), spec.name) == names.end()) continue;
      auto f = store->get_f32(spec.name, spec.shape);
      EXPECT_TRUE(f) << f.error().message;
      tensors_.push_back({spec.name, DType::kBF16, spec.shape, 0, bytes.size()});
      for (float v : *f) {
        const uint16_t h = f32_to_bf16(v);
        std::byte b[2];
        std::memcpy(b, &h, 2);
        bytes.insert(bytes.end(), b, b + 2);
      }
    }
    fd_ = memfd_create("siesta-tp-test-weights", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(::write(fd_, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  ~PushedBf16() {
    if (fd_ >= 0) ::close(fd_);
  }
  PushedBf16(const PushedBf16&) = delete;
  PushedBf16& operator=(const PushedBf16&) = delete;
  WeightUpdate update() const {
    WeightUpdate u;
    u.source = WeightSource::kShm;
    u.fd = fd_;
    u.tensors = tensors_;
    return u;
  }

 private:
  int fd_ = -1;
  std::vector<PushedTensor> tensors_;
};

TEST_F(CpuTensorParallel, WeightUpdatesKeepTp1Equality) {
  testing::TempDir dir("siesta_tp_other");
  MakeModelOptions mo;
  mo.shape = "tiny";
  mo.out_dir = dir.path();
  mo.seed = 91;
  mo.tokenizer = kModelDir / "tokenizer.json";
  mo.threads = 2;
  ASSERT_TRUE(make_model(mo));
  // Pushed on top of the other checkpoint: tensors of the tiny model's own (a
  // row-split, two column-split, a vocabulary-split tensor and a norm).
  const PushedBf16 pushed(kModelDir, {"model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.down_proj.weight",
                                       "model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight",
                                       "model.layers.3.input_layernorm.weight"});

  auto unsharded = CpuQwen3::load(kModelDir, *threads_);
  ASSERT_TRUE(unsharded);
  ASSERT_TRUE((*unsharded)->reload_weights(dir.path()));
  const ScheduleRun other = run_schedule(**unsharded);
  ASSERT_FALSE(same_bits(other.logits, reference_run_->logits));
  auto up = (*unsharded)->prepare_weight_update(pushed.update());
  ASSERT_TRUE(up) << up.error().message;
  ASSERT_TRUE((*up)->apply());
  const ScheduleRun mixed = run_schedule(**unsharded);
  ASSERT_FALSE(same_bits(mixed.logits, other.logits));

  for (int tp : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    auto model = load(tp);
    ASSERT_TRUE(model);
    ASSERT_TRUE(model->reload_weights(dir.path()));
    EXPECT_TRUE(same_bits(run_schedule(*model).logits, other.logits)) << "after reload_weights from another dir";
    auto prepared = model->prepare_weight_update(pushed.update());
    ASSERT_TRUE(prepared) << prepared.error().message;
    auto report = (*prepared)->apply();
    ASSERT_TRUE(report) << report.error().message;
    EXPECT_EQ(report->tensors, 5);
    EXPECT_TRUE(same_bits(run_schedule(*model).logits, mixed.logits)) << "after a pushed update";
  }
}

TEST(CpuTensorParallelSizes, ThatDoNotDivideAreRefusedByName) {
  ThreadPool threads(1);
  auto three = CpuQwen3Tp::load(kModelDir, 3, threads);
  ASSERT_FALSE(three);
  EXPECT_NE(three.error().message.find("does not divide the 4 attention heads"), std::string::npos)
      << three.error().message;
  auto zero = CpuQwen3Tp::load(kModelDir, 0, threads);
  ASSERT_FALSE(zero);
  EXPECT_NE(zero.error().message.find("at least 1"), std::string::npos) << zero.error().message;
  auto eight = CpuQwen3Tp::load(kModelDir, 8, threads);
  ASSERT_FALSE(eight);
  EXPECT_NE(eight.error().message.find("does not divide the 4 attention heads"), std::string::npos)
      << eight.error().message;
}

}  // namespace
}  // namespace siesta
