#include "pd/producer.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "common/log.h"
#include "pd/kv_blocks.h"

namespace siesta::pd {
namespace {

constexpr size_t kMaxParked = 4096;

bool flag(const nlohmann::json& params, const char* key) {
  if (!params.is_object()) return false;
  auto it = params.find(key);
  return it != params.end() && it->is_boolean() && it->get<bool>();
}

// A wall-clock deadline from a peer, on our steady clock.
Deadline steady_deadline(int64_t unix_ms) {
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  return Clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, unix_ms - now_ms));
}

}  // namespace

std::string Producer::key_of(const std::string& x_request_id, int32_t choice) {
  if (x_request_id.empty()) return {};
  return x_request_id + "#" + std::to_string(choice);
}

size_t Producer::num_sends() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sends_.size();
}

void Producer::transition(Send& s, SendEvent event, const std::string& detail) {
  auto next = next_send_state(s.state, event);
  if (!next) {
    SIESTA_LOG_DEBUG("pd: send {}: {}", s.id, next.error().message);
    return;
  }
  const SendState from = s.state;
  s.state = *next;
  SIESTA_LOG_DEBUG("pd: send {} {} -> {} ({}){}{}", s.id, send_state_name(from), send_state_name(s.state),
                   send_event_name(event), detail.empty() ? "" : ": ", detail);
  if (s.state != SendState::kDone) return;
  s.end = event;
  ctx_.metrics.send_ended(event);
  std::string why = send_end_reason(event);
  if (!detail.empty() && event != SendEvent::kSent) why += ": " + detail;
  ended_ids_.add(s.id, why);
  if (!s.key.empty()) {
    ended_keys_.add(s.key, why);
    by_key_.erase(s.key);
  }
  if (event != SendEvent::kSent && event != SendEvent::kPrefilled && s.target && !s.write)
    post_load_failed(*s.target, "the producer's send of request " + s.id + " " + why);
}

bool Producer::write_busy(const Send& s) const {
  return s.write_starting || (s.write && ctx_.transfers.in_flight(*s.write));
}

Producer::Target Producer::target_of(const WriteRequest& m) const {
  return Target{m, steady_deadline(m.deadline_unix_ms)};
}

std::string Producer::check_prompt(const Send& s, const PromptCheck& p, const LocalKv& kv) const {
  if (p.layout != kv.layout || p.block_bytes != kv.block_bytes)
    return fmt::format("KV cache layouts differ: the consumer has '{}' ({} bytes a block), this producer '{}' ({} "
                       "bytes a block); serve the same model with the same dtype on both",
                       p.layout, p.block_bytes, kv.layout, kv.block_bytes);
  if (p.num_tokens != s.num_tokens || p.hash != s.prompt_hash)
    return fmt::format("the prompts differ: the consumer's has {} tokens, the producer's request {} has {} (or other "
                       "tokens)",
                       p.num_tokens, s.id, s.num_tokens);
  return {};
}

// ---- engine loop ------------------------------------------------------------------

ConnectorPlan Producer::on_added(const EngineRequest& r) {
  if (!flag(r.kv_transfer_params, "do_remote_decode")) return {};
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) {
    SIESTA_LOG_WARN("pd: request {} asks for remote decode, but the KV cache is not registered for transfers; it "
                    "gets no kv_transfer_params",
                    r.id);
    return {};
  }
  // READ mode names one request per answer (vLLM's kv_transfer_params are
  // per response): later choices of the same HTTP request are not held.
  if (ctx_.config.mode == TransferMode::kRead && r.choice_index > 0) return {};
  std::lock_guard<std::mutex> lock(mu_);
  Send s;
  s.id = r.id;
  s.key = key_of(r.x_request_id, r.choice_index);
  s.num_tokens = static_cast<int32_t>(r.prompt_tokens.size());
  s.prompt_hash = prompt_hash(r.prompt_tokens);
  if (!s.key.empty()) {
    if (cancelled_early_.find(s.key)) {
      SIESTA_LOG_INFO("pd: request {} (X-Request-Id {}, choice {}) was cancelled by the decode engine before it came; "
                      "its blocks are not held",
                      r.id, r.x_request_id, r.choice_index);
      return {};
    }
    if (by_key_.count(s.key)) {
      SIESTA_LOG_WARN("pd: request {}: X-Request-Id {} choice {} is already prefilling for a decode engine; this one "
                      "is not offered for remote decode",
                      r.id, r.x_request_id, r.choice_index);
      return {};
    }
    auto parked = parked_.find(s.key);
    if (parked != parked_.end()) {
      s.target = std::move(parked->second);
      parked_.erase(parked);
    }
    by_key_[s.key] = s.id;
  }
  sends_[s.id] = std::move(s);
  return ConnectorPlan{.hold_blocks_for_remote_reader = true, .load_remote_kv = false};
}

