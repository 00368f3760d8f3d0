// The gather-copy kernel: every piece (src, dst, bytes) of a transfer copied by
// the SMs in one launch, where one cudaMemcpyAsync per piece costs a few
// microseconds of submission each (1.75 MiB KV blocks: ~410 GB/s on an H200).
// A plain C++ header over the CUDA runtime's types, included by piece_copy.cpp
// (host code) and gather_copy.cu (nvcc, C++17); compiled only when the build
// has CUDA.
//
// The work is cut into chunks of `chunk_bytes` (a piece's last chunk may be
// shorter): chunk c belongs to piece chunk_piece[c] and starts at byte
// (c - first_chunk) * chunk_bytes of it. CTAs take chunks grid-stride; a CTA
// copies 16-byte words where source and destination are equally aligned
// modulo 16 (8- or 4-byte words, or bytes, where they are not), with bytes
// before the first and after the last word. Loads and stores are streaming
// (evict-first): the bytes copied are not read again by this kernel.
//
// Every address must be one the launching device may read (src) or write
// (dst): its own memory, or another GPU's mapped for it. Pieces must not
// overlap each other's destinations or their own sources.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace siesta::transfer::ipc {

struct GatherPiece {
  const char* src;
  char* dst;
  uint64_t bytes;
  uint32_t first_chunk;  // index of the piece's first chunk
  uint32_t reserved;
};
static_assert(sizeof(GatherPiece) == 32, "the piece table is uploaded as bytes");

inline constexpr int kGatherThreads = 512;

// How many CTAs of the kernel one SM of the current device runs at once.
cudaError_t gather_copy_ctas_per_sm(int* ctas);

// Launches the kernel on `stream` (of the current device) with `ctas` CTAs;
// `pieces` and `chunk_piece` are in device memory and stay there until the
// kernel ends. The launch's own error; faults surface at the stream's sync.
cudaError_t launch_gather_copy(const GatherPiece* pieces, const uint32_t* chunk_piece, uint32_t chunks,
                               uint64_t chunk_bytes, int ctas, cudaStream_t stream);

}  // namespace siesta::transfer::ipc
