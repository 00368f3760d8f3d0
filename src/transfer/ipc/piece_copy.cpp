#include "transfer/ipc/piece_copy.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <limits>

#include "common/log.h"

#ifdef SIESTA_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gather/gather_copy.h"
#endif

namespace siesta::transfer::ipc {

const char* ipc_copy_rule(IpcCopy path) {
  switch (path) {
    case IpcCopy::kAuto:
      return "one SM gather-kernel launch for the pieces whose both ends are on the copying GPU, and for those "
             "on a peer GPU it addresses where they average less than 8 MiB; one cudaMemcpyAsync per piece for "
             "the others (larger pieces across GPUs, host memory)";
    case IpcCopy::kKernel:
      return "one SM gather-kernel launch for the pieces whose both ends the copying GPU addresses (its own "
             "memory, or another GPU's through peer access), one cudaMemcpyAsync per piece for the others";
    case IpcCopy::kCopyEngine:
      return "one cudaMemcpyAsync per piece (copy engines)";
  }
  return "?";
}

bool copies_with_kernel(IpcCopy path, PieceEnds ends, uint64_t peer_average) {
  switch (path) {
    case IpcCopy::kAuto:
      return ends == PieceEnds::kThisDevice || (ends == PieceEnds::kPeerDevice && peer_average < kPeerKernelMaxAverage);
    case IpcCopy::kKernel:
      return ends != PieceEnds::kElsewhere;
    case IpcCopy::kCopyEngine:
      return false;
  }
  return false;
}

#ifdef SIESTA_HAVE_CUDA

namespace {

using gather::gather_copy_ctas_per_sm;
using gather::gather_share;
using gather::GatherParams;
using gather::GatherPiece;
using gather::GatherShare;
using gather::kGatherFewPieces;
using gather::kGatherManyPieces;
using gather::launch_gather_copy;

constexpr size_t kMinTableBytes = size_t{64} << 10;

Status cuda_rt_error(const std::string& what, cudaError_t e) {
  return io_error(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// What one thread copies with on one device: a stream, and the pinned host
// staging and device copy of the kernel's piece table. Every copy waits for
// its stream, so the buffers are free again when the next copy of the thread
// starts. Made on first use, remade when the thread copies for another
// device, freed when the thread exits.
class CopyStream {
 public:
  CopyStream() = default;
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  ~CopyStream() { reset(); }

  // Binds to `device`, which must be the current device.
  Ok bind(int device) {
    if (device_ == device) return {};
    reset();
    cudaError_t e = cudaSetDevice(device);  // reset() may have switched to the old one
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      stream_ = nullptr;
      return cuda_rt_error(fmt::format("creating a copy stream on CUDA device {}", device), e);
    }
    device_ = device;
    return {};
  }

  cudaStream_t stream() const { return stream_; }

  Result<char*> host_table(size_t bytes) {
    if (bytes > host_bytes_) {
      if (host_ != nullptr) cudaFreeHost(host_);
      host_ = nullptr;
      host_bytes_ = 0;
      size_t want = std::bit_ceil(std::max(bytes, kMinTableBytes));
      void* p = nullptr;
      cudaError_t e = cudaHostAlloc(&p, want, cudaHostAllocPortable);
      if (e != cudaSuccess) return cuda_rt_error(fmt::format("pinning {} bytes for a piece table", want), e);
      host_ = static_cast<char*>(p);
      host_bytes_ = want;
    }
    return host_;
  }

  Result<char*> device_table(size_t bytes) {
    if (bytes > device_bytes_) {
      if (device_buffer_ != nullptr) cudaFree(device_buffer_);
      device_buffer_ = nullptr;
      device_bytes_ = 0;
      size_t want = std::bit_ceil(std::max(bytes, kMinTableBytes));
      void* p = nullptr;
      cudaError_t e = cudaMalloc(&p, want);
      if (e != cudaSuccess) return cuda_rt_error(fmt::format("cudaMalloc of {} bytes for a piece table", want), e);
      device_buffer_ = static_cast<char*>(p);
      device_bytes_ = want;
    }
    return device_buffer_;
  }

  // CTAs of the kernel that fill every SM of the device at once.
  Result<int> full_grid() {
    if (grid_ == 0) {
      int sms = 0, per_sm = 0;
      cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_);
      if (e == cudaSuccess) e = gather_copy_ctas_per_sm(&per_sm);
      if (e != cudaSuccess && !gather::gather_kernel_missing(e))
        return cuda_rt_error("sizing the gather kernel's grid", e);
      grid_ = std::max(sms, 1) * std::max(per_sm, 1);
    }
    return grid_;
  }

  // The kernel has no code for this device: its pieces go to the copy engines.
  bool kernel_missing = false;

 private:
  void reset() {
    if (device_ < 0) return;
    // Errors are ignored: this runs at thread exit too.
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (device_buffer_ != nullptr) cudaFree(device_buffer_);
    if (host_ != nullptr) cudaFreeHost(host_);
    device_ = -1;
    stream_ = nullptr;
    host_ = nullptr;
    host_bytes_ = 0;
    device_buffer_ = nullptr;
    device_bytes_ = 0;
    grid_ = 0;
    kernel_missing = false;
  }

  int device_ = -1;
  cudaStream_t stream_ = nullptr;
  char* host_ = nullptr;
  size_t host_bytes_ = 0;
  char* device_buffer_ = nullptr;
  size_t device_bytes_ = 0;
  int grid_ = 0;
};

thread_local CopyStream t_copy;

std::atomic<bool> g_warned_kernel_missing{false};

Ok copy_engines(std::span<const CopyPiece> pieces, cudaStream_t stream) {
  for (const CopyPiece& p : pieces) {
    if (p.bytes == 0) continue;
    cudaError_t e = cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDefault, stream);
    if (e != cudaSuccess) return cuda_rt_error("cudaMemcpyAsync", e);
  }
  return {};
}

// The pieces with bytes, laid end to end, into `out`; how many.
uint32_t write_pieces(std::span<const CopyPiece> pieces, GatherPiece* out) {
  uint32_t k = 0;
  uint64_t begin = 0;
  for (const CopyPiece& p : pieces) {
    if (p.bytes == 0) continue;
    out[k++] = GatherPiece{static_cast<const char*>(p.src), static_cast<char*>(p.dst), p.bytes, begin};
    begin += p.bytes;
  }
  return k;
}

// The launch parameters of `pieces` (no more than N of them with bytes).
template <int N>
void fill_params(std::span<const CopyPiece> pieces, const GatherShare& share, GatherParams<N>* params) {
  params->total = share.total;
  params->per_cta = share.per_cta;
  params->pieces = write_pieces(pieces, params->piece);
}

// Launches the kernel over `pieces`, their table in the launch's parameters
// (up to kGatherManyPieces) or uploaded first; false in `*launched` when the
// kernel has no code for this device (nothing enqueued but the upload).
Ok gather_kernel(std::span<const CopyPiece> pieces, bool* launched) {
  *launched = false;
  size_t n = 0;
  uint64_t total = 0;
  for (const CopyPiece& p : pieces) {
    if (p.bytes == 0) continue;
    ++n;
    total += p.bytes;
  }
  if (n == 0) {
    *launched = true;
    return {};
  }
  if (n > std::numeric_limits<uint32_t>::max())
    return invalid_argument(fmt::format("{} pieces are too many for one gather-kernel launch", n));
  SIESTA_ASSIGN_OR_RETURN(int grid, t_copy.full_grid());
  const GatherShare share = gather_share(total, n, grid);
  cudaStream_t stream = t_copy.stream();
  cudaError_t e = cudaSuccess;
  if (n <= static_cast<size_t>(kGatherFewPieces)) {
    // Few pieces: in the launch's parameters, nothing to upload first.
    GatherParams<kGatherFewPieces> params;
    fill_params(pieces, share, &params);
    e = launch_gather_copy(params, share.ctas, stream);
  } else if (n <= static_cast<size_t>(kGatherManyPieces)) {
    static thread_local GatherParams<kGatherManyPieces> params;  // 31 KiB: not on the stack
    fill_params(pieces, share, &params);
    e = launch_gather_copy(params, share.ctas, stream);
  } else {
    const size_t table_bytes = n * sizeof(GatherPiece);
    SIESTA_ASSIGN_OR_RETURN(char* host, t_copy.host_table(table_bytes));
    SIESTA_ASSIGN_OR_RETURN(char* device, t_copy.device_table(table_bytes));
    write_pieces(pieces, reinterpret_cast<GatherPiece*>(host));
    e = cudaMemcpyAsync(device, host, table_bytes, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return cuda_rt_error("uploading the gather kernel's piece table", e);
    e = launch_gather_copy(reinterpret_cast<const GatherPiece*>(device), static_cast<uint32_t>(n), share, stream);
  }
  if (gather::gather_kernel_missing(e)) {
    t_copy.kernel_missing = true;
    if (!g_warned_kernel_missing.exchange(true))
      SIESTA_LOG_WARN("ipc: the gather-copy kernel has no code for this GPU ({}); CUDA pieces are copied with "
                      "cudaMemcpyAsync instead (rebuild with this GPU in CMAKE_CUDA_ARCHITECTURES)",
                      cudaGetErrorString(e));
    return {};
  }
  if (e != cudaSuccess) return cuda_rt_error(fmt::format("launching the gather-copy kernel ({} pieces)", n), e);
  *launched = true;
  return {};
}

Ok copy_on_current_device(std::span<const CopyPiece> by_kernel, std::span<const CopyPiece> by_copy_engine,
                          int device) {
  SIESTA_TRY(t_copy.bind(device));
  cudaStream_t stream = t_copy.stream();
  Ok enqueued = [&]() -> Ok {
    if (!by_kernel.empty()) {
      bool launched = false;
      if (!t_copy.kernel_missing) SIESTA_TRY(gather_kernel(by_kernel, &launched));
      if (!launched) SIESTA_TRY(copy_engines(by_kernel, stream));
    }
    return copy_engines(by_copy_engine, stream);
  }();
  // Whatever was enqueued ends before the buffers are reused or the error returns.
  cudaError_t e = cudaStreamSynchronize(stream);
  if (!enqueued) return enqueued;
  if (e != cudaSuccess) return cuda_rt_error("waiting for the copy stream", e);
  return {};
}

}  // namespace

Ok cuda_copy_pieces(std::span<const CopyPiece> by_kernel, std::span<const CopyPiece> by_copy_engine, int device) {
  int previous = 0;
  cudaError_t e = cudaGetDevice(&previous);
  if (e != cudaSuccess) return cuda_rt_error("cudaGetDevice (is there a usable CUDA driver and device?)", e);
  if (previous != device && (e = cudaSetDevice(device)) != cudaSuccess)
    return cuda_rt_error(fmt::format("cudaSetDevice({})", device), e);
  Ok result = copy_on_current_device(by_kernel, by_copy_engine, device);
  if (previous != device) cudaSetDevice(previous);
  return result;
}

Ok cuda_copy(const std::vector<CopyPiece>& pieces, int device) { return cuda_copy_pieces({}, pieces, device); }

#else  // !SIESTA_HAVE_CUDA

namespace {
Status no_cuda() {
  return unavailable("this siesta was built without CUDA, so the ipc backend cannot copy CUDA memory; rebuild with "
                     "nvcc on the PATH (or /usr/local/cuda) or transfer host memory");
}
}  // namespace

Ok cuda_copy_pieces(std::span<const CopyPiece>, std::span<const CopyPiece>, int) { return no_cuda(); }
Ok cuda_copy(const std::vector<CopyPiece>&, int) { return no_cuda(); }

#endif

}  // namespace siesta::transfer::ipc
