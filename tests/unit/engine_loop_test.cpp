// The Engine over the tiny CPU model: submit from several threads, streamed
// deltas, stop strings, validation, abort in every state, pause/resume, and
// metrics. Outputs are compared with the same request run alone.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
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

EngineOptions options() {
  EngineOptions o;
  o.model_dir = siesta::testing::tiny_model_dir().string();
  o.threads = 2;
  o.max_model_len = 256;
  o.num_kv_blocks = 64;
  o.seed = 1;
  return o;
}

std::unique_ptr<Engine> make_engine(EngineOptions o = options()) {
  auto e = Engine::create(o);
  EXPECT_TRUE(e) << e.error().message;
  return e ? std::move(*e) : nullptr;
}

std::vector<int32_t> prompt(int seed, int len) {
  std::vector<int32_t> p;
  for (int j = 0; j < len; ++j) p.push_back(static_cast<int32_t>(request_draw(seed, j) % 4000) + 10);
  return p;
}

EngineRequest request(const std::string& id, std::vector<int32_t> tokens, int max_tokens, bool seeded) {
  EngineRequest r;
  r.id = id;
  r.prompt_tokens = std::move(tokens);
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  if (seeded) {
    r.params.temperature = 0.8;
    r.params.top_p = 0.9;
    r.params.seed = 42;
  } else {
    r.params.temperature = 0.0;
  }
  return r;
}

struct Collected {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;
  std::optional<RequestFinish> finish;
  int deltas = 0;
};

// Drains a stream; every wait has a deadline, and the whole drain too.
std::vector<Collected> drain(OutputStream& s, Clock::duration limit = 60s, Clock::duration wait = 100ms) {
  std::vector<Collected> out(s.size());
  const auto end = Clock::now() + limit;
  while (!s.finished() && Clock::now() < end) {
    for (IndexedDelta& d : s.next(Clock::now() + wait)) {
      Collected& c = out[d.index];
      EXPECT_FALSE(c.finish) << "delta after the finish";
      c.text += d.delta.text;
      c.tokens.insert(c.tokens.end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
      c.logprobs.insert(c.logprobs.end(), d.delta.logprobs.begin(), d.delta.logprobs.end());
      if (d.delta.finish) c.finish = d.delta.finish;
      ++c.deltas;
    }
  }
  EXPECT_TRUE(s.finished());
  return out;
}

Collected run_one(Engine& e, EngineRequest r) {
  auto s = e.submit({std::move(r)});
  EXPECT_TRUE(s) << s.error().message;
  return drain(*s)[0];
}

TEST(EngineLoop, StreamsTokensTextAndUsage) {
  auto e = make_engine();
  EngineRequest r = request("a", prompt(1, 20), 12, false);
  r.params.logprobs = 3;
  Collected c = run_one(*e, r);
  ASSERT_TRUE(c.finish);
  EXPECT_EQ(c.finish->reason, FinishReason::kLength);
  EXPECT_EQ(c.tokens.size(), 12u);
  EXPECT_EQ(c.finish->num_prompt_tokens, 20);
  EXPECT_EQ(c.finish->num_output_tokens, 12);
  EXPECT_EQ(c.text, e->tokenizer().decode(c.tokens, true));
  ASSERT_EQ(c.logprobs.size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(c.logprobs[i].chosen.token, c.tokens[i]);
    EXPECT_EQ(c.logprobs[i].top.size(), 3u);
    EXPECT_EQ(c.logprobs[i].chosen.rank, 1);  // greedy
  }
  EXPECT_GT(c.deltas, 1);
}

TEST(EngineLoop, ConcurrentSubmissionsMatchRunsAlone) {
  std::vector<EngineRequest> reqs;
  const std::vector<int32_t> shared = prompt(7, 40);
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> p = i % 3 == 0 ? shared : std::vector<int32_t>{};
    const std::vector<int32_t> tail = prompt(100 + i, 5 + 7 * i);
    p.insert(p.end(), tail.begin(), tail.end());
    std::string id = "r";
    id += std::to_string(i);  // (not "r" + ...: GCC 12 warns falsely about it)
    reqs.push_back(request(id, p, 10 + i % 4, i % 2 == 1));
  }
  std::map<std::string, std::vector<int32_t>> alone;
  {
    auto e = make_engine();
    for (const EngineRequest& r : reqs) alone[r.id] = run_one(*e, r).tokens;
  }
  EngineOptions tight = options();
  tight.num_kv_blocks = 20;            // 320 token slots for 12 requests: preemptions
  tight.max_num_batched_tokens = 32;   // chunked prefill
  tight.max_num_seqs = 6;
  auto e = make_engine(tight);
  // The threads submit while the engine is paused, so that all twelve requests
  // contend for the blocks whatever the threads' timing (on a busy machine they
  // could otherwise arrive one after another and never preempt).
  ASSERT_TRUE(e->pause(PauseMode::kKeep, Clock::now() + 10s));
  std::map<std::string, std::vector<int32_t>> batched;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (const EngineRequest& r : reqs)
    threads.emplace_back([&, r] {
      Collected c = run_one(*e, r);
      std::lock_guard<std::mutex> lock(mu);
      batched[r.id] = c.tokens;
    });
  const auto submitted = Clock::now() + 10s;
  while (e->metrics().num_requests_waiting < 12 && Clock::now() < submitted) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(e->metrics().num_requests_waiting, 12);
  EXPECT_TRUE(e->resume(Clock::now() + 10s));
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(batched, alone);
  // Gauges are published after the step whose outputs the streams already saw.
  const auto end = Clock::now() + 10s;
  while (e->metrics().num_requests_running > 0 && Clock::now() < end) std::this_thread::sleep_for(1ms);
  const EngineMetricsSnapshot m = e->metrics();
  EXPECT_GT(m.num_preemptions, 0u);
  EXPECT_GT(m.prefix_cache_hits, 0u);
  EXPECT_EQ(m.finished(FinishReason::kLength), 12u);
  EXPECT_EQ(m.num_requests_running, 0);
  EXPECT_EQ(m.kv_cache_usage, 0.0);
}

