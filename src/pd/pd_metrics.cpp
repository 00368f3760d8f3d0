#include "pd/pd_metrics.h"

namespace siesta::pd {

void PdMetrics::transfer_done(uint64_t bytes, double seconds, double data_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.transfers_done;
  m_.transfer_bytes += bytes;
  m_.transfer_seconds.observe(seconds);
  m_.transfer_data_seconds.observe(data_seconds);
}

void PdMetrics::transfer_failed() {
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.transfers_failed;
}

void PdMetrics::load_done(uint64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.loads_done;
  m_.load_bytes += bytes;
  m_.load_seconds.observe(seconds);
}

void PdMetrics::first_token_from_producer() {
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.loads_with_logits;
}

void PdMetrics::load_failed() {
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.load_failures;
  ++m_.recomputed_requests;
}

void PdMetrics::recomputed() {
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.recomputed_requests;
}

void PdMetrics::send_ended(SendEvent why) {
  std::lock_guard<std::mutex> lock(mu_);
  switch (why) {
    case SendEvent::kSent: ++m_.sends_done; break;
    case SendEvent::kExpired: ++m_.sends_expired; break;
    case SendEvent::kFailed: ++m_.sends_failed; break;
    case SendEvent::kAborted:
    case SendEvent::kCancelled:
    case SendEvent::kReleased: ++m_.sends_aborted; break;
    case SendEvent::kPrefilled:
    case SendEvent::kWriteStarted:
    case SendEvent::kDrained: break;
  }
}

KvTransferMetrics PdMetrics::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return m_;
}

}  // namespace siesta::pd