nlohmann::json Producer::params(const RequestId& id, const std::vector<BlockId>& blocks) const {
  const std::string& address = ctx_.transfers.address();
  const size_t colon = address.rfind(':');
  return nlohmann::json{
      {"do_remote_prefill", true},
      {"do_remote_decode", false},
      {"remote_engine_id", ctx_.transfers.engine_id()},
      {"remote_block_ids", blocks},
      {"remote_host", address.substr(0, colon)},
      {"remote_port", std::stoi(address.substr(colon + 1))},
      {"remote_request_id", id},
      {"tp_size", 1},
  };
}

nlohmann::json Producer::on_finished(const EngineRequest& r, const RequestOutput& out) {
  if (!flag(r.kv_transfer_params, "do_remote_decode")) return nullptr;
  // The prefill succeeded whatever happens to the blocks: the answer always
  // carries kv_transfer_params (a proxy checks them), and names no blocks
  // when none are held for a reader (the decode engine then computes the
  // prompt itself).
  const std::vector<BlockId> none;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(r.id);
  if (it == sends_.end()) {
    if (!out.held_blocks.empty()) orphan_holds_.push_back(send_hold_owner(r.id));
    return params(r.id, none);
  }
  Send& s = it->second;
  if (out.held_blocks.empty()) {
    transition(s, SendEvent::kFailed, "its blocks could not be held");
    return params(s.id, none);
  }
  s.hold_taken = true;
  if (!out.new_tokens.empty()) s.logits = out.new_tokens.front().logits;
  const LocalKv kv = ctx_.kv.get();
  // The prompt's blocks (a request that generated more than one token holds
  // more; the reader needs the prompt's only).
  s.blocks.assign(out.held_blocks.begin(),
                  out.held_blocks.begin() + std::min<size_t>(out.held_blocks.size(), kv.blocks_for(s.num_tokens)));
  if (s.cancelled) {
    transition(s, SendEvent::kAborted, "the decode engine cancelled it during prefill");
    return params(s.id, none);
  }
  if (!kv.registered) {
    transition(s, SendEvent::kReleased, "the KV cache was released during prefill");
    return params(s.id, none);
  }
  if (static_cast<int32_t>(s.blocks.size()) != kv.blocks_for(s.num_tokens)) {
    transition(s, SendEvent::kFailed,
               fmt::format("{} blocks held for a prompt of {} tokens", s.blocks.size(), s.num_tokens));
    return params(s.id, none);
  }
  transition(s, SendEvent::kPrefilled);
  s.hold_deadline = Clock::now() + ctx_.config.hold_timeout;
  if (s.target) post_write(s.id);
  ctx_.kick();
  return params(s.id, s.blocks);
}

void Producer::on_aborted(const RequestId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(id);
  if (it == sends_.end()) return;
  Send& s = it->second;
  if (s.state == SendState::kWaiting) transition(s, SendEvent::kAborted, "the request was aborted here");
}

void Producer::collect(ConnectorUpdates& updates) {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::string& owner : orphan_holds_) updates.releasable_holds.push_back(std::move(owner));
  orphan_holds_.clear();
  for (auto it = sends_.begin(); it != sends_.end();) {
    Send& s = it->second;
    if (s.state != SendState::kDone || write_busy(s)) {
      ++it;
      continue;
    }
    if (s.hold_taken) updates.releasable_holds.push_back(send_hold_owner(s.id));
    SIESTA_LOG_DEBUG("pd: send {} forgotten ({}hold given back)", s.id, s.hold_taken ? "" : "no ");
    if (!s.key.empty() && by_key_.count(s.key) && by_key_[s.key] == s.id) by_key_.erase(s.key);
    it = sends_.erase(it);
  }
}

