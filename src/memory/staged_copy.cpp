#include "memory/staged_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/log.h"
#include "common/thread_pool.h"

namespace siesta::memory {
namespace {

constexpr size_t kMemcpyPiece = size_t{1} << 20;

Ok check_ring(const StagingRing& ring) {
  if (ring.slots.empty() || ring.slot_bytes == 0) return internal_error("staged copy: the staging ring is empty");
  return {};
}

// Waits for every slot that may still have a copy in flight, keeping the
// first error; used on the error paths so that no DMA outlives the call.
void drain(StagingDma& dma, const std::vector<bool>& busy) {
  for (size_t s = 0; s < busy.size(); ++s) {
    if (!busy[s]) continue;
    if (Ok ok = dma.wait(s); !ok) SIESTA_LOG_ERROR("staged copy: waiting for slot {}: {}", s, ok.error().message);
  }
}

}  // namespace

void parallel_memcpy(ThreadPool& threads, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const size_t pieces = (bytes + kMemcpyPiece - 1) / kMemcpyPiece;
  threads.parallel_for(pieces, [&](size_t begin, size_t end) {
    const size_t from = begin * kMemcpyPiece;
    const size_t to = std::min(bytes, end * kMemcpyPiece);
    std::memcpy(d + from, s + from, to - from);
  });
}

Ok staged_copy_to_host(StagingDma& dma, const StagingRing& ring, ThreadPool& threads, void* host_dst,
                       const void* device_src, size_t bytes) {
  SIESTA_TRY(check_ring(ring));
  const size_t k = ring.slots.size(), slot_bytes = ring.slot_bytes;
  const size_t n = (bytes + slot_bytes - 1) / slot_bytes;
  auto* dst = static_cast<std::byte*>(host_dst);
  const auto* src = static_cast<const std::byte*>(device_src);
  std::vector<bool> busy(k, false);
  auto issue = [&](size_t i) -> Ok {
    const size_t off = i * slot_bytes, len = std::min(slot_bytes, bytes - off);
    busy[i % k] = true;
    return dma.to_slot(i % k, src + off, len);
  };
  auto fail = [&](const Status& error) -> Ok {
    drain(dma, busy);
    return error;
  };
  for (size_t i = 0; i < std::min(n, k); ++i)
    if (Ok ok = issue(i); !ok) return fail(ok.error());
  for (size_t i = 0; i < n; ++i) {
    const size_t slot = i % k, off = i * slot_bytes, len = std::min(slot_bytes, bytes - off);
    if (Ok ok = dma.wait(slot); !ok) return fail(ok.error());
    busy[slot] = false;
    parallel_memcpy(threads, dst + off, ring.slots[slot], len);
    if (i + k < n)
      if (Ok ok = issue(i + k); !ok) return fail(ok.error());
  }
  return {};
}

Ok staged_copy_from_host(StagingDma& dma, const StagingRing& ring, ThreadPool& threads, void* device_dst,
                         const void* host_src, size_t bytes) {
  SIESTA_TRY(check_ring(ring));
  const size_t k = ring.slots.size(), slot_bytes = ring.slot_bytes;
  const size_t n = (bytes + slot_bytes - 1) / slot_bytes;
  auto* dst = static_cast<std::byte*>(device_dst);
  const auto* src = static_cast<const std::byte*>(host_src);
  std::vector<bool> busy(k, false);
  auto fail = [&](const Status& error) -> Ok {
    drain(dma, busy);
    return error;
  };
  for (size_t i = 0; i < n; ++i) {
    const size_t slot = i % k, off = i * slot_bytes, len = std::min(slot_bytes, bytes - off);
    if (busy[slot]) {
      // The DMA that read this slot last must be done before it is rewritten.
      if (Ok ok = dma.wait(slot); !ok) return fail(ok.error());
      busy[slot] = false;
    }
    parallel_memcpy(threads, ring.slots[slot], src + off, len);
    busy[slot] = true;
    if (Ok ok = dma.from_slot(slot, dst + off, len); !ok) return fail(ok.error());
  }
  for (size_t s = 0; s < k; ++s) {
    if (!busy[s]) continue;
    if (Ok ok = dma.wait(s); !ok) return fail(ok.error());
    busy[s] = false;
  }
  return {};
}

}  // namespace siesta::memory
