#include "model/cuda/weight_upload.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "common/thread_pool.h"
#include "memory/staged_copy.h"
#include "model/cuda/cuda_check.h"

namespace siesta::cuda {

// The DMA side of the staged copy through the CUDA runtime: one stream, one
// event per slot.
struct WeightUpload::State final : public memory::StagingDma {
  memory::StagingRing ring;
  std::vector<cudaEvent_t> events;
  cudaStream_t stream = nullptr;
  std::unique_ptr<ThreadPool> threads;

  ~State() override {
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (void* p : ring.slots) cudaFreeHost(p);
  }

  Ok to_slot(size_t slot, const void* device_src, size_t bytes) override {
    SIESTA_CUDA_TRY(cudaMemcpyAsync(ring.slots[slot], device_src, bytes, cudaMemcpyDeviceToHost, stream),
                    "copying to a staging slot");
    return cuda_result(cudaEventRecord(events[slot], stream), "recording a staging event");
  }
  Ok from_slot(size_t slot, void* device_dst, size_t bytes) override {
    SIESTA_CUDA_TRY(cudaMemcpyAsync(device_dst, ring.slots[slot], bytes, cudaMemcpyHostToDevice, stream),
                    "copying weights to the GPU");
    return cuda_result(cudaEventRecord(events[slot], stream), "recording a staging event");
  }
  Ok wait(size_t slot) override {
    return cuda_result(cudaEventSynchronize(events[slot]), "waiting for a weight copy");
  }
};

Result<std::unique_ptr<WeightUpload>> WeightUpload::create(size_t slots, size_t slot_bytes, size_t copy_threads) {
  auto state = std::make_unique<State>();
  state->ring.slot_bytes = std::max<size_t>(slot_bytes, size_t{1} << 20);
  for (size_t i = 0; i < std::max<size_t>(slots, 2); ++i) {
    void* p = nullptr;
    SIESTA_CUDA_TRY(cudaMallocHost(&p, state->ring.slot_bytes), "allocating pinned staging memory for weights");
    state->ring.slots.push_back(p);
    cudaEvent_t e = nullptr;
    SIESTA_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating a CUDA event");
    state->events.push_back(e);
  }
  SIESTA_CUDA_TRY(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking), "creating a CUDA stream");
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  state->threads = std::make_unique<ThreadPool>(copy_threads ? copy_threads : std::min<size_t>(8, cores));
  return std::unique_ptr<WeightUpload>(new WeightUpload(std::move(state)));
}

WeightUpload::WeightUpload(std::unique_ptr<State> state) : state_(std::move(state)) {}
WeightUpload::~WeightUpload() = default;

Result<void> WeightUpload::copy(void* device_dst, const void* host_src, size_t bytes) {
  return memory::staged_copy_from_host(*state_, state_->ring, *state_->threads, device_dst, host_src, bytes);
}

}  // namespace siesta::cuda
