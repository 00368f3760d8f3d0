// TransferConfig: everything TransferEngine::create needs. Defaults suit tests
// on loopback; serve fills it from --kv-transfer-config.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transfer/side_channel.h"

namespace siesta::transfer {

// Which backend moves the bytes: "ipc" (same host: memfd / cuMem FDs over a
// Unix socket) or "ucx".
enum class BackendKind : uint8_t { kIpc, kUcx };

// How the ipc backend copies pieces of CUDA memory (ipc/piece_copy.h).
enum class IpcCopy : uint8_t {
  kAuto,        // the kernel where both ends are on the copying device, copy engines elsewhere
  kKernel,      // the kernel wherever the copying device addresses both ends (peer GPUs too)
  kCopyEngine,  // cudaMemcpyAsync per piece, always
};

// Which regions the ucx backend moves through pinned host staging.
enum class UcxStaging : uint8_t {
  kAuto,    // CUDA regions when this UCX cannot register CUDA memory
  kAlways,  // every region (host memory too: tests)
  kNever,   // none: such CUDA regions are refused
};

// The names the configs and flags use ("ipc" / "ucx"; "auto" / "kernel" /
// "copy_engine"; "auto" / "always" / "never"). A name not in the list is
// kInvalidArgument naming it and the list.
Result<BackendKind> parse_backend_kind(std::string_view text);
const char* backend_kind_name(BackendKind kind);
Result<IpcCopy> parse_ipc_copy(std::string_view text);
const char* ipc_copy_name(IpcCopy copy);
Result<UcxStaging> parse_ucx_staging(std::string_view text);
const char* ucx_staging_name(UcxStaging staging);

struct TransferConfig {
  // Unique among the engines that talk to each other (P/D: remote_engine_id).
  std::string engine_id;
  BackendKind backend = BackendKind::kIpc;
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
  // kAuto: one SM gather-kernel launch for the pieces whose both ends are on
  // cuda_device, cudaMemcpyAsync per piece for the rest (another GPU, host
  // memory); kKernel: the kernel across GPUs with peer access too;
  // kCopyEngine: cudaMemcpyAsync per piece, always.
  IpcCopy ipc_copy = IpcCopy::kAuto;
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
  // ucx: which regions move through pinned host staging. kAuto: CUDA regions
  // when the installed UCX cannot register CUDA memory; kAlways: every region
  // (host memory too: how tests cover the path); kNever: refuse such CUDA
  // regions. Staging memory is two pools (our transfers, peers' requests) of
  // ucx_staging_chunks chunks of ucx_staging_chunk_bytes each, made when the
  // first staged region is registered.
  UcxStaging ucx_staging = UcxStaging::kAuto;
  size_t ucx_staging_chunk_bytes = size_t{4} << 20;
  size_t ucx_staging_chunks = 8;
};

}  // namespace siesta::transfer
