// The Engine with --tensor-parallel-size on the CPU (CpuQwen3Tp over the
// tiny model): concurrent streaming requests (greedy and seeded sampling,
// chunked prefill, preemption, shared prefixes) give the tokens and text of
// tensor parallel size 1; a level-2 sleep and full wake (the checkpoint read
// again into every rank's shards) keep them; sizes that do not fit, and any
// size above 1 on CUDA, are one-line errors naming the problem.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <ostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/random.h"
#include "test_data.h"

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

Deadline soon() { return Clock::now() + 30s; }

EngineOptions options(int tp) {
  EngineOptions o;
  o.model_dir = siesta::testing::tiny_model_dir();
  o.threads = 2;
  o.max_model_len = 256;
  o.num_kv_blocks = 16;           // 256 token slots for 10 requests: preemptions
  o.max_num_batched_tokens = 32;  // chunked prefill
  o.max_num_seqs = 8;
  o.seed = 1;
  o.enable_sleep_mode = true;
  o.tensor_parallel_size = tp;
  return o;
}

std::unique_ptr<Engine> make_engine(const EngineOptions& o) {
  auto e = Engine::create(o);
  EXPECT_TRUE(e) << e.error().message;
  return e ? std::move(*e) : nullptr;
}

std::vector<EngineRequest> requests(const std::string& round) {
  std::vector<int32_t> shared;
  for (int j = 0; j < 36; ++j) shared.push_back(static_cast<int32_t>(request_draw(7, j) % 4000) + 10);
  std::vector<EngineRequest> out;
  for (int i = 0; i < 10; ++i) {
    EngineRequest r;
    r.id = round;
    r.id += std::to_string(i);
    if (i % 3 == 0) r.prompt_tokens = shared;
    for (int j = 0; j < 5 + 9 * i; ++j)
      r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(100 + i, j) % 4000) + 10);
    r.params.max_tokens = 10 + i % 3;
    r.params.ignore_eos = true;
    if (i % 2 == 1) {
      r.params.temperature = 0.8;
      r.params.top_p = 0.9;
      r.params.seed = 40 + i;
    } else {
      r.params.temperature = 0.0;
    }
    out.push_back(std::move(r));
  }
  return out;
}

struct Output {
  std::vector<int32_t> tokens;
  std::string text;
  int deltas = 0;
  bool operator==(const Output& o) const { return tokens == o.tokens && text == o.text; }
};
void PrintTo(const Output& o, std::ostream* os) {
  *os << "{tokens";
  for (int32_t t : o.tokens) *os << " " << t;
  *os << ", " << o.deltas << " deltas}";
}

// Each request from its own thread while the engine is paused (so that they
// all contend for the blocks), then resumed; every stream drained as it goes.
// The threads submit in the requests' order, so the queue, and with it the
// preemptions, are the same on every run, whatever the threads' timing.
std::map<std::string, Output> run_concurrently(Engine& e, const std::vector<EngineRequest>& reqs) {
  EXPECT_TRUE(e.pause(PauseMode::kKeep, soon()));
  std::map<std::string, Output> out;
  std::mutex mu;
  std::condition_variable turn_cv;
  size_t turn = 0;  // the request whose thread submits next (under mu)
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i)
    threads.emplace_back([&, i, r = reqs[i]] {
      {
        std::unique_lock<std::mutex> lock(mu);
        EXPECT_TRUE(turn_cv.wait_until(lock, Clock::now() + 10s, [&] { return turn == i; })) << r.id;
      }
      auto s = e.submit({r});
      {
        std::lock_guard<std::mutex> lock(mu);
        ++turn;
      }
      turn_cv.notify_all();
      EXPECT_TRUE(s) << s.error().message;
      if (!s) return;
      Output o;
      const auto end = Clock::now() + 60s;
      while (!s->finished() && Clock::now() < end)
        for (IndexedDelta& d : s->next(Clock::now() + 100ms)) {
          o.tokens.insert(o.tokens.end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
          o.text += d.delta.text;
          ++o.deltas;
        }
      EXPECT_TRUE(s->finished()) << r.id;
      std::lock_guard<std::mutex> lock(mu);
      out[r.id] = std::move(o);
    });
  const auto submitted = Clock::now() + 10s;
  while (e.metrics().num_requests_waiting < static_cast<int32_t>(reqs.size()) && Clock::now() < submitted)
    std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(e.resume(soon()));
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(EngineTensorParallel, ConcurrentStreamingRequestsMatchTp1AndSurviveALevel2Sleep) {
  std::map<std::string, Output> want;
  {
    auto e = make_engine(options(1));
    ASSERT_TRUE(e);
    want = run_concurrently(*e, requests("a"));
  }
  ASSERT_EQ(want.size(), 10u);
  auto e = make_engine(options(2));
  ASSERT_TRUE(e);
  const std::map<std::string, Output> got = run_concurrently(*e, requests("a"));
  EXPECT_EQ(got, want);
  for (const auto& [id, o] : got) {
    EXPECT_GE(o.tokens.size(), 10u) << id;
    EXPECT_GT(o.deltas, 1) << id;  // streamed, not one answer at the end
  }
  const auto end = Clock::now() + 10s;
  while (e->metrics().num_requests_running > 0 && Clock::now() < end) std::this_thread::sleep_for(1ms);
  EXPECT_GT(e->metrics().num_preemptions, 0u);
  EXPECT_GT(e->metrics().prefix_cache_hits, 0u);

  // Level 2: every rank's weights released; the full wake reads the
  // checkpoint into each rank's shards again.
  ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->wake_up(memory::TagSet::all(), soon()));
  std::map<std::string, Output> again = run_concurrently(*e, requests("b"));
  std::map<std::string, Output> renamed;
  for (auto& [id, o] : again) {
    std::string as_first = "a";  // (not "a" + ...: GCC 12 warns falsely about it)
    as_first += id.substr(1);
    renamed[as_first] = std::move(o);
  }
  EXPECT_EQ(renamed, want);
}

TEST(EngineTensorParallel, SizesThatDoNotFitAreOneLineErrors) {
  auto check = [](EngineOptions o, const std::string& needle) {
    auto e = Engine::create(o);
    ASSERT_FALSE(e) << needle;
    EXPECT_NE(e.error().message.find(needle), std::string::npos) << e.error().message;
    EXPECT_EQ(e.error().message.find('\n'), std::string::npos) << e.error().message;
  };
  check(options(3), "--tensor-parallel-size 3: tensor parallel size 3 does not divide the 4 attention heads");
  check(options(8), "does not divide the 4 attention heads");
  check(options(0), "--tensor-parallel-size must be at least 1, got 0");
  check(options(-2), "--tensor-parallel-size must be at least 1, got -2");
  EngineOptions cuda = options(2);
  cuda.device = Device::kCuda;
  check(cuda, "tensor parallelism on CUDA is not built yet");
  cuda.tensor_parallel_size = 1;
  EXPECT_TRUE(validate_tensor_parallel_size(cuda));
}

}  // namespace
}  // namespace siesta
