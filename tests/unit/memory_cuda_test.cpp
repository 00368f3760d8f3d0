// MemoryPool on the CUDA backend: the host backend's lifecycle tests against
// real device memory, measured with the device's free memory (cuMemGetInfo);
// and the backend's host->device restores from pinned host memory (kept
// buffers, staging slots), by the gather kernel and by the copy engines
// (HostToDeviceCopy), byte for byte. Skipped, with the reason, where there is
// no GPU (or no CUDA in the build).
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "memory/cuda_backend.h"
#include "memory/memory_pool.h"

namespace siesta::memory {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

uint64_t pattern_word(size_t i, uint64_t seed) { return (i + 1) * 0x9E3779B97F4A7C15ull ^ seed; }

class MemoryPoolCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<MemoryBackend>> backend = make_cuda_backend({.device = 0});
    if (!backend) GTEST_SKIP() << "no CUDA backend here: " << backend.error().message;
    std::printf("backend: %s\n", (*backend)->description().c_str());
    pool_ = std::make_unique<MemoryPool>(std::move(*backend));
  }

  MemoryPool& pool() { return *pool_; }
  MemoryBackend& backend() { return pool_->backend(); }
  uint64_t device_free() { return backend().memory_info().value().free_bytes; }

  // Device memory is written and read through the backend's copies.
  void fill(void* base, size_t bytes, uint64_t seed) {
    std::vector<uint64_t> host(bytes / 8);
    for (size_t i = 0; i < host.size(); ++i) host[i] = pattern_word(i, seed);
    ASSERT_TRUE(backend().copy_from_host(base, host.data(), bytes));
  }
  bool holds(const void* base, size_t bytes, uint64_t seed) {
    std::vector<uint64_t> host(bytes / 8);
    if (!backend().copy_to_host(host.data(), base, bytes)) return false;
    for (size_t i = 0; i < host.size(); ++i) {
      if (host[i] != pattern_word(i, seed)) return false;
    }
    return true;
  }
  bool all_zero(const void* base, size_t bytes) {
    std::vector<uint64_t> host(bytes / 8, 1);
    if (!backend().copy_to_host(host.data(), base, bytes)) return false;
    return std::all_of(host.begin(), host.end(), [](uint64_t w) { return w == 0; });
  }

  struct EngineMemory {
    Allocation weights, kv, scratch;
    uint64_t total() const { return weights.bytes + kv.bytes + scratch.bytes; }
  };
  EngineMemory allocate_engine(size_t weights, size_t weights_chunk, size_t kv, size_t scratch) {
    return EngineMemory{
        pool().allocate(weights, Tag::kWeights, {.chunk_bytes = weights_chunk, .name = "weights"}).value(),
        pool().allocate(kv, Tag::kKvCache, {.single_allocation = true, .name = "kv"}).value(),
        pool().allocate(scratch, Tag::kScratch, {.name = "scratch"}).value(),
    };
  }

  // Allocates scratch until at most `leave` bytes of the device stay free: the
  // memory another process (the trainer) takes while the engine sleeps.
  std::vector<Allocation> occupy_device_leaving(uint64_t leave) {
    std::vector<Allocation> taken;
    const size_t g = backend().granularity();
    for (size_t piece : {size_t{1} * kGiB, 64 * kMiB, g}) {
      while (device_free() > leave + piece) {
        Result<Allocation> a = pool().allocate(piece, Tag::kScratch, {.single_allocation = true, .name = "tenant"});
        if (!a) break;
        taken.push_back(*a);
      }
    }
    return taken;
  }

  std::unique_ptr<MemoryPool> pool_;
};

TEST_F(MemoryPoolCuda, AllocatesPerTagResidentZeroedAndWritable) {
  const size_t g = backend().granularity();
  EngineMemory m = allocate_engine(256 * kMiB, 32 * kMiB, 1 * kGiB, 64 * kMiB + 1);
  EXPECT_EQ(m.weights.pieces, 8u);
  EXPECT_EQ(m.kv.pieces, 1u);
  EXPECT_EQ(m.scratch.bytes, (64 * kMiB + 1 + g - 1) / g * g);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m.kv.base) % g, 0u);
  for (const Allocation* a : {&m.weights, &m.kv, &m.scratch}) {
    EXPECT_TRUE(all_zero(a->base, a->bytes)) << a->name;
    fill(a->base, a->bytes, a->id.value);
  }
  for (const Allocation* a : {&m.weights, &m.kv, &m.scratch}) EXPECT_TRUE(holds(a->base, a->bytes, a->id.value));
  PoolUsage u = pool().usage();
  EXPECT_EQ(u[Tag::kWeights], (TagUsage{1, m.weights.bytes, 0, 0, 0}));
  EXPECT_EQ(u[Tag::kKvCache], (TagUsage{1, m.kv.bytes, 0, 0, 0}));
  EXPECT_EQ(u[Tag::kScratch], (TagUsage{1, m.scratch.bytes, 0, 0, 0}));
}

