#include "memory/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/log.h"
#include "common/thread_pool.h"
#include "gather/gather_copy.h"
#include "memory/cuda_driver.h"
#include "memory/staged_copy.h"
#include "memory/tag.h"

namespace siesta::memory {
namespace {

CUdeviceptr device_ptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p)); }

// The device and its primary context, shared by the backend and everything it
// hands out (Backings, pinned buffers, imports), which may outlive it.
struct CudaDevice {
  std::unique_ptr<CudaDriver> driver;
  CUdevice device = 0;
  int ordinal = 0;
  CUcontext context = nullptr;

  ~CudaDevice() {
    if (context != nullptr) driver->cuDevicePrimaryCtxRelease(device);
  }

  // Driver calls that touch memory need the context current on this thread.
  Ok make_current() const { return driver->check(driver->cuCtxSetCurrent(context), "cuCtxSetCurrent"); }
  Ok check(CUresult r, std::string_view what) const { return driver->check(r, what); }

  Result<DeviceMemoryInfo> memory_info() const {
    SIESTA_TRY(make_current());
    size_t free_bytes = 0, total_bytes = 0;
    SIESTA_TRY(check(driver->cuMemGetInfo(&free_bytes, &total_bytes), "cuMemGetInfo"));
    return DeviceMemoryInfo{free_bytes, total_bytes};
  }
};

struct Piece {
  CUmemGenericAllocationHandle handle = 0;
  size_t offset = 0;
  size_t bytes = 0;
};

// Unmaps [base, base + mapped_bytes) and releases the handles. The mapped
// range covers whole pieces; one cuMemUnmap over several mappings is allowed,
// per piece is the fallback.
Ok unmap_and_release(const CudaDevice& dev, CUdeviceptr base, size_t& mapped_bytes, std::vector<Piece>& pieces) {
  SIESTA_TRY(dev.make_current());
  if (mapped_bytes != 0) {
    if (dev.driver->cuMemUnmap(base, mapped_bytes) != CUDA_SUCCESS) {
      for (const Piece& p : pieces) {
        if (p.offset + p.bytes > mapped_bytes) break;
        SIESTA_TRY(dev.check(dev.driver->cuMemUnmap(base + p.offset, p.bytes),
                             fmt::format("cuMemUnmap of {} at offset {}", format_bytes(p.bytes), p.offset)));
      }
    }
    mapped_bytes = 0;
  }
  while (!pieces.empty()) {
    SIESTA_TRY(dev.check(dev.driver->cuMemRelease(pieces.back().handle), "cuMemRelease"));
    pieces.pop_back();
  }
  return {};
}

class CudaBacking final : public Backing {
 public:
  CudaBacking(std::shared_ptr<const CudaDevice> dev, CUdeviceptr base, bool exportable)
      : dev_(std::move(dev)), base_(base), exportable_(exportable) {}

  ~CudaBacking() override {
    Ok ok = release();
    if (!ok) SIESTA_LOG_ERROR("CUDA memory at {:#x}: {}", base_, ok.error().message);
  }

  Ok release() override { return unmap_and_release(*dev_, base_, mapped_bytes_, pieces_); }

  Result<std::vector<ExportedPiece>> export_pieces() override {
    if (!exportable_) {
      return unavailable(fmt::format(
          "cuMem export is not supported on CUDA device {} (no POSIX file descriptor handle type), so the ipc KV "
          "transfer backend cannot share this memory; use --kv-transfer-config '{{\"backend\":\"ucx\"}}' or disable "
          "sleep mode",
          dev_->ordinal));
    }
    SIESTA_TRY(dev_->make_current());
    std::vector<ExportedPiece> out;
    for (const Piece& p : pieces_) {
      int fd = -1;
      CUresult r = dev_->driver->cuMemExportToShareableHandle(&fd, p.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) {
        for (const ExportedPiece& done : out) close(done.fd);
        return dev_->check(r, "cuMemExportToShareableHandle").error();
      }
      out.push_back(ExportedPiece{fd, p.offset, p.bytes});
    }
    return out;
  }

  size_t piece_count() const override { return pieces_.size(); }

  // Called by map while it builds the range: pieces are created and mapped in
  // address order, so the mapped part is always a prefix.
  void add_piece(const Piece& piece) { pieces_.push_back(piece); }
  void add_mapped(size_t bytes) { mapped_bytes_ += bytes; }