// Every step wakes the consumers it pushed to: a consumer that waits with a
// deadline far beyond the run is woken by each step, whether its stream holds
// one request or several (whose deltas reach it together, one wake per step).
TEST(EngineLoop, EachStepWakesItsConsumers) {
  auto e = make_engine();
  const auto t0 = Clock::now();
  auto batch = e->submit({request("b0", prompt(1, 12), 8, false), request("b1", prompt(2, 9), 8, true),
                          request("b2", prompt(3, 15), 8, false)});
  auto single = e->submit({request("s", prompt(4, 10), 8, false)});
  ASSERT_TRUE(batch && single);
  std::vector<Collected> from_batch, from_single;
  std::thread other([&] { from_single = drain(*single, 120s, 100s); });
  from_batch = drain(*batch, 120s, 100s);
  other.join();
  // Each drain waited on next() with a 100 s deadline: only wake-ups end those waits early.
  EXPECT_LT(Clock::now() - t0, 60s);
  ASSERT_EQ(from_batch.size(), 3u);
  ASSERT_EQ(from_single.size(), 1u);
  for (const Collected& c : from_batch) {
    ASSERT_TRUE(c.finish);
    EXPECT_EQ(c.tokens.size(), 8u);
  }
  ASSERT_TRUE(from_single[0].finish);
  EXPECT_EQ(from_single[0].tokens.size(), 8u);
  EXPECT_EQ(from_batch[0].tokens, run_one(*e, request("b0", prompt(1, 12), 8, false)).tokens);
}

TEST(EngineLoop, SubmitValidates) {
  auto e = make_engine();
  auto too_long = e->submit({request("x", prompt(1, 256), 4, false)});
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.error().message.find("256"), std::string::npos) << too_long.error().message;
  auto too_many = e->submit({request("x", prompt(1, 200), 100, false)});
  ASSERT_FALSE(too_many);
  EXPECT_NE(too_many.error().message.find("300"), std::string::npos) << too_many.error().message;
  EngineRequest bad_token = request("x", {1, 2, 4096}, 4, false);
  EXPECT_FALSE(e->submit({bad_token}));
  EngineRequest bad_params = request("x", {1, 2, 3}, 4, false);
  bad_params.params.top_p = 0.0;
  EXPECT_FALSE(e->submit({bad_params}));
  EXPECT_FALSE(e->submit({request("", {1}, 4, false)}));
  EXPECT_FALSE(e->submit({request("x", {}, 4, false)}));
  EXPECT_FALSE(e->submit({request("d", {1}, 4, false), request("d", {2}, 4, false)}));
  // Nothing half-queued: a valid one still runs.
  Collected c = run_one(*e, request("ok", {5, 6, 7}, 3, false));
  EXPECT_EQ(c.tokens.size(), 3u);
}

