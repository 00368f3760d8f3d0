// The Engine's lifecycle in sleep mode over the tiny CPU model: the state
// table of docs/engine-states.md cell by cell, every engine allocation from
// the memory pool, sleep levels 0/1/2 with full and selective wake, the KV
// cache released after a pause, weight reloads (same and other checkpoint,
// wrong shape), requests kept across a sleep or held while asleep, the bounded
// queue, and refused calls that leave the engine serving. Outputs after each
// wake are compared with the engine's own outputs before it slept.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/random.h"
#include "model/make_model.h"
#include "test_data.h"

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using memory::Tag;
using memory::TagSet;
namespace fs = std::filesystem;

const fs::path kTiny = siesta::testing::tiny_model_dir();

Deadline soon() { return Clock::now() + 30s; }

EngineOptions options() {
  EngineOptions o;
  o.model_dir = kTiny;
  o.threads = 2;
  o.max_model_len = 256;
  o.num_kv_blocks = 64;
  o.seed = 1;
  o.enable_sleep_mode = true;
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

EngineRequest greedy(const std::string& id, std::vector<int32_t> tokens, int max_tokens) {
  EngineRequest r;
  r.id = id;
  r.prompt_tokens = std::move(tokens);
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.temperature = 0.0;
  return r;
}

// Tokens of every request of a stream, drained with a deadline.
std::vector<std::vector<int32_t>> drain(OutputStream& s, Clock::duration limit = 60s) {
  std::vector<std::vector<int32_t>> out(s.size());
  const auto end = Clock::now() + limit;
  while (!s.finished() && Clock::now() < end)
    for (IndexedDelta& d : s.next(Clock::now() + 100ms))
      out[d.index].insert(out[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
  EXPECT_TRUE(s.finished()) << "the stream did not finish in time";
  return out;
}

// A fixed prompt set, run as one submission; ids unique per call.
std::vector<std::vector<int32_t>> run_prompts(Engine& e) {
  static int round = 0;
  ++round;
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    std::string id = "set";  // (built with +=: GCC 12 warns falsely about "lit" + std::string)
    id += std::to_string(round);
    id += '_';
    id += std::to_string(i);
    reqs.push_back(greedy(id, prompt(10 + i, 12 + 9 * i), 10));
  }
  auto s = e.submit(reqs);
  EXPECT_TRUE(s) << s.error().message;
  if (!s) return {};
  return drain(*s);
}

uint64_t resident(const EngineMemoryReport& r, Tag t) { return r.pool[t].resident_bytes; }
uint64_t released(const EngineMemoryReport& r, Tag t) { return r.pool[t].released_bytes; }
uint64_t offloaded(const EngineMemoryReport& r, Tag t) { return r.pool[t].offloaded_bytes; }

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("siesta_lifecycle_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// ---- the state table -----------------------------------------------------------

TEST(EngineStateTable, MatchesTheDocumentedTable) {
  using S = EngineState;
  using E = EngineEvent;
  const std::vector<E> events{E::kPauseNow,    E::kPauseWhenDrained, E::kDrained,     E::kResume,
                              E::kSleepLevel0, E::kSleepLevel1,      E::kSleepLevel2, E::kReleaseKvCache,
                              E::kWakePartial, E::kWakeAll};
  // docs/engine-states.md, "Transitions"; nullopt is "-" (refused).
  constexpr auto X = std::nullopt;
  const S run = S::kRunning, drn = S::kDraining, pau = S::kPaused, kvr = S::kPausedKvReleased,
          sl0 = S::kSleepingLevel0, sl1 = S::kSleepingLevel1, sl2 = S::kSleepingLevel2, par = S::kPartiallyAwake;
  const std::map<S, std::vector<std::optional<S>>> table{
      {run, {pau, drn, X, run, X, X, X, X, X, run}},
      {drn, {pau, drn, pau, run, X, X, X, X, X, drn}},
      {pau, {pau, pau, pau, run, sl0, sl1, sl2, kvr, X, pau}},
      {kvr, {kvr, kvr, kvr, X, par, sl1, sl2, kvr, kvr, pau}},
      {sl0, {sl0, sl0, sl0, X, sl0, sl1, sl2, par, par, run}},
      {sl1, {sl1, sl1, sl1, X, sl1, sl1, sl2, sl1, par, run}},
      {sl2, {sl2, sl2, sl2, X, sl2, sl2, sl2, sl2, par, run}},
      {par, {par, par, par, X, par, sl1, sl2, par, par, run}},
  };
  ASSERT_EQ(table.size(), 8u);
  for (const auto& [from, row] : table) {
    for (size_t i = 0; i < events.size(); ++i) {
      auto next = next_engine_state(from, events[i]);
      SCOPED_TRACE(std::string(engine_state_name(from)) + " + " + engine_event_name(events[i]));
      if (!row[i]) {
        ASSERT_FALSE(next);
        EXPECT_EQ(next.error().code, ErrorCode::kConflict);
        EXPECT_NE(next.error().message.find(engine_state_name(from)), std::string::npos) << next.error().message;
      } else {
        ASSERT_TRUE(next) << next.error().message;
        EXPECT_EQ(*next, *row[i]);
      }
    }
  }
  // Only running and draining schedule; only running admits.
  for (const auto& [s, row] : table) {
    EXPECT_EQ(engine_schedules(s), s == run || s == drn);
    EXPECT_EQ(engine_admits(s), s == run);
    EXPECT_EQ(engine_is_sleeping(s), s == sl0 || s == sl1 || s == sl2 || s == par);
  }
}

// ---- memory ----------------------------------------------------------------------

TEST(EngineLifecycle, EveryAllocationComesFromThePool) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const EngineMemoryReport r = e->memory_report(soon());
  EXPECT_EQ(r.pool[Tag::kWeights].allocations, 1u);
  EXPECT_GE(resident(r, Tag::kWeights), 4u * 4096 * 256);  // at least the fp32 embedding
  EXPECT_EQ(r.pool[Tag::kKvCache].allocations, 1u);
  EXPECT_EQ(resident(r, Tag::kKvCache), e->limits().kv_cache_bytes);
  EXPECT_EQ(r.pool[Tag::kScratch].allocations, 1u);
  EXPECT_GT(resident(r, Tag::kScratch), 0u);
  ASSERT_TRUE(r.process_resident_bytes);
  EXPECT_GT(*r.process_resident_bytes, resident(r, Tag::kKvCache));
  ASSERT_TRUE(r.device);
  EXPECT_GT(r.device->total_bytes, 0u);
  const EngineStatus s = e->status();
  EXPECT_EQ(s.state, EngineState::kRunning);
  EXPECT_EQ(s.resident, TagSet::all());
  EXPECT_TRUE(s.not_resident.empty());
  EXPECT_TRUE(s.weights_loaded);
}

TEST(EngineLifecycle, KvCacheSizeFollowsKvCacheMemoryBytes) {
  EngineOptions o = options();
  o.num_kv_blocks.reset();
  o.kv_cache_memory_bytes = uint64_t{8} << 20;
  auto e = make_engine(o);
  ASSERT_TRUE(e);
  const uint64_t block = e->limits().kv_cache_bytes / static_cast<uint64_t>(e->limits().num_kv_blocks);
  EXPECT_EQ(e->limits().num_kv_blocks, static_cast<int32_t>((uint64_t{8} << 20) / block));
  EXPECT_EQ(resident(e->memory_report(soon()), Tag::kKvCache), e->limits().kv_cache_bytes);
}

// ---- sleep levels ------------------------------------------------------------------

TEST(EngineLifecycle, Level1OffloadsWeightsReleasesTheRestAndWakesIdentical) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  const EngineMemoryReport awake = e->memory_report(soon());

  auto s = e->sleep(1, PauseMode::kKeep, soon());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ(s->state, EngineState::kSleepingLevel1);
  EXPECT_EQ(s->not_resident, TagSet::all());
  EXPECT_EQ(s->call.offloaded_bytes[memory::tag_index(Tag::kWeights)], resident(awake, Tag::kWeights));
  EXPECT_EQ(s->call.released_bytes[memory::tag_index(Tag::kKvCache)], resident(awake, Tag::kKvCache));
  const EngineMemoryReport asleep = e->memory_report(soon());
  EXPECT_EQ(offloaded(asleep, Tag::kWeights), resident(awake, Tag::kWeights));
  EXPECT_EQ(released(asleep, Tag::kKvCache), resident(awake, Tag::kKvCache));
  EXPECT_EQ(released(asleep, Tag::kScratch), resident(awake, Tag::kScratch));
  EXPECT_EQ(asleep.pool.total().resident_bytes, 0u);

  auto w = e->wake_up(TagSet::all(), soon());
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(w->state, EngineState::kRunning);
  EXPECT_EQ(w->call.restored_bytes[memory::tag_index(Tag::kWeights)], resident(awake, Tag::kWeights));
  EXPECT_EQ(e->memory_report(soon()).pool, awake.pool);
  // The KV contents are gone, so the prefix cache must be empty: the same
  // prompts find nothing cached (while awake, a rerun finds their blocks).
  const uint64_t hits = e->metrics().prefix_cache_hits;
  EXPECT_EQ(run_prompts(*e), baseline);
  EXPECT_EQ(e->metrics().prefix_cache_hits, hits);
  EXPECT_EQ(run_prompts(*e), baseline);
  EXPECT_GT(e->metrics().prefix_cache_hits, hits);
}

TEST(EngineLifecycle, Level2SelectiveWakeWaitsForEveryTagAndReloads) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  const EngineMemoryReport awake = e->memory_report(soon());

  auto s = e->sleep(2, PauseMode::kKeep, soon());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ(s->state, EngineState::kSleepingLevel2);
  EXPECT_FALSE(s->weights_loaded);
  const EngineMemoryReport asleep = e->memory_report(soon());
  EXPECT_EQ(released(asleep, Tag::kWeights), resident(awake, Tag::kWeights));
  EXPECT_EQ(offloaded(asleep, Tag::kWeights), 0u);

  // A request sent while asleep waits.
  auto held = e->submit({greedy("held", prompt(10, 12), 10)});
  ASSERT_TRUE(held);

  // reload_weights needs the weights mapped.
  auto early = e->reload_weights(std::nullopt, soon());
  ASSERT_FALSE(early);
  EXPECT_EQ(early.error().code, ErrorCode::kConflict);
  EXPECT_NE(early.error().message.find("wake_up?tags=weights"), std::string::npos) << early.error().message;

  auto w1 = e->wake_up({Tag::kWeights}, soon());
  ASSERT_TRUE(w1) << w1.error().message;
  EXPECT_EQ(w1->state, EngineState::kPartiallyAwake);
  EXPECT_EQ(w1->not_resident, (TagSet{Tag::kKvCache, Tag::kScratch}));
  EXPECT_TRUE(e->status().held_requests == 1);
  EXPECT_TRUE(held->next(Clock::now() + 200ms).empty());  // not scheduled while partially awake

  auto r = e->reload_weights(std::nullopt, soon());
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(r->weights_loaded);
  EXPECT_EQ(r->call.weights_loaded_from, kTiny.string());
  EXPECT_EQ(r->state, EngineState::kPartiallyAwake);

  auto w2 = e->wake_up({Tag::kKvCache}, soon());
  ASSERT_TRUE(w2) << w2.error().message;
  EXPECT_EQ(w2->state, EngineState::kRunning);
  EXPECT_TRUE(w2->call.weights_loaded_from.empty());  // reloaded already
  EXPECT_EQ(e->memory_report(soon()).pool, awake.pool);
  EXPECT_EQ(drain(*held)[0], baseline[0]);
  EXPECT_EQ(run_prompts(*e), baseline);
}