 private:
  std::shared_ptr<const CudaDevice> dev_;
  CUdeviceptr base_;
  bool exportable_;
  std::vector<Piece> pieces_;
  size_t mapped_bytes_ = 0;
};

// Host->device copies by the SMs (HostToDeviceCopy::kKernel): the gather
// kernel (gather/gather_copy.h) reading pinned host memory through its device
// mapping. Launched through the CUDA runtime, which takes the context current
// on the calling thread: the backend's primary context (make_current). Where
// the build has no code for the device, nothing is launched and the caller
// copies with the copy engines (logged once).
class KernelCopy {
 public:
  explicit KernelCopy(int ordinal) : ordinal_(ordinal) {}

  // Enqueues the copy of `pieces` (sources: device addresses of pinned host
  // memory) on `stream`. True when launched; false when the kernel cannot run
  // on this device, nothing enqueued (and false from then on).
  Result<bool> enqueue(std::span<const gather::GatherPiece> pieces, CUstream stream) {
    if (missing_) return false;
    if (grid_ == 0) {
      const cudaError_t e = gather::gather_copy_full_grid(&grid_);
      if (e != cudaSuccess) {
        grid_ = 0;
        return failed(e, "sizing the gather kernel's grid");
      }
    }
    const cudaError_t e =
        gather::launch_gather_copy_pieces(pieces.data(), pieces.size(), grid_, reinterpret_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return failed(e, fmt::format("launching the gather kernel over {} piece(s)", pieces.size()));
    return true;
  }

 private:
  Result<bool> failed(cudaError_t e, const std::string& what) {
    (void)cudaGetLastError();  // the runtime's last error is the thread's: leave it clear for the model's checks
    if (!gather::gather_kernel_missing(e)) {
      return io_error(fmt::format("{} on CUDA device {}: {} ({})", what, ordinal_, cudaGetErrorName(e),
                                  cudaGetErrorString(e)));
    }
    missing_ = true;
    SIESTA_LOG_WARN("memory: the gather kernel has no code for CUDA device {} ({}); host->device copies use the copy "
                    "engines (rebuild with this GPU in CMAKE_CUDA_ARCHITECTURES)",
                    ordinal_, cudaGetErrorString(e));
    return false;
  }

  int ordinal_;
  int grid_ = 0;
  bool missing_ = false;
};

class PinnedBuffer final : public HostBuffer {
 public:
  PinnedBuffer(std::shared_ptr<const CudaDevice> dev, void* data, size_t bytes)
      : dev_(std::move(dev)), data_(data), bytes_(bytes) {}
  ~PinnedBuffer() override {
    if (dev_->make_current()) dev_->driver->cuMemFreeHost(data_);
  }
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  std::shared_ptr<const CudaDevice> dev_;
  void* data_;
  size_t bytes_;
};

// Ordinary host memory for staged offloads: anonymous pages, first touched by
// the copy threads (in parallel), with transparent huge pages asked for so
// that faulting in and freeing tens of GiB stays cheap.
//
// A buffer the pool keeps (retain_host) is pinned by a thread of its own,
// kPinPiece bytes at a time from its start (cuMemHostRegister of pages that
// are touched already, mapped for the device: CU_MEMHOSTREGISTER_DEVICEMAP),
// while the engine runs or sleeps; copies reach the pinned prefix directly
// (device->host by DMA, one piece per copy; host->device by the gather kernel
// reading the pieces' device mappings, or by DMA) and stage the rest. The
// pinning stops between pieces when the buffer goes.
class PageableBuffer;

// The buffers a backend pins (retain_host), for copies to look up; a buffer
// leaves when it is destroyed. Shared, since buffers may outlive the backend.
struct KeptBuffers {
  std::mutex mu;
  std::set<PageableBuffer*> live;
};

class PageableBuffer final : public HostBuffer {
 public:
  static constexpr size_t kPinPiece = size_t{256} << 20;

  PageableBuffer(std::shared_ptr<const CudaDevice> dev, void* data, size_t bytes)
      : dev_(std::move(dev)), data_(data), bytes_(bytes) {}
  ~PageableBuffer() override {
    if (registry_) {
      std::lock_guard<std::mutex> lock(registry_->mu);
      registry_->live.erase(this);
    }
    stop_.store(true);
    if (pinner_.joinable()) pinner_.join();
    const size_t pinned = pinned_.load();
    if (pinned > 0 && dev_->make_current())
      for (size_t off = 0; off < pinned; off += kPinPiece) dev_->driver->cuMemHostUnregister(static_cast<std::byte*>(data_) + off);
    munmap(data_, bytes_);
  }
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }
  size_t pinned_bytes() const override { return pinned_.load(); }

