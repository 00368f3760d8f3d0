#include "model/cuda/pool_allocator.h"

#include <string>

#include "common/log.h"

namespace siesta::cuda {

memory::Tag pool_tag(DeviceMemoryTag tag) {
  switch (tag) {
    case DeviceMemoryTag::kWeights: return memory::Tag::kWeights;
    case DeviceMemoryTag::kKvCache: return memory::Tag::kKvCache;
    case DeviceMemoryTag::kScratch: return memory::Tag::kScratch;
  }
  return memory::Tag::kScratch;
}

PoolDeviceAllocator::~PoolDeviceAllocator() {
  for (auto& [ptr, live] : live_) {
    SIESTA_LOG_WARN("cuda: {} buffer of {} bytes still allocated when its allocator went; freeing it",
                    device_memory_tag_name(live.tag), live.bytes);
    if (auto ok = pool_.free(live.id); !ok) SIESTA_LOG_ERROR("cuda: {}", ok.error().message);
  }
}

Result<void*> PoolDeviceAllocator::allocate(size_t bytes, DeviceMemoryTag tag) {
  memory::AllocationOptions options;
  options.name = std::string("model ") + device_memory_tag_name(tag);
  // The KV cache is one physical allocation: one exported FD, one registration.
  options.single_allocation = tag == DeviceMemoryTag::kKvCache;
  auto a = pool_.allocate(bytes == 0 ? 1 : bytes, pool_tag(tag), options);
  if (!a) return a.error().with_context(std::string("allocating device memory for ") + device_memory_tag_name(tag));
  live_.emplace(a->base, Live{a->id, bytes, tag});
  in_use_[static_cast<size_t>(tag)] += bytes;
  return a->base;
}

void PoolDeviceAllocator::deallocate(void* ptr) {
  auto it = live_.find(ptr);
  if (it == live_.end()) return;
  if (auto ok = pool_.free(it->second.id); !ok)
    SIESTA_LOG_ERROR("cuda: freeing a {} buffer: {}", device_memory_tag_name(it->second.tag), ok.error().message);
  in_use_[static_cast<size_t>(it->second.tag)] -= it->second.bytes;
  live_.erase(it);
}

size_t PoolDeviceAllocator::bytes_in_use(DeviceMemoryTag tag) const { return in_use_[static_cast<size_t>(tag)]; }

}  // namespace siesta::cuda
