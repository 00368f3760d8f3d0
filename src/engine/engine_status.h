// EngineStatus: what every lifecycle call of the Engine answers (the state it
// left, which memory is resident, whether the weights hold a checkpoint, what
// waits), and EngineMemoryReport: the bytes behind GET /memory. Plain values,
// filled by the Engine; the HTTP layer turns them into JSON.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_state.h"
#include "memory/backend.h"
#include "memory/memory_pool.h"
#include "memory/tag.h"
#include "model/weight_update.h"

namespace siesta {

// What a P/D connector did for a call that reset or released the KV cache
// (KvConnector::release_transfer_kv).
struct KvReleaseReport {
  int32_t loads_ended = 0;               // loads that had not ended: their requests recompute
  int32_t sends_ended = 0;               // holds for remote readers ended; the readers told
  std::vector<std::string> invalidated;  // peers sent INVALIDATE (engine ids)
  std::vector<std::string> acked;        // ... that acknowledged (they dropped our memory)
  std::vector<std::string> unanswered;   // ... that did not before the deadline (skipped, logged)
  bool deregistered = false;             // the KV cache is no longer registered for transfers
};

// What one lifecycle call did to the memory (zero for calls that did nothing).
struct EngineCallReport {
  memory::TagBytes released_bytes{};  // physical memory given back, per tag
  memory::TagBytes offloaded_bytes{}; // of which copied to host memory first
  memory::TagBytes mapped_bytes{};    // physical memory taken again, per tag
  memory::TagBytes restored_bytes{};  // of which filled from host copies
  uint64_t discarded_bytes = 0;       // host copies dropped (level 2 after level 1)
  std::string weights_loaded_from;    // a checkpoint read into the weights by this call
  // What this call wrote into the weights (update_weights, reload_weights, a
  // wake that read the checkpoint again).
  std::optional<WeightUpdateReport> weights_update;
  // The P/D connector's part, when the call reset or released the KV cache of
  // an engine that has one.
  std::optional<KvReleaseReport> kv_transfer;
  double seconds = 0;
};

struct EngineStatus {
  EngineState state = EngineState::kRunning;
  memory::TagSet resident;      // tags whose every allocation is mapped
  memory::TagSet not_resident;  // the others: what a wake_up still has to map
  // The weights hold a checkpoint (resident, or offloaded at level 1). False
  // after a level-2 sleep until reload_weights or the wake that makes every
  // tag resident (which reloads weights_dir).
  bool weights_loaded = true;
  std::string weights_dir;      // the checkpoint the weights hold (or held); the last one read
  // Where the weights' contents came from last: "dir" (weights_dir), or
  // "shm" / "cuda_ipc" when tensors were pushed since (update_weights).
  std::string weights_source = "dir";
  // After a sleep that released the weights: tensors not written again yet
  // (0 when weights_loaded).
  int32_t weights_unwritten = 0;
  int32_t held_requests = 0;    // arrived while not admitting; enter at resume / wake
  int32_t running_requests = 0;
  int32_t waiting_requests = 0; // in the scheduler (kept by a pause, or queued), and held
  EngineCallReport call;
};

struct EngineMemoryReport {
  memory::PoolUsage pool;
  std::optional<uint64_t> process_resident_bytes;  // absent when /proc cannot be read
  memory::BackendKind backend = memory::BackendKind::kHost;
  std::string backend_description;
  std::optional<memory::DeviceMemoryInfo> device;  // where the pool allocates (host: MemAvailable)
  // Host memory of offloads (copies, kept buffers) that copies reach by direct DMA.
  uint64_t pinned_host_bytes = 0;
};

}  // namespace siesta
