// HostBackend: pool memory in ordinary host RAM, with the same semantics as
// the CUDA backend, so the CPU engine and CI exercise the whole sleep/wake
// lifecycle.
//
//   reserve    mmap(PROT_NONE, MAP_NORESERVE): address space only
//   map        one memfd per allocation (sealed against resizing, so a peer
//              holding the fd cannot truncate it under us); per piece,
//              fallocate (the pages exist: running out of memory is an error
//              here, not a SIGBUS later) and mmap MAP_FIXED|MAP_SHARED|
//              MAP_POPULATE over the reservation (the pages are in the page
//              table, so RSS counts them as a GPU engine's memory counts)
//   release    the range is mapped back to PROT_NONE and the memfd closed:
//              once no exported fd and no peer mapping remain, the kernel
//              frees the pages
//   export     a dup of the memfd: one piece covering the whole allocation
//
// Contents of fresh memory are zero (new memfd pages are zero-filled).
//
// `capacity_bytes` bounds the memory committed through this backend, as a
// device's size bounds a GPU pool; 0 means the host's memory is the bound. It
// makes running out of memory at wake reproducible in tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "memory/backend.h"

namespace siesta::memory {

struct HostBackendOptions {
  uint64_t capacity_bytes = 0;
};

class HostBackend final : public MemoryBackend {
 public:
  explicit HostBackend(HostBackendOptions options = {});

  BackendKind kind() const override { return BackendKind::kHost; }
  std::string description() const override;
  size_t granularity() const override { return page_bytes_; }

  Result<void*> reserve(size_t bytes) override;
  void unreserve(void* base, size_t bytes) override;
  Result<std::unique_ptr<Backing>> map(void* base, size_t bytes, size_t piece_bytes, bool zero_fill,
                                       std::string_view label) override;

  Result<std::unique_ptr<HostBuffer>> allocate_host(size_t bytes) override;
  Ok copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  Ok copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  Ok synchronize() override { return {}; }
  Result<DeviceMemoryInfo> memory_info() override;
  Result<std::unique_ptr<ImportedMapping>> map_import(const std::vector<ExportedPiece>& pieces) override;

  // Bytes committed by Backings that are mapped now.
  uint64_t committed_bytes() const { return committed_->load(); }

 private:
  HostBackendOptions options_;
  size_t page_bytes_;
  // Shared with the Backings, which give their bytes back when released.
  std::shared_ptr<std::atomic<uint64_t>> committed_;
};

Result<std::unique_ptr<MemoryBackend>> make_host_backend(HostBackendOptions options = {});

}  // namespace siesta::memory
