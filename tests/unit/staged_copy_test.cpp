// The staged copy pipeline (src/memory/staged_copy.h) with a fake DMA that
// runs each copy as late as it may (when its slot is waited for), so a
// pipeline that reused a slot before waiting for it would corrupt the data.
// The CUDA backend runs the same code with real DMA (memory_cuda_test).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <vector>

#include "common/thread_pool.h"
#include "memory/staged_copy.h"

namespace siesta::memory {
namespace {

class LateDma final : public StagingDma {
 public:
  explicit LateDma(StagingRing& ring) : ring_(ring), pending_(ring.slots.size()) {}

  Ok to_slot(size_t slot, const void* src, size_t bytes) override {
    if (fail_at_ != 0 && ++calls_ == fail_at_) return io_error("injected DMA failure");
    void* dst = ring_.slots[slot];
    pending_[slot].push_back([=] { std::memcpy(dst, src, bytes); });
    return {};
  }
  Ok from_slot(size_t slot, void* dst, size_t bytes) override {
    if (fail_at_ != 0 && ++calls_ == fail_at_) return io_error("injected DMA failure");
    const void* src = ring_.slots[slot];
    pending_[slot].push_back([=] { std::memcpy(dst, src, bytes); });
    return {};
  }
  Ok wait(size_t slot) override {
    for (auto& op : pending_[slot]) op();
    pending_[slot].clear();
    ++waits_;
    return {};
  }

  void fail_at(int call) { fail_at_ = call; }
  size_t in_flight() const {
    size_t n = 0;
    for (const auto& q : pending_) n += q.size();
    return n;
  }
  int waits() const { return waits_; }

 private:
  StagingRing& ring_;
  std::vector<std::deque<std::function<void()>>> pending_;
  int fail_at_ = 0;
  int calls_ = 0;
  int waits_ = 0;
};

struct Ring {
  Ring(size_t slots, size_t slot_bytes) : storage(slots, std::vector<std::byte>(slot_bytes)) {
    ring.slot_bytes = slot_bytes;
    for (auto& s : storage) ring.slots.push_back(s.data());
  }
  std::vector<std::vector<std::byte>> storage;
  StagingRing ring;
};

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed + (i >> 12));
  return v;
}

TEST(StagedCopy, RoundTripsEverySizeThroughTheRing) {
  ThreadPool threads(3);
  // Sizes below one slot, exactly the ring, ragged ends, many times the ring.
  for (size_t slot_bytes : {size_t{4096}, size_t{1} << 20}) {
    for (size_t slots : {size_t{2}, size_t{4}}) {
      for (size_t bytes : {size_t{1}, slot_bytes - 3, slot_bytes, slots * slot_bytes, slots * slot_bytes + 17,
                           11 * slot_bytes + 5, size_t{3} << 20}) {
        Ring r(slots, slot_bytes);
        LateDma dma(r.ring);
        const std::vector<uint8_t> device = pattern(bytes, static_cast<uint8_t>(bytes));
        std::vector<uint8_t> host(bytes, 0xEE);
        ASSERT_TRUE(staged_copy_to_host(dma, r.ring, threads, host.data(), device.data(), bytes));
        EXPECT_EQ(dma.in_flight(), 0u);
        EXPECT_EQ(host, device) << "to host: " << bytes << " B, " << slots << " x " << slot_bytes;
        std::vector<uint8_t> back(bytes, 0x11);
        ASSERT_TRUE(staged_copy_from_host(dma, r.ring, threads, back.data(), host.data(), bytes));
        EXPECT_EQ(dma.in_flight(), 0u) << "from_host returned with copies in flight";
        EXPECT_EQ(back, device) << "from host: " << bytes << " B, " << slots << " x " << slot_bytes;
      }
    }
  }
}

TEST(StagedCopy, NothingToCopyIsNoWork) {
  ThreadPool threads(2);
  Ring r(2, 4096);
  LateDma dma(r.ring);
  ASSERT_TRUE(staged_copy_to_host(dma, r.ring, threads, nullptr, nullptr, 0));
  ASSERT_TRUE(staged_copy_from_host(dma, r.ring, threads, nullptr, nullptr, 0));
  EXPECT_EQ(dma.waits(), 0);
}

TEST(StagedCopy, AFailedDmaIsReportedWithNothingLeftInFlight) {
  ThreadPool threads(2);
  for (int fail_at : {1, 2, 3, 6}) {
    Ring r(3, 4096);
    LateDma dma(r.ring);
    dma.fail_at(fail_at);
    std::vector<uint8_t> device = pattern(10 * 4096, 1), host(10 * 4096);
    Ok to = staged_copy_to_host(dma, r.ring, threads, host.data(), device.data(), host.size());
    ASSERT_FALSE(to);
    EXPECT_NE(to.error().message.find("injected"), std::string::npos);
    EXPECT_EQ(dma.in_flight(), 0u) << "to_host left copies in flight after failing at call " << fail_at;

    Ring r2(3, 4096);
    LateDma dma2(r2.ring);
    dma2.fail_at(fail_at);
    Ok from = staged_copy_from_host(dma2, r2.ring, threads, device.data(), host.data(), host.size());
    ASSERT_FALSE(from);
    EXPECT_EQ(dma2.in_flight(), 0u) << "from_host left copies in flight after failing at call " << fail_at;
  }
}

TEST(StagedCopy, AnEmptyRingIsAnError) {
  ThreadPool threads(1);
  StagingRing empty;
  Ring r(1, 16);
  LateDma dma(r.ring);
  std::vector<uint8_t> a(8), b(8);
  EXPECT_FALSE(staged_copy_to_host(dma, empty, threads, a.data(), b.data(), 8));
}

TEST(StagedCopy, ParallelMemcpyCopiesEveryByte) {
  ThreadPool threads(4);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{1} << 20, (size_t{5} << 20) + 123}) {
    const std::vector<uint8_t> src = pattern(bytes, 9);
    std::vector<uint8_t> dst(bytes, 0);
    parallel_memcpy(threads, dst.data(), src.data(), bytes);
    EXPECT_EQ(dst, src) << bytes;
  }
}

}  // namespace
}  // namespace siesta::memory
