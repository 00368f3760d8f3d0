#include "engine/engine_kv_cache.h"

#include <string>
#include <utility>

#include "common/log.h"

namespace siesta {

Result<KvCacheMemory> KvCacheMemory::allocate(memory::MemoryPool& pool, const KvCacheLayout& layout,
                                              int32_t num_blocks) {
  if (num_blocks < 1) return invalid_argument("the KV cache needs at least one block, got " + std::to_string(num_blocks));
  const uint64_t bytes = static_cast<uint64_t>(num_blocks) * layout.block_bytes();
  auto a = pool.allocate(static_cast<size_t>(bytes), memory::Tag::kKvCache,
                         {.single_allocation = true, .chunk_bytes = 0, .name = "kv_cache"});
  if (!a)
    return Status{a.error().code,
                  "could not allocate the KV cache: " + memory::format_bytes(bytes) + " (" + std::to_string(num_blocks) +
                      " blocks): " + a.error().message + "; lower --kv-cache-memory-bytes"};
  return KvCacheMemory(pool, std::move(*a), layout, num_blocks, bytes);
}

KvCacheMemory::KvCacheMemory(KvCacheMemory&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      allocation_(std::move(other.allocation_)),
      layout_(other.layout_),
      num_blocks_(other.num_blocks_),
      bytes_(other.bytes_),
      export_(std::exchange(other.export_, std::nullopt)) {}

std::string kv_layout_fingerprint(const KvCacheLayout& l) {
  return "layers=" + std::to_string(l.num_layers) + " kv_heads=" + std::to_string(l.num_kv_heads) +
         " head_dim=" + std::to_string(l.head_dim) + " block_size=" + std::to_string(l.block_size) +
         " elem_bytes=" + std::to_string(l.elem_bytes);
}

KvCacheRegion KvCacheMemory::export_for_transfer(int cuda_device) {
  close_transfer_export();
  KvCacheRegion r;
  r.base = allocation_.base;
  r.bytes = bytes_;
  r.num_blocks = num_blocks_;
  r.block_size = layout_.block_size;
  r.block_bytes = layout_.block_bytes();
  r.layout = kv_layout_fingerprint(layout_);
  r.cuda = pool_->backend().kind() == memory::BackendKind::kCuda;
  r.cuda_device = r.cuda ? cuda_device : 0;
  auto e = pool_->export_fd(allocation_.id);
  if (!e) {
    SIESTA_LOG_WARN("engine: the KV cache cannot be exported to same-host peers ({}); the ipc transfer backend "
                    "will refuse it",
                    e.error().message);
    return r;
  }
  export_ = e->id;
  if (e->pieces.size() == 1) {
    r.export_fd = e->pieces[0].fd;
    r.export_offset = e->pieces[0].offset;
    r.export_bytes = e->pieces[0].bytes;
  } else {
    SIESTA_LOG_WARN("engine: the KV cache is {} physical pieces, not one; same-host peers cannot map it",
                    e->pieces.size());
  }
  return r;
}

void KvCacheMemory::close_transfer_export() {
  if (!export_ || !pool_) return;
  if (auto ok = pool_->close_export(*export_); !ok)
    SIESTA_LOG_WARN("engine: closing the KV cache's export: {}", ok.error().message);
  export_.reset();
}

KvCacheMemory::~KvCacheMemory() {
  if (!pool_) return;
  close_transfer_export();
  if (auto ok = pool_->free(allocation_.id); !ok)
    SIESTA_LOG_WARN("engine: freeing the KV cache: {}", ok.error().message);
}

}  // namespace siesta