TEST_F(MemoryPoolCuda, SleepOffloadsWeightsAndWakeRestoresThemAtTheSameAddresses) {
  EngineMemory m = allocate_engine(256 * kMiB, 32 * kMiB, 512 * kMiB, 64 * kMiB);
  fill(m.weights.base, m.weights.bytes, 1);
  fill(m.kv.base, m.kv.bytes, 2);
  fill(m.scratch.base, m.scratch.bytes, 3);

  SleepReport slept = pool().sleep({Tag::kWeights}).value();
  EXPECT_EQ(slept.released_bytes, (TagBytes{m.weights.bytes, m.kv.bytes, m.scratch.bytes}));
  EXPECT_EQ(slept.offloaded_bytes, (TagBytes{m.weights.bytes, 0, 0}));
  EXPECT_EQ(pool().state(m.weights.id).value(), AllocationState::kOffloaded);
  EXPECT_EQ(pool().state(m.kv.id).value(), AllocationState::kReleased);
  EXPECT_TRUE(pool().resident_tags().empty());

  WakeReport woke = pool().wake(TagSet::all()).value();
  EXPECT_EQ(woke.restored_bytes, (TagBytes{m.weights.bytes, 0, 0}));
  std::vector<Allocation> after = pool().allocations();
  ASSERT_EQ(after.size(), 3u);
  EXPECT_EQ(after[0].base, m.weights.base);
  EXPECT_EQ(after[1].base, m.kv.base);
  EXPECT_EQ(after[2].base, m.scratch.base);
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 1));
  EXPECT_TRUE(all_zero(m.kv.base, m.kv.bytes));
  EXPECT_TRUE(all_zero(m.scratch.base, m.scratch.bytes));
  fill(m.kv.base, m.kv.bytes, 4);
  EXPECT_TRUE(holds(m.kv.base, m.kv.bytes, 4));
}

TEST_F(MemoryPoolCuda, DeviceMemoryIsFreedBySleepAndTakenBackByWake) {
  EngineMemory m = allocate_engine(1 * kGiB, 256 * kMiB, 2 * kGiB, 256 * kMiB);
  fill(m.weights.base, m.weights.bytes, 7);
  for (TagSet offload : {TagSet{}, TagSet{Tag::kWeights}}) {  // level 2, then level 1
    const uint64_t awake = device_free();
    SleepReport r = pool().sleep(offload).value();
    ASSERT_EQ(sum(r.released_bytes), m.total());
    const uint64_t asleep = device_free();
    // On the device, level 1 frees the weights too: their copy is in host memory.
    EXPECT_GE(asleep - awake, m.total() * 9 / 10) << "offload " << offload.to_string();
    ASSERT_TRUE(pool().wake(TagSet::all()));
    EXPECT_GE(asleep - device_free(), m.total() * 9 / 10);
    if (offload.empty()) fill(m.weights.base, m.weights.bytes, 7);  // reload after level 2
  }
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 7));
}

