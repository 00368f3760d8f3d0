// The proxy's choice of instances: the least loaded of those up and serving,
// ties in turn, never one asleep, paused or being woken; a prefix's instance
// within the slack; failures marking an instance down until its next good
// health check; wakes and parks claimed one at a time.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "proxy/instance_set.h"

namespace siesta::proxy {
namespace {

std::vector<InstanceUrl> urls(int n) {
  std::vector<InstanceUrl> out;
  for (int i = 0; i < n; ++i) {
    Result<InstanceUrl> url = parse_instance_url("http://10.0.0." + std::to_string(i + 1) + ":8000");
    EXPECT_TRUE(url);
    out.push_back(*url);
  }
  return out;
}

std::vector<size_t> picks(InstanceSet& set, int n) {
  std::vector<size_t> out;
  for (int i = 0; i < n; ++i) {
    std::optional<Pick> p = set.pick();
    EXPECT_TRUE(p.has_value());
    if (p) out.push_back(p->index);
  }
  return out;
}

void all_up(InstanceSet& set) {
  for (size_t i = 0; i < set.size(); ++i) set.record_health(i, true, "");
}

TEST(InstanceSet, NothingIsPickedBeforeTheFirstHealthCheck) {
  InstanceSet set(Role::kPrefill, urls(2));
  EXPECT_EQ(set.up_count(), 0u);
  EXPECT_FALSE(set.pick().has_value());
  EXPECT_EQ(
      set.describe_none_up(),
      "no prefill instance is up: http://10.0.0.1:8000 (not checked yet), http://10.0.0.2:8000 (not checked yet)");
}

TEST(InstanceSet, RoundRobinVisitsEveryInstanceInTurn) {
  InstanceSet set(Role::kDecode, urls(3));
  all_up(set);
  EXPECT_EQ(picks(set, 7), (std::vector<size_t>{0, 1, 2, 0, 1, 2, 0}));
  const auto snapshot = set.snapshot();
  EXPECT_EQ(snapshot[0].picked, 3u);
  EXPECT_EQ(snapshot[1].picked, 2u);
  EXPECT_EQ(snapshot[2].picked, 2u);
}

TEST(InstanceSet, InstancesDownAreSkipped) {
  InstanceSet set(Role::kPrefill, urls(3));
  all_up(set);
  set.record_health(1, false, "cannot connect");
  EXPECT_EQ(picks(set, 4), (std::vector<size_t>{0, 2, 0, 2}));
  EXPECT_EQ(set.up_count(), 2u);
  const auto snapshot = set.snapshot();
  EXPECT_FALSE(snapshot[1].up);
  EXPECT_EQ(snapshot[1].why_down, "cannot connect");
}

TEST(InstanceSet, AFailedRequestMarksDownUntilTheNextGoodHealthCheck) {
  InstanceSet set(Role::kPrefill, urls(2));
  all_up(set);
  ASSERT_EQ(set.pick()->index, 0u);
  set.record_failure(0, "answered HTTP 500");
  EXPECT_EQ(picks(set, 3), (std::vector<size_t>{1, 1, 1}));
  EXPECT_EQ(set.snapshot()[0].why_down, "request failed: answered HTTP 500");
  EXPECT_EQ(set.snapshot()[0].failures, 1u);
  set.record_health(0, true, "");
  EXPECT_EQ(set.up_count(), 2u);
  std::vector<size_t> next = picks(set, 2);
  std::sort(next.begin(), next.end());
  EXPECT_EQ(next, (std::vector<size_t>{0, 1}));
}

TEST(InstanceSet, NoneUpMeansNoPickAndSaysWhy) {
  InstanceSet set(Role::kDecode, urls(2));
  all_up(set);
  set.record_failure(0, "no answer within 2.0 s");
  set.record_health(1, false, "GET /health answered HTTP 503");
  EXPECT_FALSE(set.pick().has_value());
  EXPECT_FALSE(set.first_up().has_value());
  EXPECT_EQ(set.describe_none_up(),
            "no decode instance is up: http://10.0.0.1:8000 (request failed: no answer within 2.0 s), "
            "http://10.0.0.2:8000 (GET /health answered HTTP 503)");
}

TEST(InstanceSet, FirstUpIsTheFirstHealthyInOrder) {
  InstanceSet set(Role::kDecode, urls(3));
  all_up(set);
  set.record_health(0, false, "down");
  EXPECT_EQ(set.first_up()->index, 1u);
  EXPECT_EQ(set.find("http://10.0.0.3:8000"), std::optional<size_t>(2));
  EXPECT_FALSE(set.find("http://10.0.0.9:8000").has_value());
}

TEST(InstanceSet, ConcurrentPicksStayBalanced) {
  InstanceSet set(Role::kPrefill, urls(4));
  all_up(set);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) ASSERT_TRUE(set.pick().has_value());
    });
  for (auto& t : threads) t.join();
  // Least loaded first, ties in turn: none is starved (how evenly depends on the threads' timing).
  for (const InstanceStatus& s : set.snapshot()) {
    EXPECT_GT(s.picked, 250u);
    EXPECT_EQ(s.in_flight, 0u);
  }
}

