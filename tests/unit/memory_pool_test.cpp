// MemoryPool on the host backend: the whole sleep/wake lifecycle that a GPU
// engine goes through, checked with real memory (RSS, memfd exports, a second
// mapping as a peer makes one).
#include <dirent.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "memory/host_backend.h"
#include "memory/memory_pool.h"
#include "memory/process_memory.h"

namespace siesta::memory {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

MemoryPool make_pool(uint64_t capacity_bytes = 0) {
  return MemoryPool(std::make_unique<HostBackend>(HostBackendOptions{capacity_bytes}));
}

uint64_t rss() { return process_resident_bytes().value(); }

void fill(void* p, size_t bytes, uint64_t seed) {
  auto* w = static_cast<uint64_t*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) w[i] = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
}

bool holds(const void* p, size_t bytes, uint64_t seed) {
  const auto* w = static_cast<const uint64_t*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) {
    if (w[i] != ((i + 1) * 0x9E3779B97F4A7C15ull ^ seed)) return false;
  }
  return true;
}

bool all_zero(const void* p, size_t bytes) {
  const auto* w = static_cast<const uint64_t*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) {
    if (w[i] != 0) return false;
  }
  return true;
}

size_t open_fd_count() {
  size_t n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

size_t mapping_count() {
  std::ifstream in("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

std::string maps_text() {
  std::ifstream in("/proc/self/maps");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The three allocations an engine makes, with their usual layouts.
struct EngineMemory {
  Allocation weights, kv, scratch;

  static EngineMemory allocate(MemoryPool& pool, size_t weights, size_t kv, size_t scratch) {
    return EngineMemory{
        pool.allocate(weights, Tag::kWeights, {.chunk_bytes = 4 * kMiB, .name = "weights"}).value(),
        pool.allocate(kv, Tag::kKvCache, {.single_allocation = true, .name = "kv"}).value(),
        pool.allocate(scratch, Tag::kScratch, {.name = "scratch"}).value(),
    };
  }
  uint64_t total() const { return weights.bytes + kv.bytes + scratch.bytes; }
};

TEST(MemoryPoolHost, AllocatesPerTagResidentZeroedAndWritable) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 64 * kMiB, 128 * kMiB, 16 * kMiB + 1);

  EXPECT_EQ(m.weights.pieces, 16u);
  EXPECT_EQ(m.kv.pieces, 1u);
  EXPECT_EQ(m.scratch.requested_bytes, 16 * kMiB + 1);
  EXPECT_EQ(m.scratch.bytes, 16 * kMiB + 4096);  // rounded up to the page size
  for (const Allocation* a : {&m.weights, &m.kv, &m.scratch}) {
    EXPECT_TRUE(all_zero(a->base, a->bytes)) << a->name;
    fill(a->base, a->bytes, a->id.value);
  }
  for (const Allocation* a : {&m.weights, &m.kv, &m.scratch}) EXPECT_TRUE(holds(a->base, a->bytes, a->id.value));

  PoolUsage u = pool.usage();
  EXPECT_EQ(u[Tag::kWeights], (TagUsage{1, 64 * kMiB, 0, 0, 0}));
  EXPECT_EQ(u[Tag::kKvCache], (TagUsage{1, 128 * kMiB, 0, 0, 0}));
  EXPECT_EQ(u[Tag::kScratch], (TagUsage{1, 16 * kMiB + 4096, 0, 0, 0}));
  EXPECT_EQ(pool.resident_tags(), TagSet::all());
  // memfd-backed, named after the allocation, as an operator sees it.
  EXPECT_NE(maps_text().find("/memfd:siesta:kv"), std::string::npos);
}

TEST(MemoryPoolHost, SleepOffloadsWeightsAndWakeRestoresThemAtTheSameAddresses) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 32 * kMiB, 64 * kMiB, 8 * kMiB);
  fill(m.weights.base, m.weights.bytes, 1);
  fill(m.kv.base, m.kv.bytes, 2);
  fill(m.scratch.base, m.scratch.bytes, 3);

  SleepReport slept = pool.sleep({Tag::kWeights}).value();
  EXPECT_EQ(slept.released_bytes, (TagBytes{m.weights.bytes, m.kv.bytes, m.scratch.bytes}));
  EXPECT_EQ(slept.offloaded_bytes, (TagBytes{m.weights.bytes, 0, 0}));
  EXPECT_EQ(slept.held_by_exports_bytes, 0u);
  EXPECT_EQ(pool.state(m.weights.id).value(), AllocationState::kOffloaded);
  EXPECT_EQ(pool.state(m.kv.id).value(), AllocationState::kReleased);
  EXPECT_EQ(pool.state(m.scratch.id).value(), AllocationState::kReleased);
  PoolUsage asleep = pool.usage();
  EXPECT_EQ(asleep[Tag::kWeights], (TagUsage{1, 0, m.weights.bytes, 0, 0}));
  EXPECT_EQ(asleep[Tag::kKvCache], (TagUsage{1, 0, 0, m.kv.bytes, 0}));
  EXPECT_TRUE(pool.resident_tags().empty());

  WakeReport woke = pool.wake(TagSet::all()).value();
  EXPECT_EQ(woke.mapped_bytes, (TagBytes{m.weights.bytes, m.kv.bytes, m.scratch.bytes}));
  EXPECT_EQ(woke.restored_bytes, (TagBytes{m.weights.bytes, 0, 0}));
  EXPECT_TRUE(woke.not_resident.empty());
  std::vector<Allocation> after = pool.allocations();
  ASSERT_EQ(after.size(), 3u);
  EXPECT_EQ(after[0].base, m.weights.base);
  EXPECT_EQ(after[1].base, m.kv.base);
  EXPECT_EQ(after[2].base, m.scratch.base);
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 1));
  EXPECT_TRUE(all_zero(m.kv.base, m.kv.bytes));
  EXPECT_TRUE(all_zero(m.scratch.base, m.scratch.bytes));
  fill(m.kv.base, m.kv.bytes, 4);
  EXPECT_TRUE(holds(m.kv.base, m.kv.bytes, 4));
  EXPECT_EQ(pool.usage().total(), (TagUsage{3, m.total(), 0, 0, 0}));
}

