// GuardedTarget: serves peers' guarded reads and writes (guarded_messages.h)
// of this engine's host regions that UCX registered directly, inside the
// active-message handlers on the progress thread:
//
//   kGuardedWrite        check every range -> copy the message's bytes into
//                        the region(s) -> kGuardedWriteAck
//   kGuardedReadRequest  check every range -> copy the ranges out ->
//                        kGuardedReadData + those bytes
//
// Every range is checked (live in the region table at the initiator's epoch,
// a region served here, in bounds) before any byte is copied, and the checks
// and the copies run under one lock that remove_region() takes too: once
// deregistration has begun no request touches the region, and it returns
// only after a copy that began before it ended. A refused request copies
// nothing and is answered with why.
//
// Answers go through StagedTarget's endpoint to the initiator (made on its
// kStagedHello); a request from an initiator without one is dropped (its
// transfer fails at its deadline).
//
// Lifecycle: install() before the worker's thread starts; add_region /
// remove_region from the engine's thread; stop() once the worker's thread
// stopped, before the StagedTarget goes; then destroy.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "common/status.h"
#include "transfer/region.h"
#include "transfer/ucx/guarded_messages.h"

namespace siesta::transfer {
class RegionTable;
}

namespace siesta::transfer::ucx {

class StagedTarget;
class UcxWorker;

class GuardedTarget {
 public:
  GuardedTarget(UcxWorker& worker, const RegionTable& table, StagedTarget& endpoints);
  GuardedTarget(const GuardedTarget&) = delete;
  GuardedTarget& operator=(const GuardedTarget&) = delete;

  // Registers the request handlers on the worker.
  Ok install();
  // Serves region `id` ([base, base + bytes), host memory, table slot `slot`) from now on.
  void add_region(RegionId id, uint32_t slot, char* base, size_t bytes);
  // Stops serving `id`; returns once no copy into or out of it runs.
  void remove_region(RegionId id);
  // Requests from now on are dropped unanswered.
  void stop();

 private:
  struct Served {
    uint32_t slot = 0;
    char* base = nullptr;
    size_t bytes = 0;
  };

  static ucs_status_t on_write(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  static ucs_status_t on_read(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param);
  // Checks every range of `r`, then copies: from `in` into the regions
  // (write), or out of them into `out` (read). All or nothing.
  Ok serve(const GuardedRequest& r, const char* in, std::string* out);
  // Our endpoint to the initiator named `initiator` (null, and logged, when there is none).
  ucp_ep_h reply_endpoint(uint64_t initiator);
  void reply(ucp_ep_h ep, unsigned id, uint64_t token, const Ok& result, std::string data);

  UcxWorker& worker_;
  const RegionTable& table_;
  StagedTarget& endpoints_;

  std::mutex mu_;  // held for every check-and-copy, and by add/remove_region
  std::map<RegionId, Served> served_;
  std::atomic<bool> stopped_{false};
};

}  // namespace siesta::transfer::ucx
