// The CPU Qwen3 forward against Hugging Face's fp32 reference (golden files
// made by transformers), and its batch- and chunk-invariance.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>

#include "common/thread_pool.h"
#include "model/cpu/qwen3_cpu.h"
#include "model/safetensors.h"
#include "test_data.h"

namespace siesta {
namespace {

const std::filesystem::path kSource = siesta::testing::test_data_root();
const std::filesystem::path kModelDir = kSource / "models/tiny-qwen3";
const std::filesystem::path kGolden = kSource / "tests/data/golden";

struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> greedy;
};

std::vector<Prompt> golden_prompts() {
  std::ifstream f(kGolden / "tiny-qwen3_golden.json");
  nlohmann::json j = nlohmann::json::parse(f);
  std::vector<Prompt> out;
  for (const auto& p : j["prompts"]) out.push_back({p["input_ids"].get<std::vector<int32_t>>(), p["greedy_24"].get<std::vector<int32_t>>()});
  return out;
}

// A KV cache plus a simple block allocator that hands out blocks in a
// scrambled order, so tests also cover non-contiguous block tables.
class TestCache {
 public:
  TestCache(const KvCacheLayout& layout, int num_blocks, uint32_t seed = 7) : layout_(layout) {
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

 private:
  KvCacheLayout layout_;
  std::vector<float> data_;
  std::vector<int32_t> free_;
};

class Qwen3CpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pool_ = new ThreadPool(2);
    auto m = CpuQwen3::load(kModelDir, *pool_);
    ASSERT_TRUE(m) << m.error().message;
    model_ = m->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete pool_;
  }
  static ThreadPool* pool_;
  static CpuQwen3* model_;

  // Runs a whole prompt as one chunk and returns the logits of every position.
  std::vector<float> prompt_logits(const std::vector<int32_t>& ids, TestCache& cache) {
    std::vector<int32_t> table;
    cache.grow(table, ids.size());
    SequenceChunk seq{ids, 0, table, true};
    ForwardOutput out;
    auto r = model_->forward({&seq, 1}, cache.view(), out);
    EXPECT_TRUE(r) << r.error().message;
    return out.logits;
  }
};
ThreadPool* Qwen3CpuTest::pool_ = nullptr;
CpuQwen3* Qwen3CpuTest::model_ = nullptr;

TEST_F(Qwen3CpuTest, LogitsMatchHuggingFaceAtEveryPosition) {
  auto ref = TensorStore::open_file(kGolden / "tiny-qwen3_logits.safetensors");
  ASSERT_TRUE(ref) << ref.error().message;
  const auto prompts = golden_prompts();
  ASSERT_EQ(prompts.size(), 8u);
  const int64_t vocab = model_->config().vocab_size;
  double worst = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    TestCache cache(model_->kv_layout(), 64);
    const auto ours = prompt_logits(prompts[i].ids, cache);
    auto theirs = ref->get_f32("logits_" + std::to_string(i), {static_cast<int64_t>(prompts[i].ids.size()), vocab});
    ASSERT_TRUE(theirs) << theirs.error().message;
    ASSERT_EQ(ours.size(), theirs->size());
    for (size_t pos = 0; pos < prompts[i].ids.size(); ++pos) {
      double max_ref = 0, max_diff = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double a = ours[pos * vocab + v], b = (*theirs)[pos * vocab + v];
        ASSERT_FALSE(std::isnan(a)) << "prompt " << i << " position " << pos;
        max_ref = std::max(max_ref, std::abs(b));
        max_diff = std::max(max_diff, std::abs(a - b));
      }
      EXPECT_LE(max_diff / max_ref, 1e-3) << "prompt " << i << " position " << pos;
      worst = std::max(worst, max_diff / max_ref);
    }
  }
  std::cout << "worst max|diff| / max|ref| over all prompts and positions: " << worst << "\n";
}

// Greedy decoding through the paged cache, one token per step.
std::vector<int32_t> greedy(Model& model, const std::vector<int32_t>& prompt, int n, TestCache& cache) {
  std::vector<int32_t> table, out;
  std::vector<int32_t> step(prompt);
  int32_t pos = 0;
  for (int i = 0; i < n; ++i) {
    cache.grow(table, pos + step.size());
    SequenceChunk seq{step, pos, table, false};
    ForwardOutput fo;
    auto r = model.forward({&seq, 1}, cache.view(), fo);
    EXPECT_TRUE(r) << r.error().message;
    auto logits = fo.last(0);
    int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    pos += static_cast<int32_t>(step.size());
    step = {next};
  }
  return out;
}

