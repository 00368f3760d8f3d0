// UcxPutProbe / UcxPutTarget: a raw UCP put loop, with none of the transfer
// engine around it (no region-table checks, no side channel, no progress
// thread on the initiator). `siesta bench transfer --backend ucx` measures it
// in the same run as the engine, as the limit the engine is compared with.
//
//   target = UcxPutTarget::create(options, base, bytes)     // peer process
//   probe  = UcxPutProbe::connect(options, target->descriptor(), local, bytes, deadline)
//   probe->put_batch(bytes_each, count, deadline)           // puts + flush, timed by the caller
#pragma once

#include <memory>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "transfer/ucx/ucx_worker.h"

namespace siesta::transfer::ucx {

// Registers [base, base + bytes) with its own UCP worker and keeps the worker
// progressed on a thread until destroyed.
class UcxPutTarget {
 public:
  static Result<std::unique_ptr<UcxPutTarget>> create(const UcxOptions& options, void* base, size_t bytes);
  ~UcxPutTarget();
  // What UcxPutProbe::connect needs: worker address, base, size, rkey.
  const std::string& descriptor() const { return descriptor_; }

 private:
  UcxPutTarget() = default;
  std::unique_ptr<UcxWorker> worker_;
  ucp_mem_h memh_ = nullptr;
  std::string descriptor_;
};

// Puts from [local, local + local_bytes) into a target, driving its own worker
// on the calling thread.
class UcxPutProbe {
 public:
  static Result<std::unique_ptr<UcxPutProbe>> connect(const UcxOptions& options, const std::string& descriptor,
                                                      void* local, size_t local_bytes, Deadline deadline);
  ~UcxPutProbe();
  // `count` puts of `bytes` each, the i-th from local + i*bytes to the
  // target's base + i*bytes, then a flush; returns when all completed.
  Ok put_batch(size_t bytes, size_t count, Deadline deadline);

 private:
  UcxPutProbe() = default;
  Ok wait(void* request, Deadline deadline);

  std::unique_ptr<UcxWorker> worker_;
  ucp_ep_h ep_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  ucp_mem_h local_memh_ = nullptr;
  char* local_ = nullptr;
  size_t local_bytes_ = 0;
  uint64_t remote_base_ = 0;
  uint64_t remote_bytes_ = 0;
};

}  // namespace siesta::transfer::ucx
