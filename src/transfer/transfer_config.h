// TransferConfig: everything TransferEngine::create needs. Defaults suit tests
// on loopback; serve fills it from --kv-transfer-config.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "transfer/side_channel.h"

namespace siesta::transfer {

struct TransferConfig {
  // Unique among the engines that talk to each other (P/D: remote_engine_id).
  std::string engine_id;
  // "ipc" (same host: memfd / cuMem FDs over a Unix socket) or "ucx".
  std::string backend = "ipc";
  // Where the side channel listens (port 0: the OS picks; read address() back).
  SideChannelOptions side_channel;
  // Most regions registered at once (slots in the shared region table).
  uint32_t max_regions = 1024;
  // The engine frees and re-registers memory (sleep mode). create() refuses a
  // backend whose supports_sleep() is false when this is set.
  bool sleep_mode = false;
  // How long an INVALIDATE waits for our transfers to that peer to finish
  // before it answers that it could not drop the peer's memory yet.
  std::chrono::milliseconds invalidate_drain_timeout{5000};

  // ipc: CUDA device whose context imports a peer's CUDA memory (and copies).
  int cuda_device = 0;
  // ipc: how pieces of CUDA memory are copied (src/transfer/ipc/piece_copy.h).
  // "auto": one SM gather-kernel launch for the pieces whose both ends are on
  // cuda_device, cudaMemcpyAsync per piece for the rest (another GPU, host
  // memory); "kernel": the kernel across GPUs with peer access too;
  // "copy_engine": cudaMemcpyAsync per piece, always.
  std::string ipc_copy = "auto";
  // ucx: UCX_TLS and UCX_NET_DEVICES for this engine's UCP context (empty:
  // UCX's own choice or the environment's).
  std::string ucx_transports;
  std::string ucx_net_devices;
  // ucx: create endpoints with UCP_ERR_HANDLING_MODE_PEER, so a dead peer
  // fails transfers at once. UCX 1.13's shared-memory transports (posix, sysv)
  // lack it: set false to use them (a peer on this host is then watched
  // through its pid; a hung peer fails at the transfer's deadline).
  bool ucx_peer_error_handling = true;
  // ucx: where UCX serves puts and gets in software on the target anyway (no
  // RMA lane to it: tcp and shared memory in UCX 1.13), transfers between host
  // regions go as guarded active messages, which the target checks against
  // its region table as it copies: one round trip, no window between check
  // and copy. false: one-sided puts and gets between two region-table checks
  // everywhere (the path of RDMA transports; how tests cover it without one).
  bool ucx_guarded = true;
  // ucx: which regions move through pinned host staging. "auto": CUDA regions
  // when the installed UCX cannot register CUDA memory; "always": every region
  // (host memory too: how tests cover the path); "never": refuse such CUDA
  // regions. Staging memory is two pools (our transfers, peers' requests) of
  // ucx_staging_chunks chunks of ucx_staging_chunk_bytes each, made when the
  // first staged region is registered.
  std::string ucx_staging = "auto";
  size_t ucx_staging_chunk_bytes = size_t{4} << 20;
  size_t ucx_staging_chunks = 8;
};

}  // namespace siesta::transfer