TEST(EngineLifecycle, FullWakeAfterLevel2ReadsTheCheckpointAgain) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
  auto deeper = e->sleep(2, PauseMode::kKeep, soon());  // drops the host copy
  ASSERT_TRUE(deeper) << deeper.error().message;
  EXPECT_EQ(deeper->state, EngineState::kSleepingLevel2);
  EXPECT_GT(deeper->call.discarded_bytes, 0u);
  EXPECT_EQ(e->memory_report(soon()).pool[Tag::kWeights].offloaded_bytes, 0u);
  auto w = e->wake_up(TagSet::all(), soon());
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(w->state, EngineState::kRunning);
  EXPECT_EQ(w->call.weights_loaded_from, kTiny.string());
  EXPECT_EQ(run_prompts(*e), baseline);
}

TEST(EngineLifecycle, Level0OnlyPauses) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  const EngineMemoryReport awake = e->memory_report(soon());
  auto s = e->sleep(0, PauseMode::kKeep, soon());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ(s->state, EngineState::kSleepingLevel0);
  EXPECT_EQ(e->memory_report(soon()).pool, awake.pool);
  auto resume = e->resume(soon());  // asleep: wake_up, not resume
  ASSERT_FALSE(resume);
  EXPECT_EQ(resume.error().code, ErrorCode::kConflict);
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(e->state(), EngineState::kRunning);
  EXPECT_EQ(run_prompts(*e), baseline);
}

