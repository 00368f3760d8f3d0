#include "model/cuda/weight_upload.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/thread_pool.h"
#include "gather/gather_copy.h"
#include "memory/staged_copy.h"
#include "model/cuda/cuda_check.h"

namespace siesta::cuda {

namespace {

// What copy_files' threads own: two pinned slots (and their device
// mappings), a stream, an event per slot.
struct FileReader {
  void* slots[2] = {nullptr, nullptr};
  const char* mapped[2] = {nullptr, nullptr};
  cudaEvent_t done[2] = {nullptr, nullptr};
  cudaStream_t stream = nullptr;
  size_t uses = 0;
};

// One pread into a slot and where its bytes go.
struct FileRead {
  int fd = -1;
  size_t file = 0;  // index into the opened files, for messages
  uint64_t offset = 0;
  size_t bytes = 0;
  struct Scatter {
    size_t at;  // bytes into the slot
    void* dst;
    size_t bytes;
  };
  std::vector<Scatter> scatter;
};

// Reads can merge pieces whose gap in the file is at most this (read and dropped).
constexpr uint64_t kMergeGap = 64 << 10;

// The device address of pinned host memory from cudaMallocHost.
Result<const char*> device_mapping(void* host) {
  void* mapped = nullptr;
  SIESTA_CUDA_TRY(cudaHostGetDevicePointer(&mapped, host, 0), "mapping a pinned slot for the device");
  return static_cast<const char*>(mapped);
}

}  // namespace

// The device side of the staged copy through the CUDA runtime: one stream,
// one event per slot; and the readers of copy_files.
struct WeightUpload::State final : public memory::StagingDma {
  memory::StagingRing ring;
  std::vector<const char*> ring_mapped;  // each ring slot's device mapping
  std::vector<cudaEvent_t> events;
  cudaStream_t stream = nullptr;
  std::unique_ptr<ThreadPool> threads;
  int device = 0;
  // Copies out of the slots by the gather kernel, over this many CTAs at most
  // (the device's full grid); false: cudaMemcpyAsync.
  bool kernel = false;
  int gather_grid = 0;
  size_t file_slot_bytes = size_t{8} << 20;
  std::unique_ptr<ThreadPool> file_threads;
  std::vector<FileReader> readers;

  ~State() override {
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (void* p : ring.slots) cudaFreeHost(p);
    for (FileReader& r : readers) {
      if (r.stream) {
        cudaStreamSynchronize(r.stream);
        cudaStreamDestroy(r.stream);
      }
      for (int s = 0; s < 2; ++s) {
        if (r.done[s]) cudaEventDestroy(r.done[s]);
        if (r.slots[s]) cudaFreeHost(r.slots[s]);
      }
    }
  }

  Result<void> make_readers() {
    if (!readers.empty()) return {};
    const size_t cores = std::max(1u, std::thread::hardware_concurrency());
    const size_t n = std::min<size_t>(12, cores);
    file_threads = std::make_unique<ThreadPool>(n);
    readers.resize(n);
    for (FileReader& r : readers) {
      for (int s = 0; s < 2; ++s) {
        SIESTA_CUDA_TRY(cudaMallocHost(&r.slots[s], file_slot_bytes), "allocating pinned memory for checkpoint reads");
        if (kernel) {
          SIESTA_ASSIGN_OR_RETURN(r.mapped[s], device_mapping(r.slots[s]));
        }
        SIESTA_CUDA_TRY(cudaEventCreateWithFlags(&r.done[s], cudaEventDisableTiming), "creating a CUDA event");
      }
      SIESTA_CUDA_TRY(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "creating a CUDA stream");
    }
    return {};
  }

  Ok to_slot(size_t slot, const void* device_src, size_t bytes) override {
    SIESTA_CUDA_TRY(cudaMemcpyAsync(ring.slots[slot], device_src, bytes, cudaMemcpyDeviceToHost, stream),
                    "copying to a staging slot");
    return cuda_result(cudaEventRecord(events[slot], stream), "recording a staging event");
  }
  Ok from_slot(size_t slot, void* device_dst, size_t bytes) override {
    if (kernel) {
      const gather::GatherPiece piece{ring_mapped[slot], static_cast<char*>(device_dst), bytes, 0};
      SIESTA_TRY(copy_by_kernel(&piece, 1, stream, "copying weights to the GPU"));
    } else {
      SIESTA_CUDA_TRY(cudaMemcpyAsync(device_dst, ring.slots[slot], bytes, cudaMemcpyHostToDevice, stream),
                      "copying weights to the GPU");
    }
    return cuda_result(cudaEventRecord(events[slot], stream), "recording a staging event");
  }