TEST(EngineLoop, StopStringsTruncateTextAndEndTheRequest) {
  auto e = make_engine();
  Collected full = run_one(*e, request("full", prompt(3, 10), 24, false));
  ASSERT_GE(full.text.size(), 8u);
  // A stop string made of a piece of the generated text, from its middle.
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  const size_t at = full.text.find(stop);
  EngineRequest r = request("stop", prompt(3, 10), 24, false);
  r.params.stop = {stop};
  Collected c = run_one(*e, r);
  ASSERT_TRUE(c.finish);
  EXPECT_EQ(c.finish->reason, FinishReason::kStop);
  EXPECT_EQ(std::get<std::string>(c.finish->stop_reason), stop);
  EXPECT_EQ(c.text, full.text.substr(0, at));
  EXPECT_LE(c.tokens.size(), full.tokens.size());
  EXPECT_EQ(c.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + c.tokens.size()));

  r.id = "stop-incl";
  r.params.include_stop_str_in_output = true;
  Collected incl = run_one(*e, r);
  EXPECT_EQ(incl.text, full.text.substr(0, at + stop.size()));

  // A stop token id: the token is kept in the ids, its text left out.
  EngineRequest t = request("stop-token", prompt(3, 10), 24, false);
  t.params.stop_token_ids = {full.tokens[5]};
  Collected ct = run_one(*e, t);
  ASSERT_TRUE(ct.finish);
  EXPECT_EQ(ct.finish->reason, FinishReason::kStop);
  EXPECT_EQ(std::get<int32_t>(ct.finish->stop_reason), full.tokens[5]);
  const auto first = std::find(full.tokens.begin(), full.tokens.end(), full.tokens[5]);
  const std::vector<int32_t> expect(full.tokens.begin(), first + 1);
  EXPECT_EQ(ct.tokens, expect);
  EXPECT_EQ(ct.text, e->tokenizer().decode(std::vector<int32_t>(expect.begin(), expect.end() - 1), true));
}

TEST(EngineLoop, AbortEndsRequestsInAnyState) {
  EngineOptions o = options();
  o.max_num_seqs = 1;  // the second request waits
  auto e = make_engine(o);
  auto s = e->submit({request("long", prompt(1, 8), 200, false), request("queued", prompt(2, 8), 200, false)});
  ASSERT_TRUE(s);
  // Wait for the first tokens of the running one.
  std::vector<IndexedDelta> first;
  const auto end = Clock::now() + 30s;
  while (first.empty() && Clock::now() < end) first = s->next(Clock::now() + 100ms);
  ASSERT_FALSE(first.empty());
  e->abort("queued");
  e->abort("long");
  e->abort("unknown");  // ignored
  std::vector<Collected> c = drain(*s);
  for (const Collected& x : c) {
    ASSERT_TRUE(x.finish);
    EXPECT_EQ(x.finish->reason, FinishReason::kAbort);
    EXPECT_FALSE(x.finish->error);
  }
  EXPECT_EQ(e->metrics().finished(FinishReason::kAbort), 2u);
  // The ids are free again.
  EXPECT_TRUE(e->submit({request("long", {1, 2}, 2, false)}));
}

TEST(EngineLoop, DestroyingTheStreamAborts) {
  auto e = make_engine();
  {
    auto s = e->submit({request("gone", prompt(1, 8), 200, false)});
    ASSERT_TRUE(s);
  }
  const auto end = Clock::now() + 30s;
  while (e->metrics().finished(FinishReason::kAbort) < 1 && Clock::now() < end) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(e->metrics().finished(FinishReason::kAbort), 1u);
  EXPECT_EQ(e->metrics().num_requests_running, 0);
}