TEST(EngineLifecycle, RepeatedCallsLeaveTheStateAsItWas) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  auto w = e->wake_up(TagSet::all(), soon());  // wake when awake
  ASSERT_TRUE(w);
  EXPECT_EQ(w->state, EngineState::kRunning);
  EXPECT_EQ(memory::sum(w->call.mapped_bytes), 0u);
  ASSERT_TRUE(e->resume(soon()));  // resume when running
  ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
  const EngineMemoryReport asleep = e->memory_report(soon());
  for (int level : {1, 0}) {  // same level, and shallower
    auto again = e->sleep(level, PauseMode::kKeep, soon());
    ASSERT_TRUE(again) << again.error().message;
    EXPECT_EQ(again->state, EngineState::kSleepingLevel1);
    EXPECT_EQ(memory::sum(again->call.released_bytes), 0u);
  }
  auto paused = e->pause(PauseMode::kAbort, soon());  // pause when asleep
  ASSERT_TRUE(paused);
  EXPECT_EQ(paused->state, EngineState::kSleepingLevel1);
  auto released_again = e->release_kv_cache_memory(soon());
  ASSERT_TRUE(released_again);
  EXPECT_EQ(released_again->state, EngineState::kSleepingLevel1);
  EXPECT_EQ(e->memory_report(soon()).pool, asleep.pool);
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  auto twice = e->wake_up(TagSet::all(), soon());
  ASSERT_TRUE(twice);
  EXPECT_EQ(twice->state, EngineState::kRunning);
}

