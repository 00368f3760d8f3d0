// BenchMemory: memory a benchmark (or test) process owns and can share with
// the ipc backend: a populated memfd for host memory, an exportable cuMem
// allocation for CUDA memory. Engines take their memory from the memory pool;
// this is for `siesta bench transfer` only.
//
// Content is deterministic per (seed, length): fill() writes it, hash() reads
// it back, expected_hash() computes what a filled range hashes to without
// touching memory, so two processes can compare ranges without moving them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "transfer/ipc/cuda_import.h"
#include "transfer/region.h"

namespace siesta::transfer {

class BenchMemory {
 public:
  static Result<std::unique_ptr<BenchMemory>> create(MemoryKind kind, size_t bytes, int cuda_device);
  ~BenchMemory();
  BenchMemory(const BenchMemory&) = delete;
  BenchMemory& operator=(const BenchMemory&) = delete;

  char* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  // What register_region takes (with the export FD for ipc).
  RegionSpec spec() const;

  Ok fill(size_t offset, size_t length, uint64_t seed);
  Result<uint64_t> hash(size_t offset, size_t length);
  uint64_t expected_hash(size_t length, uint64_t seed) const;

 private:
  BenchMemory() = default;
  MemoryKind kind_ = MemoryKind::kHost;
  int device_ = 0;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
  ipc::CudaExportable cuda_;
  std::vector<char> staging_;  // CUDA: host side of fills and hashes
};

}  // namespace siesta::transfer