TEST(EngineLoop, PauseKeepRecomputesAfterResumeWithTheSameTokens) {
  auto e = make_engine();
  const EngineRequest r = request("p", prompt(5, 30), 40, true);
  const Collected alone = run_one(*e, r);
  EngineRequest again = r;
  again.id = "p2";
  auto s = e->submit({again});
  ASSERT_TRUE(s);
  std::vector<int32_t> tokens;
  auto take = [&](std::vector<IndexedDelta> ds) {
    for (IndexedDelta& d : ds) tokens.insert(tokens.end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
    return ds.size();
  };
  const auto end = Clock::now() + 30s;
  while (tokens.empty() && Clock::now() < end) take(s->next(Clock::now() + 100ms));
  ASSERT_TRUE(e->pause(PauseMode::kKeep, Clock::now() + 10s));
  EXPECT_EQ(e->state(), EngineState::kPaused);
  EXPECT_TRUE(e->pause(PauseMode::kKeep, Clock::now() + 10s));  // idempotent
  auto held = e->submit({request("held", {1, 2, 3}, 2, false)});  // waits while paused
  ASSERT_TRUE(held);
  take(s->next(Clock::now() + 50ms));  // what the last step before the pause produced
  const size_t before = tokens.size();
  EXPECT_LT(before, 40u);
  EXPECT_EQ(take(s->next(Clock::now() + 200ms)), 0u);  // nothing moves while paused
  EXPECT_TRUE(held->next(Clock::now() + 50ms).empty());
  EXPECT_EQ(e->metrics().num_requests_running, 0);
  EXPECT_EQ(e->metrics().num_requests_waiting, 2);
  ASSERT_TRUE(e->resume(Clock::now() + 10s));
  Collected rest = drain(*s)[0];
  tokens.insert(tokens.end(), rest.tokens.begin(), rest.tokens.end());
  EXPECT_EQ(tokens, alone.tokens);  // recomputed, then went on exactly as alone
  EXPECT_EQ(drain(*held)[0].tokens.size(), 2u);
  EXPECT_GT(e->metrics().num_preemptions, 0u);
}

TEST(EngineLoop, PauseAbortAndWait) {
  auto e = make_engine();
  auto s = e->submit({request("a", prompt(1, 8), 200, false)});
  ASSERT_TRUE(s);
  ASSERT_TRUE(e->pause(PauseMode::kAbort, Clock::now() + 10s));
  Collected c = drain(*s)[0];
  ASSERT_TRUE(c.finish);
  EXPECT_EQ(c.finish->reason, FinishReason::kAbort);
  ASSERT_TRUE(e->resume(Clock::now() + 10s));

  auto w = e->submit({request("w", prompt(2, 8), 20, false)});
  ASSERT_TRUE(w);
  ASSERT_TRUE(e->pause(PauseMode::kWait, Clock::now() + 30s));
  EXPECT_EQ(e->state(), EngineState::kPaused);
  Collected cw = drain(*w)[0];
  ASSERT_TRUE(cw.finish);
  EXPECT_EQ(cw.finish->reason, FinishReason::kLength);  // it ran to the end
  ASSERT_TRUE(e->resume(Clock::now() + 10s));
  EXPECT_EQ(e->state(), EngineState::kRunning);
}

TEST(EngineLoop, ShutdownEndsLiveRequestsWithAnError) {
  auto e = make_engine();
  auto s = e->submit({request("a", prompt(1, 8), 200, false)});
  ASSERT_TRUE(s);
  e.reset();
  Collected c = drain(*s)[0];
  ASSERT_TRUE(c.finish);
  EXPECT_EQ(c.finish->reason, FinishReason::kAbort);
  ASSERT_TRUE(c.finish->error);
  EXPECT_EQ(c.finish->error->code, ErrorCode::kUnavailable);
  s->abort();  // the engine is gone: nothing happens
}

TEST(EngineLoop, MetricsCountTokensAndLatencies) {
  auto e = make_engine();
  run_one(*e, request("a", prompt(1, 17), 5, false));
  run_one(*e, request("b", prompt(1, 17), 5, false));  // same prompt: prefix-cache hit
  const EngineMetricsSnapshot m = e->metrics();
  EXPECT_EQ(m.num_requests_submitted, 2u);
  EXPECT_EQ(m.prompt_tokens, 34u);
  EXPECT_EQ(m.generation_tokens, 10u);
  EXPECT_EQ(m.finished(FinishReason::kLength), 2u);
  EXPECT_EQ(m.time_to_first_token.count, 2u);
  EXPECT_EQ(m.inter_token_latency.count, 8u);
  EXPECT_EQ(m.e2e_request_latency.count, 2u);
  EXPECT_EQ(m.prefix_cache_queries, 34u);
  EXPECT_EQ(m.prefix_cache_hits, 16u);
  EXPECT_EQ(m.num_kv_blocks, 64);
}

TEST(EngineLoop, LimitsFollowTheOptions) {
  EngineOptions o = options();
  o.max_model_len.reset();
  o.num_kv_blocks.reset();
  o.kv_cache_memory_bytes = 64 * 65536;  // 64 blocks of the tiny model: 1024 tokens
  auto e = make_engine(o);
  EXPECT_EQ(e->limits().num_kv_blocks, 64);
  EXPECT_EQ(e->limits().max_model_len, 1024);  // lowered from 4096 to what fits
  o.max_model_len = 2048;
  auto bad = Engine::create(o);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("2048"), std::string::npos) << bad.error().message;
}

}  // namespace
}  // namespace siesta
