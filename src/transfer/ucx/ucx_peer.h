// UcxPeer: what the ucx backend holds for one remote engine: an endpoint to
// its worker (peer error handling on), the rkeys of its regions and of its
// region table. Everything but post()/release() runs on the progress thread.
//
// A transfer (UcxXfer) goes through stages on the progress thread:
//   kPreCheck  GET the peer's region table; every remote region must be live
//              at our descriptor's epoch, else nothing is sent
//   kData      ucp_put_nbx / ucp_get_nbx for every direct segment (both sides
//              registered with UCX), staged pieces (below) as chunks allow;
//              once the last put/get is posted: a fence and the post-check
//              GET of the table, ordered after the data, so its completion
//              also says that every put reached the target (no separate
//              flush round trip). A deregistration during the transfer fails
//              it (a READ's bytes are then not trusted)
// Segments to or from a peer's staged regions are checked by the peer itself
// (staged_target.h), so a transfer with only those needs no table GET.
//
// Guarded transfers (guarded_xfer.cpp, over guarded_messages.h): where UCX
// serves puts and gets on our endpoint in software on the peer anyway (no
// RMA lane: tcp, shared memory), a transfer between host regions registered
// directly on both sides takes neither table GET nor a put:
//   kGuarded   active messages of at most the peer's guarded size (64 KiB),
//              kGuardedMessagesInFlight at a time, each carrying (region,
//              slot, offset, bytes) per range, our descriptor's epoch and, for
//              a WRITE, the bytes; the peer's progress thread checks every
//              range against its table and copies (or refuses, copying
//              nothing), then answers, a READ with the bytes, which we copy
//              into our region. Done when every message was answered ok: one
//              round trip for a small transfer, the check done where the copy
//              is. TransferConfig::ucx_guarded turns it off.
//
// Staged pieces (staged_pieces.cpp): a segment whose local region is staged
// (CUDA memory UCX cannot register, or any memory when staging is forced), or
// whose remote region is (it has no rkey), moves in pieces of at most one
// staging chunk. WRITE: copy the piece into a chunk (cudaMemcpyAsync D2H),
// then put it or send it to the peer's staged region (kStagedWrite, which the
// peer acks once the bytes are in its region); the chunk returns as soon as
// the wire is done with it, so chunk i copies while chunk i-1 is on the wire.
// READ: get the piece into a chunk (or receive the peer's kStagedReadData),
// then copy it to the region (H2D). A transfer counts as done only after
// every copy and every ack, so its notification follows its data.
//
// An endpoint error (the peer died), the peer's process exiting or a missed
// deadline breaks the peer: every transfer in flight fails.
//
// The checks cannot close one window for direct segments: a peer that
// deregisters (and frees) a region between our pre-check and our puts,
// without INVALIDATE first, may still receive the bytes on transports without
// hardware keys (tcp writes to the address). The post-check then fails the
// transfer. The protocol (invalidate_peers before deregister_region) is what
// makes this safe. Staged regions and guarded transfers have no such window:
// the owner checks each piece or range as it copies.
#pragma once

#include <ucp/api/ucp.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "transfer/engine_meta.h"
#include "transfer/transfer_backend.h"
#include "transfer/ucx/guarded_messages.h"

