// UcxWorker: one UCP context and worker, and the thread that owns the worker.
//
// Every call that touches the worker (endpoints, rkey unpacking, puts, gets,
// flushes, progress) runs on that thread: post() queues a task for it.
// Context-level calls (ucp_mem_map, ucp_rkey_pack) are thread safe
// (mt_workers_shared) and run on the caller's thread.
//
// The loop: run queued tasks, progress the worker, run the tick (which moves
// transfers along and enforces their deadlines). While the tick reports work
// in flight, and for 200 us after the last activity, it spins, yielding the
// CPU whenever a pass found nothing to do (on a host with fewer cores than
// busy threads, the caller waiting for a transfer, or the peer's worker, gets
// to run at once rather than after a scheduler slice); then it sleeps with a
// growing backoff (20 us to 1 ms) that post() cuts short, so a peer writing
// into our memory over a transport that needs our progress (tcp) is served
// within a millisecond even when we are idle.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/clock.h"
#include "common/status.h"

namespace siesta::transfer::ucx {

struct UcxOptions {
  std::string transports;   // UCX_TLS; empty: UCX's default
  std::string net_devices;  // UCX_NET_DEVICES; empty: UCX's default
  bool peer_error_handling = true;
};

class UcxWorker {
 public:
  static Result<std::unique_ptr<UcxWorker>> create(const UcxOptions& options);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // This worker's packed address (what peers pass to ucp_ep_create).
  const std::string& address() const { return address_; }
  // Whether UCX can register CUDA memory in this build and configuration.
  bool supports_cuda() const { return supports_cuda_; }
  bool peer_error_handling() const { return peer_error_handling_; }
  // The largest active-message header this worker sends (0: unknown).
  size_t max_am_header() const { return max_am_header_; }

  // Starts the progress thread; `tick` runs on it every loop and returns true
  // while work is in flight.
  void start(std::function<bool()> tick);
  // Stops and joins the progress thread (queued tasks run first).
  void stop();
  void post(std::function<void()> task);
  bool on_worker_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  UcxWorker() = default;
  void loop();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  bool supports_cuda_ = false;
  bool peer_error_handling_ = true;
  size_t max_am_header_ = 0;

  std::function<bool()> tick_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

Status ucx_error(const char* what, ucs_status_t status);

// Whether UCX serves puts and gets on `ep` in software on the target: none of
// its lanes is an RMA lane (tcp and shared memory in UCX 1.13; RDMA
// transports have them), so the target's progress copies every byte anyway.
// UCX 1.13's ucp_ep_query names no transports, so this reads the lane table
// that ucp_ep_print_info writes; false when it cannot tell (no lane table).
bool rma_in_software(ucp_ep_h ep);

// Memory registered with a UCP context (ucp_mem_map), and its packed rkey
// when asked for (what peers unpack to reach it).
struct MappedMemory {
  ucp_mem_h memh = nullptr;
  std::string rkey;
};
Result<MappedMemory> map_memory(ucp_context_h context, void* base, size_t bytes, ucs_memory_type_t type,
                                bool pack_rkey);

// One value handed from the progress thread to a thread that waits for it,
// until a deadline.
template <class T>
class Waiter {
 public:
  void set(T v) {
    std::lock_guard<std::mutex> lock(mu_);
    value_.emplace(std::move(v));
    cv_.notify_all();
  }
  // The value, or nothing when the deadline passed first.
  std::optional<T> wait_until(Deadline d) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, d, [&] { return value_.has_value(); });
    return value_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<T> value_;
};

}  // namespace siesta::transfer::ucx
