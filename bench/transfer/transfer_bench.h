// TransferBench: what `siesta bench transfer` measures, as a library call so
// that tests can run it too.
//
// Two processes: the caller is the initiator; a peer process (started with
// options.peer_argv, its options passed in the environment variable
// SIESTA_TRANSFER_BENCH_PEER) registers the target region. For each entry
// size, transfers of `batch` entries of that size run one at a time, each
// timed from submit() to done, and the limit moves the same bytes the same
// number of times (memcpy for ipc host memory; for ipc CUDA memory one
// cudaMemcpyAsync of each transfer's bytes as one range, device to device —
// from one GPU to the other when the peer's memory is on another device —,
// the rate that per-piece costs of either copy path can only approach; a raw
// UCX put loop for ucx: between the host regions themselves, or between host
// buffers of the same size when the regions are CUDA memory, whose staging
// aims at that rate). The two take turns in ten rounds, so load from
// elsewhere on a shared machine falls on both alike. Then every transferred
// byte is verified (both sides hash each entry, and the hash must be that of
// the source's pattern).
//
// ipc with CUDA memory: `ipc_copy` is the initiator's TransferConfig::ipc_copy
// (the initiator copies), or "both": two initiator engines, one with the
// gather kernel and one with copy engines, take their turns in the same
// rounds against the same limit; each size then has a row per path, each
// verified on its own.
//
// A program that can be the peer calls serve_transfer_bench_peer() when
// transfer_bench_peer_requested() (the CLI: `bench transfer --serve-peer`).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "transfer/region.h"
#include "transfer/xfer.h"

namespace siesta::transfer {

struct TransferBenchOptions {
  std::string backend = "ipc";  // ipc | ucx
  MemoryKind memory = MemoryKind::kHost;
  std::vector<size_t> sizes = {4u << 10, 64u << 10, 1u << 20, 16u << 20, 64u << 20};
  size_t batch = 4;
  XferOp op = XferOp::kWrite;
  size_t iterations = 0;  // per size; 0: about 512 MiB worth (8 GiB for ipc of CUDA memory), 5 to 2000
  std::string ucx_transports = "tcp";
  std::string ucx_net_devices = "lo";
  bool ucx_peer_error_handling = true;
  std::string ucx_staging = "auto";  // TransferConfig::ucx_staging of both processes
  int cuda_device = 0;       // the initiator's memory (and the device that copies, for ipc)
  int peer_cuda_device = -1;  // the peer's memory; -1: cuda_device. Another GPU: the ipc
                              // limit is a peer copy (cudaMemcpyPeer) between the two
  std::string ipc_copy = "auto";  // auto | kernel | copy_engine | both (ipc, CUDA memory)
  // The peer process: an executable and its arguments (argv[0] first).
  std::vector<std::string> peer_argv;
};

struct TransferBenchRow {
  size_t bytes = 0;  // one entry
  size_t batch = 0;
  size_t iterations = 0;
  double gb_per_s = 0;
  double limit_gb_per_s = 0;
  // ipc with CUDA memory: cudaMemcpy device-to-device of the same entries,
  // one call each (the transfer's shape), in the same rounds; 0 otherwise.
  double entries_limit_gb_per_s = 0;
  double p50_us = 0;
  double p99_us = 0;
  bool verified = false;
  std::string ipc_copy;  // the initiator's ipc_copy (ipc with CUDA memory; empty otherwise)
};

struct TransferBenchReport {
  std::string limit;  // what the limit is
  std::vector<TransferBenchRow> rows;
};

Result<TransferBenchReport> run_transfer_bench(const TransferBenchOptions& options);

bool transfer_bench_peer_requested();
// Serves as the peer until standard input closes; the exit code.
int serve_transfer_bench_peer();

// "4K,64K,1M,16M,64M" (K, M, G: powers of 1024), ascending.
Result<std::vector<size_t>> parse_byte_sizes(const std::string& text);

}  // namespace siesta::transfer
