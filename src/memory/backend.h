// MemoryBackend: where a MemoryPool's memory physically comes from. Two
// implementations with the same semantics: HostBackend (memfd pages, for the
// CPU engine and CI) and the CUDA backend (cuMem virtual memory management).
//
// Lifecycle of one pool allocation, as the pool drives it:
//   reserve(bytes)                  virtual addresses only, kept for the pool's life
//   map(base, bytes, piece_bytes)   -> Backing: physical memory created, mapped
//                                   read/write over the reservation, zero-filled
//   Backing::export_pieces()        new FDs a peer can map (see ExportedPiece)
//   Backing::release()              unmapped (the range stays reserved and
//                                   inaccessible), this process's handles dropped
//   map(...) again                  new physical memory at the same addresses
//   unreserve(base, bytes)          when the allocation is freed
//
// The physical memory is returned to the OS / driver only when no mapping and
// no handle refer to it any more: an exported FD that is still open (here, in
// the transfer engine, or in a peer that mapped it) keeps it alive.
//
// Thread safety: a backend and its Backings are used by one thread at a time
// (the pool's owner); the CUDA backend makes its context current on every call,
// so that thread may change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace siesta::memory {

enum class BackendKind : uint8_t {
  kHost = 0,  // memfd pages
  kCuda = 1,  // cuMem allocations on one device
};

const char* backend_kind_name(BackendKind kind);

// One physical piece of an allocation, as a peer maps it: `fd` exports the
// whole piece (a memfd, or a cuMem POSIX file descriptor), to be mapped from fd
// offset 0 for `bytes` at `offset` from the allocation's base.
struct ExportedPiece {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Physical memory mapped over a reserved range. Destroying a Backing that was
// not released releases it (errors are logged).
class Backing {
 public:
  virtual ~Backing() = default;

  // Unmaps the range (it stays reserved, any access faults) and drops this
  // process's handles to the memory. Safe to call twice.
  virtual Ok release() = 0;

  // New file descriptors, one per physical piece, that export this memory.
  // The caller owns them and must close them.
  virtual Result<std::vector<ExportedPiece>> export_pieces() = 0;

  // Number of physical allocations behind the range.
  virtual size_t piece_count() const = 0;
};

// Host memory that offloaded contents are copied into (pinned on CUDA, so the
// copies run at full bus speed). Freed when destroyed.
class HostBuffer {
 public:
  virtual ~HostBuffer() = default;
  virtual void* data() = 0;
  virtual size_t bytes() const = 0;
  // Bytes from data() on that copies reach by direct DMA (pinned); any thread.
  virtual size_t pinned_bytes() const { return 0; }
};

// Exported pieces mapped at a new address in this process, as a peer maps
// them. Unmapped when destroyed.
class ImportedMapping {
 public:
  virtual ~ImportedMapping() = default;
  virtual void* base() const = 0;
  virtual size_t bytes() const = 0;
};

// Free and total memory where the backend allocates: the device (CUDA,
// cuMemGetInfo) or the host (the backend's capacity if it has one, otherwise
// MemAvailable / MemTotal).
struct DeviceMemoryInfo {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
};

class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;

  virtual BackendKind kind() const = 0;
  // One line for logs and reports: "host (memfd)", "cuda device 0 (NVIDIA H200, ...)".
  virtual std::string description() const = 0;
  // Sizes, chunk sizes and addresses are multiples of this (host: the page
  // size; CUDA: cuMemGetAllocationGranularity, 2 MiB on current GPUs).
  virtual size_t granularity() const = 0;

  // Reserves `bytes` (a multiple of granularity()) of virtual address space
  // with no memory behind it.
  virtual Result<void*> reserve(size_t bytes) = 0;
  virtual void unreserve(void* base, size_t bytes) = 0;

  // Creates physical memory for [base, base + bytes) in pieces of piece_bytes
  // (the last piece may be shorter; all are multiples of granularity()), maps
  // it read/write and commits it (host: pages allocated and in the page table,
  // so RSS shows them). With zero_fill the contents are zero; otherwise they
  // are unspecified (the caller overwrites them). All or nothing: on error
  // nothing stays mapped. `label` names the memory for the OS (host memfd name).
  virtual Result<std::unique_ptr<Backing>> map(void* base, size_t bytes, size_t piece_bytes,
                                               bool zero_fill, std::string_view label) = 0;

  // Host memory for offloaded contents.
  virtual Result<std::unique_ptr<HostBuffer>> allocate_host(size_t bytes) = 0;
  // The pool keeps `buffer` (from allocate_host, holding an offload it just
  // copied) for the offloads to come (PoolOptions::keep_offload_buffers). The
  // backend may make later copies to and from it faster: the CUDA backend
  // pins it in the background, piece by piece, each piece then copied by
  // direct DMA. Default: nothing. The buffer stays valid meanwhile.
  virtual void retain_host(HostBuffer& /*buffer*/) {}
  // Copies between backend memory (a mapped range) and host memory. Both
  // complete before they return.
  virtual Ok copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual Ok copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;

  // Waits until no queued work (kernels, copies) touches backend memory, so
  // that it can be copied out and unmapped. Host: nothing to wait for.
  virtual Ok synchronize() = 0;

  virtual Result<DeviceMemoryInfo> memory_info() = 0;

  // Maps exported pieces (see ExportedPiece) contiguously at a new address, as
  // a peer does. The fds stay the caller's: they are not closed or kept.
  virtual Result<std::unique_ptr<ImportedMapping>> map_import(const std::vector<ExportedPiece>& pieces) = 0;
};

}  // namespace siesta::memory