TEST(MemoryPoolHostDeathTest, ReleasedMemoryFaultsInsteadOfReadingOtherMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MemoryPool pool = make_pool();
  Allocation kv = pool.allocate(4 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();
  ASSERT_TRUE(pool.sleep({}));
  EXPECT_DEATH({ std::printf("%d", *static_cast<volatile char*>(kv.base)); }, "");
}

TEST(MemoryPoolHost, RssFallsWithSleepAndComesBackWithWake) {
  MemoryPool pool = make_pool();
  const uint64_t before_alloc = rss();
  EngineMemory m = EngineMemory::allocate(pool, 96 * kMiB, 256 * kMiB, 32 * kMiB);
  const uint64_t awake = rss();
  // Committed at map time, untouched: RSS counts it as a GPU engine's memory counts.
  EXPECT_GE(awake - before_alloc, m.total() * 9 / 10);

  // Level 2: nothing kept.
  SleepReport level2 = pool.sleep({}).value();
  ASSERT_EQ(sum(level2.released_bytes), m.total());
  const uint64_t asleep = rss();
  EXPECT_GE(awake - asleep, m.total() * 9 / 10) << "awake " << awake << " asleep " << asleep;
  ASSERT_TRUE(pool.wake(TagSet::all()));
  EXPECT_GE(rss() - asleep, m.total() * 9 / 10);

  // Level 1: the weights' host copy stays in RSS; everything else goes.
  fill(m.weights.base, m.weights.bytes, 7);
  const uint64_t awake1 = rss();
  SleepReport level1 = pool.sleep({Tag::kWeights}).value();
  const uint64_t dropped = sum(level1.released_bytes) - sum(level1.offloaded_bytes);
  ASSERT_EQ(dropped, m.kv.bytes + m.scratch.bytes);
  const uint64_t asleep1 = rss();
  EXPECT_GE(awake1 - asleep1, dropped * 9 / 10);
  ASSERT_TRUE(pool.wake(TagSet::all()));
  EXPECT_GE(rss() - asleep1, dropped * 9 / 10);
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 7));
}