  // The gather kernel over `count` pieces (sources in the slots' device
  // mappings) on `s`; any thread (gather_grid is set before the first copy).
  Result<void> copy_by_kernel(const gather::GatherPiece* pieces, size_t count, cudaStream_t s, const char* what) const {
    const cudaError_t e = gather::launch_gather_copy_pieces(pieces, count, gather_grid, s);
    if (e != cudaSuccess) (void)cudaGetLastError();  // not left for a later check on this thread
    return cuda_result(e, what);
  }
  Ok wait(size_t slot) override {
    return cuda_result(cudaEventSynchronize(events[slot]), "waiting for a weight copy");
  }
};

Result<std::unique_ptr<WeightUpload>> WeightUpload::create(size_t slots, size_t slot_bytes, size_t copy_threads,
                                                           int device, size_t file_slot_bytes,
                                                           std::optional<memory::HostToDeviceCopy> host_to_device) {
  auto state = std::make_unique<State>();
  state->device = device;
  state->file_slot_bytes = std::max<size_t>(file_slot_bytes, size_t{1} << 20);
  SIESTA_CUDA_TRY(cudaSetDevice(device), "selecting the CUDA device for weight copies");
  if (memory::resolve_host_to_device_copy(host_to_device) == memory::HostToDeviceCopy::kKernel) {
    const cudaError_t e = gather::gather_copy_full_grid(&state->gather_grid);
    if (gather::gather_kernel_missing(e)) {
      (void)cudaGetLastError();
      SIESTA_LOG_WARN("weights: the gather kernel has no code for CUDA device {} ({}); checkpoint copies use "
                      "cudaMemcpyAsync (rebuild with this GPU in CMAKE_CUDA_ARCHITECTURES)",
                      device, cudaGetErrorString(e));
    } else {
      SIESTA_CUDA_TRY(e, "sizing the gather kernel's grid for weight copies");
      state->kernel = true;
    }
  }
  state->ring.slot_bytes = std::max<size_t>(slot_bytes, size_t{1} << 20);
  for (size_t i = 0; i < std::max<size_t>(slots, 2); ++i) {
    void* p = nullptr;
    SIESTA_CUDA_TRY(cudaMallocHost(&p, state->ring.slot_bytes), "allocating pinned staging memory for weights");
    state->ring.slots.push_back(p);
    if (state->kernel) {
      SIESTA_ASSIGN_OR_RETURN(const char* mapped, device_mapping(p));
      state->ring_mapped.push_back(mapped);
    }
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

memory::HostToDeviceCopy WeightUpload::host_to_device() const {
  return state_->kernel ? memory::HostToDeviceCopy::kKernel : memory::HostToDeviceCopy::kCopyEngine;
}

}  // namespace siesta::cuda

namespace siesta::cuda {

Result<void> WeightUpload::copy_files(std::span<const FilePiece> pieces) {
  if (pieces.empty()) return {};
  State& st = *state_;
  SIESTA_TRY(st.make_readers());
  // Open each file once; sort the pieces by file and offset.
  std::map<std::string, size_t> file_index;
  std::vector<std::string> names;
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
  };
  std::vector<const FilePiece*> sorted;
  for (const FilePiece& p : pieces) {
    if (p.bytes == 0) continue;
    if (!file_index.count(p.path)) {
      const int fd = ::open(p.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        const std::string why = std::strerror(errno);
        close_all();
        return io_error(p.path + ": cannot open for reading: " + why);
      }
      (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      file_index.emplace(p.path, fds.size());
      names.push_back(p.path);
      fds.push_back(fd);
    }
    sorted.push_back(&p);
  }
  std::sort(sorted.begin(), sorted.end(), [&](const FilePiece* a, const FilePiece* b) {
    const size_t fa = file_index.at(a->path), fb = file_index.at(b->path);
    return fa != fb ? fa < fb : a->offset < b->offset;
  });
  // Reads of at most one slot: consecutive pieces of a file (gaps up to
  // kMergeGap read along), a piece larger than a slot split over several.
  const size_t slot = st.file_slot_bytes;
  std::vector<FileRead> reads;
  for (const FilePiece* p : sorted) {
    const size_t f = file_index.at(p->path);
    uint64_t off = p->offset;
    size_t left = p->bytes;
    auto* dst = static_cast<std::byte*>(p->device_dst);
    while (left > 0) {
      FileRead* r = reads.empty() ? nullptr : &reads.back();
      const bool joins = r && r->file == f && off >= r->offset + r->bytes && off - (r->offset + r->bytes) <= kMergeGap &&
                         off + 1 - r->offset <= slot;
      if (!joins) {
        reads.push_back(FileRead{fds[f], f, off, 0, {}});
        r = &reads.back();
      }
      const size_t at = static_cast<size_t>(off - r->offset);
      const size_t n = std::min(left, slot - at);
      r->scatter.push_back({at, dst, n});
      r->bytes = at + n;
      off += n;
      dst += n;
      left -= n;
    }
  }
  // Each thread takes the next read into its next slot.
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::optional<Status> error;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(error_mu);
    if (!error) error = std::move(s);
    failed.store(true);
  };
  st.file_threads->parallel_for(st.readers.size(), [&](size_t begin, size_t end) {
    std::vector<gather::GatherPiece> gathered;
    for (size_t w = begin; w < end; ++w) {
      FileReader& rd = st.readers[w];
      if (auto ok = cuda_result(cudaSetDevice(st.device), "selecting the CUDA device for weight copies"); !ok) {
        fail(ok.error());
        return;
      }
      for (;;) {
        if (failed.load()) break;
        const size_t i = next.fetch_add(1);
        if (i >= reads.size()) break;
        const FileRead& r = reads[i];
        const size_t s = rd.uses++ % 2;
        if (auto ok = cuda_result(cudaEventSynchronize(rd.done[s]), "waiting for a checkpoint copy"); !ok) {
          fail(ok.error());
          break;
        }
        auto* buf = static_cast<std::byte*>(rd.slots[s]);
        size_t got = 0;
        while (got < r.bytes) {
          const ssize_t n = ::pread(r.fd, buf + got, r.bytes - got, static_cast<off_t>(r.offset + got));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) {
            fail(io_error(names[r.file] + ": reading " + std::to_string(r.bytes) + " bytes at offset " +
                          std::to_string(r.offset + got) + ": " +
                          (n == 0 ? std::string("the file ends there (truncated?)") : std::strerror(errno))));
            break;
          }
          got += static_cast<size_t>(n);
        }
        if (got < r.bytes) break;
        bool issued = true;
        if (st.kernel) {
          // The read's destinations in one launch (one per kGatherFewPieces of them).
          gathered.clear();
          for (const FileRead::Scatter& sc : r.scatter)
            gathered.push_back({rd.mapped[s] + sc.at, static_cast<char*>(sc.dst), sc.bytes, 0});
          auto ok = st.copy_by_kernel(gathered.data(), gathered.size(), rd.stream, "copying checkpoint bytes to the GPU");
          if (!ok) {
            fail(ok.error());
            issued = false;
          }
        } else {
          for (const FileRead::Scatter& sc : r.scatter)
            if (auto ok = cuda_result(cudaMemcpyAsync(sc.dst, buf + sc.at, sc.bytes, cudaMemcpyHostToDevice, rd.stream),
                                      "copying checkpoint bytes to the GPU");
                !ok) {
              fail(ok.error());
              issued = false;
              break;
            }
        }
        if (!issued) break;
        if (auto ok = cuda_result(cudaEventRecord(rd.done[s], rd.stream), "recording a checkpoint copy"); !ok) {
          fail(ok.error());
          break;
        }
      }
      // Nothing of this call stays in flight, whatever happened.
      if (auto ok = cuda_result(cudaStreamSynchronize(rd.stream), "finishing checkpoint copies"); !ok) fail(ok.error());
    }
  });
  close_all();
  if (error) return *error;
  return {};
}

}  // namespace siesta::cuda