TEST_F(MemoryPoolCuda, HundredSleepWakeCyclesLeaveNoCreep) {
  EngineMemory m = allocate_engine(64 * kMiB, 2 * kMiB, 128 * kMiB, 32 * kMiB);
  fill(m.weights.base, m.weights.bytes, 11);
  ASSERT_TRUE(pool().sleep({Tag::kWeights}));
  ASSERT_TRUE(pool().wake(TagSet::all()));
  const uint64_t free0 = device_free();
  const PoolUsage usage0 = pool().usage();
  for (int cycle = 0; cycle < 100; ++cycle) {
    const bool level1 = cycle % 2 == 0;
    ASSERT_TRUE(pool().sleep(level1 ? TagSet{Tag::kWeights} : TagSet{})) << "cycle " << cycle;
    if (cycle % 3 == 0) {
      ASSERT_TRUE(pool().wake({Tag::kWeights}));
    }
    ASSERT_TRUE(pool().wake(TagSet::all())) << "cycle " << cycle;
    if (level1) {
      ASSERT_TRUE(holds(m.weights.base, m.weights.bytes, 11)) << "cycle " << cycle;
    } else {
      ASSERT_TRUE(all_zero(m.weights.base, m.weights.bytes)) << "cycle " << cycle;
      fill(m.weights.base, m.weights.bytes, 11);
    }
  }
  EXPECT_EQ(pool().usage(), usage0);
  const int64_t creep = static_cast<int64_t>(free0) - static_cast<int64_t>(device_free());
  EXPECT_LT(std::abs(creep), static_cast<int64_t>(16 * kMiB)) << "device free memory moved by " << creep;
}

TEST_F(MemoryPoolCuda, ExportedFdsAreTheSameMemoryAndSleepAccountsForThem) {
  Allocation weights = pool().allocate(256 * kMiB, Tag::kWeights, {.chunk_bytes = 64 * kMiB}).value();
  Allocation kv = pool().allocate(1 * kGiB, Tag::kKvCache, {.single_allocation = true}).value();

  // Chunked: one POSIX FD per physical piece, each mappable by a peer.
  Export wexp = pool().export_fd(weights.id).value();
  ASSERT_EQ(wexp.pieces.size(), 4u);
  EXPECT_EQ(wexp.kind, BackendKind::kCuda);
  fill(weights.base, weights.bytes, 20);
  {
    std::unique_ptr<ImportedMapping> peer = backend().map_import(wexp.pieces).value();
    EXPECT_TRUE(holds(peer->base(), weights.bytes, 20));
  }
  ASSERT_TRUE(pool().close_export(wexp.id));

  // Single allocation: one FD covers the KV cache.
  Export exported = pool().export_fd(kv.id).value();
  ASSERT_EQ(exported.pieces.size(), 1u);
  EXPECT_EQ(exported.pieces[0].bytes, kv.bytes);
  std::unique_ptr<ImportedMapping> peer = backend().map_import(exported.pieces).value();
  fill(peer->base(), kv.bytes, 21);
  EXPECT_TRUE(holds(kv.base, kv.bytes, 21));

  Result<SleepReport> refused = pool().sleep({});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kConflict);
  EXPECT_NE(refused.error().message.find("close_export"), std::string::npos) << refused.error().message;
  EXPECT_EQ(pool().resident_tags(), TagSet::all());

  // Forced: the device gets the weights back, not the exported KV cache.
  const uint64_t awake = device_free();
  SleepReport forced = pool().sleep({}, {.release_exported = true}).value();
  EXPECT_EQ(forced.held_by_exports_bytes, kv.bytes);
  EXPECT_EQ(pool().usage()[Tag::kKvCache], (TagUsage{1, 0, 0, kv.bytes, kv.bytes}));
  const uint64_t asleep = device_free();
  EXPECT_GE(asleep - awake, weights.bytes * 9 / 10);
  EXPECT_LT(asleep - awake, weights.bytes + kv.bytes / 2) << "the exported KV cache should still be allocated";
  EXPECT_TRUE(holds(peer->base(), kv.bytes, 21));

  peer.reset();
  ASSERT_TRUE(pool().close_export(exported.id));
  EXPECT_GE(device_free() - asleep, kv.bytes * 9 / 10);
  EXPECT_EQ(pool().usage()[Tag::kKvCache], (TagUsage{1, 0, 0, kv.bytes, 0}));
  ASSERT_TRUE(pool().wake(TagSet::all()));
  EXPECT_TRUE(all_zero(kv.base, kv.bytes));
}

TEST_F(MemoryPoolCuda, PartialWakeReportsTheTagsNotResident) {
  EngineMemory m = allocate_engine(64 * kMiB, 32 * kMiB, 128 * kMiB, 32 * kMiB);
  fill(m.weights.base, m.weights.bytes, 5);
  ASSERT_TRUE(pool().sleep({Tag::kWeights}));
  WakeReport weights_only = pool().wake({Tag::kWeights}).value();
  EXPECT_EQ(weights_only.not_resident, (TagSet{Tag::kKvCache, Tag::kScratch}));
  EXPECT_TRUE(pool().is_resident(Tag::kWeights));
  EXPECT_FALSE(pool().is_resident(Tag::kKvCache));
  EXPECT_TRUE(holds(m.weights.base, m.weights.bytes, 5));
  EXPECT_EQ(sum(pool().wake({Tag::kWeights}).value().mapped_bytes), 0u);
  EXPECT_TRUE(pool().wake(TagSet::all()).value().not_resident.empty());
}