TEST(MemoryPoolHost, HundredSleepWakeCyclesLeaveNoCreep) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 8 * kMiB, 16 * kMiB, 4 * kMiB);
  fill(m.weights.base, m.weights.bytes, 11);
  // One cycle first, so that allocator and page-table warm-up is in the baseline.
  ASSERT_TRUE(pool.sleep({Tag::kWeights}));
  ASSERT_TRUE(pool.wake(TagSet::all()));
  const uint64_t rss0 = rss();
  const PoolUsage usage0 = pool.usage();
  const size_t fds0 = open_fd_count();
  const size_t maps0 = mapping_count();

  for (int cycle = 0; cycle < 100; ++cycle) {
    const bool level1 = cycle % 2 == 0;
    ASSERT_TRUE(pool.sleep(level1 ? TagSet{Tag::kWeights} : TagSet{})) << "cycle " << cycle;
    if (cycle % 3 == 0) {  // selective wake: weights first, the rest after
      ASSERT_TRUE(pool.wake({Tag::kWeights}));
      ASSERT_FALSE(pool.is_resident(Tag::kKvCache));
    }
    ASSERT_TRUE(pool.wake(TagSet::all())) << "cycle " << cycle;
    if (level1) {
      ASSERT_TRUE(holds(m.weights.base, m.weights.bytes, 11)) << "cycle " << cycle;
    } else {
      ASSERT_TRUE(all_zero(m.weights.base, m.weights.bytes)) << "cycle " << cycle;
      fill(m.weights.base, m.weights.bytes, 11);  // what reload_weights does after level 2
    }
    fill(m.kv.base, m.kv.bytes, cycle);
  }
  EXPECT_EQ(pool.usage(), usage0);
  EXPECT_EQ(open_fd_count(), fds0);
  EXPECT_EQ(mapping_count(), maps0);
  const int64_t creep = static_cast<int64_t>(rss()) - static_cast<int64_t>(rss0);
  EXPECT_LT(std::abs(creep), static_cast<int64_t>(4 * kMiB)) << "RSS moved by " << creep << " bytes";
}

TEST(MemoryPoolHost, ExportedFdIsTheSameMemoryAndSleepAccountsForIt) {
  MemoryPool pool = make_pool();
  Allocation weights = pool.allocate(32 * kMiB, Tag::kWeights, {.chunk_bytes = 4 * kMiB}).value();
  Allocation kv = pool.allocate(64 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();

  Export exported = pool.export_fd(kv.id).value();
  ASSERT_EQ(exported.pieces.size(), 1u);
  EXPECT_EQ(exported.kind, BackendKind::kHost);
  EXPECT_EQ(exported.pieces[0].offset, 0u);
  EXPECT_EQ(exported.pieces[0].bytes, kv.bytes);
  struct stat st {};
  ASSERT_EQ(fstat(exported.pieces[0].fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kv.bytes);
  EXPECT_EQ(pool.usage().open_exports, 1u);

  // A peer's mapping of the fd is the same memory, both ways.
  std::unique_ptr<ImportedMapping> peer = pool.backend().map_import(exported.pieces).value();
  ASSERT_NE(peer->base(), kv.base);
  fill(peer->base(), kv.bytes, 21);
  EXPECT_TRUE(holds(kv.base, kv.bytes, 21));

  // Sleep refuses while the export is open, and changes nothing.
  Result<SleepReport> refused = pool.sleep({});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kConflict);
  EXPECT_NE(refused.error().message.find("kv_cache"), std::string::npos) << refused.error().message;
  EXPECT_NE(refused.error().message.find("close_export"), std::string::npos) << refused.error().message;
  EXPECT_EQ(pool.resident_tags(), TagSet::all());
  EXPECT_TRUE(holds(kv.base, kv.bytes, 21));

  // Forced, it releases, and says the export keeps the KV cache alive. (RSS
  // cannot show that here: it counts a page once per mapping, and the pool's
  // own mapping of the KV pages is gone; the memfd's allocated blocks show it.)
  const uint64_t rss_awake = rss();
  SleepReport forced = pool.sleep({}, {.release_exported = true}).value();
  EXPECT_EQ(forced.released_bytes, (TagBytes{weights.bytes, kv.bytes, 0}));
  EXPECT_EQ(forced.held_by_exports_bytes, kv.bytes);
  ASSERT_EQ(forced.held_by.size(), 1u);
  EXPECT_NE(forced.held_by[0].find("kv_cache"), std::string::npos);
  EXPECT_EQ(pool.usage()[Tag::kKvCache], (TagUsage{1, 0, 0, kv.bytes, kv.bytes}));
  EXPECT_GE(rss_awake - rss(), weights.bytes * 9 / 10);
  ASSERT_EQ(fstat(exported.pieces[0].fd, &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kv.bytes);  // not returned to the OS
  EXPECT_TRUE(holds(peer->base(), kv.bytes, 21));                  // and still the peer's data

  // After wake the pool maps new memory; the open export still names the old.
  ASSERT_TRUE(pool.wake(TagSet::all()));
  EXPECT_TRUE(all_zero(kv.base, kv.bytes));
  EXPECT_TRUE(holds(peer->base(), kv.bytes, 21));
  EXPECT_EQ(pool.usage()[Tag::kKvCache].held_by_exports_bytes, kv.bytes);

  // Peer unmaps, export closed: nothing held any more.
  const uint64_t rss_with_peer = rss();
  peer.reset();
  ASSERT_TRUE(pool.close_export(exported.id));
  EXPECT_GE(rss_with_peer - rss(), kv.bytes * 9 / 10);
  EXPECT_EQ(pool.usage()[Tag::kKvCache], (TagUsage{1, kv.bytes, 0, 0, 0}));
  EXPECT_EQ(pool.usage().open_exports, 0u);

  // With the export closed first (the order the design prescribes), sleep
  // frees everything.
  Export again = pool.export_fd(kv.id).value();
  ASSERT_TRUE(pool.close_export(again.id));
  SleepReport clean = pool.sleep({}).value();
  EXPECT_EQ(clean.held_by_exports_bytes, 0u);
  EXPECT_TRUE(clean.held_by.empty());
}

TEST(MemoryPoolHost, PartialWakeReportsTheTagsNotResident) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 16 * kMiB, 32 * kMiB, 8 * kMiB);
  fill(m.weights.base, m.weights.bytes, 5);
  ASSERT_TRUE(pool.sleep({Tag::kWeights}));

  WakeReport weights_only = pool.wake({Tag::kWeights}).value();
  EXPECT_EQ(weights_only.not_resident, (TagSet{Tag::kKvCache, Tag::kScratch}));
  EXPECT_TRUE(pool.is_resident(Tag::kWeights));
  EXPECT_FALSE(pool.is_resident(Tag::kKvCache));
  EXPECT_FALSE(pool.is_resident(Tag::kScratch));
  EXPECT_EQ(pool.state(m.kv.id).value(), AllocationState::kReleased);
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 5));

  WakeReport again = pool.wake({Tag::kWeights}).value();  // idempotent
  EXPECT_EQ(sum(again.mapped_bytes), 0u);
  EXPECT_EQ(again.not_resident, (TagSet{Tag::kKvCache, Tag::kScratch}));

  EXPECT_EQ(pool.wake({Tag::kKvCache}).value().not_resident, TagSet{Tag::kScratch});
  EXPECT_TRUE(pool.wake({Tag::kScratch}).value().not_resident.empty());
  EXPECT_EQ(pool.resident_tags(), TagSet::all());
}

