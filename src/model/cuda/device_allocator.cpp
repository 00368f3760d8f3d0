#include "model/cuda/device_allocator.h"

#include <algorithm>
#include <string>

#include "model/cuda/cuda_check.h"

namespace siesta::cuda {

const char* device_memory_tag_name(DeviceMemoryTag tag) {
  switch (tag) {
    case DeviceMemoryTag::kWeights: return "weights";
    case DeviceMemoryTag::kKvCache: return "kv_cache";
    case DeviceMemoryTag::kScratch: return "scratch";
  }
  return "unknown";
}

Result<void*> CudaMallocAllocator::allocate(size_t bytes, DeviceMemoryTag tag) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // cudaMalloc failures are not sticky; clear the last-error slot
    return Status{err == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kInternal,
                  std::string("allocating ") + std::to_string(bytes) + " bytes of device memory for " +
                      device_memory_tag_name(tag) + ": " + cudaGetErrorString(err)};
  }
  in_use_[static_cast<size_t>(tag)] += bytes;
  live_.push_back({ptr, bytes, tag});
  return ptr;
}

void CudaMallocAllocator::deallocate(void* ptr) {
  auto it = std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.ptr == ptr; });
  if (it == live_.end()) return;
  in_use_[static_cast<size_t>(it->tag)] -= it->bytes;
  live_.erase(it);
  // A failure here (context already torn down at exit) leaves nothing to recover.
  (void)cudaFree(ptr);
}

size_t CudaMallocAllocator::bytes_in_use(DeviceMemoryTag tag) const { return in_use_[static_cast<size_t>(tag)]; }

Result<DeviceBuffer> DeviceBuffer::allocate(DeviceAllocator& allocator, size_t bytes, DeviceMemoryTag tag) {
  SIESTA_ASSIGN_OR_RETURN(void* ptr, allocator.allocate(bytes, tag));
  DeviceBuffer b;
  b.allocator_ = &allocator;
  b.ptr_ = ptr;
  b.bytes_ = bytes;
  b.tag_ = tag;
  return b;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    tag_ = other.tag_;
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (allocator_ && ptr_) allocator_->deallocate(ptr_);
  allocator_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace siesta::cuda
