// The gather-copy kernel: every piece (src, dst, bytes) of a copy done by the
// SMs in one launch, where one cudaMemcpyAsync per piece costs a few
// microseconds of submission each (1.75 MiB KV blocks: ~410 GB/s on an H200),
// and where the copy engines are slow (host->device right after a large
// device range was released and mapped again: ~30 GB/s for seconds on the
// H200, where SM loads of the mapped host memory keep ~51 GB/s;
// bench/probes/h2d_remap_probe.cpp). A plain C++ header over the CUDA
// runtime's types, included by host code (.cpp) and gather_copy.cu (nvcc,
// C++17); compiled only when the build has CUDA. Its users: the transfer
// engine's ipc copies (transfer/ipc/piece_copy.h), the CUDA memory backend's
// restores from pinned host memory (memory/cuda_backend.h) and the CUDA
// model's checkpoint reads (model/cuda/weight_upload.h).
//
// The pieces are laid end to end (piece k starts at byte `begin` of the
// whole) and every CTA copies an equal share of the whole: bytes
// [b * per_cta, (b + 1) * per_cta) for CTA b, across as many pieces as that
// range touches. Equal shares end together, where whole chunks handed out to
// CTAs grid-stride can leave a partial last wave. A CTA finds the piece its
// range starts in by binary search over `begin`. It copies 16-byte words where source and destination
// are equally aligned modulo 16 (8- or 4-byte words, or bytes, where they are
// not), with bytes before the first and after the last word. Loads and stores
// are streaming (evict-first): the bytes copied are not read again.
//
// Up to kGatherManyPieces pieces travel in the launch's own parameters, more
// in a table in device memory uploaded before the launch.
//
// Every address must be one the launching device may read (src) or write
// (dst): its own memory, another GPU's mapped for it, or pinned host memory
// through its device mapping (cuMemHostGetDevicePointer /
// cudaHostGetDevicePointer). Pieces must not overlap each other's
// destinations or their own sources.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace siesta::gather {

struct GatherPiece {
  const char* src;
  char* dst;
  uint64_t bytes;  // more than zero
  uint64_t begin;  // where the piece starts in the whole: the sum of the bytes before it
};
static_assert(sizeof(GatherPiece) == 32, "the piece table is uploaded as bytes");

inline constexpr int kGatherThreads = 512;

// Up to kGatherFewPieces pieces travel in the launch's parameters (2 KiB),
// up to kGatherManyPieces in a launch of 31 KiB of parameters (launches take
// up to 32764 bytes since CUDA 12.1): no table upload before the kernel, where
// that upload and the kernel's wait for it cost microseconds of a transfer.
// The small launch keeps the parameter copy of small transfers short.
inline constexpr int kGatherFewPieces = 64;
inline constexpr int kGatherManyPieces = 1000;

// How a transfer's bytes are shared among CTAs.
struct GatherShare {
  uint64_t total = 0;    // the bytes of every piece
  uint64_t per_cta = 0;  // a multiple of 256; the last CTAs may get less, or nothing
  int ctas = 0;
};

// The share of `total` bytes in `pieces` pieces: `ctas_max` CTAs at most (the
// device's full grid), each with 16 KiB or more unless there are many more
// pieces than CTAs, then about 8 pieces each.
GatherShare gather_share(uint64_t total, uint64_t pieces, int ctas_max);

template <int N>
struct GatherParams {
  uint32_t pieces = 0;  // used entries of `piece`, `begin` ascending
  uint32_t reserved = 0;
  uint64_t total = 0;
  uint64_t per_cta = 0;
  GatherPiece piece[N];
};
static_assert(sizeof(GatherParams<kGatherManyPieces>) <= 32764, "a launch takes at most 32764 bytes of parameters");

// How many CTAs of the kernel one SM of the current device runs at once.
cudaError_t gather_copy_ctas_per_sm(int* ctas);

// CTAs of the kernel that fill every SM of the current device at once (the
// `ctas_max` of gather_share).
cudaError_t gather_copy_full_grid(int* ctas);

// The errors of a launch (or of gather_copy_ctas_per_sm) on a device the
// build has no code for (CMAKE_CUDA_ARCHITECTURES without it): callers copy
// with the copy engines instead.
inline bool gather_kernel_missing(cudaError_t e) {
  return e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction ||
         e == cudaErrorUnsupportedPtxVersion;
}

// Launches the kernel on `stream` (of the current device) over `pieces`
// pieces of a table in device memory that stays there until the kernel ends.
// The launch's own error; faults surface at the stream's sync.
cudaError_t launch_gather_copy(const GatherPiece* pieces, uint32_t count, const GatherShare& share,
                               cudaStream_t stream);

// The same copy with the pieces in the launch's parameters (`params.total`
// and `params.per_cta` from a GatherShare of `ctas` CTAs).
cudaError_t launch_gather_copy(const GatherParams<kGatherFewPieces>& params, int ctas, cudaStream_t stream);
cudaError_t launch_gather_copy(const GatherParams<kGatherManyPieces>& params, int ctas, cudaStream_t stream);

// Copies `count` pieces on `stream` with one launch per kGatherFewPieces of
// them, each launch's pieces in its parameters (nothing uploaded first, no
// device memory of its own) and its bytes shared among up to `ctas_max` CTAs
// (gather_share). The pieces' `begin` is not read (each launch lays its
// pieces end to end itself); pieces of zero bytes are skipped. For copies of
// a few pieces at a time whose caller keeps no piece table on the device.
cudaError_t launch_gather_copy_pieces(const GatherPiece* pieces, size_t count, int ctas_max, cudaStream_t stream);

}  // namespace siesta::gather