  void start_pinning(std::shared_ptr<KeptBuffers> registry) {
    if (pinner_.joinable()) return;
    registry_ = registry;
    {
      std::lock_guard<std::mutex> lock(registry_->mu);
      registry_->live.insert(this);
    }
    pinner_ = std::thread([this] {
      if (!dev_->make_current()) return;
      for (size_t off = 0; off < bytes_ && !stop_.load(); off += kPinPiece) {
        const size_t len = std::min(kPinPiece, bytes_ - off);
        const CUresult r =
            dev_->driver->cuMemHostRegister(static_cast<std::byte*>(data_) + off, len, CU_MEMHOSTREGISTER_DEVICEMAP);
        if (r != CUDA_SUCCESS) {
          SIESTA_LOG_WARN("memory: pinning a kept offload buffer stopped at {} of {} ({}); the rest is staged",
                          format_bytes(off), format_bytes(bytes_), dev_->driver->error_text(r));
          return;
        }
        pinned_.store(off + len);
      }
      SIESTA_LOG_DEBUG("memory: kept offload buffer of {} pinned", format_bytes(pinned_.load()));
    });
  }

 private:
  std::shared_ptr<const CudaDevice> dev_;
  void* data_;
  size_t bytes_;
  std::atomic<size_t> pinned_{0};
  std::atomic<bool> stop_{false};
  std::shared_ptr<KeptBuffers> registry_;
  std::thread pinner_;
};

