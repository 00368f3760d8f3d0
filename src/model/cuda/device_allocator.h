// DeviceAllocator: where the CUDA model gets every byte of device memory.
//
//   CudaMallocAllocator alloc;                                   // cudaMalloc, for now
//   SIESTA_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::allocate(alloc, bytes, DeviceMemoryTag::kWeights));
//   w.data();                                                     // stays valid until w is destroyed
//
// Kernels and CUDA graphs keep raw pointers into these buffers, so an allocator
// must hand out addresses that stay fixed for the buffer's life. The
// sleep-capable memory pool (cuMem VMM: release and re-map physical memory at
// the same virtual addresses) implements this same interface, so it replaces
// CudaMallocAllocator without touching the model or its kernels.
//
// Thread safety: an allocator is used by the thread that owns the model.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/status.h"

namespace siesta::cuda {

// What a buffer holds; the pool sleeps and wakes memory per tag.
enum class DeviceMemoryTag : uint8_t {
  kWeights = 0,  // model parameters
  kKvCache = 1,  // the paged KV cache
  kScratch = 2,  // activations, workspaces, step metadata, graph inputs
};
inline constexpr size_t kNumDeviceMemoryTags = 3;
const char* device_memory_tag_name(DeviceMemoryTag tag);  // "weights", "kv_cache", "scratch"

class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // At least 256-byte aligned; an error (kOutOfMemory) names the tag and size.
  virtual Result<void*> allocate(size_t bytes, DeviceMemoryTag tag) = 0;
  virtual void deallocate(void* ptr) = 0;
  virtual size_t bytes_in_use(DeviceMemoryTag tag) const = 0;
};

// cudaMalloc / cudaFree on the current device, with per-tag accounting.
class CudaMallocAllocator final : public DeviceAllocator {
 public:
  CudaMallocAllocator() = default;
  ~CudaMallocAllocator() override = default;
  CudaMallocAllocator(const CudaMallocAllocator&) = delete;
  CudaMallocAllocator& operator=(const CudaMallocAllocator&) = delete;

  Result<void*> allocate(size_t bytes, DeviceMemoryTag tag) override;
  void deallocate(void* ptr) override;
  size_t bytes_in_use(DeviceMemoryTag tag) const override;

 private:
  struct Live {
    void* ptr;
    size_t bytes;
    DeviceMemoryTag tag;
  };
  std::array<size_t, kNumDeviceMemoryTags> in_use_{};
  // Few, long-lived buffers (tens): a vector is the simplest index.
  std::vector<Live> live_;
};

// One allocation, returned to its allocator on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Result<DeviceBuffer> allocate(DeviceAllocator& allocator, size_t bytes, DeviceMemoryTag tag);
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* data() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  DeviceMemoryTag tag() const { return tag_; }
  void reset();

 private:
  DeviceAllocator* allocator_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  DeviceMemoryTag tag_ = DeviceMemoryTag::kScratch;
};

}  // namespace siesta::cuda
