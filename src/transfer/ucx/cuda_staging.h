// CUDA pieces of the ucx backend's staging path: pinned host memory, and
// asynchronous copies between CUDA memory and it that the progress thread
// polls. Compiled when the build has CUDA (SIESTA_HAVE_CUDA); without it
// every CUDA call fails with a message that says so. The CUDA runtime is
// linked statically and loads the driver at run time, so binaries still start
// on machines without the NVIDIA driver (as in ipc/cuda_import.h).
//
// Host-to-host copies (staging forced on host memory, how CI tests the path)
// never touch CUDA: they are a memcpy that is finished when it returns.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta::transfer::ucx {

// Whether a CUDA device is usable here; `why` says why not.
bool cuda_staging_usable(std::string* why);

// Page-aligned host memory for staging chunks: pinned (cudaHostAlloc) when
// `pinned`, ordinary anonymous memory otherwise.
class StagingMemory {
 public:
  static Result<std::unique_ptr<StagingMemory>> allocate(size_t bytes, bool pinned);
  ~StagingMemory();
  StagingMemory(const StagingMemory&) = delete;
  StagingMemory& operator=(const StagingMemory&) = delete;

  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }

 private:
  StagingMemory() = default;
  char* data_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

// CUDA streams for staging copies, one per device and direction (copies of
// one direction run in order; the two directions overlap). Made on first use,
// destroyed with the object.
class CopyStreams {
 public:
  CopyStreams() = default;
  ~CopyStreams();
  CopyStreams(const CopyStreams&) = delete;
  CopyStreams& operator=(const CopyStreams&) = delete;

  // The stream (a cudaStream_t) for copies to (`to_device`) or from `device`.
  Result<void*> get(int device, bool to_device);

 private:
  struct Entry {
    int device;
    bool to_device;
    void* stream;
  };
  std::vector<Entry> streams_;
};

// One copy at a time, tracked by an event: start(), then poll finished()
// until it says so. `device` is the CUDA device on one side of the copy, or
// -1 when both sides are host memory (a memcpy, finished on return). Not
// thread safe: one thread (the progress thread) starts and polls; the
// destructor waits for a copy still running.
class AsyncCopy {
 public:
  AsyncCopy() = default;
  ~AsyncCopy();
  AsyncCopy(const AsyncCopy&) = delete;
  AsyncCopy& operator=(const AsyncCopy&) = delete;

  // `to_device`: host -> device, else device -> host (or host -> host).
  Ok start(void* dst, const void* src, size_t bytes, int device, bool to_device, CopyStreams& streams);
  // Ok(true) once the copy finished, Ok(false) while it runs, an error if it failed.
  Result<bool> finished();
  bool running() const { return running_; }
  // Waits for a running copy (shutdown only).
  void wait();

 private:
  void* event_ = nullptr;  // cudaEvent_t, made on first use
  int event_device_ = -1;
  bool running_ = false;
};

}  // namespace siesta::transfer::ucx
