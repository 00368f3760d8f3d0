#include "engine/engine_kv_cache.h"

#include <string>

namespace siesta {

Result<KvCacheMemory> KvCacheMemory::allocate(const KvCacheLayout& layout, int32_t num_blocks) {
  if (num_blocks < 1) return invalid_argument("the KV cache needs at least one block, got " + std::to_string(num_blocks));
  const uint64_t bytes = static_cast<uint64_t>(num_blocks) * layout.block_bytes();
  void* p = std::calloc(static_cast<size_t>(bytes), 1);
  if (!p)
    return out_of_memory("could not allocate the KV cache: " + std::to_string(bytes) + " bytes (" +
                         std::to_string(num_blocks) + " blocks); lower --kv-cache-memory-bytes");
  return KvCacheMemory(std::unique_ptr<void, Free>(p), layout, num_blocks, bytes);
}

}  // namespace siesta