TEST(MemoryPoolHost, RepeatedCallsSucceedAndChangeNothing) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 8 * kMiB, 8 * kMiB, 8 * kMiB);
  EXPECT_EQ(sum(pool.wake(TagSet::all()).value().mapped_bytes), 0u);  // awake already
  EXPECT_EQ(sum(pool.sleep({Tag::kWeights}).value().released_bytes), m.total());
  const PoolUsage asleep = pool.usage();
  SleepReport second = pool.sleep({Tag::kWeights}).value();
  EXPECT_EQ(sum(second.released_bytes), 0u);
  EXPECT_EQ(pool.usage(), asleep);
  EXPECT_EQ(pool.discard({Tag::kKvCache}).value(), 0u);  // nothing offloaded there
  EXPECT_EQ(pool.usage(), asleep);
}

TEST(MemoryPoolHost, ReleaseOfOneTagLeavesTheOthersResident) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 8 * kMiB, 16 * kMiB, 8 * kMiB);
  fill(m.weights.base, m.weights.bytes, 9);
  SleepReport r = pool.sleep({}, {.tags = {Tag::kKvCache}}).value();  // release_kv_cache_memory
  EXPECT_EQ(r.released_bytes, (TagBytes{0, m.kv.bytes, 0}));
  EXPECT_EQ(pool.resident_tags(), (TagSet{Tag::kWeights, Tag::kScratch}));
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 9));
  ASSERT_TRUE(pool.wake({Tag::kKvCache}));
  EXPECT_TRUE(all_zero(m.kv.base, m.kv.bytes));
}

TEST(MemoryPoolHost, DiscardDropsHostCopies) {
  MemoryPool pool = make_pool();
  Allocation weights = pool.allocate(16 * kMiB, Tag::kWeights).value();
  fill(weights.base, weights.bytes, 3);
  ASSERT_TRUE(pool.sleep({Tag::kWeights}));
  const uint64_t with_copy = rss();
  EXPECT_EQ(pool.discard({Tag::kWeights}).value(), weights.bytes);
  EXPECT_GE(with_copy - rss(), weights.bytes * 9 / 10);
  EXPECT_EQ(pool.usage()[Tag::kWeights], (TagUsage{1, 0, 0, weights.bytes, 0}));
  ASSERT_TRUE(pool.wake(TagSet::all()));
  EXPECT_TRUE(all_zero(weights.base, weights.bytes));
}

