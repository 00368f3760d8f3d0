// StagingPool: a bounded set of host staging chunks, registered with UCX, for
// moving CUDA memory that UCX cannot register (or any memory when staging is
// forced). Each chunk holds at most one copy in flight (AsyncCopy), so a
// piece of a transfer owns its chunk from the copy through the wire and back.
//
// A chunk that a UCX request to a dead peer may still use (UCX without peer
// error handling never completes it) is retired: never reused, and replaced
// by a fresh chunk, up to a bound, so the pool keeps its size.
//
// Lifecycle: create() on the registering thread (allocates and ucp_mem_maps);
// then acquire / copy / poll / release / retire on the progress thread only;
// destroy after the worker's thread stopped (it waits for copies still running).
#pragma once

#include <ucp/api/ucp.h>

#include <deque>
#include <memory>
#include <vector>

#include "common/status.h"
#include "transfer/ucx/cuda_staging.h"

namespace siesta::transfer::ucx {

struct StagingChunk {
  char* data = nullptr;
  ucp_mem_h memh = nullptr;  // of the memory it lies in
  AsyncCopy copy;
};

class StagingPool {
 public:
  // `chunks` chunks of `chunk_bytes`, pinned when `pinned`, mapped in `context`.
  static Result<std::unique_ptr<StagingPool>> create(ucp_context_h context, size_t chunk_bytes, size_t chunks,
                                                     bool pinned);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  size_t chunk_bytes() const { return chunk_bytes_; }
  size_t free_count() const { return free_.size(); }

  // A free chunk, or null when every chunk is in use.
  StagingChunk* acquire();
  // Gives a chunk back. One whose copy still runs (its transfer failed) is
  // reused only after poll() saw the copy finish.
  void release(StagingChunk* chunk);
  // Takes a chunk out of use for good and adds a fresh one in its place
  // (while fewer than the pool's own size were retired, and not after stop_growing()).
  void retire(StagingChunk* chunk);
  // At shutdown: retire() adds no chunk any more.
  void stop_growing() { growing_ = false; }
  // Moves released chunks whose copies finished back to the free list; true
  // while some are still draining.
  bool poll();

  // `bytes` from `src` into the chunk (device: the CUDA device of src, -1 for host memory).
  Ok copy_in(StagingChunk* chunk, const void* src, size_t bytes, int device);
  // `bytes` from the chunk to `dst` (device: the CUDA device of dst, -1 for host memory).
  Ok copy_out(StagingChunk* chunk, void* dst, size_t bytes, int device);

 private:
  struct Slab {
    std::unique_ptr<StagingMemory> memory;
    ucp_mem_h memh = nullptr;
  };
  StagingPool() = default;
  Ok add_slab(size_t chunks);

  ucp_context_h context_ = nullptr;
  size_t chunk_bytes_ = 0;
  size_t size_ = 0;
  bool pinned_ = false;
  size_t retired_ = 0;
  bool growing_ = true;
  std::vector<Slab> slabs_;
  std::vector<std::unique_ptr<StagingChunk>> chunks_;
  std::deque<StagingChunk*> free_;
  std::vector<StagingChunk*> draining_;
  CopyStreams streams_;
};

}  // namespace siesta::transfer::ucx
