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
// P/D: export_for_transfer() describes the cache for the KV connector (one
// region: address, size, block layout) with an exported FD for same-host
// peers, and keeps that export open until close_transfer_export(), which the
// engine calls once the connector has deregistered the region (before the
// memory is released for sleep); the destructor closes it too.
//
// Owned and used by the engine loop; view() may be read from any thread (it
// never changes after allocate).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"
#include "memory/memory_pool.h"
#include "model/forward.h"

namespace siesta {

// The KV cache as a P/D connector registers it with its transfer engine.
struct KvCacheRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
  int32_t num_blocks = 0;
  int32_t block_size = 0;    // tokens per block
  uint64_t block_bytes = 0;  // one block of every layer, K and V: contiguous
  // Peers exchange block ids only; both sides must lay blocks out alike.
  // "layers=4 kv_heads=2 head_dim=64 block_size=16 elem_bytes=4".
  std::string layout;
  bool cuda = false;         // device memory (cuMem) rather than host memory (memfd)
  int cuda_device = 0;       // the engine's CUDA device (cuda only)
  // An FD exporting the memory (memfd or cuMem POSIX FD), -1 when the memory
  // backend cannot export it; valid until close_transfer_export(). base sits
  // export_offset bytes into it; export_bytes is the whole exported allocation.
  int export_fd = -1;
  uint64_t export_offset = 0;
  uint64_t export_bytes = 0;
};

std::string kv_layout_fingerprint(const KvCacheLayout& layout);

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

  // Owner thread (the engine loop), while the cache is resident. Exports the
  // allocation (closing an earlier export first) and describes it; when the
  // backend cannot export, the region has export_fd -1 and why is logged.
  KvCacheRegion export_for_transfer(int cuda_device = 0);
  // Closes the export of export_for_transfer(), if open.
  void close_transfer_export();

 private:
  KvCacheMemory(memory::MemoryPool& pool, memory::Allocation allocation, const KvCacheLayout& layout,
                int32_t num_blocks, uint64_t bytes)
      : pool_(&pool), allocation_(std::move(allocation)), layout_(layout), num_blocks_(num_blocks), bytes_(bytes) {}

  memory::MemoryPool* pool_ = nullptr;  // null once moved from
  memory::Allocation allocation_;
  KvCacheLayout layout_;
  int32_t num_blocks_ = 0;
  uint64_t bytes_ = 0;
  std::optional<memory::ExportId> export_;
};

}  // namespace siesta