// ---- the consumer's messages --------------------------------------------------------

std::string Producer::on_write(const WriteRequest& m) {
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) return encode_refusal("the producer's KV cache is not registered (it is asleep or releasing it)");
  if (m.prompt.layout != kv.layout || m.prompt.block_bytes != kv.block_bytes)
    return encode_refusal(fmt::format("KV cache layouts differ: the consumer has '{}', this producer '{}'",
                                      m.prompt.layout, kv.layout));
  if (m.blocks.empty()) return encode_refusal("a write of no blocks");
  const std::string key = key_of(m.x_request_id, m.choice);
  std::lock_guard<std::mutex> lock(mu_);
  auto by = by_key_.find(key);
  if (by == by_key_.end()) {
    if (cancelled_early_.find(key)) return encode_refusal("request " + m.x_request_id + " was cancelled by the consumer");
    // (X-Request-Ids must be unique: the proxy's are.)
    if (const std::string* why = ended_keys_.find(key)) return encode_refusal("request " + m.x_request_id + " " + *why);
    if (parked_.count(key)) return encode_refusal("request " + m.x_request_id + " already has a write target");
    if (parked_.size() >= kMaxParked)
      return encode_refusal("the producer has " + std::to_string(parked_.size()) + " write requests waiting for "
                            "their requests; retry later");
    parked_[key] = target_of(m);
    ctx_.kick();
    return encode_ok();
  }
  Send& s = sends_.at(by->second);
  if (s.state == SendState::kDone) return encode_refusal("request " + s.id + " " + *ended_ids_.find(s.id));
  if (s.target) return encode_refusal("request " + s.id + " already has a write target");
  if (std::string bad = check_prompt(s, m.prompt, kv); !bad.empty()) return encode_refusal(bad);
  s.target = target_of(m);
  if (s.state == SendState::kReady) post_write(s.id);
  return encode_ok();
}

std::string Producer::on_cancel(const CancelRequest& m) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string key = key_of(m.x_request_id, m.choice);
  Send* s = nullptr;
  if (!m.producer_request.empty()) {
    auto it = sends_.find(m.producer_request);
    if (it != sends_.end()) s = &it->second;
  } else if (auto by = by_key_.find(key); by != by_key_.end()) {
    s = &sends_.at(by->second);
  }
  if (!s) {
    // Not here yet (WRITE mode: the consumer gave up first): remember, so
    // that the request holds nothing when it comes.
    if (!key.empty()) {
      parked_.erase(key);
      if (!ended_keys_.find(key)) cancelled_early_.add(key, "cancelled by the consumer");
    }
    return encode_ok({{"writing", false}});
  }
  switch (s->state) {
    case SendState::kWaiting:
      s->cancelled = true;
      s->target.reset();
      return encode_ok({{"writing", false}});
    case SendState::kReady:
      if (write_busy(*s)) return encode_ok({{"writing", true}});
      s->target.reset();  // the consumer knows: no load_failed for it
      transition(*s, SendEvent::kAborted, "cancelled by the consumer");
      ctx_.kick();
      return encode_ok({{"writing", false}});
    case SendState::kDone:
      return encode_ok({{"writing", write_busy(*s)}});
  }
  return encode_ok({{"writing", false}});
}

