#include "pd/consumer.h"

#include <fmt/format.h>

#include "common/log.h"
#include "pd/kv_blocks.h"

namespace siesta::pd {
namespace {

using nlohmann::json;

bool flag(const json& params, const char* key) {
  if (!params.is_object()) return false;
  auto it = params.find(key);
  return it != params.end() && it->is_boolean() && it->get<bool>();
}

const json* field(const json& params, const char* key) {
  auto it = params.find(key);
  return it == params.end() || it->is_null() ? nullptr : &*it;
}

bool non_empty_string(const json* v) { return v && v->is_string() && !v->get<std::string>().empty(); }

int64_t unix_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

size_t Consumer::num_loads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return loads_.size();
}

std::optional<LoadState> Consumer::state_of(const RequestId& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(id);
  if (it == loads_.end()) return std::nullopt;
  return it->second.state;
}

Result<Consumer::Source> Consumer::parse_source(const json& params, TransferMode preferred) {
  const json* engine = field(params, "remote_engine_id");
  const json* blocks = field(params, "remote_block_ids");
  const json* host = field(params, "remote_host");
  const json* port = field(params, "remote_port");
  const json* request = field(params, "remote_request_id");
  const json* url = field(params, "remote_prefill_url");
  const bool can_read = non_empty_string(engine) && blocks && blocks->is_array() && non_empty_string(host) && port &&
                        port->is_number_integer() && non_empty_string(request);
  const bool can_write = non_empty_string(request) && non_empty_string(url);
  Source s;
  if (can_read && (preferred == TransferMode::kRead || !can_write)) {
    s.mode = TransferMode::kRead;
    s.producer_engine = engine->get<std::string>();
    std::string h = host->get<std::string>();
    if (h.find(':') != std::string::npos && h.front() != '[') h = "[" + h + "]";
    const int64_t p = port->get<int64_t>();
    if (p <= 0 || p > 65535) return invalid_argument("kv_transfer_params.remote_port " + port->dump() + " is not a port");
    s.producer_address = h + ":" + std::to_string(p);
    s.producer_request = request->get<std::string>();
    for (const json& b : *blocks) {
      if (!b.is_number_integer() || b.get<int64_t>() < 0 || b.get<int64_t>() > INT32_MAX)
        return invalid_argument("kv_transfer_params.remote_block_ids holds " + b.dump() + ", not a block id");
      s.producer_blocks.push_back(b.get<int32_t>());
    }
    return s;
  }
  if (can_write) {
    s.mode = TransferMode::kWrite;
    s.prefill_url = url->get<std::string>();
    s.x_request_id = request->get<std::string>();
    return s;
  }
  return invalid_argument(
      "kv_transfer_params with do_remote_prefill name no producer: READ needs remote_engine_id, remote_block_ids, "
      "remote_host, remote_port and remote_request_id; WRITE needs remote_request_id and remote_prefill_url");
}

void Consumer::transition(Load& l, LoadEvent event, const std::string& detail) {
  auto next = next_load_state(l.state, event);
  if (!next) {
    SIESTA_LOG_DEBUG("pd: load {}: {}", l.id, next.error().message);
    return;
  }
  SIESTA_LOG_DEBUG("pd: load {} {} -> {} ({}){}{}", l.id, load_state_name(l.state), load_state_name(*next),
                   load_event_name(event), detail.empty() ? "" : ": ", detail);
  const bool was_ended = load_ended(l.state);
  l.state = *next;
  if (load_ended(l.state) != was_ended || load_final(l.state)) ctx_.progress();
}

void Consumer::fail(Load& l, const std::string& why) {
  if (load_ended(l.state)) return;
  transition(l, LoadEvent::kFailed, why);
  l.failure = why;
  if (l.waiter == Waiter::kWaiting) {
    ctx_.metrics.load_failed();
    SIESTA_LOG_WARN("pd: request {}: no remote KV ({}); it computes its prompt here", l.id, why);
  }
  post_release(l.id, l.source, l.producer_address);
  settle(l, ctx_.now());
  ctx_.kick();
}

void Consumer::settle(Load& l, Clock::time_point now) {
  if (l.state != LoadState::kEnding) return;
  if (l.source.mode == TransferMode::kRead) {
    // Our read: quiet once the backend no longer touches our blocks. Until
    // its id is known, the task submitting it settles it.
    if (!l.read) return;
    if (ctx_.port.poll(*l.read).pending() || ctx_.port.in_flight(*l.read)) return;
    transition(l, LoadEvent::kQuiet, "our read ended");
    return;
  }
  if (now >= l.quiet_at) transition(l, LoadEvent::kQuiet, "the write request's deadline and grace passed");
}

// ---- engine loop ------------------------------------------------------------------

ConnectorPlan Consumer::on_added(const EngineRequest& r) {
  if (!flag(r.kv_transfer_params, "do_remote_prefill")) return {};
  auto source = parse_source(r.kv_transfer_params, ctx_.config.mode);
  if (!source) {
    SIESTA_LOG_WARN("pd: request {}: {}; it computes its prompt here", r.id, source.error().message);
    ctx_.metrics.recomputed();
    return {};
  }
  if (source->mode == TransferMode::kWrite) source->choice = r.choice_index;
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) {
    SIESTA_LOG_WARN("pd: request {} asks for remote KV, but the KV cache is not registered for transfers; it "
                    "computes its prompt here, and the producer is told to let go of its blocks",
                    r.id);
    ctx_.metrics.recomputed();
    std::lock_guard<std::mutex> lock(mu_);
    post_release(r.id, *source, {});
    return {};
  }
  Load l;
  l.id = r.id;
  l.source = std::move(*source);
  l.prompt = PromptCheck{static_cast<int32_t>(r.prompt_tokens.size()), prompt_hash(r.prompt_tokens), kv.layout,
                         kv.block_bytes};
  // A greedy first token without log-probabilities or banned stop tokens is
  // the best entry of the producer's logits; anything else needs the row.
  const SamplingParams& p = r.params;
  if (p.greedy() && !p.logprobs && p.min_tokens <= 0) l.logits_top = 1;
  std::lock_guard<std::mutex> lock(mu_);
  loads_[l.id] = std::move(l);
  return ConnectorPlan{.hold_blocks_for_remote_reader = false, .load_remote_kv = true};
}

