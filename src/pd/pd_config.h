// PdConfig: what `siesta serve --kv-transfer-config JSON` says, in vLLM's
// KVTransferConfig shape:
//
//   {"kv_connector": "SiestaConnector",
//    "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
//    "engine_id": "prefill-0",                      (optional; default: random)
//    "kv_connector_extra_config": {
//      "backend": "ucx" | "ipc",                    (default ucx)
//      "mode": "write" | "read",                    (default write)
//      "side_channel_host": "127.0.0.1",            (what peers connect to)
//      "side_channel_port": 0,                      (0: a free port)
//      "load_timeout_s": 30,       consumer: a request waits this long for its KV, then recomputes
//      "hold_timeout_s": 120,      producer: blocks kept for a reader after prefill, at most
//      "transfer_timeout_s": 10,   one READ or WRITE of a request's blocks
//      "message_timeout_s": 5,     one side-channel round trip (and the prefill URL lookup)
//      "write_grace_s": 2,         consumer: after an unanswered WRITE request's deadline, how
//                                  long its blocks stay held in case a copy is still running
//      "worker_threads": 4,        threads for handshakes, messages and transfer starts
//      "ucx_transports": "tcp", "ucx_net_devices": "lo", "ucx_peer_error_handling": true  (ucx only)
//      "ucx_guarded": true         (ucx only) host transfers where UCX has no RMA lane go as
//                                  guarded messages checked by the owner (src/transfer/README.md);
//                                  false: one-sided puts and gets with a region-table check
//      "ipc_copy": "auto" | "kernel" | "copy_engine"  (ipc only; src/transfer/README.md: how
//                                  CUDA KV pieces are copied; "kernel" across peer GPUs at any size)
//      "auth_key": "...",          the side channel's shared secret (at least 16 bytes, the same on
//                                  every engine that talks to this one): peers prove they hold it
//                                  and every control frame carries a MAC (src/transfer/frame_auth.h)
//      "auth_key_file": "PATH",    or a file that holds it (one line; kept out of `ps`)
//      "allow_unauthenticated_peers": false   true: run without a key (anyone who reaches the
//                                  side channel can then steer transfers); siesta serve refuses a
//                                  config with neither a key nor this
//    }}
//
// Unknown keys, wrong types, out-of-range values and impossible combinations
// (a ucx option with the ipc backend, a transfer deadline longer than the
// load deadline, auth_key with auth_key_file, ...) are refused with one line
// naming them. Parsing is a pure function; load_auth_key() then reads the key
// file and refuses a config that has no key and does not allow running without one.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transfer/transfer_config.h"

namespace siesta::pd {

enum class KvRole : uint8_t { kProducer, kConsumer, kBoth };
// WRITE: the consumer tells the producer where, the producer writes after
// prefill (the proxy's --mode concurrent). READ: the consumer reads the
// producer's blocks named in kv_transfer_params (--mode sequential).
enum class TransferMode : uint8_t { kWrite, kRead };

const char* kv_role_name(KvRole role);          // "kv_producer", ...
const char* transfer_mode_name(TransferMode m);  // "write", "read"

// The transfer engine's settings as P/D starts from them: the ucx backend
// (the documented default of kv_connector_extra_config.backend), a side
// channel on 127.0.0.1 at a free port.
transfer::TransferConfig default_pd_transfer_config();

struct PdConfig {
  KvRole role = KvRole::kBoth;
  TransferMode mode = TransferMode::kWrite;
  // What the JSON says of the transfer engine: engine_id (empty: the
  // connector picks a random one), backend, side_channel.host / port /
  // auth_key, ucx_*, ipc_copy; and cuda_device, the engine's CUDA device
  // (from --device cuda:N, not from the JSON). The connector adds the rest
  // (sleep mode, region count, handler threads).
  transfer::TransferConfig transfer = default_pd_transfer_config();
  // The engine's --api-key (not from the JSON): a consumer sends it to look up a
  // prefill instance (GET /kv_transfer_info), which requires it when it has one.
  std::string http_api_key;
  std::chrono::milliseconds load_timeout{30'000};
  std::chrono::milliseconds hold_timeout{120'000};
  std::chrono::milliseconds transfer_timeout{10'000};
  std::chrono::milliseconds message_timeout{5'000};
  std::chrono::milliseconds write_grace{2'000};
  int worker_threads = 4;
  // transfer.side_channel.auth_key: the secret (from auth_key, or read from auth_key_file).
  std::string auth_key_file;
  bool allow_unauthenticated_peers = false;

  bool produces() const { return role != KvRole::kConsumer; }
  bool consumes() const { return role != KvRole::kProducer; }
};

// Parses the JSON text of --kv-transfer-config. Errors are kInvalidArgument,
// one line, starting with "--kv-transfer-config: ".
Result<PdConfig> parse_kv_transfer_config(std::string_view json_text);

// Reads auth_key_file into auth_key (trailing whitespace dropped) and checks
// that there is a key of at least 16 bytes, or allow_unauthenticated_peers.
// Errors are kInvalidArgument, one line, naming the file or the keys.
Result<void> load_auth_key(PdConfig& config);

}  // namespace siesta::pd