namespace siesta::transfer::ucx {

class UcxBackend;
class UcxPeer;
struct EndpointContext;
struct StagingChunk;
struct UcxXfer;

// Where the peer's region table lives (from its EngineMeta::backend_blob).
struct RemoteTable {
  uint64_t address = 0;
  uint64_t bytes = 0;
  std::string rkey;  // packed
};

// One staged piece of a segment: at most one staging chunk's worth.
struct StagedPiece {
  enum class State {
    kIdle,        // not started
    kCopyIn,      // WRITE from a staged region: region -> chunk copy running
    kSending,     // WRITE: the put, or kStagedWrite, in flight
    kAwaitAck,    // WRITE to a staged region: sent; the peer's ack not here yet
    kGetting,     // READ from a direct region into the chunk
    kAwaitData,   // READ from a staged region: asked; its data not here yet
    kReceiving,   // READ from a staged region: its data arriving
    kLanded,      // READ into a staged region: the bytes are in the chunk
    kCopyOut,     // READ into a staged region: chunk -> region copy running
    kDone,
  };
  UcxXfer* xfer = nullptr;
  size_t segment = 0;   // into the plan's segments
  uint64_t offset = 0;  // within the segment
  uint64_t bytes = 0;
  bool local_staged = false;
  bool remote_staged = false;
  int device = -1;  // the local region's CUDA device, -1 for host memory
  State state = State::kIdle;
  StagingChunk* chunk = nullptr;
  bool in_flight = false;  // its UCX request runs (its callback has not come)
  uint64_t token = 0;      // while the peer's reply is awaited
  std::string header;      // of its request to the peer: UCX 1.13 reads it until the send completes
  bool acked = false;      // WRITE to a staged region: the ack came (maybe before the send completed)
  void* arrived = nullptr; // READ from a staged region: the rendezvous descriptor of its data
  bool counted = false;    // in UcxXfer::pieces_done
};

// One active message of a guarded transfer, and its answer.
struct GuardedMessage {
  UcxXfer* xfer = nullptr;
  std::vector<GuardedRange> ranges;  // the peer's side
  uint64_t token = 0;   // while its answer is awaited
  std::string header;   // a GuardedRequest, once sent: UCX reads it until the send completes
  // Our side of its ranges, in order: what a WRITE sends, where a READ's bytes land.
  std::vector<ucp_dt_iov_t> local;
  uint64_t bytes = 0;
  bool answered = false;
};

struct UcxXfer {
  enum class Stage { kPreCheck, kData, kGuarded };
  UcxBackend* backend = nullptr;
  std::shared_ptr<UcxPeer> peer;
  XferPlan plan;
  XferDone done;
  Stage stage = Stage::kPreCheck;
  size_t outstanding = 0;      // UCX requests not yet completed
  bool queued = false;         // in the backend's ready list
  bool orphaned = false;       // failed and handed back; only its requests keep it
  std::optional<Status> failure;
  std::vector<uint64_t> table;  // the fetched region table words

  // Segments moved with one put/get each (neither side staged).
  std::vector<size_t> direct_segments;
  // Whether some segment reaches the peer through an rkey (the table checks apply).
  bool direct_remote = false;
  bool post_check_posted = false;
  // Staged pieces, in order; never resized after start (pieces point into it).
  std::vector<StagedPiece> pieces;
  size_t first_open = 0;      // pieces before it are done
  size_t pieces_done = 0;
  size_t direct_unposted = 0;  // pieces to direct regions whose put/get is not posted yet
  size_t copies = 0;           // staging copies running

  // Guarded transfers: their messages (never resized once sent: answers point into it).
  std::vector<GuardedMessage> guarded;
  size_t guarded_sent = 0;
  size_t guarded_answered = 0;

  bool staged() const { return !pieces.empty(); }
};

// The UCX completion callback of a transfer's request (user_data: the
// UcxXfer): frees the request, records a failure, and advances the transfer
// when it was the last one outstanding (an orphaned transfer is dropped then).
void on_xfer_request_done(void* request, ucs_status_t status, void* user_data);

class UcxPeer final : public BackendPeer, public std::enable_shared_from_this<UcxPeer> {
 public:
  // guarded_bytes: the largest guarded message the peer serves (0: none).
  // process_watch: a pidfd of the peer's process (or -1), owned from here on.
  UcxPeer(UcxBackend& backend, EngineMeta meta, std::string worker_address, RemoteTable table, uint64_t guarded_bytes,
          int process_watch);
  ~UcxPeer() override;

  void post(XferPlan plan, XferDone done) override;
  Ok release(Deadline deadline) override;