void Consumer::start_load(const RequestId& id, const RemoteKvTarget& target) {
  const LocalKv kv = ctx_.kv.get();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(id);
  if (it == loads_.end()) return;
  Load& l = it->second;
  l.blocks = target.block_table;
  l.first_block = kv.block_size > 0 ? target.num_cached_tokens / kv.block_size : 0;
  l.started = ctx_.now();
  l.deadline = l.started + ctx_.config.load_timeout;
  l.quiet_at = l.deadline + ctx_.config.write_grace;
  transition(l, LoadEvent::kAllocated);
  const auto total = static_cast<size_t>(kv.blocks_for(l.prompt.num_tokens));
  if (!kv.registered || l.blocks.size() != total) {
    fail(l, fmt::format("{} blocks for a prompt of {} tokens", l.blocks.size(), l.prompt.num_tokens));
    return;
  }
  if (l.source.mode == TransferMode::kRead && l.source.producer_blocks.size() != total) {
    fail(l, fmt::format("the producer names {} blocks for a prompt of {} tokens here (another model or block size?)",
                        l.source.producer_blocks.size(), l.prompt.num_tokens));
    return;
  }
  if (static_cast<size_t>(l.first_block) >= l.blocks.size()) {
    // The prefix cache holds the whole prompt: nothing to move.
    transition(l, LoadEvent::kKvInPlace, "every block in the prefix cache");
    ctx_.metrics.load_done(0, 0.0);
    post_release(l.id, l.source, {}, /*consumed=*/true);
    return;
  }
  if (l.source.mode == TransferMode::kWrite)
    ctx_.tasks.post([this, id] { run_write_start(id); });
  else
    ctx_.tasks.post([this, id] { run_read_start(id); });
  ctx_.kick();
}

void Consumer::on_skipped(const RequestId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(id);
  if (it == loads_.end()) return;
  ctx_.metrics.recomputed();
  post_release(id, it->second.source, {});
  loads_.erase(it);
}

void Consumer::on_aborted(const RequestId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(id);
  if (it == loads_.end()) return;
  Load& l = it->second;
  switch (l.waiter) {
    case Waiter::kWaiting:
      // Scheduler::abort keeps the blocks of a request waiting for remote KV
      // under load_hold_owner(id) (a PENDING load has none yet).
      l.waiter = l.state == LoadState::kPending ? Waiter::kGone : Waiter::kHolds;
      if (!load_ended(l.state)) fail(l, "the request was aborted");
      break;
    case Waiter::kTold: l.waiter = Waiter::kGone; break;
    case Waiter::kHolds:
    case Waiter::kGone: break;
  }
  ctx_.progress();
}

