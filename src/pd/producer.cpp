#include "pd/producer.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/host_port.h"
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

int64_t unix_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Whether the consumer that asked for a write must be told that none comes.
bool tells_consumer(SendEvent end) {
  return end == SendEvent::kFailed || end == SendEvent::kAborted || end == SendEvent::kExpired ||
         end == SendEvent::kReleased;
}

}  // namespace

std::string Producer::key_of(const std::string& x_request_id, int32_t choice) {
  if (x_request_id.empty()) return {};
  return x_request_id + "#" + std::to_string(choice);
}

std::optional<SendState> Producer::state_of(const RequestId& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(id);
  if (it == sends_.end()) return std::nullopt;
  return it->second.state;
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
  const bool ends = (s.state == SendState::kDone && from != SendState::kDraining) || s.state == SendState::kDraining;
  if (ends) {
    s.end = event;
    s.end_detail = detail;
    ctx_.metrics.send_ended(event);
    std::string why = send_end_reason(event);
    if (!detail.empty() && event != SendEvent::kSent) why += ": " + detail;
    ended_ids_.add(s.id, why);
    if (!s.key.empty()) {
      ended_keys_.add(s.key, why);
      if (auto by = by_key_.find(s.key); by != by_key_.end() && by->second == s.id) by_key_.erase(by);
    }
  }
  // A consumer waiting for our write learns that none comes once nothing of
  // ours can still write into its blocks: at DONE (after DRAINING for a write
  // that failed while the backend still moved bytes).
  if (s.state == SendState::kDone) {
    if (s.target && tells_consumer(s.end))
      post_load_failed(*s.target, "the producer's send of request " + s.id + " " + send_end_reason(s.end) +
                                      (s.end_detail.empty() ? "" : ": " + s.end_detail));
    ctx_.progress();  // its hold can go
  }
}

void Producer::settle(Send& s) {
  if (s.state != SendState::kDraining) return;
  if (s.write && ctx_.port.in_flight(*s.write)) return;
  transition(s, SendEvent::kDrained);
}

