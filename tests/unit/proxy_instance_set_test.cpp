// The proxy's choice of instances: round robin over those up, skipping those
// down, failures marking an instance down until its next good health check.
#include <gtest/gtest.h>

#include <algorithm>
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
  for (const InstanceStatus& s : set.snapshot()) EXPECT_EQ(s.picked, 1000u);
}

}  // namespace
}  // namespace siesta::proxy