void Consumer::on_dropped(const EngineRequest& r) {
  if (!flag(r.kv_transfer_params, "do_remote_prefill")) return;
  auto source = parse_source(r.kv_transfer_params, ctx_.config.mode);
  if (!source) return;
  if (source->mode == TransferMode::kWrite) source->choice = r.choice_index;
  std::lock_guard<std::mutex> lock(mu_);
  post_release(r.id, *source, {});
}

void Consumer::collect(ConnectorUpdates& updates) {
  const Clock::time_point now = ctx_.now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = loads_.begin(); it != loads_.end();) {
    Load& l = it->second;
    settle(l, now);
    if (l.waiter == Waiter::kWaiting && load_ended(l.state)) {
      const bool loaded = l.state == LoadState::kLoaded;
      const bool may_change = l.state == LoadState::kEnding;
      updates.finished_loads.push_back(FinishedLoad{l.id, loaded, may_change, loaded ? l.logits : nullptr});
      if (loaded && l.logits) ctx_.metrics.first_token_from_producer();
      l.logits.reset();
      l.waiter = may_change ? Waiter::kHolds : Waiter::kTold;
    }
    if (l.waiter == Waiter::kHolds && load_final(l.state)) {
      updates.releasable_holds.push_back(load_hold_owner(l.id));
      l.waiter = Waiter::kGone;
    }
    if ((l.waiter == Waiter::kTold || l.waiter == Waiter::kGone) && load_final(l.state))
      it = loads_.erase(it);
    else
      ++it;
  }
}

// ---- the producer's messages ------------------------------------------------------------

std::string Consumer::on_load_failed(const LoadFailed& m) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(m.consumer_request);
  if (it == loads_.end()) return encode_ok();
  Load& l = it->second;
  if (l.source.mode != TransferMode::kWrite) return encode_refusal("request " + l.id + " does not wait for a write");
  if (l.state == LoadState::kEnding) {
    transition(l, LoadEvent::kQuiet, "the producer will not write: " + m.reason);
  } else if (!load_ended(l.state)) {
    transition(l, LoadEvent::kProducerEnded, "the producer will not write: " + m.reason);
    l.failure = m.reason;
    if (l.waiter == Waiter::kWaiting) {
      ctx_.metrics.load_failed();
      SIESTA_LOG_WARN("pd: request {}: no remote KV (the producer will not write: {}); it computes its prompt here",
                      l.id, m.reason);
    }
  }
  ctx_.kick();
  return encode_ok();
}

void Consumer::on_written(const Written& w, const std::string& from_engine) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(w.consumer_request);
  if (it == loads_.end()) {
    SIESTA_LOG_DEBUG("pd: a write for request {} landed after it was forgotten", w.consumer_request);
    return;
  }
  Load& l = it->second;
  if (l.source.mode != TransferMode::kWrite || l.source.producer_engine != from_engine) {
    SIESTA_LOG_WARN("pd: engine {} notified a write for request {}, which waits for {}; ignored", from_engine, l.id,
                    l.source.producer_engine.empty() ? std::string("no write") : l.source.producer_engine);
    return;
  }
  if (l.state == LoadState::kEnding) {
    transition(l, LoadEvent::kQuiet, "the producer's write ended after the load gave up");
  } else if (l.state == LoadState::kStarting || l.state == LoadState::kAsked ||
             l.state == LoadState::kAwaitingWrite) {
    l.bytes = w.bytes;
    l.logits = w.logits;
    transition(l, LoadEvent::kKvInPlace, "written by the producer");
    ctx_.metrics.load_done(w.bytes, std::chrono::duration<double>(ctx_.now() - l.started).count());
  }
  ctx_.kick();
}

// ---- load tasks ------------------------------------------------------------------------