Producer::Target Producer::target_of(const WriteRequest& m) const {
  return Target{m, ctx_.now() + std::chrono::milliseconds(std::max<int64_t>(0, m.deadline_unix_ms - unix_now_ms()))};
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
    SIESTA_LOG_WARN("pd: request {} asks for remote decode, but the KV cache is not registered for transfers; its "
                    "answer names no blocks (the decode engine computes the prompt)",
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
  const HostPort address = split_host_port(ctx_.port.address()).value_or(HostPort{ctx_.port.address(), "0"});
  return nlohmann::json{
      {"do_remote_prefill", true},
      {"do_remote_decode", false},
      {"remote_engine_id", ctx_.port.engine_id()},
      {"remote_block_ids", blocks},
      {"remote_host", address.host},
      {"remote_port", std::stoi(address.port)},
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
    if (!out.held_blocks.empty()) ctx_.progress();
    return params(r.id, none);
  }
  Send& s = it->second;
  if (out.held_blocks.empty()) {
    transition(s, SendEvent::kFailed, "its blocks could not be held");
    return params(s.id, none);
  }
  s.hold = true;
  if (s.state != SendState::kWaiting) {
    // Ended while it prefilled (the consumer cancelled, the request was
    // aborted): its hold goes at the next collect.
    ctx_.progress();
    return params(s.id, none);
  }
  if (!out.new_tokens.empty()) s.logits = out.new_tokens.front().logits;
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) {
    transition(s, SendEvent::kReleased, "the KV cache was released during prefill");
    return params(s.id, none);
  }
  // The prompt's blocks (a request that generated more than one token holds
  // more; the reader needs the prompt's only).
  s.blocks.assign(out.held_blocks.begin(),
                  out.held_blocks.begin() + std::min<size_t>(out.held_blocks.size(), kv.blocks_for(s.num_tokens)));
  if (static_cast<int32_t>(s.blocks.size()) != kv.blocks_for(s.num_tokens)) {
    transition(s, SendEvent::kFailed,
               fmt::format("{} blocks held for a prompt of {} tokens", s.blocks.size(), s.num_tokens));
    return params(s.id, none);
  }
  transition(s, SendEvent::kPrefilled);
  s.hold_deadline = ctx_.now() + ctx_.config.hold_timeout;
  if (s.target) start_write(s);
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
  for (HoldKey& owner : orphan_holds_) updates.releasable_holds.push_back(std::move(owner));
  orphan_holds_.clear();
  for (auto it = sends_.begin(); it != sends_.end();) {
    Send& s = it->second;
    settle(s);
    if (s.state != SendState::kDone) {
      ++it;
      continue;
    }
    if (s.hold) updates.releasable_holds.push_back(send_hold_owner(s.id));
    SIESTA_LOG_DEBUG("pd: send {} forgotten ({}hold given back)", s.id, s.hold ? "" : "no ");
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
  if (!m.producer_engine.empty() && m.producer_engine != ctx_.port.engine_id()) {
    // The consumer found this address through a lookup made before we
    // started (a restart at the same address): it would not recognise our
    // notification. Refused before anything is written; it asks again.
    SIESTA_LOG_INFO("pd: a write request for {} expects engine {}; this is {} (restarted at the same address)",
                    m.x_request_id, m.producer_engine, ctx_.port.engine_id());
    return encode_refusal(fmt::format("this side channel serves engine {} now, not {} (the producer restarted)",
                                      ctx_.port.engine_id(), m.producer_engine),
                          {{"engine_id", ctx_.port.engine_id()}});
  }
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
    return encode_ok({{"engine_id", ctx_.port.engine_id()}});
  }
  Send& s = sends_.at(by->second);
  if (s.state == SendState::kDone || s.state == SendState::kDraining)
    return encode_refusal("request " + s.id + " " + *ended_ids_.find(s.id));
  if (s.target) return encode_refusal("request " + s.id + " already has a write target");
  if (std::string bad = check_prompt(s, m.prompt, kv); !bad.empty()) return encode_refusal(bad);
  s.target = target_of(m);
  if (s.state == SendState::kReady) start_write(s);
  // Who accepted: a consumer that found us through a cached lookup learns
  // that another engine (a restarted one) answers at this address now.
  return encode_ok({{"engine_id", ctx_.port.engine_id()}});
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
    case SendState::kReady:
      transition(*s, SendEvent::kCancelled, "by the consumer");
      ctx_.kick();
      return encode_ok({{"writing", false}});
    case SendState::kWriting:
      // Our write is starting or in flight: its notification (or a
      // load_failed once nothing of ours touches the consumer's blocks) follows.
      return encode_ok({{"writing", true}});
    case SendState::kDraining:
      return encode_ok({{"writing", true}});
    case SendState::kDone:
      return encode_ok({{"writing", false}});
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
  if (s.state == SendState::kWaiting) return encode_refusal("request " + s.id + " has not finished its prefill yet");
  if (s.state != SendState::kReady) {
    const std::string* why = ended_ids_.find(s.id);
    return encode_refusal("request " + s.id + " " + (why ? *why : std::string("is being written to another engine")));
  }
  if (!kv.registered) return encode_refusal("the producer's KV cache is not registered (it is asleep)");
  if (std::string bad = check_prompt(s, m.prompt, kv); !bad.empty()) return encode_refusal(bad);
  if (m.first_block < 0 || static_cast<size_t>(m.first_block) + m.blocks.size() != s.blocks.size() ||
      !std::equal(m.blocks.begin(), m.blocks.end(), s.blocks.begin() + m.first_block))
    return encode_refusal(fmt::format("the read names other blocks than request {} holds (from prompt block {}: {} "
                                      "named, {} held); its kv_transfer_params were changed on the way",
                                      s.id, m.first_block, m.blocks.size(),
                                      s.blocks.size() - std::min<size_t>(s.blocks.size(), m.first_block)));
  const auto lease = std::chrono::duration_cast<std::chrono::milliseconds>(s.hold_deadline - ctx_.now());
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

void Producer::start_write(Send& s) {
  if (s.state != SendState::kReady || !s.target) return;
  transition(s, SendEvent::kWriteStarted);
  const RequestId id = s.id;
  ctx_.tasks.post([this, id] { run_write(id); });
}

void Producer::run_write(const RequestId& id) {
  Target target;
  std::vector<BlockId> blocks;
  LogitsRow logits;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sends_.find(id);
    if (it == sends_.end() || it->second.state != SendState::kWriting || it->second.write) return;
    const Send& s = it->second;
    target = *s.target;
    blocks = s.blocks;
    logits = s.logits;
  }
  const WriteRequest& m = target.request;
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) return fail_write(id, "the producer's KV cache is not registered");
  if (ctx_.now() >= target.deadline) return fail_write(id, "the consumer's deadline passed before the prefill ended");
  if (static_cast<size_t>(m.first_block) + m.blocks.size() != blocks.size())
    return fail_write(id, fmt::format("the consumer asked for blocks [{}, {}) and the request has {}", m.first_block,
                                      m.first_block + m.blocks.size(), blocks.size()));
  const Deadline deadline = std::min(target.deadline, ctx_.now() + ctx_.config.transfer_timeout);
  auto meta = ctx_.port.peer(m.consumer_engine, m.consumer_address, m.epoch, ctx_.message_deadline(deadline));
  if (!meta) return fail_write(id, meta.error().message);
  auto region = peer_kv_region(*meta, m.region);
  if (!region) return fail_write(id, region.error().message);
  auto entries = block_entries(kv.region, std::span<const int32_t>(blocks).subspan(m.first_block), region->id,
                               m.blocks, kv.block_bytes);
  if (!entries) return fail_write(id, entries.error().message);
  const uint64_t bytes = static_cast<uint64_t>(m.blocks.size()) * kv.block_bytes;
  const Clock::time_point started = Clock::now();
  // The notification (with the logits) is encoded while the bytes move.
  auto xfer = ctx_.port.submit_notify_later(m.consumer_engine, *entries, deadline);
  if (!xfer) return fail_write(id, xfer.error().message);
  if (auto set = ctx_.port.set_notification(*xfer, encode(Written{m.consumer_request, bytes, logits, m.logits_top}));
      !set)
    SIESTA_LOG_DEBUG("pd: write of request {}: its notification was not set: {}", id, set.error().message);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Send& s = sends_.at(id);  // WRITING sends are not forgotten
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
  SIESTA_LOG_WARN("pd: write of request {} to {} failed: {}", id, s.target ? s.target->request.consumer_engine : "?",
                  why);
  transition(s, SendEvent::kFailed, why);  // DRAINING: nothing was submitted, so DONE at once
  settle(s);
  ctx_.kick();
}

