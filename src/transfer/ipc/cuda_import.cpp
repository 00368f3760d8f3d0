#include "transfer/ipc/cuda_import.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <string>
#include <vector>

#ifdef SIESTA_HAVE_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#endif

namespace siesta::transfer::ipc {

#ifdef SIESTA_HAVE_CUDA

namespace {

// X(name, version): each member has the driver's typedef for one ABI version
// and is looked up at exactly that version (a lookup at CUDA_VERSION would
// return the newest ABI of a name, whose signature may differ).
#define SIESTA_TRANSFER_CU_CALLS(X)                                                                        \
  X(cuGetErrorName, 6000) X(cuGetErrorString, 6000) X(cuMemImportFromShareableHandle, 10020)              \
  X(cuMemGetAllocationGranularity, 10020) X(cuMemAddressReserve, 10020) X(cuMemAddressFree, 10020)        \
  X(cuMemMap, 10020) X(cuMemUnmap, 10020) X(cuMemSetAccess, 10020) X(cuMemRelease, 10020)                 \
  X(cuMemCreate, 10020) X(cuMemExportToShareableHandle, 10020) X(cuMemGetAllocationPropertiesFromHandle, 10020)

// Driver functions looked up once through the runtime. The table is immutable
// after the lookup: it is a cache of addresses, not shared state.
struct DriverCalls {
#define SIESTA_DECLARE_(name, version) PFN_##name##_v##version name = nullptr;
  SIESTA_TRANSFER_CU_CALLS(SIESTA_DECLARE_)
#undef SIESTA_DECLARE_
  Status missing;  // set when the lookup failed
  bool ok = false;
};

Status cuda_rt_error(const char* what, cudaError_t e) {
  return io_error(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

const DriverCalls& driver() {
  static const DriverCalls calls = [] {
    DriverCalls c;
    // Any runtime call loads the driver (and fails cleanly without one).
    int devices = 0;
    cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess) {
      c.missing = unavailable(fmt::format("no usable CUDA driver or device: {} ({})", cudaGetErrorName(e),
                                          cudaGetErrorString(e)));
      return c;
    }
#define SIESTA_LOOKUP_(name, version)                                                                \
  {                                                                                                   \
    void* p = nullptr;                                                                                \
    cudaDriverEntryPointQueryResult q{};                                                              \
    if (cudaGetDriverEntryPointByVersion(#name, &p, version, cudaEnableDefault, &q) != cudaSuccess || \
        p == nullptr) {                                                                                   \
      c.missing = unavailable("the CUDA driver lacks " #name "; update the NVIDIA driver");               \
      return c;                                                                                           \
    }                                                                                                     \
    c.name = reinterpret_cast<decltype(c.name)>(p);                                                       \
  }
    SIESTA_TRANSFER_CU_CALLS(SIESTA_LOOKUP_)
#undef SIESTA_LOOKUP_
    c.ok = true;
    return c;
  }();
  return calls;
}

Status cu_error(const DriverCalls& d, const std::string& what, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  d.cuGetErrorName(r, &name);
  d.cuGetErrorString(r, &text);
  return io_error(fmt::format("{} failed: {} ({})", what, name ? name : "?", text ? text : "no description"));
}

Result<const DriverCalls*> usable_driver(int device) {
  const DriverCalls& d = driver();
  if (!d.ok) return d.missing;
  // The runtime's primary context on `device` makes mappings usable by its copies and kernels.
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaFree(nullptr);
  if (e != cudaSuccess) return cuda_rt_error("initialising the CUDA context", e);
  return &d;
}

size_t granularity(const DriverCalls& d, int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = 0;
  if (d.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g == 0)
    g = size_t{2} << 20;
  return g;
}

// Reserves, maps and grants the `devices` read/write access to `handle`;
// cleans up on failure.
Result<uint64_t> map_handle(const DriverCalls& d, CUmemGenericAllocationHandle handle, size_t size, size_t align,
                            const std::vector<int>& devices) {
  CUdeviceptr ptr = 0;
  CUresult r = d.cuMemAddressReserve(&ptr, size, align, 0, 0);
  if (r != CUDA_SUCCESS) return cu_error(d, "cuMemAddressReserve", r);
  r = d.cuMemMap(ptr, size, 0, handle, 0);
  if (r != CUDA_SUCCESS) {
    d.cuMemAddressFree(ptr, size);
    return cu_error(d, "cuMemMap", r);
  }
  std::vector<CUmemAccessDesc> access(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = devices[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  r = d.cuMemSetAccess(ptr, size, access.data(), access.size());
  if (r != CUDA_SUCCESS) {
    d.cuMemUnmap(ptr, size);
    d.cuMemAddressFree(ptr, size);
    return cu_error(d, fmt::format("cuMemSetAccess for device(s) {}", fmt::join(devices, ", ")), r);
  }
  return static_cast<uint64_t>(ptr);
}

}  // namespace

bool cuda_compiled() { return true; }

Result<CudaImport> cuda_import(int fd, size_t bytes, int device) {
  SIESTA_ASSIGN_OR_RETURN(const DriverCalls* d, usable_driver(device));
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = d->cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS)
    return cu_error(*d, "cuMemImportFromShareableHandle (was the peer's memory created with the POSIX FD handle type?)",
                    r);
  // Where the memory lives: on this device, or on another GPU of this host
  // (P on one GPU, D on another). The owner's ordinal is in this process's
  // numbering, so both processes must see both GPUs (CUDA_VISIBLE_DEVICES).
  CUmemAllocationProp prop{};
  int owner = device;
  if (d->cuMemGetAllocationPropertiesFromHandle(&prop, handle) == CUDA_SUCCESS &&
      prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    owner = prop.location.id;
  }
  // Another GPU: map it for this device when it can reach the owner's memory
  // directly (NVLink / PCIe peer access), else for the owner only, and the
  // copies (cudaMemcpyAsync, cudaMemcpyDefault) go through the runtime's
  // staging between the two devices.
  std::vector<int> access = {device};
  bool direct = true;
  if (owner != device) {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, owner) != cudaSuccess) can = 0;
    direct = can != 0;
    access = direct ? std::vector<int>{device, owner} : std::vector<int>{owner};
  }
  size_t g = granularity(*d, owner);
  size_t size = (bytes + g - 1) / g * g;
  auto address = map_handle(*d, handle, size, g, access);
  if (!address) {
    d->cuMemRelease(handle);
    return address.error().with_context(fmt::format("mapping the peer's CUDA allocation (on device {}, for device {})",
                                                    owner, device));
  }
  return CudaImport{*address, size, handle, owner, direct};
}

void cuda_release(CudaImport& import) {
  if (import.address == 0) return;
  const DriverCalls& d = driver();
  d.cuMemUnmap(import.address, import.size);
  d.cuMemAddressFree(import.address, import.size);
  d.cuMemRelease(import.handle);
  import = CudaImport{};
}

Result<CudaExportable> cuda_alloc_exportable(size_t bytes, int device) {
  SIESTA_ASSIGN_OR_RETURN(const DriverCalls* d, usable_driver(device));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = granularity(*d, device);
  size_t size = (bytes + g - 1) / g * g;
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = d->cuMemCreate(&handle, size, &prop, 0);
  if (r != CUDA_SUCCESS) return cu_error(*d, fmt::format("cuMemCreate of {} bytes", size), r);
  int fd = -1;
  r = d->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    d->cuMemRelease(handle);
    return cu_error(*d, "cuMemExportToShareableHandle (POSIX FD)", r);
  }
  // Readable and writable by every GPU that can reach this one, so that a
  // copy run by another device (a peer on another GPU, cudaMemcpyPeer) may use it.
  std::vector<int> access = {device};
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 1;
  for (int other = 0; other < devices; ++other) {
    int can = 0;
    if (other != device && cudaDeviceCanAccessPeer(&can, other, device) == cudaSuccess && can) access.push_back(other);
  }
  auto address = map_handle(*d, handle, size, g, access);
  if (!address) {
    close(fd);
    d->cuMemRelease(handle);
    return address.error();
  }
  return CudaExportable{reinterpret_cast<void*>(*address), size, fd, handle};
}

void cuda_free_exportable(CudaExportable& memory) {
  if (memory.base == nullptr) return;
  const DriverCalls& d = driver();
  CUdeviceptr ptr = reinterpret_cast<CUdeviceptr>(memory.base);
  d.cuMemUnmap(ptr, memory.bytes);
  d.cuMemAddressFree(ptr, memory.bytes);
  d.cuMemRelease(memory.handle);
  if (memory.fd >= 0) close(memory.fd);
  memory = CudaExportable{};
}

#else  // !SIESTA_HAVE_CUDA

namespace {
Status no_cuda() {
  return unavailable("this siesta was built without CUDA, so the ipc backend cannot map CUDA memory; rebuild with "
                     "nvcc on the PATH (or /usr/local/cuda) or transfer host memory");
}
}  // namespace

bool cuda_compiled() { return false; }
Result<CudaImport> cuda_import(int, size_t, int) { return no_cuda(); }
void cuda_release(CudaImport&) {}
Result<CudaExportable> cuda_alloc_exportable(size_t, int) { return no_cuda(); }
void cuda_free_exportable(CudaExportable&) {}

#endif

}  // namespace siesta::transfer::ipc