void Consumer::run_write_start(const RequestId& id) {
  Source source;
  Deadline deadline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it == loads_.end() || it->second.state != LoadState::kStarting) return;
    source = it->second.source;
    deadline = it->second.deadline;
  }
  auto found = ctx_.port.resolve_prefill(source.prefill_url, ctx_.message_deadline(deadline));
  const LocalKv kv = ctx_.kv.get();
  WriteRequest m;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it == loads_.end() || it->second.state != LoadState::kStarting) return;
    Load& l = it->second;
    if (!found) return fail(l, "finding the producer: " + found.error().message);
    if (!kv.registered) return fail(l, "the KV cache is not registered for transfers");
    l.producer_address = found->address;
    l.source.producer_engine = found->engine_id;
    m.x_request_id = l.source.x_request_id;
    m.choice = l.source.choice;
    m.consumer_request = l.id;
    m.consumer_engine = ctx_.port.engine_id();
    m.consumer_address = ctx_.port.address();
    m.region = kv.region.value;
    m.epoch = kv.epoch;
    m.first_block = l.first_block;
    m.blocks.assign(l.blocks.begin() + l.first_block, l.blocks.end());
    m.prompt = l.prompt;
    m.deadline_unix_ms = unix_now_ms() + std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                   l.deadline - ctx_.now())
                                                                   .count());
    m.logits_top = l.logits_top;
    m.producer_engine = found->engine_id;
    // From here the producer may write into these blocks until it says otherwise.
    transition(l, LoadEvent::kAsked, "write requested from " + found->engine_id);
  }
  // A producer restarted at a cached address refuses a request naming its
  // old engine id, and names itself: the request goes once more, to it.
  for (int attempt = 0;; ++attempt) {
    auto reply = ctx_.port.send(found->address, encode(m), ctx_.message_deadline(deadline));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it == loads_.end()) return;
    Load& l = it->second;
    if (!reply) {
      ctx_.port.forget_prefill(source.prefill_url);
      return fail(l, "asking the producer at " + found->address + " to write: " + reply.error().message);
    }
    if (!reply->ok && attempt == 0 && l.state == LoadState::kAsked) {
      auto engine = reply->body.find("engine_id");
      if (engine != reply->body.end() && engine->is_string() && !engine->get<std::string>().empty() &&
          engine->get<std::string>() != m.producer_engine) {
        SIESTA_LOG_INFO("pd: the producer at {} is engine {} now, not {} (restarted); request {} asks it again",
                        found->address, engine->get<std::string>(), m.producer_engine, l.id);
        ctx_.port.forget_prefill(source.prefill_url);
        m.producer_engine = engine->get<std::string>();
        l.source.producer_engine = m.producer_engine;
        continue;
      }
    }
    if (!reply->ok) {
      // The producer will not write. Whatever it may still hold for the
      // request (its prefill may end later, after a sleep of its own), the
      // cancel frees.
      post_release(l.id, l.source, l.producer_address);
      if (l.state == LoadState::kEnding) {
        transition(l, LoadEvent::kQuiet, "the producer refused the write");
        return;
      }
      transition(l, LoadEvent::kProducerEnded, "the producer refused the write: " + reply->reason);
      if (l.state == LoadState::kFailed && l.waiter == Waiter::kWaiting) {
        l.failure = reply->reason;
        ctx_.metrics.load_failed();
        SIESTA_LOG_WARN(
            "pd: request {}: no remote KV (the producer refused the write: {}); it computes its prompt here", l.id,
            reply->reason);
      }
      ctx_.kick();
      return;
    }
    if (auto engine = reply->body.find("engine_id"); engine != reply->body.end() && engine->is_string() &&
                                                     engine->get<std::string>() != l.source.producer_engine) {
      // A producer that does not check producer_engine (an older siesta)
      // accepted: its write and notification come from the engine it names.
      SIESTA_LOG_INFO("pd: the producer at {} is engine {} now, not {} (restarted); request {} waits for its write",
                      found->address, engine->get<std::string>(), l.source.producer_engine, l.id);
      l.source.producer_engine = engine->get<std::string>();
      ctx_.port.forget_prefill(source.prefill_url);
    }
    if (l.state == LoadState::kAsked) transition(l, LoadEvent::kAccepted, "the producer writes after its prefill");
    return;
  }
}