// The host backend, counting the buffers it hands out and is told to keep.
class CountingHostBackend final : public MemoryBackend {
 public:
  BackendKind kind() const override { return host_.kind(); }
  std::string description() const override { return host_.description(); }
  size_t granularity() const override { return host_.granularity(); }
  Result<void*> reserve(size_t bytes) override { return host_.reserve(bytes); }
  void unreserve(void* base, size_t bytes) override { host_.unreserve(base, bytes); }
  Result<std::unique_ptr<Backing>> map(void* base, size_t bytes, size_t piece_bytes, bool zero_fill,
                                       std::string_view label) override {
    return host_.map(base, bytes, piece_bytes, zero_fill, label);
  }
  Result<std::unique_ptr<HostBuffer>> allocate_host(size_t bytes) override {
    ++allocated;
    return host_.allocate_host(bytes);
  }
  void retain_host(HostBuffer&) override { ++retained; }
  Ok copy_to_host(void* dst, const void* src, size_t bytes) override { return host_.copy_to_host(dst, src, bytes); }
  Ok copy_from_host(void* dst, const void* src, size_t bytes) override { return host_.copy_from_host(dst, src, bytes); }
  Ok synchronize() override { return host_.synchronize(); }
  Result<DeviceMemoryInfo> memory_info() override { return host_.memory_info(); }
  Result<std::unique_ptr<ImportedMapping>> map_import(const std::vector<ExportedPiece>& pieces) override {
    return host_.map_import(pieces);
  }
  int allocated = 0;
  int retained = 0;

 private:
  HostBackend host_;
};

TEST(MemoryPoolHost, KeptOffloadBuffersAreReusedByLaterSleepsAndDroppedByDiscard) {
  auto backend = std::make_unique<CountingHostBackend>();
  CountingHostBackend* b = backend.get();
  MemoryPool pool(std::move(backend), PoolOptions{.keep_offload_buffers = true});
  Allocation w = pool.allocate(8 * kMiB, Tag::kWeights).value();
  Allocation kv = pool.allocate(4 * kMiB, Tag::kKvCache).value();
  for (uint64_t cycle = 1; cycle <= 4; ++cycle) {
    fill(w.base, w.bytes, cycle);
    ASSERT_TRUE(pool.sleep({Tag::kWeights}));
    EXPECT_EQ(pool.usage()[Tag::kWeights].kept_host_bytes, 0u);  // the buffer holds the copy now
    ASSERT_TRUE(pool.wake(TagSet::all()));
    EXPECT_TRUE(holds(w.base, w.bytes, cycle)) << cycle;
    EXPECT_EQ(pool.usage()[Tag::kWeights].kept_host_bytes, w.bytes);
    EXPECT_EQ(pool.usage()[Tag::kKvCache].kept_host_bytes, 0u);  // released, not offloaded
  }
  EXPECT_EQ(b->allocated, 1);  // one buffer for every sleep
  EXPECT_EQ(b->retained, 1);
  // Level 2 drops the kept buffer; the next level 1 allocates again.
  ASSERT_TRUE(pool.sleep({}));
  EXPECT_EQ(pool.discard(TagSet::all()).value(), w.bytes);
  EXPECT_EQ(pool.usage()[Tag::kWeights].kept_host_bytes, 0u);
  ASSERT_TRUE(pool.wake(TagSet::all()));
  fill(w.base, w.bytes, 9);
  ASSERT_TRUE(pool.sleep({Tag::kWeights}));
  ASSERT_TRUE(pool.wake(TagSet::all()));
  EXPECT_TRUE(holds(w.base, w.bytes, 9));
  EXPECT_EQ(b->allocated, 2);
  EXPECT_EQ(pool.pinned_host_bytes(), 0u);  // the host backend pins nothing
  ASSERT_TRUE(pool.free(kv.id));
  ASSERT_TRUE(pool.free(w.id));
  EXPECT_EQ(pool.usage().total().kept_host_bytes, 0u);
}

