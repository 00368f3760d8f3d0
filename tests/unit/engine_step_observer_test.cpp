// EngineOptions::step_observer over the tiny CPU model: every step that
// computed is reported once, in order, with its batch (sequences, decodes,
// new tokens, the KV positions its attention reads) and its times.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/random.h"
#include "test_data.h"

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Recorder {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<EngineStepRecord> records;
  int64_t samples = 0;

  void add(const EngineStepRecord& r) {
    {
      std::lock_guard<std::mutex> lock(mu);
      records.push_back(r);
      samples += r.shape.samples;
    }
    cv.notify_all();
  }
  // The records once they hold `n` sampled tokens: a step is reported after
  // its outputs reached the stream, so the last one may come a moment after
  // the stream finished.
  std::vector<EngineStepRecord> take(int64_t n) {
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, 10s, [&] { return samples >= n; })) << samples << " of " << n << " samples";
    return records;
  }
};

std::unique_ptr<Engine> make_engine(Recorder& rec) {
  EngineOptions o;
  o.model_dir = siesta::testing::tiny_model_dir().string();
  o.threads = 2;
  o.max_model_len = 256;
  o.num_kv_blocks = 64;
  o.max_num_batched_tokens = 64;
  o.enable_prefix_caching = false;
  o.seed = 1;
  o.step_observer = [&rec](const EngineStepRecord& r) { rec.add(r); };
  auto e = Engine::create(o);
  EXPECT_TRUE(e) << e.error().message;
  return e ? std::move(*e) : nullptr;
}

EngineRequest request(const std::string& id, int seed, int prompt_len, int max_tokens) {
  EngineRequest r;
  r.id = id;
  for (int j = 0; j < prompt_len; ++j)
    r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(seed, j) % 4000) + 10);
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.temperature = 0.0;
  return r;
}

// Drains a stream within a deadline; the tokens per request.
std::vector<std::vector<int32_t>> drain(OutputStream& s) {
  std::vector<std::vector<int32_t>> out(s.size());
  const auto end = Clock::now() + 60s;
  while (!s.finished() && Clock::now() < end)
    for (IndexedDelta& d : s.next(Clock::now() + 100ms))
      out[d.index].insert(out[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
  EXPECT_TRUE(s.finished());
  return out;
}

TEST(EngineStepObserver, LoneRequestPrefillThenOneDecodePerToken) {
  Recorder rec;
  auto engine = make_engine(rec);
  ASSERT_TRUE(engine);
  auto s = engine->submit({request("a", 1, 20, 4)});
  ASSERT_TRUE(s) << s.error().message;
  const auto tokens = drain(*s);
  ASSERT_EQ(tokens[0].size(), 4u);

  const std::vector<EngineStepRecord> r = rec.take(4);
  // The prompt in one step (20 tokens, within 64 per step), then one decode
  // per further token: the last token is sampled, never computed.
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].shape.sequences, 1);
  EXPECT_EQ(r[0].shape.decodes, 0);
  EXPECT_EQ(r[0].shape.samples, 1);
  EXPECT_EQ(r[0].shape.batched_tokens, 20);
  EXPECT_EQ(r[0].shape.prefill_tokens, 20);
  EXPECT_EQ(r[0].shape.context_tokens, 20);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(r[i].shape.sequences, 1);
    EXPECT_EQ(r[i].shape.decodes, 1);
    EXPECT_EQ(r[i].shape.samples, 1);
    EXPECT_EQ(r[i].shape.batched_tokens, 1);
    EXPECT_EQ(r[i].shape.prefill_tokens, 0);
    EXPECT_EQ(r[i].shape.context_tokens, 20 + i) << "step " << i << " reads the prompt and its earlier tokens";
  }
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_LE(r[i].start, r[i].computed);
    EXPECT_LE(r[i].computed, r[i].delivered);
    if (i > 0) {
      EXPECT_LE(r[i - 1].delivered, r[i].start) << "steps are reported in the order they ran";
    }
  }
}

TEST(EngineStepObserver, ChunkedPromptsAndDecodesShareSteps) {
  Recorder rec;
  auto engine = make_engine(rec);
  ASSERT_TRUE(engine);
  // 100 prompt tokens take two steps of at most 64; the others decode meanwhile.
  const int prompts[] = {30, 100, 45};
  const int max_tokens = 6;
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 3; ++i)
    reqs.push_back(request(std::string(1, static_cast<char>('a' + i)), 10 + i, prompts[i], max_tokens));
  auto s = engine->submit(std::move(reqs));
  ASSERT_TRUE(s) << s.error().message;
  const auto tokens = drain(*s);
  for (const auto& t : tokens) ASSERT_EQ(t.size(), static_cast<size_t>(max_tokens));

  const std::vector<EngineStepRecord> r = rec.take(3 * max_tokens);
  int64_t batched = 0, prefill = 0, decodes = 0, samples = 0;
  for (const EngineStepRecord& x : r) {
    EXPECT_LE(x.shape.batched_tokens, 64);
    EXPECT_EQ(x.shape.batched_tokens, x.shape.prefill_tokens + x.shape.decodes);
    EXPECT_GE(x.shape.context_tokens, x.shape.batched_tokens);
    batched += x.shape.batched_tokens;
    prefill += x.shape.prefill_tokens;
    decodes += x.shape.decodes;
    samples += x.shape.samples;
  }
  // Every prompt token computed once, then max_tokens - 1 decodes per request;
  // each generated token is one sample.
  EXPECT_EQ(prefill, 30 + 100 + 45);
  EXPECT_EQ(decodes, 3 * (max_tokens - 1));
  EXPECT_EQ(batched, prefill + decodes);
  EXPECT_EQ(samples, 3 * max_tokens);
}

}  // namespace
}  // namespace siesta