// ---- release_kv_cache_memory ----------------------------------------------------------

TEST(EngineLifecycle, ReleaseKvCacheMemoryNeedsAPause) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  auto refused = e->release_kv_cache_memory(soon());
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kConflict);
  EXPECT_NE(refused.error().message.find("/pause"), std::string::npos) << refused.error().message;
  EXPECT_EQ(e->state(), EngineState::kRunning);
  EXPECT_EQ(run_prompts(*e), baseline);  // still serving

  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  const EngineMemoryReport paused = e->memory_report(soon());
  auto r = e->release_kv_cache_memory(soon());
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->state, EngineState::kPausedKvReleased);
  EXPECT_EQ(r->not_resident, TagSet{Tag::kKvCache});
  const EngineMemoryReport m = e->memory_report(soon());
  EXPECT_EQ(released(m, Tag::kKvCache), resident(paused, Tag::kKvCache));
  EXPECT_EQ(resident(m, Tag::kWeights), resident(paused, Tag::kWeights));
  EXPECT_EQ(resident(m, Tag::kScratch), resident(paused, Tag::kScratch));

  // reload_weights works here: weights resident, scheduler stopped.
  ASSERT_TRUE(e->reload_weights(std::nullopt, soon()));
  auto w = e->wake_up({Tag::kKvCache}, soon());
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(w->state, EngineState::kPaused);  // the explicit pause stays
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), baseline);

  // A resume of a released KV cache maps it first: the engine serves at once.
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->release_kv_cache_memory(soon()));
  auto resumed = e->resume(soon());
  ASSERT_TRUE(resumed) << resumed.error().message;
  EXPECT_EQ(resumed->state, EngineState::kRunning);
  EXPECT_EQ(resumed->resident, TagSet::all());
  EXPECT_EQ(resumed->call.mapped_bytes[memory::tag_index(Tag::kKvCache)], resident(paused, Tag::kKvCache));
  EXPECT_EQ(run_prompts(*e), baseline);
}

// ---- requests across sleep --------------------------------------------------------

