#include "memory/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/log.h"
#include "memory/cuda_driver.h"
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
              std::string description)
      : dev_(std::move(dev)), prop_(prop), granularity_(granularity), description_(std::move(description)) {}

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
    SIESTA_TRY(dev_->make_current());
    void* p = nullptr;
    SIESTA_TRY(dev_->check(dev_->driver->cuMemHostAlloc(&p, bytes, 0),
                           fmt::format("cuMemHostAlloc of {} pinned host memory", format_bytes(bytes))));
    return std::unique_ptr<HostBuffer>(std::make_unique<PinnedBuffer>(dev_, p, bytes));
  }

  Ok copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    SIESTA_TRY(dev_->make_current());
    return dev_->check(dev_->driver->cuMemcpyDtoH(host_dst, device_ptr(src), bytes),
                       fmt::format("cuMemcpyDtoH of {}", format_bytes(bytes)));
  }

  Ok copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    SIESTA_TRY(dev_->make_current());
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

  std::shared_ptr<const CudaDevice> dev_;
  CUmemAllocationProp prop_;
  size_t granularity_;
  std::string description_;
};

}  // namespace

Result<std::unique_ptr<MemoryBackend>> make_cuda_backend(CudaBackendOptions options) {
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
      "cuda device {} ({}, {}, driver {}.{}; granularity {}; {}; {})", options.device, name, format_bytes(total),
      d.driver_version / 1000, d.driver_version % 1000 / 10, format_bytes(granularity),
      posix_fd ? "POSIX-FD export" : "no POSIX-FD export", rdma ? "GPUDirect RDMA with VMM" : "no GPUDirect RDMA with VMM");
  if (!posix_fd) SIESTA_LOG_WARN("{}: memory cannot be exported to ipc peers", description);
  return std::unique_ptr<MemoryBackend>(std::make_unique<CudaBackend>(dev, prop, granularity, std::move(description)));
}

}  // namespace siesta::memory
