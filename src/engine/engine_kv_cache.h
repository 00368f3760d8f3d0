// KvCacheMemory: the bytes of the paged KV cache, the one place the engine
// allocates them: one MemoryPool allocation tagged `kv_cache`, made as a single
// physical allocation so that one exported FD (one registration) covers the
// whole cache for KV transfer.
//
//   Result<KvCacheMemory> kv = KvCacheMemory::allocate(pool, model.kv_layout(), num_blocks);
//   model.forward(batch, kv->view(), out);
//   // sleep / release_kv_cache_memory: the pool releases it; view() keeps its
//   // address, which must not be touched until the pool wakes it (zero-filled)
//   // destroyed with the engine, before the pool: frees the allocation
//
// Owned and used by the engine loop; view() may be read from any thread (it
// never changes after allocate).
#pragma once

#include <cstdint>

#include "common/status.h"
#include "memory/memory_pool.h"
#include "model/forward.h"

namespace siesta {

class KvCacheMemory {
 public:
  // kOutOfMemory naming the bytes when the pool cannot allocate them. `pool`
  // must outlive the KvCacheMemory.
  static Result<KvCacheMemory> allocate(memory::MemoryPool& pool, const KvCacheLayout& layout, int32_t num_blocks);
  ~KvCacheMemory();
  KvCacheMemory(KvCacheMemory&& other) noexcept;
  KvCacheMemory& operator=(KvCacheMemory&&) = delete;
  KvCacheMemory(const KvCacheMemory&) = delete;
  KvCacheMemory& operator=(const KvCacheMemory&) = delete;

  KvCacheView view() const { return KvCacheView{allocation_.base, num_blocks_, layout_}; }
  uint64_t bytes() const { return bytes_; }
  int32_t num_blocks() const { return num_blocks_; }
  // The pool allocation (for export to peers and for its state).
  const memory::Allocation& allocation() const { return allocation_; }

 private:
  KvCacheMemory(memory::MemoryPool& pool, memory::Allocation allocation, const KvCacheLayout& layout,
                int32_t num_blocks, uint64_t bytes)
      : pool_(&pool), allocation_(std::move(allocation)), layout_(layout), num_blocks_(num_blocks), bytes_(bytes) {}

  memory::MemoryPool* pool_ = nullptr;  // null once moved from
  memory::Allocation allocation_;
  KvCacheLayout layout_;
  int32_t num_blocks_ = 0;
  uint64_t bytes_ = 0;
};

}  // namespace siesta
