// PdMetrics: the connector's counters (KvTransferMetrics), recorded by its
// threads and read by the HTTP thread. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>

#include "engine/engine_metrics.h"
#include "pd/send_state.h"

namespace siesta::pd {

class PdMetrics {
 public:
  PdMetrics() { m_.enabled = true; }

  // seconds: submit to done (a WRITE's notification acknowledged);
  // data_seconds: submit to the bytes in place.
  void transfer_done(uint64_t bytes, double seconds, double data_seconds);
  void transfer_failed();
  void load_done(uint64_t bytes, double seconds);
  void first_token_from_producer();  // a load ended with the producer's logits
  void load_failed();          // also counts a recompute
  void recomputed();           // a request that computed its prompt without a failed load (no blocks, bad params)
  void send_ended(SendEvent why);

  KvTransferMetrics snapshot() const;

 private:
  mutable std::mutex mu_;
  KvTransferMetrics m_;
};

}  // namespace siesta::pd
