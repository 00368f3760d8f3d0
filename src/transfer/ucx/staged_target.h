// StagedTarget: serves peers' reads and writes of this engine's staged
// regions (memory our UCX cannot register, so peers have no rkey for it)
// over the active messages of staged_messages.h, through a pool of staging
// chunks of its own:
//
//   kStagedWrite + data  check the region (live at the peer's epoch, range in
//                        bounds) -> receive the data into a chunk -> copy it
//                        into the region (H2D) -> kStagedWriteAck
//   kStagedReadRequest   check -> copy the range into a chunk (D2H) ->
//                        kStagedReadData + the chunk's bytes
//
// The region is checked again right before each copy, and a copy into or
// out of a region holds it: remove_region() returns only once no copy runs,
// so a deregistered region is never touched. Requests wait in arrival order
// for a chunk; one holding a chunk needs nothing else to finish, so the pool
// cannot deadlock (the initiator side has a pool of its own).
//
// Answers go through an endpoint of our own to each initiator (made when its
// kStagedHello arrives, closed on kStagedBye, force-closed when it fails or,
// without UCX peer error handling, when its process exits), so a request of
// an initiator that died is dropped and frees its chunk, not answered into a
// dead endpoint. The guarded path (guarded_target.h) answers through the
// same endpoints.
//
// Lifecycle: install() before the worker's thread starts; add_region /
// remove_region from the engine's thread; set_pool() and tick() on the
// progress thread; destroy after the worker's thread stopped.
#pragma once

#include <ucp/api/ucp.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "transfer/region.h"
#include "transfer/ucx/staged_messages.h"

namespace siesta::transfer {
class RegionTable;
}

namespace siesta::transfer::ucx {

class StagingPool;
class UcxWorker;
struct InitiatorContext;
struct StagingChunk;
struct TargetRequestContext;

class StagedTarget {
 public:
  // peer_error_handling: whether our endpoints to initiators use UCX's peer
  // error handling (TransferConfig::ucx_peer_error_handling).
  StagedTarget(UcxWorker& worker, const RegionTable& table, bool peer_error_handling);
  ~StagedTarget();
  StagedTarget(const StagedTarget&) = delete;
  StagedTarget& operator=(const StagedTarget&) = delete;

  // Registers the request handlers on the worker.
  Ok install();
  // Serves region `id` ([base, base + bytes), in table slot `slot`; device:
  // its CUDA device, -1 for host memory) from now on.
  void add_region(RegionId id, uint32_t slot, char* base, size_t bytes, int device);
  // Stops serving `id`; returns once no copy into or out of it runs, or at `deadline`.
  void remove_region(RegionId id, Deadline deadline);

  // --- progress thread ---
  void set_pool(std::unique_ptr<StagingPool> pool);
  // Our endpoint to initiator `key` failed (it exited): its requests go unanswered.
  void initiator_failed(uint64_t key, ucs_status_t status);
  // Our endpoint to initiator `key` (made on its kStagedHello), through which
  // the guarded path (guarded_target.h) answers too; null when it said no
  // hello or failed.
  ucp_ep_h reply_endpoint(uint64_t key) const;
  StagingPool* pool() { return pool_.get(); }
  // Moves requests along; true while any is in flight.
  bool tick();

 private:
  struct Served {
    uint32_t slot = 0;
    char* base = nullptr;
    size_t bytes = 0;
    int device = -1;
    size_t copying = 0;  // copies into or out of it now running
  };
  struct Request {
    enum class State {
      kQueued,     // waiting for a chunk
      kReceiving,  // write: the data is arriving in the chunk
      kReceived,   // write: the data is in the chunk
      kCopying,    // between the chunk and the region
      kReply,      // ready to answer (the ack, the data, or the failure)
      kReplying,   // the answer is on its way; the chunk is held until it left
      kDone,
    };
    bool write = false;
    StagedRequest req;
    void* rendezvous = nullptr;  // write: the data's descriptor, not received yet
    std::vector<char> eager;     // write: data that came with the message
    State state = State::kQueued;
    StagingChunk* chunk = nullptr;
    Deadline deadline;
    RegionId holding;  // the region a running copy holds (value 0: none)
    std::optional<Status> failure;
    TargetRequestContext* in_flight = nullptr;  // a UCX request of ours runs
  };

  struct Initiator {
    ucp_ep_h ep = nullptr;
    InitiatorContext* context = nullptr;  // the endpoint's error handler argument
    int watch = -1;                       // a pidfd of its process (no peer error handling), or -1
    bool failed = false;                  // its endpoint failed or it exited: nothing more goes to it
    bool leaving = false;                 // it said kStagedBye
  };

  static ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param);
  static ucs_status_t on_hello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  static ucs_status_t on_bye(void* arg, const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param);
  void hello(const StagedHello& h, const void* address, size_t bytes);
  void close_initiators();
  void abandon(std::unique_ptr<Request>& q);
  ucs_status_t accept(bool write, const void* header, size_t header_length, void* data, size_t length,
                      const ucp_am_recv_param_t* param);
  // Checks the request against the region table and the regions we serve;
  // with `hold`, the region stays held (no removal) until release_hold().
  Ok check(const StagedRequest& r, bool hold, char** address, int* device);
  void release_hold(Request& q);
  void step(Request& q);
  void start_copy(Request& q);
  void reply(Request& q);
  void done(Request& q);

  UcxWorker& worker_;
  const RegionTable& table_;
  const bool peer_error_handling_;

  std::mutex mu_;
  std::condition_variable idle_cv_;
  std::map<RegionId, Served> served_;

  // progress thread
  std::unique_ptr<StagingPool> pool_;
  std::deque<std::unique_ptr<Request>> requests_;
  std::vector<std::unique_ptr<Request>> abandoned_;  // of dead initiators; UCX may never complete them
  std::map<uint64_t, Initiator> initiators_;
  ProcessIdentity identity_ = ProcessIdentity::of_this_process();
  Clock::time_point last_watch_{};
};

}  // namespace siesta::transfer::ucx
