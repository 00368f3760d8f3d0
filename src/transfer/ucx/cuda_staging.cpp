#include "transfer/ucx/cuda_staging.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cstring>

#ifdef SIESTA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace siesta::transfer::ucx {

namespace {

Result<char*> map_anonymous(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED)
    return out_of_memory(fmt::format("{} bytes of host staging memory: {}", bytes, std::strerror(errno)));
  return static_cast<char*>(p);
}

#ifdef SIESTA_HAVE_CUDA

Status cuda_error(const std::string& what, cudaError_t e) {
  return io_error(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

#endif

}  // namespace

#ifdef SIESTA_HAVE_CUDA

bool cuda_staging_usable(std::string* why) {
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e == cudaSuccess && devices > 0) return true;
  if (why != nullptr)
    *why = e != cudaSuccess ? fmt::format("no usable CUDA driver or device: {} ({})", cudaGetErrorName(e),
                                          cudaGetErrorString(e))
                            : "no CUDA device";
  return false;
}

Result<std::unique_ptr<StagingMemory>> StagingMemory::allocate(size_t bytes, bool pinned) {
  std::unique_ptr<StagingMemory> m(new StagingMemory());
  m->bytes_ = bytes;
  if (pinned) {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) return cuda_error(fmt::format("cudaHostAlloc of {} bytes of staging memory", bytes), e);
    m->data_ = static_cast<char*>(p);
    m->pinned_ = true;
    return m;
  }
  SIESTA_ASSIGN_OR_RETURN(m->data_, map_anonymous(bytes));
  return m;
}

StagingMemory::~StagingMemory() {
  if (data_ == nullptr) return;
  if (pinned_) {
    cudaFreeHost(data_);
  } else {
    munmap(data_, bytes_);
  }
}

CopyStreams::~CopyStreams() {
  for (Entry& e : streams_) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(e.stream));
    cudaStreamDestroy(static_cast<cudaStream_t>(e.stream));
  }
}

Result<void*> CopyStreams::get(int device, bool to_device) {
  for (const Entry& e : streams_)
    if (e.device == device && e.to_device == to_device) return e.stream;
  cudaStream_t s = nullptr;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return cuda_error(fmt::format("creating a copy stream on CUDA device {}", device), e);
  streams_.push_back({device, to_device, s});
  return static_cast<void*>(s);
}

AsyncCopy::~AsyncCopy() {
  wait();
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

Ok AsyncCopy::start(void* dst, const void* src, size_t bytes, int device, bool to_device, CopyStreams& streams) {
  if (running_) return internal_error("a staging copy started while the previous one still runs");
  if (device < 0) {
    std::memcpy(dst, src, bytes);
    return {};
  }
  SIESTA_ASSIGN_OR_RETURN(void* s, streams.get(device, to_device));
  auto stream = static_cast<cudaStream_t>(s);
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return cuda_error("cudaSetDevice", e);
  if (event_ != nullptr && event_device_ != device) {
    cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    event_ = nullptr;
  }
  if (event_ == nullptr) {
    cudaEvent_t ev = nullptr;
    e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return cuda_error("cudaEventCreate", e);
    event_ = ev;
    event_device_ = device;
  }
  e = cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream);
  if (e != cudaSuccess) return cuda_error(fmt::format("cudaMemcpyAsync of {} bytes for staging", bytes), e);
  e = cudaEventRecord(static_cast<cudaEvent_t>(event_), stream);
  if (e != cudaSuccess) {
    cudaStreamSynchronize(stream);
    return cuda_error("cudaEventRecord", e);
  }
  running_ = true;
  return {};
}

Result<bool> AsyncCopy::finished() {
  if (!running_) return true;
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaErrorNotReady) return false;
  running_ = false;
  if (e != cudaSuccess) return cuda_error("a staging copy", e);
  return true;
}

void AsyncCopy::wait() {
  if (!running_) return;
  cudaEventSynchronize(static_cast<cudaEvent_t>(event_));
  running_ = false;
}

#else  // !SIESTA_HAVE_CUDA

bool cuda_staging_usable(std::string* why) {
  if (why != nullptr) *why = "this siesta was built without CUDA";
  return false;
}

Result<std::unique_ptr<StagingMemory>> StagingMemory::allocate(size_t bytes, bool pinned) {
  if (pinned)
    return unavailable("this siesta was built without CUDA, so it cannot pin staging memory; rebuild with nvcc on "
                       "the PATH (or /usr/local/cuda)");
  std::unique_ptr<StagingMemory> m(new StagingMemory());
  m->bytes_ = bytes;
  SIESTA_ASSIGN_OR_RETURN(m->data_, map_anonymous(bytes));
  return m;
}

StagingMemory::~StagingMemory() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

CopyStreams::~CopyStreams() = default;
Result<void*> CopyStreams::get(int, bool) {
  return unavailable("this siesta was built without CUDA, so the ucx backend cannot stage CUDA memory");
}

AsyncCopy::~AsyncCopy() = default;

Ok AsyncCopy::start(void* dst, const void* src, size_t bytes, int device, bool, CopyStreams&) {
  if (device >= 0)
    return unavailable("this siesta was built without CUDA, so the ucx backend cannot stage CUDA memory");
  std::memcpy(dst, src, bytes);
  return {};
}

Result<bool> AsyncCopy::finished() { return true; }
void AsyncCopy::wait() {}

#endif

}  // namespace siesta::transfer::ucx