TEST(InstanceSet, RequestsInFlightSteerTheNextPickUntilTheyEnd) {
  InstanceSet set(Role::kDecode, urls(3));
  all_up(set);
  std::optional<Pick> a = set.pick();
  std::optional<Pick> b = set.pick();
  std::optional<Pick> c = set.pick();
  std::optional<Pick> d = set.pick();  // one each, then the least loaded again
  ASSERT_TRUE(a && b && c && d);
  EXPECT_EQ((std::vector<size_t>{a->index, b->index, c->index}), (std::vector<size_t>{0, 1, 2}));
  const size_t doubled = d->index;
  std::optional<Pick> copy = d;
  d.reset();
  EXPECT_EQ(set.snapshot()[doubled].in_flight, 2u);  // a copy keeps it in flight
  copy.reset();
  EXPECT_EQ(set.snapshot()[doubled].in_flight, 1u);
  a.reset();
  EXPECT_EQ(set.pick()->index, 0u);  // the one that finished
}

TEST(InstanceSet, TheEnginesReportedLoadCountsToo) {
  InstanceSet set(Role::kPrefill, urls(2));
  EngineReport busy;
  busy.state = "running";
  busy.running = 6;
  busy.waiting = 2;
  set.record_health(0, true, "", busy);
  EngineReport idle;
  idle.state = "running";
  idle.kv_usage = 0.5;
  set.record_health(1, true, "", idle);
  EXPECT_EQ(picks(set, 4), (std::vector<size_t>{1, 1, 1, 1}));
}

TEST(InstanceSet, AsleepPausedOrDrainingInstancesAreNeverPicked) {
  InstanceSet set(Role::kPrefill, urls(4));
  const char* states[] = {"sleeping_level_1", "paused", "draining", "running"};
  for (size_t i = 0; i < 4; ++i) {
    EngineReport r;
    r.state = states[i];
    set.record_health(i, true, "", r);
  }
  EXPECT_EQ(picks(set, 3), (std::vector<size_t>{3, 3, 3}));
  EXPECT_EQ(set.serving_count(), 1u);
  EXPECT_EQ(set.snapshot()[0].condition, Condition::kAsleep);
  EXPECT_EQ(set.snapshot()[1].condition, Condition::kPaused);
  EXPECT_EQ(set.snapshot()[2].condition, Condition::kPaused);
  EXPECT_FALSE(set.pick_holding().has_value());  // one serves
  EngineReport asleep;
  asleep.state = "sleeping_level_2";
  set.record_health(3, true, "", asleep);
  EXPECT_FALSE(set.pick().has_value());
  // None serves: one asleep or paused holds the request (a proxy that does not wake on demand).
  std::optional<Pick> held = set.pick_holding();
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->index, 0u);
  EXPECT_EQ(set.describe_none_up(),
            "no prefill instance can serve: http://10.0.0.1:8000 (asleep: sleeping_level_1), http://10.0.0.2:8000 "
            "(paused: paused), http://10.0.0.3:8000 (paused: draining), http://10.0.0.4:8000 (asleep: "
            "sleeping_level_2)");
}