TEST_F(MemoryPoolCuda, ErrorsSayWhatIsWrongAndWhatToDo) {
  Result<Allocation> odd_chunk = pool().allocate(64 * kMiB, Tag::kWeights, {.chunk_bytes = 3 * kMiB});
  ASSERT_FALSE(odd_chunk);
  EXPECT_EQ(odd_chunk.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(odd_chunk.error().message.find("granularity"), std::string::npos) << odd_chunk.error().message;
  Allocation kv = pool().allocate(64 * kMiB, Tag::kKvCache, {.single_allocation = true}).value();
  ASSERT_TRUE(pool().sleep({}));
  Result<Export> export_asleep = pool().export_fd(kv.id);
  ASSERT_FALSE(export_asleep);
  EXPECT_NE(export_asleep.error().message.find("wake kv_cache"), std::string::npos);
}

TEST_F(MemoryPoolCuda, OutOfMemoryAtWakeLeavesAStateTheNextWakeRepairs) {
  Allocation weights = pool().allocate(256 * kMiB, Tag::kWeights, {.chunk_bytes = 32 * kMiB}).value();
  Allocation kv = pool().allocate(1 * kGiB, Tag::kKvCache, {.single_allocation = true}).value();
  fill(weights.base, weights.bytes, 31);
  ASSERT_TRUE(pool().sleep({Tag::kWeights}));

  // Another tenant takes the device, leaving room for part of the weights.
  std::vector<Allocation> tenant = occupy_device_leaving(100 * kMiB);
  ASSERT_LT(device_free(), weights.bytes) << "could not fill the device";
  const uint64_t free_before = device_free();
  Result<WakeReport> failed = pool().wake(TagSet::all());
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code, ErrorCode::kOutOfMemory) << failed.error().message;
  EXPECT_NE(failed.error().message.find("call wake again"), std::string::npos) << failed.error().message;
  EXPECT_EQ(pool().state(weights.id).value(), AllocationState::kOffloaded);
  EXPECT_EQ(pool().state(kv.id).value(), AllocationState::kReleased);
  // The chunks mapped before the failure were given back.
  const int64_t leaked = static_cast<int64_t>(free_before) - static_cast<int64_t>(device_free());
  EXPECT_LT(std::abs(leaked), static_cast<int64_t>(8 * kMiB));

  for (const Allocation& a : tenant) ASSERT_TRUE(pool().free(a.id));
  ASSERT_TRUE(pool().wake(TagSet::all()));
  EXPECT_TRUE(holds(weights.base, weights.bytes, 31));
  EXPECT_TRUE(all_zero(kv.base, kv.bytes));
}

TEST_F(MemoryPoolCuda, UsageIsReadableFromAnotherThreadWhileTheOwnerSleepsAndWakes) {
  EngineMemory m = allocate_engine(64 * kMiB, 2 * kMiB, 128 * kMiB, 32 * kMiB);
  std::atomic<bool> stop{false};
  std::atomic<int> inconsistent{0};
  std::thread http([&] {
    while (!stop.load()) {
      PoolUsage u = pool().usage();
      if (u.total().total_bytes() != m.total()) inconsistent++;
    }
  });
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(pool().sleep({Tag::kWeights}));
    ASSERT_TRUE(pool().wake(TagSet::all()));
  }
  stop = true;
  http.join();
  EXPECT_EQ(inconsistent.load(), 0);
}

// The restore paths, byte for byte: a backend of each HostToDeviceCopy, one
// device range, and host sources that are a kept buffer pinned in three
// registrations (direct copies, which split at registration boundaries) or
// ordinary memory (staged through three 1 MiB slots), at offsets and sizes
// that are not multiples of 16 (nor of 4, nor equally aligned at both ends).
class CudaRestore : public ::testing::TestWithParam<HostToDeviceCopy> {
 protected:
  static constexpr size_t kPin = size_t{256} << 20;  // the backend pins kept buffers in pieces of this
  static constexpr size_t kHostBytes = 2 * kPin + 40 * kMiB;
  static constexpr size_t kDeviceBytes = 640 * kMiB;

