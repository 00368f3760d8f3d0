// KvPort: the network as the producer and the consumer see it: the peers'
// descriptors, one-sided transfers of KV blocks, the P/D messages and their
// replies, and WRITE mode's lookup of a prefill instance by URL. The
// connector gives them TransferKvPort (over the TransferEngine and a
// PrefillLocator); unit tests give them a fake, so that every state of a send
// or a load can be driven without sockets or timing (tests/unit/pd_core_test.cpp).
//
// Also here: TaskRunner (where the producer and consumer run their blocking
// work) and PdClock (what "now" is).
//
// Thread safety: every KvPort method may be called from any thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "pd/pd_messages.h"
#include "pd/prefill_locator.h"
#include "transfer/engine_meta.h"
#include "transfer/xfer.h"

namespace siesta::transfer {
class TransferEngine;
}

namespace siesta::pd {

class KvPort {
 public:
  virtual ~KvPort() = default;

  virtual const std::string& engine_id() const = 0;
  // host:port of our side channel.
  virtual const std::string& address() const = 0;

  // The descriptor of peer `engine_id` at `address`, handshaking first when
  // we hold none, it is not ready, or (epoch given) it was made at another
  // epoch. Fails when `address` serves another engine, or the peer is at
  // another epoch than `epoch` after the handshake.
  virtual Result<transfer::EngineMeta> peer(const std::string& engine_id, const std::string& address,
                                            std::optional<uint64_t> epoch, Deadline deadline) = 0;

  // A READ or WRITE of `entries` with `peer`, ending (done or failed) by `deadline`.
  virtual Result<transfer::XferId> submit(const std::string& peer, transfer::XferOp op,
                                          const std::vector<transfer::XferEntry>& entries,
                                          Deadline deadline) = 0;
  // A WRITE whose notification (set_notification) reaches the peer after its data.
  virtual Result<transfer::XferId> submit_notify_later(const std::string& peer,
                                                       const std::vector<transfer::XferEntry>& entries,
                                                       Deadline deadline) = 0;
  virtual Result<void> set_notification(transfer::XferId id, std::string payload) = 0;
  // The transfer's status; a final one is reported once.
  virtual transfer::XferStatus poll(transfer::XferId id) = 0;
  // Whether the backend may still touch the transfer's memory (also after a
  // failure at the deadline, until the copy really ends).
  virtual bool in_flight(transfer::XferId id) const = 0;

  // A P/D message to the side channel at `address` and its reply. Transport
  // failures are errors; a refusal is a Reply with ok false.
  virtual Result<Reply> send(const std::string& address, std::string payload, Deadline deadline) = 0;

  // WRITE mode: the side channel of the prefill instance at HTTP `url`.
  virtual Result<PrefillSideChannel> resolve_prefill(const std::string& url, Deadline deadline) = 0;
  // A lookup that proved stale.
  virtual void forget_prefill(const std::string& url) = 0;
};

// Runs a task later, on another thread (TaskQueue), or when a test says so.
class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  virtual void post(std::function<void()> task) = 0;
};

// "Now", for every deadline of the producer and the consumer.
using PdClock = std::function<Clock::time_point()>;

// The KvPort of a real engine: its TransferEngine and a PrefillLocator that
// sends `http_api_key` (empty: none) to a prefill instance's /kv_transfer_info.
std::unique_ptr<KvPort> make_transfer_kv_port(transfer::TransferEngine& transfers, std::string http_api_key = {});

}  // namespace siesta::pd
