// Scheduler with a fake deterministic model: batch invariance, chunked
// prefill, preemption by recompute, prefix caching, abort, stop conditions,
// holds for remote readers and remote KV loads. Every test ends with all
// blocks free.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "engine/engine_step.h"
#include "engine/random.h"
#include "engine/sampler.h"

namespace siesta {
namespace {

constexpr int kVocab = 64;

// A model whose logits for position p are a hash of the tokens it reads back
// from the KV cache for positions 0..p through the block table. Any wrong
// block, stale block or misplaced slot changes the output (or fails when the
// stored position does not match), so equal outputs mean the cache held the
// right KV. Batch-invariant by construction.
class FakeModel : public Model {
 public:
  FakeModel() {
    cfg_.model_type = "fake";
    cfg_.vocab_size = kVocab;
    cfg_.num_layers = 1;
    cfg_.num_heads = 1;
    cfg_.num_kv_heads = 1;
    cfg_.head_dim = 2;
  }
  const ModelConfig& config() const override { return cfg_; }
  KvCacheLayout kv_layout() const override { return KvCacheLayout{1, 1, 2, kBlockSize, sizeof(float)}; }

  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override {
    SIESTA_TRY(validate_batch(cfg_, batch, kv));
    auto* base = static_cast<float*>(kv.base);
    auto slot = [&](std::span<const int32_t> table, int32_t pos) {
      return base + kv.layout.offset(table[pos / kBlockSize], 0, 0) + (pos % kBlockSize) * kv.layout.slot_elems();
    };
    out.vocab_size = kVocab;
    out.logits.clear();
    out.first_row.clear();
    out.num_rows.clear();
    for (const SequenceChunk& seq : batch) {
      for (size_t i = 0; i < seq.tokens.size(); ++i) {
        float* s = slot(seq.block_table, seq.start_pos + static_cast<int32_t>(i));
        s[0] = static_cast<float>(seq.tokens[i]);
        s[1] = static_cast<float>(seq.start_pos + i);
      }
      tokens_computed += seq.tokens.size();
      const int32_t last = seq.start_pos + static_cast<int32_t>(seq.tokens.size()) - 1;
      uint64_t h = 0x1234;
      for (int32_t q = 0; q <= last; ++q) {
        const float* s = slot(seq.block_table, q);
        if (s[1] != static_cast<float>(q))
          return internal_error("fake model: slot for position " + std::to_string(q) + " holds position " +
                                std::to_string(s[1]));
        h = mix64(h ^ static_cast<uint64_t>(s[0]) ^ (static_cast<uint64_t>(q) << 32));
      }
      out.first_row.push_back(out.logits.size() / kVocab);
      out.num_rows.push_back(1);
      for (int v = 0; v < kVocab; ++v)
        out.logits.push_back(static_cast<float>(mix64(h + v) >> 40) / static_cast<float>(1 << 24) * 8.0f - 4.0f);
    }
    return {};
  }

  size_t tokens_computed = 0;

 private:
  ModelConfig cfg_;
};

struct Finished {
  std::vector<int32_t> tokens;  // generated
  RequestState state = RequestState::kRunning;
  int32_t num_cached_tokens = 0;
  std::optional<int32_t> stop_token;
  std::vector<BlockId> held_blocks;
  std::vector<LogitsRow> logits;  // SampledToken::logits of each generated token
};

SchedulerOptions test_options() {
  SchedulerOptions o;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 64;
  o.max_model_len = 256;
  o.vocab_size = kVocab;
  return o;
}

class TestEngine {
 public:
  explicit TestEngine(int num_blocks, SchedulerOptions o = test_options(), bool prefix_caching = true)
      : pool(num_blocks, prefix_caching),
        kv_mem(static_cast<size_t>(num_blocks) * model.kv_layout().block_elems(), -1.0f),
        sampler(o.eos_token_ids, RandomGenerator(1)) {
    kv = KvCacheView{kv_mem.data(), num_blocks, model.kv_layout()};
    auto s = Scheduler::create(o, pool);
    EXPECT_TRUE(s) << s.error().message;
    sched = std::move(*s);
  }

  // Every test leaves no request and no block behind.
  ~TestEngine() {
    EXPECT_FALSE(sched->has_unfinished());
    EXPECT_EQ(pool.num_free_blocks(), pool.num_blocks()) << "blocks leaked";
    EXPECT_EQ(pool.stats().num_holds, 0);
  }

  void add(NewRequest r) {
    auto ok = sched->add_request(std::move(r));
    ASSERT_TRUE(ok) << ok.error().message;
  }