TEST(InstanceSet, OneWakeAtATimeAndAReportFromBeforeItDoesNotUndoIt) {
  InstanceSet set(Role::kDecode, urls(2));
  EngineReport asleep;
  asleep.state = "sleeping_level_1";
  const auto before = std::chrono::steady_clock::now();
  set.record_health(0, true, "", asleep, before);
  set.record_health(1, true, "", asleep, before);
  EXPECT_TRUE(set.can_wake());
  std::optional<size_t> first = set.wake_candidate();
  ASSERT_TRUE(first.has_value());
  EXPECT_FALSE(set.wake_candidate().has_value());  // the requests wait for this one
  EXPECT_FALSE(set.pick().has_value());            // waking is not serving
  set.wake_done(*first, true, "");
  set.record_health(*first, true, "", asleep, before);  // asked before the wake ended
  ASSERT_TRUE(set.pick().has_value());
  EXPECT_EQ(set.pick()->index, *first);
  set.record_health(*first, true, "", asleep, std::chrono::steady_clock::now());  // asked after: believed
  EXPECT_FALSE(set.pick().has_value());
  EXPECT_EQ(set.snapshot()[*first].wakes, 1u);
}

TEST(InstanceSet, IdleInstancesAreParkedOnceAndNotRoutedToMeanwhile) {
  InstanceSet set(Role::kPrefill, urls(2));
  all_up(set);
  std::optional<Pick> busy = set.pick();  // instance 0 has a request in flight
  const auto later = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  EXPECT_EQ(set.park_candidates(later, std::chrono::seconds(5)), (std::vector<size_t>{1}));
  EXPECT_TRUE(set.park_candidates(later, std::chrono::seconds(5)).empty());  // claimed already
  EXPECT_EQ(set.pick()->index, 0u);                                          // 1 is parking
  set.park_done(1, false, "sleep mode is off");
  EXPECT_EQ(set.snapshot()[1].condition, Condition::kServing);
  EXPECT_TRUE(set.park_candidates(std::chrono::steady_clock::now(), std::chrono::seconds(5)).empty());  // fresh
}

TEST(InstanceSet, APrefixGoesToOneInstanceWhileItsLoadIsWithinTheSlack) {
  InstanceSet set(Role::kPrefill, urls(3), /*affinity_slack=*/1);
  all_up(set);
  std::vector<Pick> held;
  for (int i = 0; i < 2; ++i) held.push_back(*set.pick(uint64_t{42}));
  EXPECT_EQ(held[0].index, held[1].index);  // the same leading text, the same instance
  const size_t home = held[0].index;
  held.push_back(*set.pick(uint64_t{42}));  // 2 in flight there, 0 elsewhere: beyond the slack
  EXPECT_NE(held.back().index, home);
  held.clear();
  EXPECT_EQ(set.pick(uint64_t{42})->index, home);
}

TEST(EngineReport, ReadFromSiestasAndVllmsMetrics) {
  const EngineReport s = parse_engine_report(
      "# HELP siesta:num_requests_running x\n"
      "siesta:num_requests_running{model_name=\"m\"} 3\n"
      "siesta:num_requests_waiting{model_name=\"m\"} 1\n"
      "siesta:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
      "siesta:engine_sleep_state{model_name=\"m\",sleep_state=\"awake\"} 0\n"
      "siesta:engine_state{model_name=\"m\",state=\"sleeping_level_1\"} 1\n"
      "siesta:kv_blocks_in_use{model_name=\"m\"} 7\n");
  EXPECT_EQ(s.state, "sleeping_level_1");
  EXPECT_EQ(s.running, 3);
  EXPECT_EQ(s.waiting, 1);
  EXPECT_DOUBLE_EQ(s.kv_usage, 0.25);
  EXPECT_EQ(s.asleep, std::optional<bool>(true));
  EXPECT_EQ(s.blocks_in_use, 7);
  const EngineReport v = parse_engine_report(
      "vllm:num_requests_running{engine=\"0\"} 2\nvllm:engine_sleep_state{sleep_state=\"awake\"} 1\n");
  EXPECT_EQ(v.state, "");
  EXPECT_EQ(v.running, 2);
  EXPECT_EQ(v.asleep, std::optional<bool>(false));
  EXPECT_EQ(condition_of_engine_state("partially_awake"), Condition::kAsleep);
  EXPECT_EQ(condition_of_engine_state("paused_kv_released"), Condition::kPaused);
  EXPECT_EQ(condition_of_engine_state("running"), Condition::kServing);
}

}  // namespace
}  // namespace siesta::proxy
