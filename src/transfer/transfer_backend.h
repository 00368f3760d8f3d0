// TransferBackend: how bytes move between engines. The engine owns regions,
// peers, epochs and the side channel; a backend only exports registered
// memory, imports a peer's memory after a handshake, and copies.
//
// Backends live in src/transfer/<name>/<name>_backend.{h,cpp} (ipc, ucx) and
// look alike. Lifecycle, as the engine drives it:
//   1. make_transfer_backend(config, table, engine_id)
//   2. register_region / deregister_region as the owner maps and frees memory
//      (engine lock held; never concurrently)
//   3. connect(peer meta) after GET_META → a BackendPeer holding the imports
//   4. BackendPeer::post(plan, done) per transfer, from any thread
//   5. BackendPeer::release(deadline) on INVALIDATE, re-handshake or shutdown:
//      waits for that peer's transfers, then unmaps and closes everything
//      imported from it
//   6. destruction after every BackendPeer was released
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "transfer/engine_meta.h"
#include "transfer/region.h"
#include "transfer/xfer.h"

namespace siesta::transfer {

class RegionTable;
struct TransferConfig;

// A region registered on this engine, as the backend sees it.
struct LocalRegion {
  RegionId id;
  uint32_t slot = 0;
  RegionSpec spec;
};

// One validated piece of a transfer: bounds were checked by the engine.
struct XferSegment {
  RegionId local_region;
  void* local = nullptr;  // spec.base + local_offset
  MemoryKind local_kind = MemoryKind::kHost;
  size_t remote_index = 0;  // into the peer's EngineMeta::regions
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
};

struct XferPlan {
  XferOp op = XferOp::kWrite;
  std::vector<XferSegment> segments;
  Deadline deadline;
};

// Called exactly once per posted plan, on a backend thread: Ok when every
// byte is in place at the destination (a WRITE is flushed to the target), or
// why not. It must not block.
using XferDone = std::function<void(Ok)>;

// What a backend holds for one remote engine after a handshake.
class BackendPeer {
 public:
  virtual ~BackendPeer() = default;
  // Starts moving the bytes of `plan`; never blocks on the network. A small
  // local copy may complete (and call `done`) before post() returns.
  virtual void post(XferPlan plan, XferDone done) = 0;
  // Waits (until `deadline`) for this peer's posted plans to finish, then
  // unmaps, deregisters and closes everything imported from the peer. Later
  // posts fail. kTimeout when transfers were still running at the deadline
  // (the imports are then dropped when the last of them ends).
  virtual Ok release(Deadline deadline) = 0;
};

class TransferBackend {
 public:
  virtual ~TransferBackend() = default;
  virtual std::string_view name() const = 0;
  // Whether regions can be deregistered and registered again while peers keep
  // their connection (needed for sleep mode).
  virtual bool supports_sleep() const = 0;
  // Published as EngineMeta::backend_blob.
  virtual std::string engine_blob() const = 0;
  // Exports or registers `region`; the answer is its RegionDesc::backend_blob.
  virtual Result<std::string> register_region(const LocalRegion& region) = 0;
  virtual void deregister_region(RegionId id) = 0;
  // Imports what `meta` describes (epoch meta.epoch) within `deadline`.
  virtual Result<std::shared_ptr<BackendPeer>> connect(const EngineMeta& meta, Deadline deadline) = 0;
};

// The backend config.backend names.
Result<std::unique_ptr<TransferBackend>> make_transfer_backend(const TransferConfig& config, RegionTable& table);

}  // namespace siesta::transfer