TEST(EngineLifecycle, RequestsRunningAtSleepRecomputeAfterWakeWithTheSameTokens) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    std::string id = "k";
    id += std::to_string(i);
    reqs.push_back(greedy(id, prompt(40 + i, 20 + 3 * i), 30));
  }
  std::vector<std::vector<int32_t>> alone;
  for (EngineRequest r : reqs) {
    r.id += "_alone";
    auto s = e->submit({r});
    ASSERT_TRUE(s);
    alone.push_back(drain(*s)[0]);
  }
  auto s = e->submit(reqs);
  ASSERT_TRUE(s);
  std::vector<std::vector<int32_t>> got(reqs.size());
  const auto end = Clock::now() + 30s;
  size_t seen = 0;
  while (seen == 0 && Clock::now() < end)
    for (IndexedDelta& d : s->next(Clock::now() + 100ms)) {
      got[d.index].insert(got[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
      seen += d.delta.token_ids.size();
    }
  for (int level : {1, 2}) {
    auto slept = e->sleep(level, PauseMode::kKeep, soon());
    ASSERT_TRUE(slept) << slept.error().message;
    std::this_thread::sleep_for(50ms);
    ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  }
  const auto rest = drain(*s);
  for (size_t i = 0; i < reqs.size(); ++i) {
    got[i].insert(got[i].end(), rest[i].begin(), rest[i].end());
    EXPECT_EQ(got[i], alone[i]) << reqs[i].id;
  }
}

TEST(EngineLifecycle, HeldRequestsAreBounded) {
  EngineOptions o = options();
  o.max_held_requests = 2;
  auto e = make_engine(o);
  ASSERT_TRUE(e);
  ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
  auto a = e->submit({greedy("a", prompt(1, 8), 4), greedy("b", prompt(2, 8), 4)});
  ASSERT_TRUE(a);
  auto over = e->submit({greedy("c", prompt(3, 8), 4)});
  ASSERT_FALSE(over);
  EXPECT_EQ(over.error().code, ErrorCode::kUnavailable);
  EXPECT_NE(over.error().message.find("sleeping_level_1"), std::string::npos) << over.error().message;
  EXPECT_NE(over.error().message.find("--max-held-requests"), std::string::npos) << over.error().message;
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  const auto out = drain(*a);
  EXPECT_EQ(out[0].size(), 4u);
  EXPECT_EQ(out[1].size(), 4u);
  EXPECT_TRUE(e->submit({greedy("c", prompt(3, 8), 4)}));  // awake: admitted again
}

// ---- weights ----------------------------------------------------------------------------

TEST(EngineLifecycle, ReloadWeightsIsRefusedWhileRunningOrWithAnotherShape) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  auto running = e->reload_weights(std::nullopt, soon());
  ASSERT_FALSE(running);
  EXPECT_EQ(running.error().code, ErrorCode::kConflict);
  EXPECT_NE(running.error().message.find("pause"), std::string::npos) << running.error().message;

  TempDir other;
  fs::create_directories(other.path());
  for (const auto& f : fs::directory_iterator(kTiny)) fs::copy(f.path(), other.path() / f.path().filename());
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(other.path() / "config.json"));
  cfg["num_hidden_layers"] = 2;
  std::ofstream(other.path() / "config.json") << cfg.dump(2);
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  auto shape = e->reload_weights(other.path(), soon());
  ASSERT_FALSE(shape);
  EXPECT_EQ(shape.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(shape.error().message.find("num_hidden_layers 2 (loaded: 4)"), std::string::npos)
      << shape.error().message;
  auto missing = e->reload_weights(other.path() / "nope", soon());
  ASSERT_FALSE(missing);
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), baseline);  // nothing changed
}

TEST(EngineLifecycle, ReloadWeightsFromAnotherCheckpointAndBack) {
  TempDir other;
  MakeModelOptions mo;
  mo.shape = "tiny";
  mo.out_dir = other.path();
  mo.seed = 99;
  mo.tokenizer = kTiny / "tokenizer.json";
  mo.threads = 2;
  ASSERT_TRUE(make_model(mo));
  std::vector<std::vector<int32_t>> theirs;
  {
    EngineOptions o = options();
    o.model_dir = other.path();
    auto e2 = make_engine(o);
    ASSERT_TRUE(e2);
    theirs = run_prompts(*e2);
  }
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto ours = run_prompts(*e);
  ASSERT_NE(ours, theirs);

  ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->wake_up({Tag::kWeights}, soon()));
  auto r = e->reload_weights(other.path(), soon());
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->weights_dir, other.path().string());
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(run_prompts(*e), theirs);

  // A level-2 sleep and full wake reads the checkpoint the weights last held.
  ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(run_prompts(*e), theirs);

  // And back, while merely paused (no sleep): the prefix cache of the other
  // weights must not leak into the outputs.
  ASSERT_TRUE(e->pause(PauseMode::kWait, soon()));
  ASSERT_TRUE(e->reload_weights(kTiny, soon()));
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), ours);
}

