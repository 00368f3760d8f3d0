#include "model/cuda/ipc_weights.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "common/log.h"

namespace siesta::cuda {
namespace {

std::string rt_error(cudaError_t e) { return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")"; }

// cuMemGetAddressRange through the runtime (the driver is not linked: see
// src/memory/cuda_driver.h), looked up once at the ABI version of its typedef.
PFN_cuMemGetAddressRange_v3020 address_range_fn() {
  static const PFN_cuMemGetAddressRange_v3020 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 3020, cudaEnableDefault, &q) != cudaSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuMemGetAddressRange_v3020>(nullptr);
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(p);
  }();
  return fn;
}

}  // namespace

Result<IpcWeightBuffers> IpcWeightBuffers::open(std::span<const CudaIpcBuffer> buffers, int device) {
  IpcWeightBuffers out;
  out.device_ = device;
  if (buffers.empty()) return invalid_argument("update_weights (cuda_ipc): no buffers given");
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return internal_error("update_weights (cuda_ipc): selecting CUDA device " + std::to_string(device) + ": " +
                          rt_error(e));
  const PFN_cuMemGetAddressRange_v3020 range = address_range_fn();
  if (range == nullptr)
    return unavailable(
        "update_weights (cuda_ipc): the CUDA driver lacks cuMemGetAddressRange; update the NVIDIA driver");
  // Distinct handles: the bytes of each, and where it was opened.
  std::map<std::string, std::pair<std::byte*, uint64_t>> by_handle;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const CudaIpcBuffer& b = buffers[i];
    const std::string key(reinterpret_cast<const char*>(b.handle.data()), b.handle.size());
    auto it = by_handle.find(key);
    if (it == by_handle.end()) {
      cudaIpcMemHandle_t h;
      static_assert(sizeof(h) == kCudaIpcHandleBytes);
      std::memcpy(&h, b.handle.data(), sizeof(h));
      void* p = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky: clear it
        return invalid_argument(
            "update_weights (cuda_ipc): buffer " + std::to_string(i) + ": cudaIpcOpenMemHandle failed: " + rt_error(e) +
            "; the handle must be a cudaIpcMemHandle_t from cudaIpcGetMemHandle (PyTorch: "
            "tensor.untyped_storage()._share_cuda_()) of memory on this GPU in another, still running, process; the "
            "weights are unchanged");
      }
      out.opened_.push_back(p);
      CUdeviceptr base = 0;
      size_t size = 0;
      if (CUresult r = range(&base, &size, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p))); r != CUDA_SUCCESS)
        return invalid_argument("update_weights (cuda_ipc): buffer " + std::to_string(i) +
                                ": the size of its allocation could not be read (cuMemGetAddressRange error " +
                                std::to_string(static_cast<int>(r)) + "); the weights are unchanged");
      // The opened address is the allocation's start; what lies before it is not ours to read.
      const uint64_t usable =
          static_cast<uint64_t>(base + size - static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p)));
      it = by_handle.emplace(key, std::make_pair(static_cast<std::byte*>(p), usable)).first;
    }
    const auto [start, allocation_bytes] = it->second;
    if (b.offset > allocation_bytes || b.bytes > allocation_bytes - b.offset)
      return invalid_argument("update_weights (cuda_ipc): buffer " + std::to_string(i) + " is described as bytes [" +
                              std::to_string(b.offset) + ", " + std::to_string(b.offset + b.bytes) +
                              ") of its allocation, which holds " + std::to_string(allocation_bytes) +
                              " bytes; the weights are unchanged");
    out.starts_.push_back(start + b.offset);
    out.sizes_.push_back(b.bytes);
  }
  return out;
}

IpcWeightBuffers::IpcWeightBuffers(IpcWeightBuffers&& other) noexcept
    : device_(other.device_),
      opened_(std::exchange(other.opened_, {})),
      starts_(std::exchange(other.starts_, {})),
      sizes_(std::exchange(other.sizes_, {})) {}

IpcWeightBuffers& IpcWeightBuffers::operator=(IpcWeightBuffers&& other) noexcept {
  if (this != &other) {
    close_all();
    device_ = other.device_;
    opened_ = std::exchange(other.opened_, {});
    starts_ = std::exchange(other.starts_, {});
    sizes_ = std::exchange(other.sizes_, {});
  }
  return *this;
}

IpcWeightBuffers::~IpcWeightBuffers() { close_all(); }

void IpcWeightBuffers::close_all() {
  if (opened_.empty()) return;
  (void)cudaSetDevice(device_);
  for (void* p : opened_)
    if (cudaError_t e = cudaIpcCloseMemHandle(p); e != cudaSuccess) {
      (void)cudaGetLastError();
      SIESTA_LOG_WARN("update_weights (cuda_ipc): closing an IPC handle: {}", rt_error(e));
    }
  opened_.clear();
}

}  // namespace siesta::cuda