// prepare_offload_buffers (a sleep-mode engine's at start): the buffer the
// first sleep copies into exists, and is prepared (retained), before it; the
// sleeps after reuse it, and a second call makes nothing.
TEST(MemoryPoolHost, PreparedOffloadBuffersServeTheFirstSleep) {
  auto backend = std::make_unique<CountingHostBackend>();
  CountingHostBackend* b = backend.get();
  MemoryPool pool(std::move(backend), PoolOptions{.keep_offload_buffers = true});
  Allocation w = pool.allocate(8 * kMiB, Tag::kWeights).value();
  Allocation kv = pool.allocate(4 * kMiB, Tag::kKvCache).value();
  EXPECT_EQ(pool.prepare_offload_buffers({Tag::kWeights}).value(), w.bytes);
  EXPECT_EQ(b->allocated, 1);
  EXPECT_EQ(b->retained, 1);
  EXPECT_EQ(pool.usage()[Tag::kWeights].kept_host_bytes, w.bytes);
  EXPECT_EQ(pool.usage()[Tag::kKvCache].kept_host_bytes, 0u);
  EXPECT_EQ(pool.prepare_offload_buffers({Tag::kWeights}).value(), 0u);  // has one already
  for (uint64_t cycle = 1; cycle <= 3; ++cycle) {
    fill(w.base, w.bytes, cycle);
    ASSERT_TRUE(pool.sleep({Tag::kWeights}));
    ASSERT_TRUE(pool.wake(TagSet::all()));
    EXPECT_TRUE(holds(w.base, w.bytes, cycle)) << cycle;
  }
  EXPECT_EQ(b->allocated, 1);  // the first sleep took the prepared buffer
  EXPECT_EQ(b->retained, 1);
  ASSERT_TRUE(pool.free(kv.id));
  ASSERT_TRUE(pool.free(w.id));
  EXPECT_EQ(pool.usage().total().kept_host_bytes, 0u);
  // Without keep_offload_buffers it makes nothing.
  auto plain_backend = std::make_unique<CountingHostBackend>();
  CountingHostBackend* pb = plain_backend.get();
  MemoryPool plain(std::move(plain_backend));
  Allocation w2 = plain.allocate(4 * kMiB, Tag::kWeights).value();
  EXPECT_EQ(plain.prepare_offload_buffers({Tag::kWeights}).value(), 0u);
  EXPECT_EQ(pb->allocated, 0);
  ASSERT_TRUE(plain.free(w2.id));
}

TEST(MemoryPoolHost, WithoutKeepOffloadBuffersEverySleepAllocates) {
  auto backend = std::make_unique<CountingHostBackend>();
  CountingHostBackend* b = backend.get();
  MemoryPool pool(std::move(backend));
  Allocation w = pool.allocate(4 * kMiB, Tag::kWeights).value();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(pool.sleep({Tag::kWeights}));
    ASSERT_TRUE(pool.wake(TagSet::all()));
    EXPECT_EQ(pool.usage()[Tag::kWeights].kept_host_bytes, 0u);
  }
  EXPECT_EQ(b->allocated, 3);
  EXPECT_EQ(b->retained, 0);
  ASSERT_TRUE(pool.free(w.id));
}