// ---- the P/D connector ----------------------------------------------------------------

// Records release_transfer_kv calls by scope; can be told to fail them.
class RecordingConnector final : public KvConnector {
 public:
  explicit RecordingConnector(bool fail) : fail_(fail) {}
  ConnectorPlan on_request_added(const EngineRequest&) override { return {}; }
  void start_load(const RequestId&, const RemoteKvTarget&) override {}
  ConnectorUpdates poll() override { return {}; }
  nlohmann::json on_request_finished(const EngineRequest&, const RequestOutput&) override { return nullptr; }
  void on_request_aborted(const RequestId&) override {}
  Result<void> on_kv_cache_mapped(const KvCacheRegion&) override {
    ++mapped;
    return {};
  }
  Result<KvReleaseReport> release_transfer_kv(KvReleaseScope scope, Deadline) override {
    (scope == KvReleaseScope::kMemory ? memory_calls : reset_calls)++;
    if (fail_) return unavailable("peer 'decode-0' did not acknowledge INVALIDATE");
    KvReleaseReport r;
    if (scope == KvReleaseScope::kMemory) {
      r.invalidated = {"decode-0"};
      r.acked = {"decode-0"};
      r.deregistered = true;
    }
    return r;
  }
  std::atomic<int> memory_calls{0};
  std::atomic<int> reset_calls{0};
  std::atomic<int> mapped{0};

 private:
  bool fail_;
};

TEST(EngineLifecycle, TheConnectorEndsTransfersBeforeTheKvCacheIsResetOrReleased) {
  auto connector = std::make_unique<RecordingConnector>(false);
  RecordingConnector* c = connector.get();
  auto created = Engine::create(options(), std::move(connector));
  ASSERT_TRUE(created) << created.error().message;
  auto& e = *created;
  EXPECT_EQ(c->mapped, 1);
  const auto baseline = run_prompts(*e);
  ASSERT_TRUE(e->sleep(0, PauseMode::kKeep, soon()));
  EXPECT_EQ(c->memory_calls, 0);  // level 0 releases nothing
  auto slept = e->sleep(1, PauseMode::kKeep, soon());
  ASSERT_TRUE(slept) << slept.error().message;
  EXPECT_EQ(c->memory_calls, 1);
  ASSERT_TRUE(slept->call.kv_transfer);
  EXPECT_EQ(slept->call.kv_transfer->acked, std::vector<std::string>{"decode-0"});
  ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
  EXPECT_EQ(c->memory_calls, 1);  // the KV cache was gone already
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(c->mapped, 2);  // registered again under a new epoch
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon(), /*clear_cache=*/true));
  EXPECT_EQ(c->reset_calls, 1);
  ASSERT_TRUE(e->release_kv_cache_memory(soon()));
  EXPECT_EQ(c->memory_calls, 2);
  // resume maps the released KV cache first (and registers it) rather than refuse
  auto resumed = e->resume(soon());
  ASSERT_TRUE(resumed) << resumed.error().message;
  EXPECT_EQ(resumed->state, EngineState::kRunning);
  EXPECT_EQ(resumed->resident, TagSet::all());
  EXPECT_EQ(c->mapped, 3);
  ASSERT_TRUE(e->reset_prefix_cache(false, soon()));
  EXPECT_EQ(c->reset_calls, 2);
  EXPECT_EQ(run_prompts(*e), baseline);
}

