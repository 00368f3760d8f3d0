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
      bytes_(other.bytes_) {}

KvCacheMemory::~KvCacheMemory() {
  if (!pool_) return;
  if (auto ok = pool_->free(allocation_.id); !ok)
    SIESTA_LOG_WARN("engine: freeing the KV cache: {}", ok.error().message);
}

}  // namespace siesta
