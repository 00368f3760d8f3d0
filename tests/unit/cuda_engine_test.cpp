// The CUDA engine through its sleep lifecycle on the tiny model: level 1
// (weights offloaded to host, the rest released), level 2 with
// wake_up(weights) + reload_weights + wake_up(all), and level 2 with a plain
// wake; after each wake the greedy tokens of a fixed prompt set equal those
// before the first sleep, and while asleep the device's free memory
// (cuMemGetInfo) shows the pool's bytes given back. Also the KV cache sized by
// --gpu-memory-utilization. Skips without a GPU (or a build without CUDA).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/random.h"
#include "test_data.h"

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using memory::Tag;
using memory::TagSet;

const std::filesystem::path kTiny = siesta::testing::tiny_model_dir();
constexpr uint64_t kMiB = uint64_t{1} << 20;

Deadline soon() { return Clock::now() + 120s; }

EngineOptions cuda_options() {
  EngineOptions o;
  o.model_dir = kTiny;
  o.device = Device::kCuda;
  o.enable_sleep_mode = true;
  o.max_model_len = 512;
  o.max_num_seqs = 16;
  o.max_num_batched_tokens = 512;
  o.kv_cache_memory_bytes = 256 * kMiB;  // large enough that freeing it shows in cuMemGetInfo
  o.enable_prefix_caching = false;       // every run computes the same chunks
  o.seed = 1;
  return o;
}

std::unique_ptr<Engine> make_engine_or_skip(const EngineOptions& o, std::string& skip) {
  auto e = Engine::create(o);
  if (!e) {
    if (e.error().code == ErrorCode::kUnavailable) skip = e.error().message;
    else ADD_FAILURE() << e.error().message;
    return nullptr;
  }
  return std::move(*e);
}

// A fixed prompt set (lengths 5..61, one longer than a prefill tile), greedy.
std::vector<std::vector<int32_t>> run_prompts(Engine& e) {
  static int round = 0;
  ++round;
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    EngineRequest r;
    r.id = "r";  // built with +=: GCC 12 warns falsely about "lit" + std::string
    r.id += std::to_string(round);
    r.id += '_';
    r.id += std::to_string(i);
    for (int j = 0; j < 5 + 11 * i; ++j) r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(40 + i, j) % 4000) + 10);
    r.params.max_tokens = 16;
    r.params.ignore_eos = true;
    r.params.temperature = 0.0;
    reqs.push_back(std::move(r));
  }
  auto s = e.submit(reqs);
  EXPECT_TRUE(s) << s.error().message;
  if (!s) return {};
  std::vector<std::vector<int32_t>> out(s->size());
  const auto end = Clock::now() + 120s;
  while (!s->finished() && Clock::now() < end)
    for (IndexedDelta& d : s->next(Clock::now() + 100ms)) {
      if (d.delta.finish && d.delta.finish->error) ADD_FAILURE() << d.delta.finish->error->message;
      out[d.index].insert(out[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
    }
  EXPECT_TRUE(s->finished());
  for (const auto& t : out) EXPECT_EQ(t.size(), 16u);
  return out;
}

uint64_t device_free(Engine& e) {
  EngineMemoryReport r = e.memory_report(soon());
  EXPECT_TRUE(r.device.has_value());
  return r.device ? r.device->free_bytes : 0;
}

uint64_t pool_bytes(const EngineMemoryReport& r) { return r.pool.total().total_bytes(); }

class CudaEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string skip;
    engine_ = make_engine_or_skip(cuda_options(), skip);
    if (!skip.empty()) GTEST_SKIP() << "no CUDA engine here: " << skip;
    ASSERT_NE(engine_, nullptr);
  }
  std::unique_ptr<Engine> engine_;
};

TEST_F(CudaEngine, EveryByteComesFromThePoolByTag) {
  EngineMemoryReport r = engine_->memory_report(soon());
  EXPECT_EQ(r.backend, memory::BackendKind::kCuda);
  EXPECT_GT(r.pool[Tag::kWeights].resident_bytes, 0u);
  EXPECT_GE(r.pool[Tag::kKvCache].resident_bytes, 256 * kMiB);
  EXPECT_EQ(r.pool[Tag::kKvCache].allocations, 1u) << "the KV cache is one allocation";
  EXPECT_GT(r.pool[Tag::kScratch].resident_bytes, 0u);
}