  void SetUp() override {
    Result<std::unique_ptr<MemoryBackend>> backend = make_cuda_backend(
        {.device = 0, .staging_slots = 3, .staging_slot_bytes = 1 * kMiB, .host_to_device = GetParam()});
    if (!backend) GTEST_SKIP() << "no CUDA backend here: " << backend.error().message;
    std::printf("backend: %s\n", (*backend)->description().c_str());
    pool_ = std::make_unique<MemoryPool>(std::move(*backend));
    device_ = pool_->allocate(kDeviceBytes, Tag::kWeights, {.single_allocation = true, .name = "restore"}).value();
    mirror_.assign(kDeviceBytes, std::byte{0});  // what the device holds: zero-filled at first
  }

  MemoryBackend& backend() { return pool_->backend(); }
  std::byte* device() { return static_cast<std::byte*>(device_.base); }

  static void random_bytes(std::byte* p, size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const uint64_t w = rng();
      std::memcpy(p + i, &w, 8);
    }
    for (; i < n; ++i) p[i] = static_cast<std::byte>(rng());
  }

  // Copies `bytes` from host `src` to device offset `at`, then reads back the
  // range and 4 KiB either side (by the staged device->host path) against
  // what the device should hold.
  void restore_and_check(size_t at, const std::byte* src, size_t bytes) {
    SCOPED_TRACE(std::to_string(bytes) + " bytes to device offset " + std::to_string(at));
    ASSERT_LE(at + bytes, kDeviceBytes);
    Ok ok = backend().copy_from_host(device() + at, src, bytes);
    ASSERT_TRUE(ok) << ok.error().message;
    std::memcpy(mirror_.data() + at, src, bytes);
    const size_t lo = at > 4096 ? at - 4096 : 0, hi = std::min(kDeviceBytes, at + bytes + 4096);
    std::vector<std::byte> back(hi - lo);
    ok = backend().copy_to_host(back.data(), device() + lo, back.size());
    ASSERT_TRUE(ok) << ok.error().message;
    for (size_t i = 0; i < back.size(); ++i) {
      if (back[i] == mirror_[lo + i]) continue;
      const size_t d = lo + i;
      FAIL() << "device byte " << d << " differs (" << (d < at ? "before" : d < at + bytes ? "inside" : "after")
             << " the copy)";
    }
  }

  std::unique_ptr<MemoryPool> pool_;
  Allocation device_;
  std::vector<std::byte> mirror_;
};