  // --- progress thread ---
  // Creates the endpoint, unpacks the rkeys and flushes (which completes the
  // connection); `done` gets the outcome.
  void open(std::function<void(Ok)> done);
  // Moves a transfer to its next stage once its requests completed.
  void advance(UcxXfer* x);
  // Schedules advance() for the next tick (from UCX callbacks).
  void advance_later(UcxXfer* x);
  // Moves the staged pieces of `x` along (every tick while it has any).
  void pump(UcxXfer* x);
  // The peer's reply to a staged piece arrived (from the backend's AM handlers).
  void on_write_ack(StagedPiece* piece, Ok result);
  // Returns UCS_INPROGRESS when it keeps the rendezvous descriptor `data`.
  ucs_status_t on_read_data(StagedPiece* piece, Ok result, void* data, size_t length, bool rendezvous);
  // The peer answered a guarded message (its token is already forgotten).
  void on_guarded_reply(GuardedMessage* message, Ok result, const void* data, size_t length, bool rendezvous);
  // The endpoint failed, the peer exited or a deadline passed: fail every
  // transfer in flight. With peer error handling on, or when the peer is gone
  // (`peer_gone`), the endpoint is force-closed, which cancels their requests;
  // otherwise (a live peer without error handling, where a forced close is
  // undefined behaviour for it) the requests are left to finish.
  void break_connection(const Status& why, bool peer_gone);
  bool process_exited() const;
  // At shutdown (worker stopped): fails `x` now; its requests, if any, are
  // left to UCX as an orphan that the backend frees after the worker.
  void abandon(UcxXfer* x, const Status& why);
  const EngineMeta& meta() const { return meta_; }

 private:
  void start(UcxXfer* x);
  void issue(UcxXfer* x, const std::function<ucs_status_ptr_t()>& call);
  bool endpoint_usable(UcxXfer* x);
  void fetch_table(UcxXfer* x);
  void send_data(UcxXfer* x);
  void post_check(UcxXfer* x);
  void complete(UcxXfer* x, Ok result);
  void orphan(UcxXfer* x);
  void release_staging(UcxXfer* x, bool orphaning);

  // guarded_xfer.cpp
  bool guarded_eligible(const UcxXfer* x) const;
  void start_guarded(UcxXfer* x);
  void send_guarded(UcxXfer* x);
  void advance_guarded(UcxXfer* x);
  void forget_guarded(UcxXfer* x);
  void close_endpoint(bool force, std::function<void()> closed);
  void send_key(unsigned id, std::string header, const std::string& data);

  // staged_pieces.cpp
  Ok plan_pieces(UcxXfer* x);
  void step_piece(StagedPiece& p);
  Ok start_piece(StagedPiece& p);
  Ok send_piece(StagedPiece& p);
  void issue_piece(StagedPiece& p, StagedPiece::State next, const std::function<ucs_status_ptr_t()>& call);
  void fail_piece(StagedPiece& p, const Status& why);
  void piece_done(StagedPiece& p);

  UcxBackend& backend_;
  const EngineMeta meta_;
  const std::string worker_address_;
  const RemoteTable table_;
  const uint64_t guarded_bytes_;
  const int process_watch_;

  // progress thread
  ucp_ep_h ep_ = nullptr;
  EndpointContext* ep_context_ = nullptr;
  std::vector<ucp_rkey_h> rkeys_;  // parallel to meta_.regions; null for staged regions
  std::vector<bool> remote_staged_;  // parallel to meta_.regions
  std::vector<uint64_t> remote_chunk_;  // a staged region's owner's chunk size
  ucp_rkey_h table_rkey_ = nullptr;
  uint64_t initiator_key_ = 0;  // our name in staged and guarded requests to this peer (0: we sent no hello)
  // Host-memory transfers go guarded: UCX serves our puts and gets in software
  // on the peer (rma_in_software()), the peer serves guarded messages, and
  // TransferConfig::ucx_guarded is on.
  bool guarded_ = false;
  std::optional<Status> broken_;
  std::set<UcxXfer*> xfers_;

  // any thread
  std::mutex mu_;
  std::condition_variable idle_cv_;
  size_t in_flight_ = 0;
  bool released_ = false;
};

}  // namespace siesta::transfer::ucx
