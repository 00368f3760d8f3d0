// OutputStream: the outputs of one Engine::submit call (one or more requests,
// by index in the order submitted), as the engine loop produces them.
//
//   OutputStream s = engine.submit({a, b}).value();
//   while (!s.finished()) {
//     for (IndexedDelta& d : s.next(steady_clock::now() + 100ms)) use(d.index, d.delta);
//     if (client_gone) s.abort();               // or just destroy s
//   }
//
// next() waits until something arrives or the deadline passes; what arrived
// for one request since the last call comes merged into one delta. Every
// request's last delta carries its RequestFinish. Destroying an OutputStream
// whose requests are not all finished aborts them.
//
// Thread safety: the consumer side (OutputStream) is used by one thread at a
// time; it may be moved between threads. The producer side (StreamState::push)
// is called by the engine loop. The engine may be destroyed first: abort then
// does nothing and the stream has already ended every request (kAbort).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "common/clock.h"
#include "engine/engine_request.h"

namespace siesta {

struct IndexedDelta {
  size_t index = 0;
  RequestDelta delta;
};

// Where a consumer's abort goes (the engine's inbox).
class StreamAborter {
 public:
  virtual ~StreamAborter() = default;
  virtual void abort(const std::vector<RequestId>& ids) = 0;
};

// The state shared by the engine loop (push) and the consumer (next).
class StreamState {
 public:
  explicit StreamState(std::vector<RequestId> ids);

  // Producer. Deltas after a request's finish are dropped. With notify false
  // the consumer is not woken until notify(): a producer that pushes many
  // deltas into one stream in a step wakes its consumer once.
  void push(size_t index, RequestDelta delta, bool notify = true);
  void notify() { cv_.notify_all(); }

  // Consumer. Empty when nothing arrived before the deadline (or everything was delivered).
  std::vector<IndexedDelta> next(Deadline deadline);
  bool finished() const;                       // every request finished and delivered
  std::vector<RequestId> unfinished_ids() const;  // not yet finished (pushed)
  const std::vector<RequestId>& ids() const { return ids_; }

 private:
  bool anything_pending() const;

  const std::vector<RequestId> ids_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<RequestDelta> pending_;
  std::vector<bool> has_pending_;
  std::vector<bool> finished_;    // final delta pushed
  size_t num_finished_ = 0;
  size_t num_delivered_final_ = 0;
};

class OutputStream {
 public:
  OutputStream(std::shared_ptr<StreamState> state, std::weak_ptr<StreamAborter> aborter);
  OutputStream(OutputStream&&) noexcept = default;
  OutputStream& operator=(OutputStream&& other) noexcept;
  OutputStream(const OutputStream&) = delete;
  OutputStream& operator=(const OutputStream&) = delete;
  ~OutputStream();

  std::vector<IndexedDelta> next(Deadline deadline) { return state_->next(deadline); }
  bool finished() const { return state_->finished(); }
  size_t size() const { return state_->ids().size(); }
  const RequestId& request_id(size_t index) const { return state_->ids()[index]; }
  // Asks the engine to abort every unfinished request; their final deltas
  // (reason kAbort) still arrive through next().
  void abort();

 private:
  std::shared_ptr<StreamState> state_;
  std::weak_ptr<StreamAborter> aborter_;
};

}  // namespace siesta