void Consumer::run_read_start(const RequestId& id) {
  Source source;
  PromptCheck prompt;
  Deadline deadline;
  int32_t first_block = 0;
  std::vector<BlockId> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it == loads_.end() || it->second.state != LoadState::kStarting) return;
    const Load& l = it->second;
    source = l.source;
    prompt = l.prompt;
    deadline = l.deadline;
    first_block = l.first_block;
    blocks = l.blocks;
  }
  auto failed = [&](const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it != loads_.end()) fail(it->second, why);
  };
  const auto num_blocks = static_cast<int32_t>(blocks.size()) - first_block;
  ReadStart start;
  start.producer_request = source.producer_request;
  start.first_block = first_block;
  start.blocks.assign(source.producer_blocks.begin() + first_block, source.producer_blocks.end());
  start.prompt = prompt;
  auto reply = ctx_.port.send(source.producer_address, encode(start), ctx_.message_deadline(deadline));
  if (!reply) return failed("asking the producer at " + source.producer_address + ": " + reply.error().message);
  // A refusal: whatever the producer still holds for the request, the cancel that fail() sends frees it.
  if (!reply->ok) return failed("the producer refused the read: " + reply->reason);
  auto epoch = reply_u64(*reply, "epoch");
  auto region_id = reply_u64(*reply, "region");
  if (!epoch || !region_id)
    return failed("the producer's read_start answer: " + (epoch ? region_id.error() : epoch.error()).message);
  auto meta = ctx_.port.peer(source.producer_engine, source.producer_address, *epoch, ctx_.message_deadline(deadline));
  if (!meta) return failed(meta.error().message);
  auto region = peer_kv_region(*meta, *region_id);
  if (!region) return failed(region.error().message);
  const LocalKv kv = ctx_.kv.get();
  if (!kv.registered) return failed("the KV cache is not registered for transfers");
  auto entries = block_entries(kv.region, std::span<const int32_t>(blocks).subspan(first_block), region->id,
                               std::span<const int32_t>(source.producer_blocks).subspan(first_block), kv.block_bytes);
  if (!entries) return failed(entries.error().message);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it == loads_.end() || it->second.state != LoadState::kStarting) return;
    // From here our read may touch the blocks (READING, or ENDING if the load fails meanwhile).
    transition(it->second, LoadEvent::kReadStarted);
  }
  const Clock::time_point started = ctx_.now();
  auto xfer = ctx_.port.submit(source.producer_engine, transfer::XferOp::kRead, *entries,
                               std::min(deadline, started + ctx_.config.transfer_timeout));
  std::lock_guard<std::mutex> lock(mu_);
  Load& l = loads_.at(id);  // READING and ENDING loads are not forgotten
  if (!xfer) {
    ctx_.metrics.transfer_failed();
    if (l.state == LoadState::kReading) fail(l, "reading from the producer: " + xfer.error().message);
    if (l.state == LoadState::kEnding) transition(l, LoadEvent::kQuiet, "no read was submitted");
    return;
  }
  l.read = *xfer;
  l.read_started = started;
  l.bytes = static_cast<uint64_t>(num_blocks) * kv.block_bytes;
  settle(l, ctx_.now());
  ctx_.kick();
}

void Consumer::run_read_confirm(const RequestId& id) {
  Source source;
  Deadline deadline;
  int32_t logits_top = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it == loads_.end() || it->second.state != LoadState::kConfirming) return;
    source = it->second.source;
    deadline = it->second.deadline;
    logits_top = it->second.logits_top;
  }
  auto reply = ctx_.port.send(source.producer_address, encode(ReadDone{source.producer_request, logits_top}),
                              ctx_.message_deadline(deadline));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loads_.find(id);
  if (it == loads_.end() || it->second.state != LoadState::kConfirming) return;
  Load& l = it->second;
  if (!reply) return fail(l, "confirming the producer's hold: " + reply.error().message);
  if (!reply->ok) return fail(l, "the producer did not confirm its hold: " + reply->reason);
  auto held = reply_bool(*reply, "held");
  if (!held) return fail(l, "the producer's read_done answer: " + held.error().message);
  if (!*held) {
    std::string why = "the producer's hold ended before the read did; the KV read is discarded";
    if (auto r = reply->body.find("reason"); r != reply->body.end() && r->is_string())
      why += " (" + r->get<std::string>() + ")";
    // read_done freed whatever the producer held: nothing to cancel.
    transition(l, LoadEvent::kProducerEnded, why);
    l.failure = why;
    if (l.waiter == Waiter::kWaiting) {
      ctx_.metrics.load_failed();
      SIESTA_LOG_WARN("pd: request {}: no remote KV ({}); it computes its prompt here", l.id, why);
    }
    ctx_.kick();
    return;
  }
  l.logits = reply->logits;
  transition(l, LoadEvent::kKvInPlace, "the producer's hold lasted the whole read");
  ctx_.metrics.load_done(l.bytes, std::chrono::duration<double>(ctx_.now() - l.started).count());
  ctx_.kick();
}