void Producer::post_load_failed(const Target& target, const std::string& why) {
  const WriteRequest m = target.request;
  PdContext* ctx = &ctx_;
  ctx_.tasks.post([ctx, m, why] {
    auto r = ctx->port.send(m.consumer_address, encode(LoadFailed{m.consumer_request, why}),
                            ctx->now() + ctx->config.message_timeout);
    if (!r) SIESTA_LOG_DEBUG("pd: telling {} that {} will not be written: {}", m.consumer_engine, m.consumer_request,
                             r.error().message);
  });
}

// ---- ticker and release -------------------------------------------------------------------

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
    if (s.state == SendState::kWriting && s.write) {
      transfer::XferStatus st = ctx_.port.poll(*s.write);
      if (st.pending()) {
        busy = true;
        if (wait_on && !*wait_on) *wait_on = *s.write;
        continue;
      }
      if (st.done()) {
        ctx_.metrics.transfer_done(s.write_bytes, std::chrono::duration<double>(st.finished_at - s.write_started).count(),
                                   std::chrono::duration<double>(st.data_at - s.write_started).count());
        transition(s, SendEvent::kSent, "written to " + s.target->request.consumer_engine);
      } else {
        ctx_.metrics.transfer_failed();
        SIESTA_LOG_WARN("pd: write of request {} to {} failed: {}", id, s.target->request.consumer_engine,
                        st.why.message);
        transition(s, SendEvent::kFailed, st.why.message);
      }
    }
    settle(s);
    if (s.state == SendState::kReady && now >= s.hold_deadline)
      transition(s, SendEvent::kExpired,
                 fmt::format("no reader within {} s", std::chrono::duration<double>(ctx_.config.hold_timeout).count()));
    if (s.state == SendState::kWriting || s.state == SendState::kDraining) busy = true;
  }
  return busy;
}

int32_t Producer::end_all() {
  int32_t ended = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, s] : sends_) {
    if (s.state != SendState::kReady) continue;
    transition(s, SendEvent::kReleased);
    ++ended;
  }
  return ended;
}

size_t Producer::writes_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t busy = 0;
  for (const auto& [id, s] : sends_) busy += s.state == SendState::kWriting || s.state == SendState::kDraining;
  return busy;
}

}  // namespace siesta::pd