  // Steps once; records outputs. Returns false when nothing was scheduled.
  bool step() {
    auto outs = run_step(*sched, model, kv, sampler, logits);
    EXPECT_TRUE(outs) << outs.error().message;
    if (!outs) return false;
    ++steps;
    for (RequestOutput& o : *outs) {
      Finished& f = results[o.request_id];
      for (const SampledToken& t : o.new_tokens) {
        f.tokens.push_back(t.token);
        f.logits.push_back(t.logits);
      }
      f.state = o.state;
      f.num_cached_tokens = o.num_cached_tokens;
      f.stop_token = o.stop_token;
      f.held_blocks = o.held_blocks;
    }
    return !outs->empty() || sched->has_unfinished();
  }

  std::map<RequestId, Finished>& run(int max_steps = 100000) {
    for (int i = 0; i < max_steps && sched->has_unfinished(); ++i)
      if (!step()) break;
    EXPECT_FALSE(sched->has_unfinished());
    return results;
  }

  FakeModel model;
  BlockPool pool;
  std::vector<float> kv_mem;
  KvCacheView kv;
  Sampler sampler;
  ForwardOutput logits;
  std::unique_ptr<Scheduler> sched;
  std::map<RequestId, Finished> results;
  int steps = 0;
};

std::vector<int32_t> prompt(int len, uint64_t seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(static_cast<int32_t>(request_draw(seed, i) % kVocab));
  return p;
}

NewRequest request(const std::string& id, std::vector<int32_t> tokens, int max_tokens, std::optional<uint64_t> seed = {},
                   double temperature = 0.0) {
  NewRequest r;
  r.id = id;
  r.prompt_tokens = std::move(tokens);
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.seed = seed;
  return r;
}

// A mixed set: greedy and seeded sampling, short and long prompts.
std::vector<NewRequest> mixed_requests(int n) {
  std::vector<NewRequest> out;
  for (int i = 0; i < n; ++i) {
    const int len = 5 + (i * 37) % 90;
    std::string id = "r";
    id += std::to_string(i);
    NewRequest r = request(id, prompt(len, 100 + i), 10 + (i * 7) % 25);
    if (i % 2 == 1) {
      r.params.temperature = 0.9;
      r.params.seed = 1000 + i;
      r.params.top_k = (i % 4 == 1) ? 20 : 0;
      r.params.top_p = (i % 4 == 3) ? 0.9 : 1.0;
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::map<RequestId, Finished> run_alone(const std::vector<NewRequest>& reqs) {
  std::map<RequestId, Finished> out;
  for (const NewRequest& r : reqs) {
    TestEngine e(64);
    e.add(r);
    out[r.id] = e.run()[r.id];
    EXPECT_EQ(e.pool.num_free_blocks(), 64);
  }
  return out;
}

void expect_same_tokens(const std::map<RequestId, Finished>& a, const std::map<RequestId, Finished>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [id, f] : a) {
    auto it = b.find(id);
    ASSERT_NE(it, b.end()) << id;
    EXPECT_EQ(f.tokens, it->second.tokens) << id;
    EXPECT_EQ(f.state, it->second.state) << id;
  }
}

TEST(Scheduler, GeneratesMaxTokensAndFreesEverything) {
  TestEngine e(32);
  e.add(request("a", prompt(20, 1), 12));
  auto& r = e.run();
  EXPECT_EQ(r["a"].tokens.size(), 12u);
  EXPECT_EQ(r["a"].state, RequestState::kFinishedLength);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
  EXPECT_EQ(e.sched->stats().num_running, 0);
}

TEST(Scheduler, RequestsGiveTheSameTokensAloneAndBatched) {
  const auto reqs = mixed_requests(12);
  const auto alone = run_alone(reqs);
  SchedulerOptions o = test_options();
  o.max_num_seqs = 5;              // some wait for a slot
  o.max_num_batched_tokens = 40;   // long prompts are chunked, and share steps with decodes
  TestEngine e(96, o);
  for (const NewRequest& r : reqs) e.add(r);
  expect_same_tokens(alone, e.run());
  EXPECT_EQ(e.pool.num_free_blocks(), 96);
}

TEST(Scheduler, LongPromptsArePrefilledInChunksWithinTheBudget) {
  SchedulerOptions o = test_options();
  o.max_num_batched_tokens = 16;
  TestEngine chunked(32, o);
  chunked.add(request("a", prompt(100, 7), 5));
  // 100 prompt tokens at 16 per step: 7 steps before the first token.
  for (int i = 0; i < 6; ++i) {
    SchedulerOutput out = chunked.sched->schedule();
    ASSERT_EQ(out.sequences.size(), 1u);
    EXPECT_EQ(out.num_batched_tokens, 16);
    EXPECT_FALSE(out.sequences[0].sample);
    std::vector<SampledToken> none;
    ASSERT_TRUE(chunked.model.forward(out.chunks, chunked.kv, chunked.logits));
    ASSERT_TRUE(chunked.sched->update(out, none));
  }
  auto& r = chunked.run();
  TestEngine whole(32);
  whole.add(request("a", prompt(100, 7), 5));
  EXPECT_EQ(r["a"].tokens, whole.run()["a"].tokens);
  EXPECT_EQ(chunked.pool.num_free_blocks(), 32);
}

TEST(Scheduler, PreemptionUnderATinyKvCacheGivesTheSameTokens) {
  auto reqs = mixed_requests(8);
  for (NewRequest& r : reqs) r.params.max_tokens = 40;  // decodes grow into new blocks
  const auto alone = run_alone(reqs);
  SchedulerOptions o = test_options();
  o.max_model_len = 160;  // 10 blocks: the cache below holds one long request and a bit
  TestEngine e(12, o);
  for (const NewRequest& r : reqs) e.add(r);
  expect_same_tokens(alone, e.run());
  EXPECT_GT(e.sched->stats().num_preemptions, 0u);
  EXPECT_EQ(e.pool.num_free_blocks(), 12);
}

TEST(Scheduler, PreemptedRequestsRecomputeTheirGeneratedTokens) {
  TestEngine e(32);
  e.add(request("a", prompt(30, 3), 20, 77, 1.0));
  for (int i = 0; i < 8; ++i) e.step();
  const size_t before = e.results["a"].tokens.size();
  ASSERT_GT(before, 3u);
  EXPECT_EQ(e.sched->preempt_all(), 1);
  EXPECT_EQ(e.sched->find("a")->state, RequestState::kPreempted);
  EXPECT_EQ(e.sched->find("a")->num_computed_tokens, 0);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
  auto& r = e.run();
  TestEngine ref(32);
  ref.add(request("a", prompt(30, 3), 20, 77, 1.0));
  EXPECT_EQ(r["a"].tokens, ref.run()["a"].tokens);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

TEST(Scheduler, SharedPrefixesHitTheCacheWithoutChangingOutputs) {
  const std::vector<int32_t> shared = prompt(70, 9);  // 4 full blocks
  auto with_suffix = [&](uint64_t s) {
    auto p = shared;
    for (int32_t t : prompt(10, s)) p.push_back(t);
    return p;
  };
  std::vector<NewRequest> reqs{request("a", with_suffix(1), 8), request("b", with_suffix(2), 8, 5, 1.0),
                               request("c", shared, 8)};
  TestEngine no_cache(64, test_options(), /*prefix_caching=*/false);
  for (const NewRequest& r : reqs) no_cache.add(r);
  const auto expected = no_cache.run();

  TestEngine e(64);
  e.add(reqs[0]);
  e.run();
  e.add(reqs[1]);
  e.add(reqs[2]);
  auto& r = e.run();
  expect_same_tokens(expected, r);
  EXPECT_EQ(r["a"].num_cached_tokens, 0);
  EXPECT_EQ(r["b"].num_cached_tokens, 64);
  // "c" is exactly the shared part (70 tokens): its 4 full blocks are cached.
  EXPECT_EQ(r["c"].num_cached_tokens, 64);
  const BlockPoolStats s = e.pool.stats();
  EXPECT_EQ(s.prefix_cache_hits, 128u);
  EXPECT_EQ(s.prefix_cache_queries, 80u + 80u + 70u);
  // b and c computed 128 fewer prompt tokens than a run without the cache.
  EXPECT_EQ(e.model.tokens_computed + 128, no_cache.model.tokens_computed);
  EXPECT_EQ(e.pool.num_free_blocks(), 64);
}

TEST(Scheduler, APromptThatIsAllCachedStillComputesItsLastToken) {
  const std::vector<int32_t> p = prompt(32, 4);  // exactly two blocks
  TestEngine e(16);
  e.add(request("a", p, 3));
  e.run();
  e.add(request("b", p, 3));
  auto& r = e.run();
  EXPECT_EQ(r["b"].num_cached_tokens, 16);  // the block with the last token is computed again
  EXPECT_EQ(r["a"].tokens, r["b"].tokens);
  EXPECT_EQ(e.pool.num_free_blocks(), 16);
}

TEST(Scheduler, OnlyComputedBlocksAreCached) {
  // A follow-up turn: the previous prompt and answer, then more. The answer's
  // last token was sampled but never computed, so the block it completes is
  // not a hit.
  TestEngine e(32);
  e.add(request("turn1", prompt(40, 30), 8));  // 48 tokens in all
  auto& first = e.run();
  std::vector<int32_t> next = prompt(40, 30);
  next.insert(next.end(), first["turn1"].tokens.begin(), first["turn1"].tokens.end());
  for (int32_t t : prompt(5, 31)) next.push_back(t);
  e.add(request("turn2", next, 6));
  auto& r = e.run();
  EXPECT_EQ(r["turn2"].num_cached_tokens, 32);
  TestEngine ref(32, test_options(), /*prefix_caching=*/false);
  ref.add(request("turn2", next, 6));
  EXPECT_EQ(r["turn2"].tokens, ref.run()["turn2"].tokens);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

TEST(Scheduler, ARequestArrivingMidPrefillHitsOnlyTheChunksAlreadyComputed) {
  SchedulerOptions o = test_options();
  o.max_num_batched_tokens = 40;
  TestEngine e(32, o);
  const std::vector<int32_t> p = prompt(64, 32);
  e.add(request("a", p, 4));
  e.step();  // 40 of a's tokens computed: two full blocks and part of a third
  // Next step a computes its last 24 tokens and b is admitted beside it: only
  // a's first two blocks are ready.
  e.add(request("b", p, 4));
  auto& r = e.run();
  EXPECT_EQ(r["b"].num_cached_tokens, 32);
  EXPECT_EQ(r["a"].tokens, r["b"].tokens);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

TEST(Scheduler, CacheSaltSeparatesPrefixes) {
  const std::vector<int32_t> p = prompt(48, 5);
  TestEngine e(16);
  NewRequest a = request("a", p, 2);
  a.cache_salt = "tenant-1";
  e.add(a);
  e.run();
  NewRequest b = request("b", p, 2);
  b.cache_salt = "tenant-2";
  e.add(b);
  NewRequest c = request("c", p, 2);
  c.cache_salt = "tenant-1";
  e.add(c);
  auto& r = e.run();
  EXPECT_EQ(r["b"].num_cached_tokens, 0);
  EXPECT_EQ(r["c"].num_cached_tokens, 32);
  EXPECT_EQ(r["a"].tokens, r["b"].tokens);
}

TEST(Scheduler, AbortFreesBlocksInEveryState) {
  SchedulerOptions o = test_options();
  o.max_num_batched_tokens = 16;
  o.max_num_seqs = 2;
  TestEngine e(32, o);
  e.add(request("prefilling", prompt(60, 1), 10));
  e.add(request("decoding", prompt(4, 2), 50));
  e.add(request("waiting", prompt(10, 3), 10));
  e.step();
  e.step();
  e.step();
  ASSERT_EQ(e.sched->find("waiting")->state, RequestState::kWaiting);
  ASSERT_EQ(e.sched->find("prefilling")->state, RequestState::kRunning);
  ASSERT_LT(e.sched->find("prefilling")->num_computed_tokens, 60);
  auto w = e.sched->abort("waiting");
  ASSERT_TRUE(w);
  EXPECT_EQ(w->state, RequestState::kFinishedAborted);
  ASSERT_TRUE(e.sched->abort("prefilling"));
  e.step();
  e.sched->preempt_all();
  ASSERT_EQ(e.sched->find("decoding")->state, RequestState::kPreempted);
  ASSERT_TRUE(e.sched->abort("decoding"));
  EXPECT_FALSE(e.sched->has_unfinished());
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
  auto again = e.sched->abort("decoding");
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, ErrorCode::kNotFound);
  // A running request aborted mid-decode frees its blocks too.
  e.add(request("x", prompt(20, 4), 30));
  e.step();
  e.step();
  EXPECT_LT(e.pool.num_free_blocks(), 32);
  ASSERT_TRUE(e.sched->abort("x"));
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

// The greedy continuation of a prompt, to pick stop tokens from.
std::vector<int32_t> greedy_tokens(const std::vector<int32_t>& p, int n) {
  TestEngine e(32);
  e.add(request("g", p, n));
  return e.run()["g"].tokens;
}

TEST(Scheduler, EosStopsUnlessIgnoredAndIsKeptInTheOutput) {
  const auto p = prompt(10, 11);
  const auto toks = greedy_tokens(p, 20);
  const int32_t eos = toks[5];
  const size_t first = std::find(toks.begin(), toks.end(), eos) - toks.begin();
  SchedulerOptions o = test_options();
  o.eos_token_ids = {eos};
  TestEngine e(32, o);
  e.add(request("stops", p, 20));
  NewRequest ignoring = request("ignores", p, 20);
  ignoring.params.ignore_eos = true;
  e.add(ignoring);
  auto& r = e.run();
  EXPECT_EQ(r["stops"].state, RequestState::kFinishedStopped);
  EXPECT_EQ(r["stops"].tokens, std::vector<int32_t>(toks.begin(), toks.begin() + first + 1));
  EXPECT_FALSE(r["stops"].stop_token.has_value());
  EXPECT_EQ(r["ignores"].state, RequestState::kFinishedLength);
  EXPECT_EQ(r["ignores"].tokens, toks);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

TEST(Scheduler, StopTokenIdsEndTheRequestAndAreReported) {
  const auto p = prompt(10, 12);
  const auto toks = greedy_tokens(p, 20);
  TestEngine e(32);
  NewRequest r = request("a", p, 20);
  r.params.stop_token_ids = {toks[3]};
  e.add(r);
  auto& out = e.run();
  const size_t first = std::find(toks.begin(), toks.end(), toks[3]) - toks.begin();
  EXPECT_EQ(out["a"].tokens.size(), first + 1);
  EXPECT_EQ(out["a"].state, RequestState::kFinishedStopped);
  EXPECT_EQ(out["a"].stop_token, toks[3]);
}

TEST(Scheduler, MinTokensDelaysStops) {
  const auto p = prompt(10, 13);
  const auto toks = greedy_tokens(p, 20);
  SchedulerOptions o = test_options();
  o.eos_token_ids = {toks[0]};  // the most likely first token
  TestEngine e(32, o);
  NewRequest r = request("a", p, 20);
  r.params.min_tokens = 6;
  e.add(r);
  auto& out = e.run();
  ASSERT_GE(out["a"].tokens.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NE(out["a"].tokens[i], toks[0]) << i;
}

TEST(Scheduler, MaxModelLenCapsTheLength) {
  SchedulerOptions o = test_options();
  o.max_model_len = 40;
  TestEngine e(8, o);
  NewRequest r = request("a", prompt(30, 14), 100);
  e.add(r);
  r.id = "b";
  r.params.max_tokens.reset();
  e.add(r);
  auto& out = e.run();
  EXPECT_EQ(out["a"].tokens.size(), 10u);
  EXPECT_EQ(out["a"].state, RequestState::kFinishedLength);
  EXPECT_EQ(out["b"].tokens.size(), 10u);
  EXPECT_EQ(e.pool.num_free_blocks(), 8);
}

TEST(Scheduler, StopFromAStopStringEndsARunningRequest) {
  TestEngine e(16);
  e.add(request("a", prompt(8, 15), 50));
  e.step();
  e.step();
  auto s = e.sched->stop("a");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->state, RequestState::kFinishedStopped);
  EXPECT_EQ(s->num_output_tokens, 2);
  EXPECT_EQ(e.pool.num_free_blocks(), 16);
  e.add(request("w", prompt(8, 16), 5));
  auto refused = e.sched->stop("w");  // still waiting: nothing streamed yet
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kConflict);
  e.run();
}

TEST(Scheduler, BadRequestsAreRefusedWithReasons) {
  TestEngine e(32);
  struct Case {
    NewRequest r;
    const char* says;
  };
  std::vector<Case> cases;
  cases.push_back({request("", prompt(4, 1), 4), "id"});
  cases.push_back({request("x", {}, 4), "no tokens"});
  cases.push_back({request("x", prompt(300, 1), 4), "maximum model length of 256"});
  cases.push_back({request("x", {1, 2, 64}, 4), "outside the vocabulary"});
  cases.push_back({request("x", {1, -2}, 4), "outside the vocabulary"});
  NewRequest bad_temp = request("x", {1, 2}, 4);
  bad_temp.params.temperature = -1;
  cases.push_back({bad_temp, "temperature"});
  for (Case& c : cases) {
    auto r = e.sched->add_request(c.r);
    ASSERT_FALSE(r) << c.says;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message.find(c.says), std::string::npos) << r.error().message;
  }
  e.add(request("dup", {1, 2}, 2));
  auto dup = e.sched->add_request(request("dup", {1, 2}, 2));
  ASSERT_FALSE(dup);
  EXPECT_NE(dup.error().message.find("already in use"), std::string::npos);
  e.run();
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

TEST(Scheduler, CreateRefusesAMaxModelLenTheCacheCannotHold) {
  BlockPool pool(4);
  SchedulerOptions o = test_options();
  o.max_model_len = 100;  // 7 blocks
  auto s = Scheduler::create(o, pool);
  ASSERT_FALSE(s);
  EXPECT_NE(s.error().message.find("needs 7 KV blocks"), std::string::npos) << s.error().message;
  o.max_model_len = 64;
  EXPECT_TRUE(Scheduler::create(o, pool));
  o.max_num_batched_tokens = 0;
  EXPECT_FALSE(Scheduler::create(o, pool));
}

TEST(Scheduler, ResetPrefixCacheWaitsForRunningRequestsUnlessAskedToPreemptThem) {
  TestEngine e(32);
  e.add(request("a", prompt(40, 17), 10, 3, 1.0));
  e.step();
  e.step();
  auto refused = e.sched->reset_prefix_cache();
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kConflict);
  EXPECT_NE(refused.error().message.find("1 running requests"), std::string::npos) << refused.error().message;
  ASSERT_TRUE(e.sched->reset_prefix_cache(/*reset_running_requests=*/true));
  EXPECT_EQ(e.pool.stats().num_cached_blocks, 0);
  EXPECT_EQ(e.sched->find("a")->state, RequestState::kPreempted);
  auto& r = e.run();
  TestEngine ref(32);
  ref.add(request("a", prompt(40, 17), 10, 3, 1.0));
  EXPECT_EQ(r["a"].tokens, ref.run()["a"].tokens);
  EXPECT_GT(e.pool.stats().num_cached_blocks, 0);
  ASSERT_TRUE(e.sched->reset_prefix_cache());
  EXPECT_EQ(e.pool.stats().num_cached_blocks, 0);
  EXPECT_EQ(e.pool.num_free_blocks(), 32);
}

TEST(Scheduler, ProducerBlocksAreHeldForTheRemoteReaderUntilReleased) {
  TestEngine e(16);
  NewRequest p = request("p", prompt(40, 18), 1);
  p.hold_blocks_for_remote_reader = true;
  e.add(p);
  NewRequest aborted = request("q", prompt(40, 19), 5);
  aborted.hold_blocks_for_remote_reader = true;
  e.add(aborted);
  e.step();
  ASSERT_TRUE(e.sched->abort("q"));  // aborted: nothing to read, nothing held
  auto& r = e.run();
  ASSERT_EQ(r["p"].held_blocks.size(), 3u);  // 40 prompt tokens
  EXPECT_EQ(e.pool.num_free_blocks(), 13);
  EXPECT_EQ(e.pool.stats().num_held_blocks, 3);
  EXPECT_FALSE(e.pool.held_by(send_hold_owner("q")));
  ASSERT_TRUE(e.sched->release_hold(send_hold_owner("p")));
  EXPECT_EQ(e.pool.num_free_blocks(), 16);
}

// Copies one block's KV between two engines' caches, as a transfer would.
void copy_block(const TestEngine& from, BlockId src, TestEngine& to, BlockId dst) {
  const size_t n = from.model.kv_layout().block_elems();
  std::copy_n(from.kv_mem.begin() + src * n, n, to.kv_mem.begin() + dst * n);
}

TEST(Scheduler, ConsumerDecodesFromRemoteKvWithTheSameTokens) {
  const auto p = prompt(50, 20);
  TestEngine producer(16);
  NewRequest pr = request("x", p, 1);
  pr.hold_blocks_for_remote_reader = true;
  producer.add(pr);
  const std::vector<BlockId> src = producer.run()["x"].held_blocks;

  TestEngine consumer(16);
  consumer.add(request("x", p, 12, 4, 1.0));
  auto target = consumer.sched->await_remote_kv("x");
  ASSERT_TRUE(target) << target.error().message;
  ASSERT_EQ(target->block_table.size(), src.size());
  EXPECT_EQ(consumer.sched->find("x")->state, RequestState::kWaitingForRemoteKv);
  EXPECT_TRUE(consumer.sched->schedule().empty());  // parked while the peer writes
  for (size_t i = 0; i < src.size(); ++i) copy_block(producer, src[i], consumer, target->block_table[i]);
  ASSERT_TRUE(producer.sched->release_hold(send_hold_owner("x")));
  ASSERT_TRUE(consumer.sched->finish_remote_kv("x", /*loaded=*/true));
  auto& r = consumer.run();

  TestEngine local(16);
  local.add(request("x", p, 12, 4, 1.0));
  EXPECT_EQ(r["x"].tokens, local.run()["x"].tokens);
  // Only the last prompt token and the decode tokens were computed locally.
  EXPECT_EQ(consumer.model.tokens_computed, 1u + 11u);
  EXPECT_EQ(consumer.pool.num_free_blocks(), 16);
  EXPECT_EQ(producer.pool.num_free_blocks(), 16);
}

TEST(Scheduler, OnlyTheFirstTokenOfAHeldRequestKeepsItsLogits) {
  TestEngine e(16);
  NewRequest held = request("p", prompt(40, 26), 3, 8, 1.0);
  held.hold_blocks_for_remote_reader = true;
  e.add(held);
  e.add(request("q", prompt(40, 27), 3));
  auto& r = e.run();
  ASSERT_EQ(r["p"].logits.size(), 3u);
  ASSERT_NE(r["p"].logits[0], nullptr);
  EXPECT_EQ(r["p"].logits[0]->size(), static_cast<size_t>(kVocab));
  EXPECT_EQ(r["p"].logits[1], nullptr);
  EXPECT_EQ(r["p"].logits[2], nullptr);
  for (const LogitsRow& l : r["q"].logits) EXPECT_EQ(l, nullptr);
  // The kept row is the one the first token came from.
  Sampler again({}, RandomGenerator(1));
  SamplingParams params = held.params;
  EXPECT_EQ(again.sample(*r["p"].logits[0], params, 0).token, r["p"].tokens[0]);
  ASSERT_TRUE(e.sched->release_hold(send_hold_owner("p")));
}

// A producer's prefill (max_tokens 1, as the proxy asks) and its KV and
// logits, for a consumer to continue from.
struct Prefilled {
  std::vector<BlockId> blocks;
  LogitsRow logits;
};
Prefilled prefill_on(TestEngine& producer, const std::vector<int32_t>& p) {
  NewRequest pr = request("x", p, 1);
  pr.hold_blocks_for_remote_reader = true;
  producer.add(pr);
  Finished& f = producer.run()["x"];
  EXPECT_EQ(f.logits.size(), 1u);
  return Prefilled{f.held_blocks, f.logits.empty() ? nullptr : f.logits[0]};
}

TEST(Scheduler, ConsumerContinuesFromTheProducersLogitsWithoutComputingThePrompt) {
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>(), std::optional<uint64_t>(5)}) {
    const auto p = prompt(48, 28);  // ends on a block boundary: the first token needs a new block
    TestEngine producer(16);
    const Prefilled pre = prefill_on(producer, p);
    ASSERT_NE(pre.logits, nullptr);

    TestEngine consumer(16);
    const NewRequest asked = request("x", p, 12, seed, seed ? 1.0 : 0.0);
    consumer.add(asked);
    auto target = consumer.sched->await_remote_kv("x");
    ASSERT_TRUE(target) << target.error().message;
    for (size_t i = 0; i < pre.blocks.size(); ++i) copy_block(producer, pre.blocks[i], consumer, target->block_table[i]);
    ASSERT_TRUE(producer.sched->release_hold(send_hold_owner("x")));
    const SampledToken first = consumer.sampler.sample(*pre.logits, asked.params, 0);
    auto out = consumer.sched->finish_remote_kv_sampled("x", first);
    ASSERT_TRUE(out) << out.error().message;
    EXPECT_EQ(out->new_tokens.size(), 1u);
    EXPECT_FALSE(out->finished());
    EXPECT_EQ(consumer.sched->find("x")->state, RequestState::kWaiting);
    consumer.results["x"].tokens.push_back(first.token);
    auto& r = consumer.run();

    TestEngine local(16);
    local.add(request("x", p, 12, seed, seed ? 1.0 : 0.0));
    EXPECT_EQ(r["x"].tokens, local.run()["x"].tokens);
    // Only the decode tokens were computed here: none of the prompt.
    EXPECT_EQ(consumer.model.tokens_computed, 11u);
  }
}

TEST(Scheduler, AConsumerRequestCanEndOnTheProducersFirstToken) {
  const auto p = prompt(30, 29);
  TestEngine producer(16);
  const Prefilled pre = prefill_on(producer, p);
  ASSERT_TRUE(producer.sched->release_hold(send_hold_owner("x")));
  TestEngine consumer(16);
  const NewRequest asked = request("x", p, 1);
  consumer.add(asked);
  ASSERT_TRUE(consumer.sched->await_remote_kv("x"));
  auto out = consumer.sched->finish_remote_kv_sampled("x", consumer.sampler.sample(*pre.logits, asked.params, 0));
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(out->state, RequestState::kFinishedLength);
  EXPECT_EQ(out->num_output_tokens, 1);
  EXPECT_FALSE(consumer.sched->has_unfinished());
  EXPECT_EQ(consumer.model.tokens_computed, 0u);
  // A second call finds nothing to continue.
  auto again = consumer.sched->finish_remote_kv_sampled("x", SampledToken{});
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, ErrorCode::kNotFound);
}

TEST(Scheduler, AFailedRemoteLoadRecomputesThePrompt) {
  const auto p = prompt(50, 21);
  TestEngine consumer(16);
  consumer.add(request("x", p, 6));
  ASSERT_TRUE(consumer.sched->await_remote_kv("x"));
  ASSERT_TRUE(consumer.sched->finish_remote_kv("x", /*loaded=*/false));
  EXPECT_EQ(consumer.pool.num_free_blocks(), 16);
  EXPECT_EQ(consumer.sched->stats().num_remote_kv_failures, 1u);
  auto& r = consumer.run();
  TestEngine local(16);
  local.add(request("x", p, 6));
  EXPECT_EQ(r["x"].tokens, local.run()["x"].tokens);
  EXPECT_EQ(consumer.pool.num_free_blocks(), 16);
}

TEST(Scheduler, AFailedLoadAPeerMayStillWriteRecomputesInOtherBlocks) {
  const auto p = prompt(50, 25);
  TestEngine consumer(16);
  consumer.add(request("x", p, 6));
  auto target = consumer.sched->await_remote_kv("x");
  ASSERT_TRUE(target);
  ASSERT_TRUE(consumer.sched->finish_remote_kv("x", /*loaded=*/false, /*hold_blocks=*/true));
  // The 4 blocks the peer was told about stay held; the request recomputes
  // its prompt in others, and none of the held ones is handed out.
  const std::vector<BlockId> held = target->block_table;
  ASSERT_NE(consumer.pool.held_by(load_hold_owner("x")), nullptr);
  EXPECT_EQ(*consumer.pool.held_by(load_hold_owner("x")), held);
  EXPECT_EQ(consumer.pool.num_free_blocks(), 12);
  consumer.step();
  const Request* r = consumer.sched->find("x");
  ASSERT_NE(r, nullptr);
  for (BlockId b : r->block_table) EXPECT_EQ(std::count(held.begin(), held.end(), b), 0) << b;
  auto& out = consumer.run();
  TestEngine local(16);
  local.add(request("x", p, 6));
  EXPECT_EQ(out["x"].tokens, local.run()["x"].tokens);
  EXPECT_EQ(consumer.pool.num_free_blocks(), 12);
  ASSERT_TRUE(consumer.sched->release_hold(load_hold_owner("x")));
  EXPECT_EQ(consumer.pool.num_free_blocks(), 16);
}

TEST(Scheduler, AbortWhileLoadingKeepsBlocksUntilTheWriteHasEnded) {
  TestEngine consumer(16);
  consumer.add(request("x", prompt(40, 22), 6));
  auto target = consumer.sched->await_remote_kv("x");
  ASSERT_TRUE(target);
  ASSERT_TRUE(consumer.sched->abort("x"));
  EXPECT_EQ(consumer.pool.num_free_blocks(), 13);
  ASSERT_TRUE(consumer.sched->release_hold(load_hold_owner("x")));
  EXPECT_EQ(consumer.pool.num_free_blocks(), 16);
}

TEST(Scheduler, RemoteKvNeedsAWaitingRequestAndFreeBlocks) {
  SchedulerOptions o = test_options();
  o.max_model_len = 64;
  TestEngine e(4, o);
  e.add(request("big", prompt(60, 23), 2));
  e.add(request("other", prompt(60, 24), 2));
  e.step();
  auto running = e.sched->await_remote_kv("big");
  ASSERT_FALSE(running);
  EXPECT_EQ(running.error().code, ErrorCode::kConflict);
  auto full = e.sched->await_remote_kv("other");
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error().code, ErrorCode::kUnavailable);
  e.run();
  EXPECT_EQ(e.pool.num_free_blocks(), 4);
}

TEST(RequestState, TransitionsFollowTheTable) {
  using S = RequestState;
  using E = RequestEvent;
  EXPECT_EQ(*next_state(S::kWaiting, E::kSchedule), S::kRunning);
  EXPECT_EQ(*next_state(S::kWaiting, E::kAwaitRemoteKv), S::kWaitingForRemoteKv);
  EXPECT_EQ(*next_state(S::kWaitingForRemoteKv, E::kRemoteKvLoaded), S::kWaiting);
  EXPECT_EQ(*next_state(S::kWaitingForRemoteKv, E::kRemoteKvFailed), S::kWaiting);
  EXPECT_EQ(*next_state(S::kRunning, E::kPreempt), S::kPreempted);
  EXPECT_EQ(*next_state(S::kPreempted, E::kSchedule), S::kRunning);
  EXPECT_EQ(*next_state(S::kRunning, E::kStop), S::kFinishedStopped);
  EXPECT_EQ(*next_state(S::kPreempted, E::kStop), S::kFinishedStopped);
  EXPECT_EQ(*next_state(S::kRunning, E::kReachLength), S::kFinishedLength);
  EXPECT_EQ(*next_state(S::kWaiting, E::kStop), S::kFinishedStopped);        // ended on a remote load's first token
  EXPECT_EQ(*next_state(S::kWaiting, E::kReachLength), S::kFinishedLength);
  EXPECT_FALSE(next_state(S::kWaitingForRemoteKv, E::kStop));
  for (S s : {S::kWaiting, S::kWaitingForRemoteKv, S::kRunning, S::kPreempted})
    EXPECT_EQ(*next_state(s, E::kAbort), S::kFinishedAborted);
  for (S s : {S::kFinishedStopped, S::kFinishedLength, S::kFinishedAborted}) {
    auto r = next_state(s, E::kAbort);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, ErrorCode::kConflict);
  }
  EXPECT_FALSE(next_state(S::kWaiting, E::kPreempt));
  EXPECT_FALSE(next_state(S::kRunning, E::kSchedule));
  EXPECT_FALSE(next_state(S::kWaitingForRemoteKv, E::kSchedule));
  EXPECT_STREQ(finish_reason(S::kFinishedLength), "length");
  EXPECT_EQ(finish_reason(S::kRunning), nullptr);
}

}  // namespace
}  // namespace siesta