void Consumer::post_release(const RequestId& id, const Source& source, std::string producer_address, bool consumed) {
  PdContext* ctx = &ctx_;
  ctx_.tasks.post([this, ctx, id, source, address = std::move(producer_address), consumed]() mutable {
    const Deadline deadline = ctx->now() + ctx->config.message_timeout;
    if (source.mode == TransferMode::kRead) {
      // We never write into the producer: nothing to wait for in its answer.
      std::string payload = consumed ? encode(ReadDone{source.producer_request})
                                     : encode(CancelRequest{"", 0, source.producer_request});
      auto r = ctx->port.send(source.producer_address, std::move(payload), deadline);
      if (!r) SIESTA_LOG_DEBUG("pd: releasing {} at {}: {}", source.producer_request, source.producer_address,
                               r.error().message);
      return;
    }
    if (address.empty()) {
      auto found = ctx->port.resolve_prefill(source.prefill_url, deadline);
      if (!found) {
        SIESTA_LOG_DEBUG("pd: cancelling {} at {}: {}", source.x_request_id, source.prefill_url,
                         found.error().message);
        return;
      }
      address = found->address;
    }
    CancelRequest cancel;
    cancel.x_request_id = source.x_request_id;
    cancel.choice = source.choice;
    auto r = ctx->port.send(address, encode(cancel), deadline);
    if (!r || !r->ok) {
      SIESTA_LOG_DEBUG("pd: cancelling {} at {}: {}", source.x_request_id, address, r ? r->reason : r.error().message);
      return;
    }
    auto writing = reply_bool(*r, "writing");
    if (!writing || *writing) return;  // its notification or load_failed will say when it ends
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(id);
    if (it != loads_.end() && it->second.state == LoadState::kEnding)
      transition(it->second, LoadEvent::kQuiet, "the producer is not writing");
    ctx->kick();
  });
}

// ---- ticker and release -------------------------------------------------------------------

bool Consumer::tick(Clock::time_point now, std::optional<transfer::XferId>* wait_on) {
  bool busy = false;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, l] : loads_) {
    if (l.state == LoadState::kReading && l.read) {
      transfer::XferStatus st = ctx_.port.poll(*l.read);
      if (st.pending()) {
        busy = true;
        if (wait_on && !*wait_on) *wait_on = *l.read;
      } else if (st.done()) {
        ctx_.metrics.transfer_done(l.bytes, std::chrono::duration<double>(st.finished_at - l.read_started).count(),
                                   std::chrono::duration<double>(st.data_at - l.read_started).count());
        transition(l, LoadEvent::kReadDone);
        const RequestId rid = id;
        ctx_.tasks.post([this, rid] { run_read_confirm(rid); });
      } else {
        ctx_.metrics.transfer_failed();
        fail(l, "reading from the producer: " + st.why.message);
      }
    }
    if (!load_ended(l.state) && l.state != LoadState::kPending && now >= l.deadline)
      fail(l, fmt::format("no KV within load_timeout_s ({} s) in state {}",
                          std::chrono::duration<double>(ctx_.config.load_timeout).count(), load_state_name(l.state)));
    settle(l, now);
    if (l.state == LoadState::kReading || (l.state == LoadState::kEnding && l.source.mode == TransferMode::kRead))
      busy = true;
  }
  return busy;
}

int32_t Consumer::end_all(const std::string& why) {
  int32_t ended = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, l] : loads_) {
    if (load_ended(l.state)) continue;
    fail(l, why);
    ++ended;
  }
  return ended;
}

size_t Consumer::reads_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t busy = 0;
  for (const auto& [id, l] : loads_)
    busy += l.state == LoadState::kReading || (l.state == LoadState::kEnding && l.source.mode == TransferMode::kRead);
  return busy;
}

void Consumer::peers_invalidated(const std::vector<std::string>* acked) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, l] : loads_) {
    if (l.state != LoadState::kEnding || l.source.mode != TransferMode::kWrite) continue;
    if (acked && std::find(acked->begin(), acked->end(), l.source.producer_engine) == acked->end()) continue;
    transition(l, LoadEvent::kQuiet, "the producer dropped our memory (INVALIDATE acknowledged)");
  }
}

}  // namespace siesta::pd