// The staging ring of OffloadMode::kStaged: pinned slots (mapped for the
// device), one stream for the copies, one event per slot, and the host
// threads. Made at the first staged copy, kept for the backend's life.
// Host->device copies (from the slots, and from a kept buffer's pinned part)
// go through `kernel` where it is given (HostToDeviceCopy::kKernel), by DMA
// otherwise.
class StagingResources final : public StagingDma {
 public:
  static Result<std::unique_ptr<StagingResources>> create(std::shared_ptr<const CudaDevice> dev,
                                                          const CudaBackendOptions& options, KernelCopy* kernel) {
    auto r = std::unique_ptr<StagingResources>(new StagingResources(std::move(dev), kernel));
    const CudaDevice& d = *r->dev_;
    SIESTA_TRY(d.make_current());
    const size_t slots = std::max<size_t>(2, options.staging_slots);
    const size_t slot_bytes = std::max<size_t>(size_t{1} << 20, options.staging_slot_bytes);
    r->ring_.slot_bytes = slot_bytes;
    for (size_t i = 0; i < slots; ++i) {
      void* p = nullptr;
      SIESTA_TRY(d.check(d.driver->cuMemHostAlloc(&p, slot_bytes, CU_MEMHOSTALLOC_DEVICEMAP),
                         fmt::format("cuMemHostAlloc of a {} pinned staging slot", format_bytes(slot_bytes))));
      r->ring_.slots.push_back(p);
      CUdeviceptr mapped = 0;
      SIESTA_TRY(d.check(d.driver->cuMemHostGetDevicePointer(&mapped, p, 0),
                         "cuMemHostGetDevicePointer of a pinned staging slot"));
      r->slot_mapped_.push_back(mapped);
      CUevent e = nullptr;
      SIESTA_TRY(d.check(d.driver->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate"));
      r->events_.push_back(e);
    }
    SIESTA_TRY(d.check(d.driver->cuStreamCreate(&r->stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
    const size_t cores = std::max(1u, std::thread::hardware_concurrency());
    r->threads_ = std::make_unique<ThreadPool>(options.copy_threads ? options.copy_threads : std::min<size_t>(8, cores));
    return r;
  }

  ~StagingResources() override {
    if (!dev_->make_current()) return;
    const CudaDriver& d = *dev_->driver;
    if (stream_ != nullptr) {
      // Nothing is in flight between calls; synchronising is only a safeguard.
      for (CUevent e : events_) d.cuEventSynchronize(e);
      d.cuStreamDestroy(stream_);
    }
    for (CUevent e : events_) d.cuEventDestroy(e);
    for (void* p : ring_.slots) d.cuMemFreeHost(p);
  }

  Ok to_slot(size_t slot, const void* device_src, size_t bytes) override {
    const CudaDriver& d = *dev_->driver;
    SIESTA_TRY(dev_->check(d.cuMemcpyDtoHAsync(ring_.slots[slot], device_ptr(device_src), bytes, stream_),
                           fmt::format("cuMemcpyDtoHAsync of {} into a staging slot", format_bytes(bytes))));
    return dev_->check(d.cuEventRecord(events_[slot], stream_), "cuEventRecord");
  }
  Ok from_slot(size_t slot, void* device_dst, size_t bytes) override {
    const CudaDriver& d = *dev_->driver;
    bool launched = false;
    if (kernel_ != nullptr) {
      const gather::GatherPiece piece{reinterpret_cast<const char*>(slot_mapped_[slot]), static_cast<char*>(device_dst),
                                      bytes, 0};
      SIESTA_ASSIGN_OR_RETURN(launched, kernel_->enqueue({&piece, 1}, stream_));
    }
    if (!launched)
      SIESTA_TRY(dev_->check(d.cuMemcpyHtoDAsync(device_ptr(device_dst), ring_.slots[slot], bytes, stream_),
                             fmt::format("cuMemcpyHtoDAsync of {} from a staging slot", format_bytes(bytes))));
    return dev_->check(d.cuEventRecord(events_[slot], stream_), "cuEventRecord");
  }
  Ok wait(size_t slot) override {
    return dev_->check(dev_->driver->cuEventSynchronize(events_[slot]), "cuEventSynchronize on a staging slot");
  }

  // Direct copies between device memory and pinned host memory, in pieces
  // that never cross `piece` boundaries counted from `pinned_base` (each
  // piece is a registration of its own, with its own device mapping); return
  // when done. Device->host by DMA; host->device by one launch of the kernel
  // over every piece where there is one, by DMA otherwise.
  Ok direct_to_host(void* host_dst, const void* device_src, size_t bytes, const void* pinned_base, size_t piece) {
    return direct(host_dst, device_src, bytes, pinned_base, piece, true);
  }
  Ok direct_from_host(void* device_dst, const void* host_src, size_t bytes, const void* pinned_base, size_t piece) {
    if (kernel_ != nullptr) {
      SIESTA_ASSIGN_OR_RETURN(bool launched, kernel_from_host(device_dst, host_src, bytes, pinned_base, piece));
      if (launched) return {};
    }
    return direct(const_cast<void*>(host_src), device_dst, bytes, pinned_base, piece, false);
  }

  const StagingRing& ring() const { return ring_; }
  ThreadPool& threads() { return *threads_; }
  size_t pinned_bytes() const { return ring_.slots.size() * ring_.slot_bytes; }

 private:
  StagingResources(std::shared_ptr<const CudaDevice> dev, KernelCopy* kernel) : dev_(std::move(dev)), kernel_(kernel) {}

  // The kernel's half of direct_from_host: false when it cannot run here
  // (nothing was enqueued).
  Result<bool> kernel_from_host(void* device_dst, const void* host_src, size_t bytes, const void* pinned_base,
                                size_t piece) {
    const CudaDriver& d = *dev_->driver;
    const auto* h = static_cast<const std::byte*>(host_src);
    auto* dv = static_cast<char*>(device_dst);
    const auto* base = static_cast<const std::byte*>(pinned_base);
    std::vector<gather::GatherPiece> pieces;
    for (size_t done = 0; done < bytes;) {
      const size_t in_piece = static_cast<size_t>(h + done - base) % piece;
      const size_t len = std::min(bytes - done, piece - in_piece);
      // The registration that holds these bytes starts in_piece bytes before them.
      CUdeviceptr mapped = 0;
      SIESTA_TRY(dev_->check(d.cuMemHostGetDevicePointer(&mapped, const_cast<std::byte*>(h + done - in_piece), 0),
                             "cuMemHostGetDevicePointer of a kept buffer's pinned piece"));
      pieces.push_back(gather::GatherPiece{reinterpret_cast<const char*>(mapped + in_piece), dv + done, len, 0});
      done += len;
    }
    Result<bool> launched = kernel_->enqueue(pieces, stream_);
    // Whatever was enqueued finishes before the call returns, also on error.
    Ok finished = finish("the gather kernel's copy from pinned host memory");
    if (!launched) return launched.error();
    SIESTA_TRY(std::move(finished));
    return *launched;
  }

  // Records an event after everything issued on the stream and waits for it.
  Ok finish(std::string_view what) {
    const CudaDriver& d = *dev_->driver;
    SIESTA_TRY(dev_->check(d.cuEventRecord(events_[0], stream_), fmt::format("cuEventRecord after {}", what)));
    return dev_->check(d.cuEventSynchronize(events_[0]), fmt::format("cuEventSynchronize after {}", what));
  }

  Ok direct(void* host, const void* device, size_t bytes, const void* pinned_base, size_t piece, bool to_host) {
    const CudaDriver& d = *dev_->driver;
    auto* h = static_cast<std::byte*>(host);
    const auto* dv = static_cast<const std::byte*>(device);
    const auto* base = static_cast<const std::byte*>(pinned_base);
    for (size_t done = 0; done < bytes;) {
      const size_t in_piece = static_cast<size_t>(h + done - base) % piece;
      const size_t len = std::min(bytes - done, piece - in_piece);
      const CUresult r = to_host ? d.cuMemcpyDtoHAsync(h + done, device_ptr(dv + done), len, stream_)
                                 : d.cuMemcpyHtoDAsync(device_ptr(dv + done), h + done, len, stream_);
      if (r != CUDA_SUCCESS) {
        // Whatever was issued finishes before the error goes up.
        (void)d.cuEventRecord(events_[0], stream_);
        (void)d.cuEventSynchronize(events_[0]);
        return dev_->check(r, fmt::format("direct copy of {} {} pinned host memory", format_bytes(len),
                                          to_host ? "to" : "from"));
      }
      done += len;
    }
    SIESTA_TRY(dev_->check(d.cuEventRecord(events_[0], stream_), "cuEventRecord"));
    return dev_->check(d.cuEventSynchronize(events_[0]), "cuEventSynchronize after a direct copy");
  }

  std::shared_ptr<const CudaDevice> dev_;
  KernelCopy* kernel_;  // the backend's; null: host->device by DMA
  StagingRing ring_;
  std::vector<CUdeviceptr> slot_mapped_;  // each slot's device mapping
  std::vector<CUevent> events_;
  CUstream stream_ = nullptr;
  std::unique_ptr<ThreadPool> threads_;
};

class CudaImport final : public ImportedMapping {
 public:
  CudaImport(std::shared_ptr<const CudaDevice> dev, CUdeviceptr base, size_t bytes)
      : dev_(std::move(dev)), base_(base), bytes_(bytes) {}
  ~CudaImport() override {
    Ok ok = unmap_and_release(*dev_, base_, mapped_bytes_, pieces_);
    if (!ok) SIESTA_LOG_ERROR("unmapping imported CUDA memory: {}", ok.error().message);
    dev_->driver->cuMemAddressFree(base_, bytes_);
  }
  void* base() const override { return reinterpret_cast<void*>(static_cast<uintptr_t>(base_)); }
  size_t bytes() const override { return bytes_; }

  // Called by map_import while it builds the mapping, in address order.
  void add_piece(const Piece& piece) { pieces_.push_back(piece); }
  void add_mapped(size_t bytes) { mapped_bytes_ += bytes; }
  size_t mapped_bytes() const { return mapped_bytes_; }

 private:
  std::shared_ptr<const CudaDevice> dev_;
  CUdeviceptr base_;
  size_t bytes_;
  std::vector<Piece> pieces_;
  size_t mapped_bytes_ = 0;
};

class CudaBackend final : public MemoryBackend {
 public:
  CudaBackend(std::shared_ptr<const CudaDevice> dev, CUmemAllocationProp prop, size_t granularity,
              std::string description, CudaBackendOptions options)
      : dev_(std::move(dev)),
        prop_(prop),
        granularity_(granularity),
        description_(std::move(description)),
        options_(options) {
    if (options_.offload == OffloadMode::kStaged && options_.host_to_device == HostToDeviceCopy::kKernel)
      kernel_ = std::make_unique<KernelCopy>(dev_->ordinal);
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string description() const override { return description_; }
  size_t granularity() const override { return granularity_; }

  Result<void*> reserve(size_t bytes) override {
    SIESTA_TRY(dev_->make_current());
    CUdeviceptr ptr = 0;
    SIESTA_TRY(dev_->check(dev_->driver->cuMemAddressReserve(&ptr, bytes, granularity_, 0, 0),
                           fmt::format("cuMemAddressReserve of {}", format_bytes(bytes))));
    return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr));
  }

  void unreserve(void* base, size_t bytes) override {
    if (!dev_->make_current()) return;
    Ok ok = dev_->check(dev_->driver->cuMemAddressFree(device_ptr(base), bytes), "cuMemAddressFree");
    if (!ok) SIESTA_LOG_ERROR("{}", ok.error().message);
  }

  Result<std::unique_ptr<Backing>> map(void* base, size_t bytes, size_t piece_bytes, bool zero_fill,
                                       std::string_view /*label*/) override {
    if (bytes == 0 || piece_bytes == 0 || bytes % granularity_ != 0 || piece_bytes % granularity_ != 0) {
      return internal_error(fmt::format("CUDA map of {} B in pieces of {} B: not multiples of the granularity {} B",
                                        bytes, piece_bytes, granularity_));
    }
    SIESTA_TRY(dev_->make_current());
    const CudaDriver& d = *dev_->driver;
    const CUdeviceptr at = device_ptr(base);
    // On any error below, the backing's destructor undoes what was done.
    auto backing = std::make_unique<CudaBacking>(dev_, at, exportable());
    for (size_t off = 0; off < bytes; off += piece_bytes) {
      size_t len = std::min(piece_bytes, bytes - off);
      CUmemGenericAllocationHandle handle = 0;
      CUresult r = d.cuMemCreate(&handle, len, &prop_, 0);
      if (r != CUDA_SUCCESS) {
        return dev_->check(r, fmt::format("cuMemCreate of {} (of {} to map) on CUDA device {}", format_bytes(len),
                                          format_bytes(bytes - off), dev_->ordinal))
            .error();
      }
      backing->add_piece(Piece{handle, off, len});
      SIESTA_TRY(dev_->check(d.cuMemMap(at + off, len, 0, handle, 0), "cuMemMap"));
      backing->add_mapped(len);
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev_->ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    SIESTA_TRY(dev_->check(d.cuMemSetAccess(at, bytes, &access, 1), "cuMemSetAccess"));
    if (zero_fill) {
      // New physical memory may hold another allocation's old bytes; both
      // backends promise zeros.
      SIESTA_TRY(dev_->check(d.cuMemsetD8(at, 0, bytes), "cuMemsetD8"));
      SIESTA_TRY(dev_->check(d.cuCtxSynchronize(), "cuCtxSynchronize after zero-fill"));
    }
    return std::unique_ptr<Backing>(std::move(backing));
  }

  Result<std::unique_ptr<HostBuffer>> allocate_host(size_t bytes) override {
    if (options_.offload == OffloadMode::kStaged) {
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      const size_t rounded = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
      void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        return out_of_memory(fmt::format("allocating {} of host memory for an offload failed: {}",
                                         format_bytes(bytes), std::strerror(errno)));
      }
      (void)madvise(p, rounded, MADV_HUGEPAGE);  // a hint; without THP the copy still works
      return std::unique_ptr<HostBuffer>(std::make_unique<PageableBuffer>(dev_, p, rounded));
    }
    SIESTA_TRY(dev_->make_current());
    void* p = nullptr;
    SIESTA_TRY(dev_->check(dev_->driver->cuMemHostAlloc(&p, bytes, 0),
                           fmt::format("cuMemHostAlloc of {} pinned host memory", format_bytes(bytes))));
    return std::unique_ptr<HostBuffer>(std::make_unique<PinnedBuffer>(dev_, p, bytes));
  }

  void retain_host(HostBuffer& buffer) override {
    if (options_.offload != OffloadMode::kStaged || !options_.pin_kept_buffers) return;
    auto* pageable = dynamic_cast<PageableBuffer*>(&buffer);
    if (pageable != nullptr) pageable->start_pinning(kept_);
  }

  Ok copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    SIESTA_TRY(dev_->make_current());
    if (options_.offload == OffloadMode::kStaged) {
      SIESTA_ASSIGN_OR_RETURN(StagingResources * staging, staging_resources());
      // The pinned prefix of a kept buffer by direct DMA, the rest staged.
      const auto [buffer, pinned] = pinned_part(host_dst, bytes);
      if (pinned > 0)
        SIESTA_TRY(staging->direct_to_host(host_dst, src, pinned, buffer, PageableBuffer::kPinPiece));
      if (pinned == bytes) return {};
      return staged_copy_to_host(*staging, staging->ring(), staging->threads(), static_cast<std::byte*>(host_dst) + pinned,
                                 static_cast<const std::byte*>(src) + pinned, bytes - pinned);
    }
    return dev_->check(dev_->driver->cuMemcpyDtoH(host_dst, device_ptr(src), bytes),
                       fmt::format("cuMemcpyDtoH of {}", format_bytes(bytes)));
  }

  Ok copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    SIESTA_TRY(dev_->make_current());
    if (options_.offload == OffloadMode::kStaged) {
      SIESTA_ASSIGN_OR_RETURN(StagingResources * staging, staging_resources());
      const auto [buffer, pinned] = pinned_part(host_src, bytes);
      if (pinned > 0)
        SIESTA_TRY(staging->direct_from_host(dst, host_src, pinned, buffer, PageableBuffer::kPinPiece));
      if (pinned == bytes) return {};
      return staged_copy_from_host(*staging, staging->ring(), staging->threads(), static_cast<std::byte*>(dst) + pinned,
                                   static_cast<const std::byte*>(host_src) + pinned, bytes - pinned);
    }
    return dev_->check(dev_->driver->cuMemcpyHtoD(device_ptr(dst), host_src, bytes),
                       fmt::format("cuMemcpyHtoD of {}", format_bytes(bytes)));
  }

  Ok synchronize() override {
    SIESTA_TRY(dev_->make_current());
    return dev_->check(dev_->driver->cuCtxSynchronize(), "cuCtxSynchronize");
  }

  Result<DeviceMemoryInfo> memory_info() override { return dev_->memory_info(); }

  Result<std::unique_ptr<ImportedMapping>> map_import(const std::vector<ExportedPiece>& pieces) override {
    if (pieces.empty()) return invalid_argument("nothing to import: no exported pieces");
    size_t total = 0;
    for (const ExportedPiece& p : pieces) {
      if (p.fd < 0 || p.bytes == 0 || p.offset % granularity_ != 0 || p.bytes % granularity_ != 0) {
        return invalid_argument(
            fmt::format("exported piece (fd {}, offset {}, {} B) cannot be mapped", p.fd, p.offset, p.bytes));
      }
      total = std::max<size_t>(total, p.offset + p.bytes);
    }
    SIESTA_ASSIGN_OR_RETURN(void* base, reserve(total));
    const CUdeviceptr at = device_ptr(base);
    auto import = std::make_unique<CudaImport>(dev_, at, total);
    std::vector<ExportedPiece> sorted = pieces;
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
    const CudaDriver& d = *dev_->driver;
    for (const ExportedPiece& p : sorted) {
      CUmemGenericAllocationHandle handle = 0;
      SIESTA_TRY(dev_->check(
          d.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(p.fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle"));
      import->add_piece(Piece{handle, p.offset, p.bytes});
      if (p.offset != import->mapped_bytes()) {
        return invalid_argument("exported pieces leave a gap; import needs them contiguous from offset 0");
      }
      SIESTA_TRY(dev_->check(d.cuMemMap(at + p.offset, p.bytes, 0, handle, 0), "cuMemMap of an import"));
      import->add_mapped(p.bytes);
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev_->ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    SIESTA_TRY(dev_->check(d.cuMemSetAccess(at, total, &access, 1), "cuMemSetAccess of an import"));
    return std::unique_ptr<ImportedMapping>(std::move(import));
  }

 private:
  bool exportable() const { return prop_.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; }

  // The kept buffer that [host, host + bytes) starts in, and how many of
  // those bytes are pinned (a prefix of the range); {nullptr, 0} otherwise.
  // (The pool frees buffers on the thread that copies, so none goes while a copy runs.)
  std::pair<const void*, size_t> pinned_part(const void* host, size_t bytes) {
    std::lock_guard<std::mutex> lock(kept_->mu);
    const auto* h = static_cast<const std::byte*>(host);
    for (PageableBuffer* b : kept_->live) {
      const auto* base = static_cast<const std::byte*>(b->data());
      if (h < base || h >= base + b->bytes()) continue;
      const size_t pinned_end = b->pinned_bytes();
      const size_t at = static_cast<size_t>(h - base);
      if (at >= pinned_end) return {base, 0};
      return {base, std::min(bytes, pinned_end - at)};
    }
    return {nullptr, 0};
  }

  Result<StagingResources*> staging_resources() {
    if (!staging_) {
      auto made = StagingResources::create(dev_, options_, kernel_.get());
      if (!made) return made.error().with_context("setting up the pinned staging ring for offload copies");
      staging_ = std::move(*made);
      SIESTA_LOG_DEBUG("memory: staging ring of {} pinned, {} copy threads", format_bytes(staging_->pinned_bytes()),
                       staging_->threads().size());
    }
    return staging_.get();
  }

  std::shared_ptr<const CudaDevice> dev_;
  CUmemAllocationProp prop_;
  size_t granularity_;
  std::string description_;
  CudaBackendOptions options_;
  std::unique_ptr<KernelCopy> kernel_;         // kStaged with HostToDeviceCopy::kKernel; outlives staging_
  std::unique_ptr<StagingResources> staging_;  // kStaged, from the first staged copy
  std::shared_ptr<KeptBuffers> kept_ = std::make_shared<KeptBuffers>();
};

}  // namespace

const char* offload_mode_name(OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kStaged: return "staged";
    case OffloadMode::kPinned: return "pinned";
  }
  return "unknown";
}

Result<std::unique_ptr<MemoryBackend>> make_cuda_backend(CudaBackendOptions options) {
  options.host_to_device = resolve_host_to_device_copy(options.host_to_device);
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<CudaDriver> driver, CudaDriver::load());
  auto dev = std::make_shared<CudaDevice>();
  dev->driver = std::move(driver);
  dev->ordinal = options.device;
  const CudaDriver& d = *dev->driver;

  int count = 0;
  SIESTA_TRY(d.check(d.cuDeviceGetCount(&count), "cuDeviceGetCount"));
  if (options.device < 0 || options.device >= count) {
    return unavailable(fmt::format("CUDA device {} does not exist ({} device(s) visible; check CUDA_VISIBLE_DEVICES)",
                                   options.device, count));
  }
  SIESTA_TRY(d.check(d.cuDeviceGet(&dev->device, options.device), "cuDeviceGet"));
  auto attribute = [&](CUdevice_attribute a) {
    int v = 0;
    return d.cuDeviceGetAttribute(&v, a, dev->device) == CUDA_SUCCESS ? v : 0;
  };
  if (!attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
    return unavailable(fmt::format("CUDA device {} does not support virtual memory management (cuMemCreate), which "
                                   "sleep mode needs; run without --enable-sleep-mode",
                                   options.device));
  }
  SIESTA_TRY(d.check(d.cuDevicePrimaryCtxRetain(&dev->context, dev->device), "cuDevicePrimaryCtxRetain"));
  SIESTA_TRY(dev->make_current());

  const bool posix_fd = attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 0;
  const bool rdma = attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) != 0;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = options.device;
  prop.requestedHandleTypes = posix_fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  size_t granularity = 0;
  SIESTA_TRY(d.check(d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                     "cuMemGetAllocationGranularity"));

  char name[256] = {};
  d.cuDeviceGetName(name, sizeof(name) - 1, dev->device);
  size_t total = 0;
  d.cuDeviceTotalMem(&total, dev->device);
  std::string description = fmt::format(
      "cuda device {} ({}, {}, driver {}.{}; granularity {}; {}; {}; offload {})", options.device, name,
      format_bytes(total), d.driver_version / 1000, d.driver_version % 1000 / 10, format_bytes(granularity),
      posix_fd ? "POSIX-FD export" : "no POSIX-FD export", rdma ? "GPUDirect RDMA with VMM" : "no GPUDirect RDMA with VMM",
      options.offload == OffloadMode::kStaged
          ? fmt::format("staged through {} x {} pinned, restored by {}", std::max<size_t>(2, options.staging_slots),
                        format_bytes(std::max<size_t>(size_t{1} << 20, options.staging_slot_bytes)),
                        *options.host_to_device == HostToDeviceCopy::kKernel ? "the SMs (gather kernel)"
                                                                              : "the copy engines")
          : std::string("to pinned host memory"));
  if (!posix_fd) SIESTA_LOG_WARN("{}: memory cannot be exported to ipc peers", description);
  return std::unique_ptr<MemoryBackend>(
      std::make_unique<CudaBackend>(dev, prop, granularity, std::move(description), options));
}

}  // namespace siesta::memory