TEST_P(CudaRestore, FromAKeptPinnedBufferByteForByte) {
  std::unique_ptr<HostBuffer> host = backend().allocate_host(kHostBytes).value();
  auto* h = static_cast<std::byte*>(host->data());
  random_bytes(h, kHostBytes, 7);
  backend().retain_host(*host);  // pinned in the background, 256 MiB at a time
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (host->pinned_bytes() < host->bytes() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(host->pinned_bytes(), host->bytes()) << "the kept buffer was not pinned in 2 minutes";

  // Host bytes [from, from + n) of the kept buffer to device offset `at`.
  auto restore = [&](size_t at, size_t from, size_t n) {
    ASSERT_LE(from + n, kHostBytes) << "the test reads past its host buffer";
    restore_and_check(at, h + from, n);
  };
  restore(0, 0, 64 * kMiB);                                // aligned, in the first registration
  restore(3, 3, 1 * kMiB + 5);                             // equally misaligned ends, odd size
  restore(7, 1, 777);                                      // ends misaligned mod 4: bytes
  restore(4096 + 4, 8, 5 * kMiB + 12);                     // ends 4 apart mod 16: 4-byte words
  restore(8, kPin - 1000, 3000 + 13);                      // across the first registration's end
  restore(kMiB + 5, kPin - 7, kPin + 20 * kMiB + 3);       // across the second's, 276 MiB
  restore(2 * kMiB, 16, 2 * kPin + 24 * kMiB);             // all three registrations
  restore(kDeviceBytes - 1, kHostBytes - 1, 1);            // the last byte of both
}

TEST_P(CudaRestore, FromOrdinaryMemoryThroughTheStagingSlotsByteForByte) {
  std::vector<std::byte> host(24 * kMiB + 64);
  random_bytes(host.data(), host.size(), 11);
  restore_and_check(0, host.data(), 24 * kMiB);        // eight slots' worth, every slot twice or more
  restore_and_check(1, host.data() + 3, 5 * kMiB + 7);  // slots end mid-word
  restore_and_check(9, host.data() + 9, 1 * kMiB);      // exactly a slot, misaligned equally
  restore_and_check(33, host.data() + 2, 100);          // less than a word per thread
}

// Sleep and wake cycles of a pool that keeps its offload buffers: the first
// wake restores through the staging slots, the later ones from the kept
// buffer once it is pinned (three registrations), with the KV cache
// released and mapped again each time as an engine's level-1 sleep does;
// the weights change between cycles, so each sleep's copy is checked too.
TEST_P(CudaRestore, SleepWakeCyclesThroughAKeptBufferKeepTheBytes) {
  Result<std::unique_ptr<MemoryBackend>> made = make_cuda_backend({.device = 0, .host_to_device = GetParam()});
  ASSERT_TRUE(made) << made.error().message;
  MemoryPool pool(std::move(*made), {.keep_offload_buffers = true});
  MemoryBackend& b = pool.backend();
  const size_t weights_bytes = 2 * kPin + 10 * kMiB;
  Allocation weights = pool.allocate(weights_bytes, Tag::kWeights, {.chunk_bytes = 32 * kMiB}).value();
  Allocation kv = pool.allocate(1 * kGiB, Tag::kKvCache, {.single_allocation = true}).value();
  std::vector<std::byte> expect(weights.bytes), back(weights.bytes);
  for (int cycle = 0; cycle < 4; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    random_bytes(expect.data(), expect.size(), 100 + cycle);
    ASSERT_TRUE(b.copy_from_host(weights.base, expect.data(), expect.size()));
    ASSERT_TRUE(pool.sleep({Tag::kWeights}));
    ASSERT_TRUE(pool.wake(TagSet::all()));
    ASSERT_TRUE(b.copy_to_host(back.data(), weights.base, back.size()));
    ASSERT_TRUE(back == expect);
    if (cycle == 0) {
      // The buffer the first sleep made is kept and pinned in the background.
      EXPECT_EQ(pool.usage()[Tag::kWeights].kept_host_bytes, weights.bytes);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (pool.pinned_host_bytes() < weights.bytes && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      ASSERT_GE(pool.pinned_host_bytes(), weights.bytes);
    }
  }
  EXPECT_TRUE(pool.is_resident(Tag::kKvCache));
}

INSTANTIATE_TEST_SUITE_P(HostToDevice, CudaRestore,
                         ::testing::Values(HostToDeviceCopy::kKernel, HostToDeviceCopy::kCopyEngine),
                         [](const ::testing::TestParamInfo<HostToDeviceCopy>& info) {
                           return std::string(host_to_device_copy_name(info.param));
                         });

TEST(CudaRestoreChoice, TheEnvironmentChoosesWhereTheCallerDoesNot) {
  EXPECT_EQ(parse_host_to_device_copy("kernel").value(), HostToDeviceCopy::kKernel);
  EXPECT_EQ(parse_host_to_device_copy("copy_engine").value(), HostToDeviceCopy::kCopyEngine);
  Result<HostToDeviceCopy> bad = parse_host_to_device_copy("sm");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("copy_engine"), std::string::npos) << bad.error().message;
  const char* before = std::getenv(kHostToDeviceCopyEnv);
  const std::string saved = before ? before : "";
  ::setenv(kHostToDeviceCopyEnv, "copy_engine", 1);
  EXPECT_EQ(resolve_host_to_device_copy(), HostToDeviceCopy::kCopyEngine);
  EXPECT_EQ(resolve_host_to_device_copy(HostToDeviceCopy::kKernel), HostToDeviceCopy::kKernel);
  ::setenv(kHostToDeviceCopyEnv, "fast", 1);
  EXPECT_EQ(resolve_host_to_device_copy(), HostToDeviceCopy::kKernel);
  ::unsetenv(kHostToDeviceCopyEnv);
  EXPECT_EQ(resolve_host_to_device_copy(), HostToDeviceCopy::kKernel);
  EXPECT_EQ(resolve_host_to_device_copy(HostToDeviceCopy::kCopyEngine), HostToDeviceCopy::kCopyEngine);
  if (before) ::setenv(kHostToDeviceCopyEnv, saved.c_str(), 1);
}

}  // namespace
}  // namespace siesta::memory