std::string Producer::on_read_start(const ReadStart& m) {
  const LocalKv kv = ctx_.kv.get();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(m.producer_request);
  if (it == sends_.end()) {
    if (const std::string* why = ended_ids_.find(m.producer_request))
      return encode_refusal("request " + m.producer_request + " " + *why);
    return encode_refusal("request " + m.producer_request + " is not held by this producer (unknown, or ended long ago)");
  }
  Send& s = it->second;
  if (s.state == SendState::kDone) return encode_refusal("request " + s.id + " " + *ended_ids_.find(s.id));
  if (s.state == SendState::kWaiting) return encode_refusal("request " + s.id + " has not finished its prefill yet");
  if (!kv.registered) return encode_refusal("the producer's KV cache is not registered (it is asleep)");
  if (std::string bad = check_prompt(s, m.prompt, kv); !bad.empty()) return encode_refusal(bad);
  if (m.first_block < 0 || static_cast<size_t>(m.first_block) + m.blocks.size() != s.blocks.size() ||
      !std::equal(m.blocks.begin(), m.blocks.end(), s.blocks.begin() + m.first_block))
    return encode_refusal(fmt::format("the read names other blocks than request {} holds (from prompt block {}: {} "
                                      "named, {} held); its kv_transfer_params were changed on the way",
                                      s.id, m.first_block, m.blocks.size(), s.blocks.size() - std::min<size_t>(s.blocks.size(), m.first_block)));
  const auto lease = std::chrono::duration_cast<std::chrono::milliseconds>(s.hold_deadline - Clock::now());
  return encode_ok({{"region", std::to_string(kv.region.value)},
                    {"epoch", std::to_string(kv.epoch)},
                    {"lease_ms", std::max<int64_t>(0, lease.count())}});
}

std::string Producer::on_read_done(const ReadDone& m) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(m.producer_request);
  if (it == sends_.end()) {
    const std::string* why = ended_ids_.find(m.producer_request);
    return encode_ok({{"held", false}, {"reason", why ? *why : std::string("unknown request")}});
  }
  Send& s = it->second;
  if (s.state != SendState::kReady) {
    const std::string* why = ended_ids_.find(s.id);
    return encode_ok({{"held", false},
                      {"reason", s.state == SendState::kWaiting ? std::string("not prefilled yet")
                                                                : why ? *why : std::string("ended")}});
  }
  transition(s, SendEvent::kSent, "read by the consumer");
  ctx_.kick();
  return encode_ok({{"held", true}}, s.logits, m.logits_top);
}

// ---- writes (WRITE mode) --------------------------------------------------------------

void Producer::post_write(const RequestId& id) {
  Send& s = sends_.at(id);
  if (s.write_starting || s.write) return;
  s.write_starting = true;
  ctx_.tasks.post([this, id] { run_write(id); });
}

void Producer::run_write(const RequestId& id) {
  Target target;
  std::vector<BlockId> blocks;
  LogitsRow logits;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sends_.find(id);
    if (it == sends_.end()) return;
    Send& s = it->second;
    if (s.state != SendState::kReady || !s.target) {
      s.write_starting = false;
      return;
    }
    target = *s.target;
    blocks = s.blocks;
    logits = s.logits;
  }
  const WriteRequest& m = target.request;
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) return fail_write(id, "the producer's KV cache is not registered");
  if (Clock::now() >= target.deadline) return fail_write(id, "the consumer's deadline passed before the prefill ended");
  if (static_cast<size_t>(m.first_block) + m.blocks.size() != blocks.size())
    return fail_write(id, fmt::format("the consumer asked for blocks [{}, {}) and the request has {}", m.first_block,
                                      m.first_block + m.blocks.size(), blocks.size()));
  const Deadline deadline = transfer::earlier(target.deadline, Clock::now() + ctx_.config.transfer_timeout);
  auto meta = ensure_peer(ctx_.transfers, m.consumer_engine, m.consumer_address, m.epoch,
                          ctx_.message_deadline(deadline));
  if (!meta) return fail_write(id, meta.error().message);
  auto region = peer_kv_region(*meta, m.region);
  if (!region) return fail_write(id, region.error().message);
  auto entries = block_entries(kv.region, std::span<const int32_t>(blocks).subspan(m.first_block), region->id,
                               m.blocks, kv.block_bytes);
  if (!entries) return fail_write(id, entries.error().message);
  const uint64_t bytes = static_cast<uint64_t>(m.blocks.size()) * kv.block_bytes;
  const Clock::time_point started = Clock::now();
  // The notification (with the logits) is encoded while the bytes move.
  auto xfer = ctx_.transfers.submit_notify_later(m.consumer_engine, transfer::XferOp::kWrite, *entries, deadline);
  if (!xfer) return fail_write(id, xfer.error().message);
  const Clock::time_point submitted = Clock::now();
  if (auto set = ctx_.transfers.set_notification(*xfer, encode(Written{m.consumer_request, bytes, logits, m.logits_top}));
      !set)
    SIESTA_LOG_DEBUG("pd: write of request {}: its notification was not set: {}", id, set.error().message);
  SIESTA_LOG_DEBUG("pd: write of request {}: submitted in {} us, notification encoded in {} us", id,
                   std::chrono::duration_cast<std::chrono::microseconds>(submitted - started).count(),
                   std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - submitted).count());
  {
    std::lock_guard<std::mutex> lock(mu_);
    Send& s = sends_.at(id);  // kept while write_starting
    s.write_starting = false;
    s.write = *xfer;
    s.write_started = started;
    s.write_bytes = bytes;
  }
  ctx_.kick();
}