TEST_F(CudaEngine, SleepLevelOneAndTwoFreeTheMemoryAndWakeGivesTheSameTokens) {
  Engine& e = *engine_;
  const auto baseline = run_prompts(e);
  ASSERT_EQ(baseline.size(), 6u);
  const EngineMemoryReport awake = e.memory_report(soon());
  const uint64_t pool = pool_bytes(awake);
  const uint64_t weights = awake.pool[Tag::kWeights].total_bytes();
  const uint64_t free_awake = device_free(e);

  // Level 1: weights offloaded to host memory, everything released.
  auto s1 = e.sleep(1, PauseMode::kKeep, soon());
  ASSERT_TRUE(s1) << s1.error().message;
  EXPECT_EQ(s1->state, EngineState::kSleepingLevel1);
  EXPECT_EQ(memory::sum(s1->call.released_bytes), pool);
  EXPECT_EQ(s1->call.offloaded_bytes[memory::tag_index(Tag::kWeights)], weights);
  const uint64_t free_l1 = device_free(e);
  EXPECT_GE(free_l1, free_awake + pool - 64 * kMiB) << "level 1 gave back " << (free_l1 - free_awake) / kMiB
                                                     << " MiB of the pool's " << pool / kMiB << " MiB";
  EngineMemoryReport asleep = e.memory_report(soon());
  EXPECT_EQ(asleep.pool[Tag::kWeights].offloaded_bytes, weights);
  EXPECT_EQ(asleep.pool[Tag::kKvCache].resident_bytes, 0u);
  EXPECT_EQ(asleep.pool[Tag::kScratch].resident_bytes, 0u);

  auto w1 = e.wake_up(TagSet::all(), soon());
  ASSERT_TRUE(w1) << w1.error().message;
  EXPECT_EQ(w1->state, EngineState::kRunning);
  EXPECT_EQ(w1->call.restored_bytes[memory::tag_index(Tag::kWeights)], weights);
  EXPECT_LE(device_free(e), free_awake + 64 * kMiB);
  EXPECT_EQ(run_prompts(e), baseline) << "tokens after a level-1 sleep differ";

  // Level 2: everything released; weights woken, reloaded from the checkpoint, then the rest.
  auto s2 = e.sleep(2, PauseMode::kKeep, soon());
  ASSERT_TRUE(s2) << s2.error().message;
  EXPECT_EQ(s2->state, EngineState::kSleepingLevel2);
  EXPECT_FALSE(s2->weights_loaded);
  EXPECT_GE(device_free(e), free_awake + pool - 64 * kMiB);
  auto ww = e.wake_up(TagSet{Tag::kWeights}, soon());
  ASSERT_TRUE(ww) << ww.error().message;
  EXPECT_EQ(ww->state, EngineState::kPartiallyAwake);
  auto rl = e.reload_weights(std::nullopt, soon());
  ASSERT_TRUE(rl) << rl.error().message;
  EXPECT_TRUE(rl->weights_loaded);
  auto w2 = e.wake_up(TagSet::all(), soon());
  ASSERT_TRUE(w2) << w2.error().message;
  EXPECT_EQ(w2->state, EngineState::kRunning);
  EXPECT_EQ(run_prompts(e), baseline) << "tokens after level 2 + reload_weights differ";

  // Level 2 and one wake: the engine reads the checkpoint again by itself.
  ASSERT_TRUE(e.sleep(2, PauseMode::kKeep, soon()));
  auto w3 = e.wake_up(TagSet::all(), soon());
  ASSERT_TRUE(w3) << w3.error().message;
  EXPECT_FALSE(w3->call.weights_loaded_from.empty());
  EXPECT_EQ(run_prompts(e), baseline) << "tokens after level 2 + plain wake differ";
}

TEST_F(CudaEngine, ReleasingTheKvCacheAfterAPauseKeepsServingAfterWake) {
  Engine& e = *engine_;
  const auto baseline = run_prompts(e);
  const uint64_t kv = e.memory_report(soon()).pool[Tag::kKvCache].total_bytes();
  const uint64_t free_awake = device_free(e);
  ASSERT_TRUE(e.pause(PauseMode::kKeep, soon()));
  auto r = e.release_kv_cache_memory(soon());
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->state, EngineState::kPausedKvReleased);
  EXPECT_GE(device_free(e), free_awake + kv - 16 * kMiB);
  ASSERT_TRUE(e.wake_up(TagSet{Tag::kKvCache}, soon()));
  ASSERT_TRUE(e.resume(soon()));
  EXPECT_EQ(run_prompts(e), baseline);
}

TEST(CudaEngineSizing, GpuMemoryUtilizationSizesTheKvCache) {
  EngineOptions o = cuda_options();
  o.kv_cache_memory_bytes.reset();
  o.gpu_memory_utilization = 0.3;
  std::string skip;
  auto e = make_engine_or_skip(o, skip);
  if (!skip.empty()) GTEST_SKIP() << "no CUDA engine here: " << skip;
  ASSERT_NE(e, nullptr);
  EngineMemoryReport r = e->memory_report(soon());
  ASSERT_TRUE(r.device);
  const double total = static_cast<double>(r.device->total_bytes);
  const uint64_t kv = r.pool[Tag::kKvCache].total_bytes();
  const uint64_t rest = r.pool[Tag::kWeights].total_bytes() + r.pool[Tag::kScratch].total_bytes();
  // utilization x total = KV + what the engine took at load (pool + library overhead, under 1 GiB).
  EXPECT_LE(static_cast<double>(kv + rest), 0.3 * total + 4.0 * kMiB);
  EXPECT_GE(static_cast<double>(kv + rest), 0.3 * total - 1024.0 * kMiB);
  EXPECT_EQ(run_prompts(*e).size(), 6u);
}

}  // namespace
}  // namespace siesta
