// StagingPool: a bounded set of host staging chunks, registered with UCX, for
// moving CUDA memory that UCX cannot register (or any memory when staging is
// forced). Each chunk holds at most one copy in flight (AsyncCopy), so a
// piece of a transfer owns its chunk from the copy through the wire and back.
//
// Lifecycle: create() on the registering thread (allocates and ucp_mem_maps);
// then acquire / copy / poll / release on the progress thread only; destroy
// after the worker's thread stopped (it waits for copies still running).
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
  size_t index = 0;
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
  size_t chunk_count() const { return chunks_.size(); }
  size_t free_count() const { return free_.size(); }
  ucp_mem_h memh() const { return memh_; }

  // A free chunk, or null when every chunk is in use.
  StagingChunk* acquire();
  // Gives a chunk back. One whose copy still runs (its transfer failed) is
  // reused only after poll() saw the copy finish.
  void release(StagingChunk* chunk);
  // Moves released chunks whose copies finished back to the free list; true
  // while some are still draining.
  bool poll();

  // `bytes` from `src` into the chunk (device: the CUDA device of src, -1 for host memory).
  Ok copy_in(StagingChunk* chunk, const void* src, size_t bytes, int device);
  // `bytes` from the chunk to `dst` (device: the CUDA device of dst, -1 for host memory).
  Ok copy_out(StagingChunk* chunk, void* dst, size_t bytes, int device);

 private:
  StagingPool() = default;

  ucp_context_h context_ = nullptr;
  std::unique_ptr<StagingMemory> memory_;
  ucp_mem_h memh_ = nullptr;
  size_t chunk_bytes_ = 0;
  std::vector<std::unique_ptr<StagingChunk>> chunks_;
  std::deque<StagingChunk*> free_;
  std::vector<StagingChunk*> draining_;
  CopyStreams streams_;
};

}  // namespace siesta::transfer::ucx
