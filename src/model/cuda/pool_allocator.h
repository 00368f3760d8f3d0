// PoolDeviceAllocator: the CUDA model's device memory from the engine's
// MemoryPool (src/memory) on the CUDA backend, so that sleep can give it back
// and wake can map it again at the same addresses (CUDA graphs and every
// pointer the model keeps stay valid).
//
//   memory::MemoryPool pool(memory::make_cuda_backend({.device = 0}).value());
//   auto alloc = std::make_unique<cuda::PoolDeviceAllocator>(pool);
//   auto model = CudaQwen3::load(dir, std::move(alloc), options);   // the model owns it
//
// Each buffer is one pool allocation: weights (tag `weights`, in 256 MiB
// chunks: offloaded at sleep level 1, released at level 2), the KV cache (tag
// `kv_cache`, one physical allocation, so one exported FD covers it) and
// activations / workspaces / step metadata (tag `scratch`). Addresses are
// aligned to the pool's granularity (2 MiB on current GPUs).
//
// The pool must outlive the allocator, and the allocator every buffer it
// handed out. While the pool sleeps, the buffers keep their addresses but
// must not be touched (the engine does not run the model then).
// Thread safety: the thread that owns the model (as the pool's owner calls).
#pragma once

#include <array>
#include <cstddef>
#include <map>

#include "memory/memory_pool.h"
#include "model/cuda/device_allocator.h"

namespace siesta::cuda {

memory::Tag pool_tag(DeviceMemoryTag tag);

class PoolDeviceAllocator final : public DeviceAllocator {
 public:
  explicit PoolDeviceAllocator(memory::MemoryPool& pool) : pool_(pool) {}
  ~PoolDeviceAllocator() override;  // frees what is still allocated (logged)
  PoolDeviceAllocator(const PoolDeviceAllocator&) = delete;
  PoolDeviceAllocator& operator=(const PoolDeviceAllocator&) = delete;

  Result<void*> allocate(size_t bytes, DeviceMemoryTag tag) override;
  void deallocate(void* ptr) override;
  size_t bytes_in_use(DeviceMemoryTag tag) const override;

  memory::MemoryPool& pool() { return pool_; }

 private:
  struct Live {
    memory::AllocationId id;
    size_t bytes;
    DeviceMemoryTag tag;
  };
  memory::MemoryPool& pool_;
  std::map<void*, Live> live_;
  std::array<size_t, kNumDeviceMemoryTags> in_use_{};
};

}  // namespace siesta::cuda
