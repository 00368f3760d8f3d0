// How the ipc backend copies the pieces of a transfer that touch CUDA memory:
// with one launch of the SM gather kernel (gather/gather_copy.h) for the pieces whose
// both ends the copying device can address, and one cudaMemcpyAsync per piece
// (the copy engines) for the rest. Which pieces take the kernel is the
// backend's `ipc_copy` setting (TransferConfig::ipc_copy), decided per piece
// by copies_with_kernel().
//
// Copies run on a stream of the calling thread for the copying device and
// return when every byte landed; the thread's current device is left as it
// was. Compiled with CUDA (SIESTA_HAVE_CUDA); without it every copy fails
// with a message that says so. The driver is never linked (cuda_import.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "transfer/transfer_config.h"

namespace siesta::transfer::ipc {

struct CopyPiece {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

// One line for the log: what `path` does with which pieces.
const char* ipc_copy_rule(IpcCopy path);

// Where a piece's two ends are, as the copying device sees them.
enum class PieceEnds : uint8_t {
  kThisDevice,  // both in memory of the copying device
  kPeerDevice,  // both addressable by it, at least one on another GPU mapped for it (peer access)
  kElsewhere,   // host memory, or memory it cannot address
};

// Whether `path` copies a piece whose ends are `ends` with the kernel, where
// the transfer's pieces across GPUs (kPeerDevice) average `peer_average`
// bytes. Across GPUs `auto` takes the kernel for pieces of less than 8 MiB on
// average: over NVLink (H200 pair, `scripts/device-check --two-gpus`) it moved
// 1.75 MiB KV blocks at 344 GB/s against 214-244 by the copy engines, 1 and 4
// MiB pieces 1-17% faster, but 16 and 64 MiB pieces 2-3% slower, and a P/D
// transfer whose blocks merge into large pieces no faster. Over PCIe SM
// loads from a peer are known to trail the copy engines; `copy_engine` keeps
// them there.
bool copies_with_kernel(IpcCopy path, PieceEnds ends, uint64_t peer_average);
inline constexpr uint64_t kPeerKernelMaxAverage = uint64_t{8} << 20;

// Copies `by_kernel` with one gather-kernel launch on `device` (after its piece
// table is uploaded), then `by_copy_engine` with cudaMemcpyAsync, on one
// stream, and waits for both. Pieces of `by_kernel` must have both ends
// addressable by `device`; `by_copy_engine` may name host memory. Zero-byte
// pieces are skipped. Where the kernel has no code for the GPU (a build for
// another architecture), its pieces go to the copy engines, with a warning
// logged once.
Ok cuda_copy_pieces(std::span<const CopyPiece> by_kernel, std::span<const CopyPiece> by_copy_engine, int device);

// Every piece with cudaMemcpyAsync (host, device or imported memory on either
// side), on a stream of `device`; waits for it.
Ok cuda_copy(const std::vector<CopyPiece>& pieces, int device);

}  // namespace siesta::transfer::ipc