void Producer::fail_write(const RequestId& id, const std::string& why) {
  ctx_.metrics.transfer_failed();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(id);
  if (it == sends_.end()) return;
  Send& s = it->second;
  s.write_starting = false;
  SIESTA_LOG_WARN("pd: write of request {} to {} failed: {}", id, s.target ? s.target->request.consumer_engine : "?",
                  why);
  if (s.state != SendState::kDone) {
    transition(s, SendEvent::kFailed, why);  // tells the consumer (no write in flight)
  } else if (s.target) {
    post_load_failed(*s.target, "the write failed: " + why);
  }
  ctx_.kick();
}

void Producer::post_load_failed(const Target& target, const std::string& why) {
  const WriteRequest m = target.request;
  PdContext* ctx = &ctx_;
  ctx_.tasks.post([ctx, m, why] {
    auto r = send_pd_message(ctx->transfers, m.consumer_address, encode(LoadFailed{m.consumer_request, why}),
                             Clock::now() + ctx->config.message_timeout);
    if (!r) SIESTA_LOG_DEBUG("pd: telling {} that {} will not be written: {}", m.consumer_engine, m.consumer_request,
                             r.error().message);
  });
}

// ---- ticker and sleep -------------------------------------------------------------------

bool Producer::tick(Clock::time_point now, std::optional<transfer::XferId>* wait_on) {
  bool busy = false;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (now >= it->second.deadline + ctx_.config.write_grace)
      it = parked_.erase(it);
    else
      ++it;
  }
  for (auto& [id, s] : sends_) {
    if (s.write && !s.write_final) {
      transfer::XferStatus st = ctx_.transfers.poll(*s.write);
      if (st.pending()) {
        busy = true;
        if (wait_on && !*wait_on) *wait_on = *s.write;
        continue;
      }
      s.write_final = true;
      if (st.done()) {
        ctx_.metrics.transfer_done(s.write_bytes, std::chrono::duration<double>(st.finished_at - s.write_started).count(),
                                   std::chrono::duration<double>(st.data_at - s.write_started).count());
        transition(s, SendEvent::kSent, "written to " + s.target->request.consumer_engine);
      } else {
        ctx_.metrics.transfer_failed();
        SIESTA_LOG_WARN("pd: write of request {} to {} failed: {}", id, s.target->request.consumer_engine,
                        st.why.message);
        if (s.state != SendState::kDone) transition(s, SendEvent::kFailed, st.why.message);
        post_load_failed(*s.target, "the write failed: " + st.why.message);
      }
    }
    if (s.state == SendState::kReady && now >= s.hold_deadline && !write_busy(s))
      transition(s, SendEvent::kExpired,
                 fmt::format("no reader within {} s", std::chrono::duration<double>(ctx_.config.hold_timeout).count()));
    if (s.write_starting || (s.write && !s.write_final)) busy = true;
  }
  return busy;
}

Result<void> Producer::end_all(Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sends_)
      if (s.state == SendState::kReady) transition(s, SendEvent::kReleased);
  }
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t busy = 0;
      for (auto& [id, s] : sends_) busy += write_busy(s);
      if (busy == 0) return {};
      if (Clock::now() >= deadline)
        return timeout(fmt::format("{} writes to decode engines were still in flight at the deadline", busy));
    }
    tick(Clock::now());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace siesta::pd