TEST_F(Qwen3CpuTest, GreedyContinuationsMatchHuggingFace) {
  const auto prompts = golden_prompts();
  int all_24 = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    TestCache cache(model_->kv_layout(), 64);
    const auto ours = greedy(*model_, prompts[i].ids, 24, cache);
    ASSERT_EQ(prompts[i].greedy.size(), 24u);
    EXPECT_TRUE(std::equal(ours.begin(), ours.begin() + 8, prompts[i].greedy.begin())) << "prompt " << i;
    if (ours == prompts[i].greedy) ++all_24;
  }
  std::cout << all_24 << " of " << prompts.size() << " prompts reproduce all 24 greedy tokens\n";
  EXPECT_GE(all_24, 7);
}

TEST_F(Qwen3CpuTest, LogitsDoNotDependOnBatchChunkingOrThreads) {
  const auto prompts = golden_prompts();
  // Alone, one chunk each.
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    TestCache cache(model_->kv_layout(), 64);
    alone.push_back(prompt_logits(p.ids, cache));
  }
  const size_t vocab = model_->config().vocab_size;

  // All prompts in one batch, each split into random chunks over several
  // steps, with different sequences at different stages in the same step.
  std::mt19937 rng(123);
  TestCache cache(model_->kv_layout(), 256, 99);
  std::vector<std::vector<int32_t>> tables(prompts.size());
  std::vector<size_t> done(prompts.size(), 0);
  std::vector<std::vector<float>> chunked(prompts.size());
  for (bool any = true; any;) {
    any = false;
    std::vector<SequenceChunk> batch;
    std::vector<size_t> which;
    for (size_t s = 0; s < prompts.size(); ++s) {
      if (done[s] == prompts[s].ids.size() || rng() % 4 == 0) continue;
      const size_t left = prompts[s].ids.size() - done[s];
      const size_t len = std::min<size_t>(left, 1 + rng() % 19);
      cache.grow(tables[s], done[s] + len);
      batch.push_back({std::span<const int32_t>(prompts[s].ids).subspan(done[s], len), static_cast<int32_t>(done[s]),
                       tables[s], true});
      which.push_back(s);
    }
    for (size_t s = 0; s < prompts.size(); ++s) any |= done[s] < prompts[s].ids.size();
    if (batch.empty()) continue;
    ForwardOutput out;
    ASSERT_TRUE(model_->forward(batch, cache.view(), out));
    for (size_t b = 0; b < batch.size(); ++b) {
      auto& dst = chunked[which[b]];
      for (size_t r = 0; r < out.num_rows[b]; ++r) {
        auto row = out.row(b, r);
        dst.insert(dst.end(), row.begin(), row.end());
      }
      done[which[b]] += batch[b].tokens.size();
    }
  }
  for (size_t s = 0; s < prompts.size(); ++s) {
    ASSERT_EQ(chunked[s].size(), prompts[s].ids.size() * vocab);
    EXPECT_EQ(0, std::memcmp(chunked[s].data(), alone[s].data(), chunked[s].size() * sizeof(float)))
        << "prompt " << s << " differs when batched and chunked";
  }

  // One thread instead of two.
  ThreadPool single(1);
  auto m1 = CpuQwen3::load(kModelDir, single);
  ASSERT_TRUE(m1);
  TestCache c1(model_->kv_layout(), 64, 5);
  std::vector<int32_t> table;
  c1.grow(table, prompts[3].ids.size());
  SequenceChunk seq{prompts[3].ids, 0, table, true};
  ForwardOutput out;
  ASSERT_TRUE((*m1)->forward({&seq, 1}, c1.view(), out));
  EXPECT_EQ(0, std::memcmp(out.logits.data(), alone[3].data(), out.logits.size() * sizeof(float)));
}

TEST_F(Qwen3CpuTest, BadInputIsAnErrorNotAWrite) {
  TestCache cache(model_->kv_layout(), 4);
  std::vector<int32_t> table;
  cache.grow(table, 16);
  ForwardOutput out;
  std::vector<int32_t> bad_token = {1, model_->config().vocab_size};
  SequenceChunk seq{bad_token, 0, table, false};
  auto r = model_->forward({&seq, 1}, cache.view(), out);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("outside the vocabulary"), std::string::npos) << r.error().message;

  std::vector<int32_t> long_prompt(40, 1);
  SequenceChunk too_long{long_prompt, 0, table, false};
  r = model_->forward({&too_long, 1}, cache.view(), out);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("block table"), std::string::npos) << r.error().message;

  std::vector<int32_t> bad_table = {4};
  std::vector<int32_t> one = {1};
  SequenceChunk bad_block{one, 0, bad_table, false};
  r = model_->forward({&bad_block, 1}, cache.view(), out);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("block id"), std::string::npos) << r.error().message;
}

}  // namespace
}  // namespace siesta
