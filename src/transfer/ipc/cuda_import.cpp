#include "transfer/ipc/cuda_import.h"

#include <fmt/format.h>

#ifdef SIESTA_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace siesta::transfer::ipc {

#ifdef SIESTA_HAVE_CUDA

namespace {

Status cu_error(const char* what, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  return io_error(fmt::format("{} failed: {} ({})", what, name ? name : "?", text ? text : "no description"));
}

Status cuda_rt_error(const char* what, cudaError_t e) {
  return io_error(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// One stream per copying thread and device.
Result<cudaStream_t> thread_stream(int device) {
  thread_local int stream_device = -1;
  thread_local cudaStream_t stream = nullptr;
  if (stream != nullptr && stream_device == device) return stream;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return cuda_rt_error("cudaSetDevice", e);
  cudaStream_t s = nullptr;
  e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return cuda_rt_error("cudaStreamCreate", e);
  stream = s;
  stream_device = device;
  return stream;
}

}  // namespace

bool cuda_compiled() { return true; }

Result<CudaImport> cuda_import(int fd, size_t bytes, int device) {
  CUresult r = cuInit(0);
  if (r != CUDA_SUCCESS) return cu_error("cuInit", r);
  // The runtime's primary context makes the mapping usable by cudaMemcpyAsync.
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaFree(nullptr);
  if (e != cudaSuccess) return cuda_rt_error("initialising the CUDA context", e);

  CudaImport out;
  CUmemGenericAllocationHandle handle = 0;
  r = cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS)
    return cu_error("cuMemImportFromShareableHandle (was the peer's memory created with the POSIX FD handle type?)", r);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t granularity = 0;
  r = cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS || granularity == 0) granularity = 2u << 20;
  size_t size = (bytes + granularity - 1) / granularity * granularity;
  CUdeviceptr ptr = 0;
  r = cuMemAddressReserve(&ptr, size, granularity, 0, 0);
  if (r != CUDA_SUCCESS) {
    cuMemRelease(handle);
    return cu_error("cuMemAddressReserve", r);
  }
  r = cuMemMap(ptr, size, 0, handle, 0);
  if (r != CUDA_SUCCESS) {
    cuMemAddressFree(ptr, size);
    cuMemRelease(handle);
    return cu_error("cuMemMap of the peer's allocation", r);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = cuMemSetAccess(ptr, size, &access, 1);
  if (r != CUDA_SUCCESS) {
    cuMemUnmap(ptr, size);
    cuMemAddressFree(ptr, size);
    cuMemRelease(handle);
    return cu_error(fmt::format("cuMemSetAccess for device {}", device).c_str(), r);
  }
  out.address = ptr;
  out.size = size;
  out.handle = handle;
  return out;
}

void cuda_release(CudaImport& import) {
  if (import.address == 0) return;
  cuMemUnmap(import.address, import.size);
  cuMemAddressFree(import.address, import.size);
  cuMemRelease(import.handle);
  import = CudaImport{};
}

Ok cuda_copy(const std::vector<CopyPiece>& pieces, int device) {
  SIESTA_ASSIGN_OR_RETURN(cudaStream_t stream, thread_stream(device));
  for (const CopyPiece& p : pieces) {
    cudaError_t e = cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDefault, stream);
    if (e != cudaSuccess) {
      cudaStreamSynchronize(stream);
      return cuda_rt_error("cudaMemcpyAsync", e);
    }
  }
  cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return cuda_rt_error("waiting for the copy stream", e);
  return {};
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
Ok cuda_copy(const std::vector<CopyPiece>&, int) { return no_cuda(); }

#endif

}  // namespace siesta::transfer::ipc
