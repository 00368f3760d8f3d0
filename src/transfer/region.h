// Region: a range of memory the engine may move bytes into or out of.
//
// The owner of the memory (the P/D connector for the engine's KV cache, a
// benchmark, or a test; never the memory pool, which knows nothing of
// transfers) registers it with
// TransferEngine::register_region(RegionSpec) and gets a RegionId. The engine
// never allocates or frees region memory; it only maps, registers and copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace siesta::transfer {

enum class MemoryKind : uint8_t {
  kHost = 0,  // ordinary process memory (memfd-backed where ipc must export it)
  kCuda = 1,  // CUDA device memory (cuMem VMM allocation)
};

const char* memory_kind_name(MemoryKind kind);

// Unique within one engine for its whole life: a region registered again
// (after sleep) gets a new id, so a stale descriptor can never name it.
struct RegionId {
  uint64_t value = 0;
  friend auto operator<=>(RegionId, RegionId) = default;
};

// What the owner of some memory hands to register_region.
struct RegionSpec {
  void* base = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  // For the ipc backend: a file descriptor that exports this memory (a memfd
  // for host memory, a cuMem POSIX FD for CUDA memory) and where `base` sits in
  // it. The engine dup()s it at registration and closes its copy at
  // deregistration; the caller keeps ownership of its own descriptor.
  int export_fd = -1;
  uint64_t export_offset = 0;
  // Size of the whole exported allocation. 0: the memfd's size for host memory,
  // export_offset + bytes for CUDA memory (cuMemMap maps whole allocations).
  uint64_t export_bytes = 0;
  // CUDA device that owns the memory (kCuda only).
  int cuda_device = 0;
};

}  // namespace siesta::transfer

template <>
struct std::hash<siesta::transfer::RegionId> {
  size_t operator()(siesta::transfer::RegionId id) const noexcept { return std::hash<uint64_t>{}(id.value); }
};