TEST(MemoryPoolHost, FreeReturnsTheMemoryAndTheAddresses) {
  MemoryPool pool = make_pool();
  Allocation a = pool.allocate(32 * kMiB, Tag::kScratch).value();
  const uint64_t before = rss();
  ASSERT_TRUE(pool.free(a.id));
  EXPECT_GE(before - rss(), a.bytes * 9 / 10);
  EXPECT_TRUE(pool.allocations().empty());
  EXPECT_EQ(pool.state(a.id).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(pool.free(a.id).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(pool.usage(), PoolUsage{});
}

TEST(MemoryPoolHost, ErrorsSayWhatIsWrongAndWhatToDo) {
  Result<Tag> bad_tag = parse_tag("kv");
  ASSERT_FALSE(bad_tag);
  EXPECT_EQ(bad_tag.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(bad_tag.error().message.find("weights, kv_cache and scratch"), std::string::npos);
  EXPECT_FALSE(parse_tags({"weights", "activations"}));
  EXPECT_EQ(parse_tags({"weights", "kv_cache"}).value(), (TagSet{Tag::kWeights, Tag::kKvCache}));
  EXPECT_EQ(parse_tag("scratch").value(), Tag::kScratch);

  MemoryPool pool = make_pool();
  EXPECT_EQ(pool.allocate(0, Tag::kScratch).error().code, ErrorCode::kInvalidArgument);
  Result<Allocation> odd_chunk = pool.allocate(8 * kMiB, Tag::kWeights, {.chunk_bytes = 1000});
  ASSERT_FALSE(odd_chunk);
  EXPECT_NE(odd_chunk.error().message.find("granularity"), std::string::npos) << odd_chunk.error().message;

  EXPECT_EQ(pool.export_fd(AllocationId{999}).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(pool.close_export(ExportId{999}).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(pool.state(AllocationId{999}).error().code, ErrorCode::kNotFound);

  Allocation kv = pool.allocate(8 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();
  Result<SleepReport> offload_unreleased = pool.sleep({Tag::kWeights}, {.tags = {Tag::kKvCache}});
  EXPECT_EQ(offload_unreleased.error().code, ErrorCode::kInvalidArgument);

  Export e = pool.export_fd(kv.id).value();
  Result<void> free_exported = pool.free(kv.id);
  ASSERT_FALSE(free_exported);
  EXPECT_EQ(free_exported.error().code, ErrorCode::kConflict);
  EXPECT_NE(free_exported.error().message.find("close"), std::string::npos);
  ASSERT_TRUE(pool.close_export(e.id));
  EXPECT_EQ(pool.close_export(e.id).error().code, ErrorCode::kNotFound);

  ASSERT_TRUE(pool.sleep({}));
  Result<Export> export_asleep = pool.export_fd(kv.id);
  ASSERT_FALSE(export_asleep);
  EXPECT_EQ(export_asleep.error().code, ErrorCode::kConflict);
  EXPECT_NE(export_asleep.error().message.find("wake kv_cache"), std::string::npos) << export_asleep.error().message;
}

TEST(MemoryPoolHost, OutOfMemoryInTheMiddleOfAnAllocationLeavesItAsItWas) {
  // A 64 MiB "device"; while the engine sleeps another tenant takes 44 MiB.
  MemoryPool pool = make_pool(64 * kMiB);
  auto& host = dynamic_cast<HostBackend&>(pool.backend());
  Allocation weights = pool.allocate(24 * kMiB, Tag::kWeights, {.chunk_bytes = 4 * kMiB}).value();
  Allocation kv = pool.allocate(16 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();
  fill(weights.base, weights.bytes, 31);
  ASSERT_TRUE(pool.sleep({Tag::kWeights}));
  Allocation tenant = pool.allocate(44 * kMiB, Tag::kScratch, {.name = "tenant"}).value();

  // The weights' 6th chunk does not fit: the five mapped before are undone.
  Result<WakeReport> failed = pool.wake(TagSet::all());
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, ErrorCode::kOutOfMemory);
  const std::string& why = failed.error().message;
  EXPECT_NE(why.find("weights"), std::string::npos) << why;
  EXPECT_NE(why.find("host copy is kept"), std::string::npos) << why;
  EXPECT_NE(why.find("call wake again"), std::string::npos) << why;
  EXPECT_EQ(host.committed_bytes(), tenant.bytes);
  EXPECT_EQ(pool.state(weights.id).value(), AllocationState::kOffloaded);
  EXPECT_EQ(pool.state(kv.id).value(), AllocationState::kReleased);
  EXPECT_EQ(pool.usage()[Tag::kWeights], (TagUsage{1, 0, weights.bytes, 0, 0}));

  // The tenant leaves; the same call now succeeds and the weights are intact.
  ASSERT_TRUE(pool.free(tenant.id));
  WakeReport woke = pool.wake(TagSet::all()).value();
  EXPECT_TRUE(woke.not_resident.empty());
  EXPECT_TRUE(holds(weights.base, weights.bytes, 31));
  EXPECT_TRUE(all_zero(kv.base, kv.bytes));
}

TEST(MemoryPoolHost, OutOfMemoryAfterSomeAllocationsWokeSaysWhichAreBack) {
  MemoryPool pool = make_pool(64 * kMiB);
  Allocation weights = pool.allocate(8 * kMiB, Tag::kWeights).value();
  Allocation kv = pool.allocate(16 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();
  ASSERT_TRUE(pool.sleep({}));
  Allocation tenant = pool.allocate(44 * kMiB, Tag::kScratch, {.name = "tenant"}).value();

  Result<WakeReport> failed = pool.wake({Tag::kWeights, Tag::kKvCache});
  ASSERT_FALSE(failed);
  EXPECT_NE(failed.error().message.find("already resident again: weights"), std::string::npos)
      << failed.error().message;
  EXPECT_TRUE(pool.is_resident(Tag::kWeights));
  EXPECT_FALSE(pool.is_resident(Tag::kKvCache));
  ASSERT_TRUE(pool.free(tenant.id));
  WakeReport woke = pool.wake({Tag::kWeights, Tag::kKvCache}).value();
  EXPECT_EQ(woke.mapped_bytes, (TagBytes{0, kv.bytes, 0}));
  EXPECT_TRUE(all_zero(kv.base, kv.bytes));
}

// A host backend whose offload copies fail on request: sleep must then
// release nothing.
class FailingOffloadBackend final : public MemoryBackend {
 public:
  BackendKind kind() const override { return host_.kind(); }
  std::string description() const override { return "host with failing offload"; }
  size_t granularity() const override { return host_.granularity(); }
  Result<void*> reserve(size_t bytes) override { return host_.reserve(bytes); }
  void unreserve(void* base, size_t bytes) override { host_.unreserve(base, bytes); }
  Result<std::unique_ptr<Backing>> map(void* base, size_t bytes, size_t piece, bool zero, std::string_view label) override {
    return host_.map(base, bytes, piece, zero, label);
  }
  Result<std::unique_ptr<HostBuffer>> allocate_host(size_t bytes) override {
    if (fail_after_ == 0) return out_of_memory("pinned host memory exhausted (injected)");
    --fail_after_;
    return host_.allocate_host(bytes);
  }
  Ok copy_to_host(void* d, const void* s, size_t n) override { return host_.copy_to_host(d, s, n); }
  Ok copy_from_host(void* d, const void* s, size_t n) override { return host_.copy_from_host(d, s, n); }
  Ok synchronize() override { return {}; }
  Result<DeviceMemoryInfo> memory_info() override { return host_.memory_info(); }
  Result<std::unique_ptr<ImportedMapping>> map_import(const std::vector<ExportedPiece>& p) override {
    return host_.map_import(p);
  }
  int fail_after_ = 1 << 30;

 private:
  HostBackend host_;
};

TEST(MemoryPoolHost, FailedOffloadReleasesNothing) {
  auto backend = std::make_unique<FailingOffloadBackend>();
  FailingOffloadBackend* failing = backend.get();
  MemoryPool pool(std::move(backend));
  Allocation w1 = pool.allocate(8 * kMiB, Tag::kWeights, {.name = "layers 0-13"}).value();
  Allocation w2 = pool.allocate(8 * kMiB, Tag::kWeights, {.name = "layers 14-27"}).value();
  Allocation kv = pool.allocate(8 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();
  fill(w1.base, w1.bytes, 41);
  fill(w2.base, w2.bytes, 42);
  fill(kv.base, kv.bytes, 43);
  failing->fail_after_ = 1;  // the second copy fails

  Result<SleepReport> failed = pool.sleep({Tag::kWeights});
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, ErrorCode::kOutOfMemory);
  EXPECT_NE(failed.error().message.find("nothing released"), std::string::npos) << failed.error().message;
  EXPECT_NE(failed.error().message.find("layers 14-27"), std::string::npos) << failed.error().message;
  EXPECT_EQ(pool.resident_tags(), TagSet::all());
  EXPECT_TRUE(holds(w1.base, w1.bytes, 41));
  EXPECT_TRUE(holds(kv.base, kv.bytes, 43));

  failing->fail_after_ = 1 << 30;
  ASSERT_TRUE(pool.sleep({Tag::kWeights}));
  ASSERT_TRUE(pool.wake(TagSet::all()));
  EXPECT_TRUE(holds(w1.base, w1.bytes, 41));
  EXPECT_TRUE(holds(w2.base, w2.bytes, 42));
}

TEST(MemoryPoolHost, UsageIsReadableFromAnotherThreadWhileTheOwnerSleepsAndWakes) {
  MemoryPool pool = make_pool();
  EngineMemory m = EngineMemory::allocate(pool, 8 * kMiB, 16 * kMiB, 4 * kMiB);
  std::atomic<bool> stop{false};
  std::atomic<int> snapshots{0};
  std::atomic<int> inconsistent{0};
  std::thread http([&] {
    while (!stop.load()) {
      PoolUsage u = pool.usage();
      if (u[Tag::kWeights].total_bytes() != m.weights.bytes || u[Tag::kKvCache].total_bytes() != m.kv.bytes ||
          u[Tag::kScratch].total_bytes() != m.scratch.bytes) {
        inconsistent++;
      }
      (void)pool.is_resident(Tag::kKvCache);
      snapshots++;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(pool.sleep({Tag::kWeights}));
    ASSERT_TRUE(pool.wake({Tag::kWeights}));
    ASSERT_TRUE(pool.wake(TagSet::all()));
  }
  stop = true;
  http.join();
  EXPECT_GT(snapshots.load(), 0);
  EXPECT_EQ(inconsistent.load(), 0);
}

}  // namespace
}  // namespace siesta::memory