TEST(EngineLifecycle, ACallWhoseConnectorCannotEndTransfersChangesNothing) {
  auto connector = std::make_unique<RecordingConnector>(true);
  RecordingConnector* c = connector.get();
  auto created = Engine::create(options(), std::move(connector));
  ASSERT_TRUE(created) << created.error().message;
  auto& e = *created;
  const auto baseline = run_prompts(*e);
  auto slept = e->sleep(1, PauseMode::kKeep, soon());
  ASSERT_FALSE(slept);
  EXPECT_NE(slept.error().message.find("nothing was reset or released"), std::string::npos) << slept.error().message;
  EXPECT_NE(slept.error().message.find("decode-0"), std::string::npos) << slept.error().message;
  EXPECT_NE(slept.error().message.find("running as before the call"), std::string::npos) << slept.error().message;
  EXPECT_EQ(e->state(), EngineState::kRunning);  // the sleep's pause is undone
  EXPECT_EQ(e->status().resident, TagSet::all());
  EXPECT_EQ(run_prompts(*e), baseline);

  auto paused = e->pause(PauseMode::kKeep, soon(), /*clear_cache=*/true);
  ASSERT_FALSE(paused);
  EXPECT_NE(paused.error().message.find("running as before the call"), std::string::npos) << paused.error().message;
  EXPECT_EQ(e->state(), EngineState::kRunning);

  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  auto released = e->release_kv_cache_memory(soon());
  ASSERT_FALSE(released);
  EXPECT_EQ(e->state(), EngineState::kPaused);
  EXPECT_EQ(e->status().resident, TagSet::all());
  EXPECT_EQ(c->mapped, 1);  // never deregistered, never registered again
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), baseline);
}

// Holds every finished request's blocks for a remote reader (as a producer
// does) and gives the holds back only when told: a transfer that will not end.
class HoldingConnector final : public KvConnector {
 public:
  ConnectorPlan on_request_added(const EngineRequest&) override {
    return ConnectorPlan{.hold_blocks_for_remote_reader = true, .load_remote_kv = false};
  }
  void start_load(const RequestId&, const RemoteKvTarget&) override {}
  ConnectorUpdates poll() override {
    ConnectorUpdates u;
    std::lock_guard<std::mutex> lock(mu);
    if (let_go) {
      u.releasable_holds = std::move(holds);
      holds.clear();
    }
    return u;
  }
  nlohmann::json on_request_finished(const EngineRequest& r, const RequestOutput& out) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!out.held_blocks.empty()) holds.push_back(send_hold_owner(r.id));
    return nullptr;
  }
  void on_request_aborted(const RequestId&) override {}
  Result<KvReleaseReport> release_transfer_kv(KvReleaseScope, Deadline) override { return KvReleaseReport{}; }

  std::mutex mu;
  std::vector<HoldKey> holds;
  bool let_go = false;
};

TEST(EngineLifecycle, AResetWaitsForTheBlocksOfTransfersAndACallThatCannotGetThemChangesNothing) {
  auto connector = std::make_unique<HoldingConnector>();
  HoldingConnector* c = connector.get();
  auto created = Engine::create(options(), std::move(connector));
  ASSERT_TRUE(created) << created.error().message;
  auto& e = *created;
  const auto baseline = run_prompts(*e);  // every request leaves its blocks held
  for (auto end = Clock::now() + 5s; e->metrics().num_kv_blocks_held_for_remote == 0 && Clock::now() < end;)
    std::this_thread::sleep_for(10ms);  // the loop publishes its metrics after the step
  ASSERT_GT(e->metrics().num_kv_blocks_held_for_remote, 0);

  // The holds outlive the deadline: the pause is undone, nothing was reset.
  auto paused = e->pause(PauseMode::kKeep, Clock::now() + 300ms, /*clear_cache=*/true);
  ASSERT_FALSE(paused);
  EXPECT_EQ(paused.error().code, ErrorCode::kTimeout);
  EXPECT_NE(paused.error().message.find("for remote readers"), std::string::npos) << paused.error().message;
  EXPECT_NE(paused.error().message.find("nothing was reset or released"), std::string::npos)
      << paused.error().message;
  EXPECT_NE(paused.error().message.find("running as before the call"), std::string::npos) << paused.error().message;
  EXPECT_EQ(e->state(), EngineState::kRunning);
  auto slept = e->sleep(1, PauseMode::kKeep, Clock::now() + 300ms);
  ASSERT_FALSE(slept);
  EXPECT_EQ(e->state(), EngineState::kRunning);
  EXPECT_EQ(e->status().resident, TagSet::all());

  // A resume that comes while a pause waits for the blocks ends the wait: the
  // pause says so, the resume answers, the engine runs.
  std::atomic<bool> done{false};
  Result<EngineStatus> waited = conflict("not yet");
  std::thread t([&] {
    waited = e->pause(PauseMode::kKeep, Clock::now() + 30s, /*clear_cache=*/true);
    done = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(done);
  auto resumed = e->resume(soon());
  t.join();
  ASSERT_TRUE(resumed) << resumed.error().message;
  EXPECT_EQ(resumed->state, EngineState::kRunning);
  ASSERT_FALSE(waited);
  EXPECT_EQ(waited.error().code, ErrorCode::kConflict);
  EXPECT_NE(waited.error().message.find("a resume came"), std::string::npos) << waited.error().message;
  EXPECT_EQ(run_prompts(*e), baseline);

  // Once the transfers let go, the same pause clears the cache and every block is free.
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->let_go = true;
  }
  auto cleared = e->pause(PauseMode::kKeep, soon(), /*clear_cache=*/true);
  ASSERT_TRUE(cleared) << cleared.error().message;
  EXPECT_EQ(cleared->state, EngineState::kPaused);
  for (auto end = Clock::now() + 5s; e->metrics().num_kv_blocks_in_use != 0 && Clock::now() < end;)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(e->metrics().num_kv_blocks_in_use, 0);
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), baseline);
}

