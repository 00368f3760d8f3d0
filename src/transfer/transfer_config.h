// TransferConfig: everything TransferEngine::create needs. Defaults suit tests
// on loopback; serve fills it from --kv-transfer-config.
#pragma once

#include <chrono>
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

  // ipc: CUDA device whose context imports a peer's CUDA memory.
  int cuda_device = 0;
  // ucx: UCX_TLS and UCX_NET_DEVICES for this engine's UCP context (empty:
  // UCX's own choice or the environment's).
  std::string ucx_transports;
  std::string ucx_net_devices;
};

}  // namespace siesta::transfer