TEST(EngineLifecycle, ARequestHeldLongerThanMaxHeldSecondsEndsWithAnErrorNamingTheState) {
  EngineOptions o = options();
  o.max_held_seconds = 0.3;
  auto e = make_engine(o);
  ASSERT_TRUE(e);
  ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
  auto s = e->submit({greedy("held", prompt(3, 20), 4)});
  ASSERT_TRUE(s) << s.error().message;
  const auto start = Clock::now();
  std::optional<RequestFinish> finish;
  while (!s->finished() && Clock::now() - start < 10s)
    for (IndexedDelta& d : s->next(Clock::now() + 100ms))
      if (d.delta.finish) finish = d.delta.finish;
  ASSERT_TRUE(finish);
  EXPECT_GE(Clock::now() - start, 250ms);
  ASSERT_TRUE(finish->error);
  EXPECT_EQ(finish->error->code, ErrorCode::kUnavailable);
  EXPECT_NE(finish->error->message.find("sleeping_level_1"), std::string::npos) << finish->error->message;
  EXPECT_NE(finish->error->message.find("/wake_up"), std::string::npos) << finish->error->message;
  EXPECT_EQ(e->status().held_requests, 0);
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
}

// ---- refusals ---------------------------------------------------------------------------

TEST(EngineLifecycle, WrongCallsAreRefusedAndTheEngineKeepsServing) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  auto level7 = e->sleep(7, PauseMode::kKeep, soon());
  ASSERT_FALSE(level7);
  EXPECT_EQ(level7.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(level7.error().message.find("got 7"), std::string::npos);
  EXPECT_EQ(e->state(), EngineState::kRunning);
  EXPECT_EQ(run_prompts(*e), baseline);

  EngineOptions o = options();
  o.enable_sleep_mode = false;
  auto off = make_engine(o);
  ASSERT_TRUE(off);
  auto refused = off->sleep(1, PauseMode::kKeep, soon());
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("--enable-sleep-mode"), std::string::npos);
  EXPECT_FALSE(off->release_kv_cache_memory(soon()));
  EXPECT_EQ(run_prompts(*off), baseline);
}

TEST(EngineLifecycle, ManyCyclesReturnToTheAwakeAccounting) {
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto baseline = run_prompts(*e);
  const EngineMemoryReport awake = e->memory_report(soon());
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(e->sleep(1 + i % 2, PauseMode::kKeep, soon()));
    if (i % 3 == 0) {
      ASSERT_TRUE(e->wake_up({Tag::kWeights}, soon()));
    }
    ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
    ASSERT_EQ(e->memory_report(soon()).pool, awake.pool) << "cycle " << i;
  }
  EXPECT_EQ(run_prompts(*e), baseline);
}

}  // namespace
}  // namespace siesta
