// The P/D core without sockets or timing: a Producer and a Consumer over a
// fake KvPort (every message recorded and answered by the test, every
// transfer completed or failed when the test says), a task runner that runs
// when told, and a clock the test moves. Sleep (release), abort, cancel and
// timeout arrive in every load state and every send state; each case asserts
// what the engine is told (FinishedLoad, holds it may give back: where the
// blocks end up) and what the peer is told.
#include <gtest/gtest.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "pd/consumer.h"
#include "pd/producer.h"

namespace siesta::pd {
namespace {

using transfer::XferId;
using transfer::XferStatus;

constexpr const char* kProducerEngine = "prefill-0";
constexpr const char* kProducerAddress = "10.0.0.1:7001";
constexpr const char* kPrefillUrl = "http://10.0.0.1:8001";

// ---- the fakes --------------------------------------------------------------------------------

class ManualTasks final : public TaskRunner {
 public:
  void post(std::function<void()> task) override { queue.push_back(std::move(task)); }
  // Runs queued tasks (and those they post) until none is left.
  void run_all() {
    while (!queue.empty()) {
      auto t = std::move(queue.front());
      queue.pop_front();
      t();
    }
  }
  std::deque<std::function<void()>> queue;
};

struct Sent {
  std::string address;
  PdMessage message;
};

class FakePort final : public KvPort {
 public:
  struct Xfer {
    transfer::XferState state = transfer::XferState::kPending;
    bool in_flight = true;
    bool reported = false;
    std::string peer;
    transfer::XferOp op = transfer::XferOp::kRead;
    std::optional<std::string> notification;
  };

  explicit FakePort(std::string engine_id, std::string address)
      : engine_id_(std::move(engine_id)), address_(std::move(address)) {}

  const std::string& engine_id() const override { return engine_id_; }
  const std::string& address() const override { return address_; }

  Result<transfer::EngineMeta> peer(const std::string& engine_id, const std::string& address,
                                    std::optional<uint64_t> epoch, Deadline) override {
    if (!peer_error.empty()) return unavailable(peer_error);
    transfer::EngineMeta m;
    m.engine_id = engine_id;
    m.epoch = transfer::Epoch{epoch.value_or(9)};
    m.side_channel_address = address;
    m.backend = "ipc";
    m.regions.push_back(transfer::RegionDesc{transfer::RegionId{epoch ? 7u : 5u}, 0, 0x1000, 1 << 20,
                                             transfer::MemoryKind::kHost, {}});
    if (epoch) m.regions.back().id = transfer::RegionId{7};
    return m;
  }
  Result<XferId> submit(const std::string& peer, transfer::XferOp op, const std::vector<transfer::XferEntry>&,
                        Deadline) override {
    XferId id{next_++};
    xfers[id.value] = Xfer{transfer::XferState::kPending, true, false, peer, op, std::nullopt};
    return id;
  }
  Result<XferId> submit_notify_later(const std::string& peer, const std::vector<transfer::XferEntry>& e,
                                     Deadline d) override {
    return submit(peer, transfer::XferOp::kWrite, e, d);
  }
  Result<void> set_notification(XferId id, std::string payload) override {
    xfers.at(id.value).notification = std::move(payload);
    return {};
  }
  XferStatus poll(XferId id) override {
    auto it = xfers.find(id.value);
    if (it == xfers.end() || it->second.reported) return XferStatus::make_failed(not_found("unknown transfer"));
    if (it->second.state == transfer::XferState::kPending) return XferStatus::make_pending();
    it->second.reported = true;
    return it->second.state == transfer::XferState::kDone ? XferStatus::make_done()
                                                          : XferStatus::make_failed(timeout("the transfer's deadline"));
  }
  bool in_flight(XferId id) const override {
    auto it = xfers.find(id.value);
    return it != xfers.end() && it->second.in_flight;
  }
  Result<Reply> send(const std::string& address, std::string payload, Deadline) override {
    auto m = decode_message(payload);
    if (!m) return m.error();
    sent.push_back(Sent{address, *m});
    if (!reachable) return unavailable("connection refused");
    if (responder) {
      if (auto answer = responder(*m)) return decode_reply(*answer);
    }
    return decode_reply(default_answer(*m));
  }
  Result<PrefillSideChannel> resolve_prefill(const std::string&, Deadline) override {
    return PrefillSideChannel{kProducerEngine, kProducerAddress};
  }
  void forget_prefill(const std::string&) override {}

  // The test ends a transfer: done, or failed (still in flight when the
  // backend has not let go of the memory yet).
  void finish(uint64_t id, bool ok, bool still_in_flight = false) {
    Xfer& x = xfers.at(id);
    x.state = ok ? transfer::XferState::kDone : transfer::XferState::kFailed;
    x.in_flight = still_in_flight;
  }
  void let_go(uint64_t id) { xfers.at(id).in_flight = false; }

  template <typename M>
  std::vector<M> sent_of() const {
    std::vector<M> out;
    for (const Sent& s : sent)
      if (auto* m = std::get_if<M>(&s.message)) out.push_back(*m);
    return out;
  }

  std::string peer_error;
  bool reachable = true;
  bool cancel_answers_writing = false;  // the producer's write is in flight
  // Return an encoded reply to override the default for a message (nullopt: default).
  std::function<std::optional<std::string>(const PdMessage&)> responder;
  std::vector<Sent> sent;
  std::map<uint64_t, Xfer> xfers;

 private:
  std::string default_answer(const PdMessage& m) const {
    if (std::holds_alternative<CancelRequest>(m)) return encode_ok({{"writing", cancel_answers_writing}});
    if (std::holds_alternative<ReadStart>(m)) return encode_ok({{"region", "7"}, {"epoch", "9"}, {"lease_ms", 1000}});
    if (std::holds_alternative<ReadDone>(m)) return encode_ok({{"held", true}});
    return encode_ok();
  }

  std::string engine_id_;
  std::string address_;
  uint64_t next_ = 1;
};

// One half (producer or consumer) with its fakes.
struct Harness {
  explicit Harness(TransferMode mode, const std::string& engine_id, const std::string& address)
      : port(engine_id, address) {
    config.mode = mode;
    config.load_timeout = std::chrono::milliseconds(4000);
    config.hold_timeout = std::chrono::milliseconds(10000);
    config.write_grace = std::chrono::milliseconds(1000);
    LocalKv k;
    k.registered = true;
    k.region = transfer::RegionId{3};
    k.epoch = 4;
    k.num_blocks = 64;
    k.block_size = 16;
    k.block_bytes = 1024;
    k.layout = "test-layout";
    kv.set(k);
    ctx = std::make_unique<PdContext>(
        PdContext{config, port, kv, tasks, metrics, [this] { return now; }, [] {}, [] {}});
  }
  void advance(std::chrono::milliseconds d) { now += d; }

  PdConfig config;
  FakePort port;
  LocalKvState kv;
  ManualTasks tasks;
  PdMetrics metrics;
  Clock::time_point now = Clock::now();
  std::unique_ptr<PdContext> ctx;
};

EngineRequest request(const std::string& id, nlohmann::json params, int32_t prompt_tokens = 40) {
  EngineRequest r;
  r.id = id;
  for (int32_t i = 0; i < prompt_tokens; ++i) r.prompt_tokens.push_back(100 + i);
  r.params.temperature = 0;
  r.params.max_tokens = 8;
  r.kv_transfer_params = std::move(params);
  r.x_request_id = "x-" + id;
  return r;
}

// ---- the consumer ---------------------------------------------------------------------------

// A consumer's load of one request, driven to a named state.
struct ConsumerCase {
  explicit ConsumerCase(TransferMode mode) : h(mode, "decode-0", "10.0.0.2:7002"), consumer(*h.ctx) {
    nlohmann::json params = {{"do_remote_prefill", true}, {"remote_request_id", "x-r1"}};
    if (mode == TransferMode::kWrite) {
      params["remote_prefill_url"] = kPrefillUrl;
    } else {
      params["remote_engine_id"] = kProducerEngine;
      params["remote_host"] = "10.0.0.1";
      params["remote_port"] = 7001;
      params["remote_block_ids"] = {20, 21, 22};
      params["remote_request_id"] = "p-r1";
    }
    r = request("r1", params);
    EXPECT_TRUE(consumer.on_added(r).load_remote_kv);
  }

  // Blocks 0..2 for the 40-token prompt.
  void start() { consumer.start_load("r1", RemoteKvTarget{{0, 1, 2}, 0}); }

  LoadState state() const { return *consumer.state_of("r1"); }
  ConnectorUpdates collect() {
    ConnectorUpdates u;
    consumer.collect(u);
    return u;
  }
  size_t cancels() const { return h.port.sent_of<CancelRequest>().size(); }

  // Drives the load to `target` (a state on its way to Loaded). ASKED lasts
  // while the producer has our write request and has not answered: `while_asked`
  // runs then (from inside the fake's answer), and the answer is ok.
  void drive_to(LoadState target, std::function<void()> while_asked = nullptr) {
    if (target == LoadState::kPending) return;
    start();
    if (target == LoadState::kStarting) return;
    if (h.config.mode == TransferMode::kWrite) {
      if (target == LoadState::kAsked) {
        h.port.responder = [this, while_asked](const PdMessage& m) -> std::optional<std::string> {
          if (!std::holds_alternative<WriteRequest>(m)) return std::nullopt;
          EXPECT_EQ(state(), LoadState::kAsked);
          while_asked();
          return encode_ok();
        };
        h.tasks.queue.front()();  // the write task, up to and after its answer
        h.tasks.queue.pop_front();
        h.port.responder = nullptr;
        return;
      }
      h.tasks.run_all();  // locate, ask, accepted
      ASSERT_EQ(state(), LoadState::kAwaitingWrite);
      return;
    }
    h.tasks.run_all();  // read_start, then the read is submitted
    ASSERT_EQ(state(), LoadState::kReading);
    if (target == LoadState::kReading) return;
    h.port.finish(h.port.xfers.begin()->first, true);
    consumer.tick(h.now);
    ASSERT_EQ(state(), LoadState::kConfirming);
    // read_done is the next task; the test decides when it runs.
  }

  Harness h;
  Consumer consumer;
  EngineRequest r;
};

TEST(PdConsumer, AWriteLoadThatArrivesIsReportedWithTheLogitsAndNothingMoreIsSaid) {
  ConsumerCase c(TransferMode::kWrite);
  c.drive_to(LoadState::kAwaitingWrite);
  ASSERT_EQ(c.h.port.sent_of<WriteRequest>().size(), 1u);
  const WriteRequest w = c.h.port.sent_of<WriteRequest>()[0];
  EXPECT_EQ(w.x_request_id, "x-r1");
  EXPECT_EQ(w.blocks, (std::vector<int32_t>{0, 1, 2}));
  auto logits = std::make_shared<const std::vector<float>>(std::vector<float>{0.5f, 2.0f});
  c.consumer.on_written(Written{"r1", 3072, logits, 0}, kProducerEngine);
  EXPECT_EQ(c.state(), LoadState::kLoaded);
  ConnectorUpdates u = c.collect();
  ASSERT_EQ(u.finished_loads.size(), 1u);
  EXPECT_TRUE(u.finished_loads[0].loaded);
  EXPECT_FALSE(u.finished_loads[0].blocks_may_change);
  EXPECT_EQ(u.finished_loads[0].first_logits, logits);
  EXPECT_TRUE(u.releasable_holds.empty());
  EXPECT_EQ(c.cancels(), 0u);
  EXPECT_EQ(c.consumer.num_loads(), 0u);  // forgotten
}

// Every state a WRITE load passes, with each way it can end on our side.
TEST(PdConsumer, AWriteLoadEndedInAnyStateRecomputesTellsTheProducerAndGivesItsBlocksBackOnceQuiet) {
  enum class End { kRelease, kAbort, kTimeout };
  for (LoadState at : {LoadState::kPending, LoadState::kStarting, LoadState::kAsked, LoadState::kAwaitingWrite}) {
    for (End end : {End::kRelease, End::kAbort, End::kTimeout}) {
      SCOPED_TRACE(std::string(load_state_name(at)) + " / " +
                   (end == End::kRelease ? "release" : end == End::kAbort ? "abort" : "timeout"));
      ConsumerCase c(TransferMode::kWrite);
      const bool producer_may_write = at == LoadState::kAsked || at == LoadState::kAwaitingWrite;
      auto event = [&] {
        // The producer is writing: it answers a cancel with writing: true.
        c.h.port.cancel_answers_writing = true;
        switch (end) {
          case End::kRelease: EXPECT_EQ(c.consumer.end_all("released for sleep"), 1); break;
          case End::kAbort: c.consumer.on_aborted("r1"); break;
          case End::kTimeout:
            if (at == LoadState::kPending) {
              c.consumer.end_all("released for sleep");  // a PENDING load has no deadline yet
            } else {
              c.h.advance(std::chrono::milliseconds(4001));
              c.consumer.tick(c.h.now);
            }
            break;
        }
      };
      if (at == LoadState::kAsked) {
        c.drive_to(at, event);
      } else {
        c.drive_to(at);
        ASSERT_EQ(c.state(), at);
        event();
      }
      EXPECT_EQ(c.state(), producer_may_write ? LoadState::kEnding : LoadState::kFailed);
      c.h.tasks.run_all();  // the cancel goes out
      ASSERT_EQ(c.cancels(), 1u);
      const CancelRequest cancel = c.h.port.sent_of<CancelRequest>()[0];
      EXPECT_EQ(cancel.x_request_id, "x-r1");
      EXPECT_EQ(cancel.choice, 0);
      ConnectorUpdates u = c.collect();
      if (end == End::kAbort) {
        EXPECT_TRUE(u.finished_loads.empty());  // the request is gone
      } else {
        ASSERT_EQ(u.finished_loads.size(), 1u);
        EXPECT_FALSE(u.finished_loads[0].loaded);
        EXPECT_EQ(u.finished_loads[0].blocks_may_change, producer_may_write);
      }
      // The blocks: an aborted request's are held by the scheduler whenever it had blocks
      // (not PENDING); a recomputing one's only while the producer may write.
      const bool held = producer_may_write || (end == End::kAbort && at != LoadState::kPending);
      if (producer_may_write) {
        EXPECT_TRUE(u.releasable_holds.empty());  // the producer still writes
        c.consumer.on_written(Written{"r1", 3072, nullptr, 0}, kProducerEngine);  // its write ended
        EXPECT_EQ(c.state(), LoadState::kFailed);
        u = c.collect();
      }
      if (held) {
        EXPECT_EQ(u.releasable_holds, std::vector<HoldKey>{load_hold_owner("r1")});
      } else {
        EXPECT_TRUE(u.releasable_holds.empty());
      }
      EXPECT_EQ(c.consumer.num_loads(), 0u);
    }
  }
}

TEST(PdConsumer, AProducerRestartedAtTheSameAddressIsFollowedAtItsFirstAnswer) {
  ConsumerCase c(TransferMode::kWrite);
  // The lookup (cached) names prefill-0; the engine that answers the write request is a new one.
  c.h.port.responder = [](const PdMessage& m) -> std::optional<std::string> {
    if (std::holds_alternative<WriteRequest>(m)) return encode_ok({{"engine_id", "prefill-0-restarted"}});
    return std::nullopt;
  };
  c.drive_to(LoadState::kAwaitingWrite);
  // Its notification is the load's, not a stranger's.
  c.consumer.on_written(Written{"r1", 3072, nullptr, 0}, kProducerEngine);
  EXPECT_EQ(c.state(), LoadState::kAwaitingWrite);  // from the old engine id: ignored
  c.consumer.on_written(Written{"r1", 3072, nullptr, 0}, "prefill-0-restarted");
  EXPECT_EQ(c.state(), LoadState::kLoaded);
}

TEST(PdConsumer, AWriteRequestNamesTheLookedUpProducerAndARestartedOneIsAskedAgainBeforeItWrites) {
  ConsumerCase c(TransferMode::kWrite);
  // The cached lookup names prefill-0; a new process answers at its address
  // and refuses a request meant for the old one, naming itself.
  std::vector<std::string> expected;
  c.h.port.responder = [&expected](const PdMessage& m) -> std::optional<std::string> {
    if (const auto* w = std::get_if<WriteRequest>(&m)) {
      expected.push_back(w->producer_engine);
      if (w->producer_engine != "prefill-0-restarted")
        return encode_refusal("this side channel serves engine prefill-0-restarted now",
                              {{"engine_id", "prefill-0-restarted"}});
      return encode_ok({{"engine_id", "prefill-0-restarted"}});
    }
    return std::nullopt;
  };
  c.drive_to(LoadState::kAwaitingWrite);
  EXPECT_EQ(expected, (std::vector<std::string>{kProducerEngine, "prefill-0-restarted"}));
  c.consumer.on_written(Written{"r1", 3072, nullptr, 0}, "prefill-0-restarted");
  EXPECT_EQ(c.state(), LoadState::kLoaded);
}

TEST(PdConsumer, AnEndingWriteLoadIsQuietWhenTheProducerSaysItIsNotWritingOrAtTheWriteGrace) {
  {
    ConsumerCase c(TransferMode::kWrite);
    c.drive_to(LoadState::kAwaitingWrite);
    c.consumer.end_all("released");
    c.h.tasks.run_all();  // cancel answered writing: false
    EXPECT_EQ(c.state(), LoadState::kFailed);
    ConnectorUpdates u = c.collect();
    ASSERT_EQ(u.finished_loads.size(), 1u);
    EXPECT_FALSE(u.finished_loads[0].blocks_may_change);
  }
  {
    ConsumerCase c(TransferMode::kWrite);
    c.drive_to(LoadState::kAwaitingWrite);
    c.h.port.reachable = false;  // the producer is gone: no answer says it stopped
    c.consumer.end_all("released");
    c.h.tasks.run_all();
    ConnectorUpdates u = c.collect();
    ASSERT_EQ(u.finished_loads.size(), 1u);
    EXPECT_TRUE(u.finished_loads[0].blocks_may_change);
    c.h.advance(std::chrono::milliseconds(4000));  // the write request's deadline
    EXPECT_TRUE(c.collect().releasable_holds.empty());
    c.h.advance(std::chrono::milliseconds(1000));  // ... plus write_grace
    EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{load_hold_owner("r1")});
  }
  {
    // INVALIDATE acknowledged by the producer: it cannot write any more.
    ConsumerCase c(TransferMode::kWrite);
    c.drive_to(LoadState::kAwaitingWrite);
    c.h.port.reachable = false;
    c.consumer.end_all("released");
    c.h.tasks.run_all();
    const std::vector<std::string> other{"prefill-9"};
    c.consumer.peers_invalidated(&other);
    EXPECT_EQ(c.state(), LoadState::kEnding);
    const std::vector<std::string> acked{kProducerEngine};
    c.consumer.peers_invalidated(&acked);
    EXPECT_EQ(c.state(), LoadState::kFailed);
  }
}

TEST(PdConsumer, TheProducersLoadFailedEndsTheLoadWithoutACancel) {
  ConsumerCase c(TransferMode::kWrite);
  c.drive_to(LoadState::kAwaitingWrite);
  c.consumer.on_load_failed(LoadFailed{"r1", "released (the producer's KV cache went to sleep)"});
  EXPECT_EQ(c.state(), LoadState::kFailed);
  c.h.tasks.run_all();
  EXPECT_EQ(c.cancels(), 0u);
  ConnectorUpdates u = c.collect();
  ASSERT_EQ(u.finished_loads.size(), 1u);
  EXPECT_FALSE(u.finished_loads[0].loaded);
  EXPECT_FALSE(u.finished_loads[0].blocks_may_change);
}

TEST(PdConsumer, ARefusedWriteIsCancelledSoThatTheProducerHoldsNothingWhenItsPrefillEndsLater) {
  ConsumerCase c(TransferMode::kWrite);
  c.h.port.responder = [](const PdMessage& m) -> std::optional<std::string> {
    if (std::holds_alternative<WriteRequest>(m)) return encode_refusal("the producer's KV cache is not registered");
    return std::nullopt;
  };
  c.start();
  c.h.tasks.run_all();
  EXPECT_EQ(c.state(), LoadState::kFailed);
  EXPECT_EQ(c.cancels(), 1u);
}

TEST(PdConsumer, WithoutARegisteredKvCacheTheRequestComputesAndTheProducerIsToldAtOnce) {
  Harness h(TransferMode::kRead, "decode-0", "10.0.0.2:7002");
  LocalKv k = h.kv.get();
  k.registered = false;
  h.kv.set(k);
  Consumer consumer(*h.ctx);
  EngineRequest r = request("r1", {{"do_remote_prefill", true},
                                   {"remote_engine_id", kProducerEngine},
                                   {"remote_host", "10.0.0.1"},
                                   {"remote_port", 7001},
                                   {"remote_block_ids", {20, 21, 22}},
                                   {"remote_request_id", "p-r1"}});
  EXPECT_FALSE(consumer.on_added(r).load_remote_kv);
  h.tasks.run_all();
  auto cancels = h.port.sent_of<CancelRequest>();
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_EQ(cancels[0].producer_request, "p-r1");
  EXPECT_EQ(h.port.sent[0].address, kProducerAddress);
}

TEST(PdConsumer, AReadLoadEndedInAnyStateRecomputesAndItsBlocksWaitForOurRead) {
  enum class End { kRelease, kAbort, kTimeout };
  for (LoadState at : {LoadState::kStarting, LoadState::kReading, LoadState::kConfirming}) {
    for (End end : {End::kRelease, End::kAbort, End::kTimeout}) {
      SCOPED_TRACE(std::string(load_state_name(at)) + " / " +
                   (end == End::kRelease ? "release" : end == End::kAbort ? "abort" : "timeout"));
      ConsumerCase c(TransferMode::kRead);
      c.drive_to(at);
      ASSERT_EQ(c.state(), at);
      const uint64_t read = c.h.port.xfers.empty() ? 0 : c.h.port.xfers.begin()->first;
      switch (end) {
        case End::kRelease: EXPECT_EQ(c.consumer.end_all("released for sleep"), 1); break;
        case End::kAbort: c.consumer.on_aborted("r1"); break;
        case End::kTimeout:
          c.h.advance(std::chrono::milliseconds(4001));
          c.consumer.tick(c.h.now);
          break;
      }
      const bool our_read = at == LoadState::kReading;
      EXPECT_EQ(c.state(), our_read ? LoadState::kEnding : LoadState::kFailed);
      EXPECT_EQ(c.consumer.reads_in_flight(), our_read ? 1u : 0u);
      c.h.tasks.run_all();  // the cancel (and a late read_done task, which finds the load ended)
      auto cancels = c.h.port.sent_of<CancelRequest>();
      ASSERT_EQ(cancels.size(), 1u);
      EXPECT_EQ(cancels[0].producer_request, "p-r1");
      ConnectorUpdates u = c.collect();
      if (end != End::kAbort) {
        ASSERT_EQ(u.finished_loads.size(), 1u);
        EXPECT_FALSE(u.finished_loads[0].loaded);
        EXPECT_EQ(u.finished_loads[0].blocks_may_change, our_read);
      }
      if (our_read) {
        EXPECT_TRUE(u.releasable_holds.empty());  // our read still touches the blocks
        c.h.port.finish(read, /*ok=*/false, /*still_in_flight=*/true);  // failed at its deadline, still copying
        c.consumer.tick(c.h.now);
        EXPECT_EQ(c.state(), LoadState::kEnding);
        EXPECT_TRUE(c.collect().releasable_holds.empty());
        c.h.port.let_go(read);
        c.consumer.tick(c.h.now);
        EXPECT_EQ(c.state(), LoadState::kFailed);
        EXPECT_EQ(c.consumer.reads_in_flight(), 0u);
        u = c.collect();
      }
      const bool held = our_read || (end == End::kAbort);
      if (held) {
        EXPECT_EQ(u.releasable_holds, std::vector<HoldKey>{load_hold_owner("r1")});
      } else {
        EXPECT_TRUE(u.releasable_holds.empty());
      }
      EXPECT_EQ(c.consumer.num_loads(), 0u);
    }
  }
}

TEST(PdConsumer, AReadWhoseHoldEndedIsDiscardedAndNotCancelled) {
  ConsumerCase c(TransferMode::kRead);
  c.drive_to(LoadState::kConfirming);
  c.h.port.responder = [](const PdMessage& m) -> std::optional<std::string> {
    if (std::holds_alternative<ReadDone>(m)) return encode_ok({{"held", false}, {"reason", "released"}});
    return std::nullopt;
  };
  c.h.tasks.run_all();
  EXPECT_EQ(c.state(), LoadState::kFailed);
  EXPECT_EQ(c.cancels(), 0u);  // read_done freed what the producer held
  ConnectorUpdates u = c.collect();
  ASSERT_EQ(u.finished_loads.size(), 1u);
  EXPECT_FALSE(u.finished_loads[0].loaded);
}

// ---- the producer -------------------------------------------------------------------------------

struct ProducerCase {
  explicit ProducerCase(TransferMode mode) : h(mode, kProducerEngine, kProducerAddress), producer(*h.ctx) {
    r = request("p-r1", {{"do_remote_decode", true}});
    EXPECT_TRUE(producer.on_added(r).hold_blocks_for_remote_reader);
  }
  std::optional<SendState> state() const { return producer.state_of("p-r1"); }

  // The request finished its prefill with blocks 20..22 held.
  nlohmann::json prefilled() {
    RequestOutput out;
    out.request_id = "p-r1";
    out.state = RequestState::kFinishedLength;
    out.held_blocks = {20, 21, 22};
    return producer.on_finished(r, out);
  }
  // The consumer's write request for this request (WRITE mode).
  std::string ask_write() {
    WriteRequest w;
    w.x_request_id = "x-p-r1";
    w.consumer_request = "d-r1";
    w.consumer_engine = "decode-0";
    w.consumer_address = "10.0.0.2:7002";
    w.region = 7;
    w.epoch = 9;
    w.blocks = {0, 1, 2};
    w.prompt = PromptCheck{40, prompt_hash(r.prompt_tokens), "test-layout", 1024};
    w.deadline_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count() +
                         4000;
    return producer.on_write(w);
  }
  ConnectorUpdates collect() {
    ConnectorUpdates u;
    producer.collect(u);
    return u;
  }
  std::vector<LoadFailed> told() const { return h.port.sent_of<LoadFailed>(); }

  Harness h;
  Producer producer;
  EngineRequest r;
};

TEST(PdProducer, AWriteRequestForAnotherEngineIsRefusedWithThisEnginesIdAndNothingIsWritten) {
  ProducerCase c(TransferMode::kWrite);
  c.prefilled();
  WriteRequest w;
  w.x_request_id = "x-p-r1";
  w.consumer_request = "d-r1";
  w.consumer_engine = "decode-0";
  w.consumer_address = "10.0.0.2:7002";
  w.region = 7;
  w.epoch = 9;
  w.blocks = {0, 1, 2};
  w.prompt = PromptCheck{40, prompt_hash(c.r.prompt_tokens), "test-layout", 1024};
  w.deadline_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count() +
                       4000;
  w.producer_engine = "prefill-0-before-restart";
  auto refused = decode_reply(c.producer.on_write(w));
  ASSERT_TRUE(refused);
  EXPECT_FALSE(refused->ok);
  EXPECT_EQ(refused->body.value("engine_id", ""), kProducerEngine);
  EXPECT_EQ(c.state(), SendState::kReady);  // no write started
  w.producer_engine = kProducerEngine;
  auto accepted = decode_reply(c.producer.on_write(w));
  ASSERT_TRUE(accepted);
  EXPECT_TRUE(accepted->ok);
  EXPECT_EQ(c.state(), SendState::kWriting);
}

TEST(PdProducer, AWaitingSendSurvivesARelease_AbortOrCancelEndItAndNoBlocksStayHeld) {
  {
    ProducerCase c(TransferMode::kWrite);
    EXPECT_EQ(c.producer.end_all(), 0);  // the request recomputes after wake, then holds new blocks
    EXPECT_EQ(c.state(), SendState::kWaiting);
  }
  {
    ProducerCase c(TransferMode::kWrite);
    c.producer.on_aborted("p-r1");
    EXPECT_EQ(c.state(), SendState::kDone);
    EXPECT_TRUE(c.collect().releasable_holds.empty());  // no blocks were held yet
  }
  {
    ProducerCase c(TransferMode::kWrite);
    ASSERT_EQ(decode_reply(c.ask_write())->ok, true);
    // The consumer gave up during the prefill.
    auto answer = decode_reply(c.producer.on_cancel(CancelRequest{"x-p-r1", 0, ""}));
    ASSERT_TRUE(answer);
    EXPECT_FALSE(*reply_bool(*answer, "writing"));
    EXPECT_EQ(c.state(), SendState::kDone);
    // The prefill ends afterwards: its answer names no blocks and the hold goes back at once.
    nlohmann::json params = c.prefilled();
    EXPECT_TRUE(params["remote_block_ids"].empty());
    EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{send_hold_owner("p-r1")});
    c.h.tasks.run_all();
    EXPECT_TRUE(c.told().empty());  // it was the consumer's own cancel
  }
}

TEST(PdProducer, AReadySendEndedByReleaseExpiryOrCancelGivesItsBlocksBackAndRefusesLateMessages) {
  enum class End { kRelease, kExpire, kCancel };
  for (End end : {End::kRelease, End::kExpire, End::kCancel}) {
    SCOPED_TRACE(end == End::kRelease ? "release" : end == End::kExpire ? "expire" : "cancel");
    ProducerCase c(TransferMode::kWrite);
    // No write target yet: the send stays READY (a target arriving now would start the write at once).
    nlohmann::json params = c.prefilled();
    EXPECT_EQ(params["remote_block_ids"], (std::vector<int32_t>{20, 21, 22}));
    ASSERT_EQ(c.state(), SendState::kReady);
    EXPECT_TRUE(c.collect().releasable_holds.empty());
    switch (end) {
      case End::kRelease: EXPECT_EQ(c.producer.end_all(), 1); break;
      case End::kExpire:
        c.h.advance(std::chrono::milliseconds(9999));
        c.producer.tick(c.h.now);
        ASSERT_EQ(c.state(), SendState::kReady);
        c.h.advance(std::chrono::milliseconds(2));
        c.producer.tick(c.h.now);
        break;
      case End::kCancel: c.producer.on_cancel(CancelRequest{"x-p-r1", 0, ""}); break;
    }
    EXPECT_EQ(c.state(), SendState::kDone);
    EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{send_hold_owner("p-r1")});
    EXPECT_FALSE(c.state());  // forgotten
    // A late write request about it is refused at once, with the reason.
    auto refused = decode_reply(c.ask_write());
    ASSERT_TRUE(refused);
    EXPECT_FALSE(refused->ok);
    EXPECT_NE(refused->reason.find(end == End::kRelease  ? "released"
                                   : end == End::kExpire ? "expired"
                                                         : "cancelled"),
              std::string::npos)
        << refused->reason;
  }
}

TEST(PdProducer, AReleaseOfASendWithATargetTellsTheConsumerAtOnce) {
  ProducerCase c(TransferMode::kWrite);
  ASSERT_TRUE(decode_reply(c.ask_write())->ok);  // parked on the WAITING send
  // The producer's KV cache goes away before the prefill ends: the send ends released when it does.
  LocalKv k = c.h.kv.get();
  k.registered = false;
  c.h.kv.set(k);
  nlohmann::json params = c.prefilled();
  EXPECT_TRUE(params["remote_block_ids"].empty());
  EXPECT_EQ(c.state(), SendState::kDone);
  c.h.tasks.run_all();
  ASSERT_EQ(c.told().size(), 1u);
  EXPECT_EQ(c.told()[0].consumer_request, "d-r1");
  EXPECT_NE(c.told()[0].reason.find("released"), std::string::npos) << c.told()[0].reason;
  EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{send_hold_owner("p-r1")});
}

TEST(PdProducer, AWriteInFlightHoldsTheBlocksThroughReleaseAndCancelAndTheConsumerLearnsOnlyWhenItEnds) {
  for (bool write_ok : {true, false}) {
    SCOPED_TRACE(write_ok ? "the write lands" : "the write fails at its deadline while still copying");
    ProducerCase c(TransferMode::kWrite);
    c.prefilled();
    ASSERT_TRUE(decode_reply(c.ask_write())->ok);
    ASSERT_EQ(c.state(), SendState::kWriting);
    c.h.tasks.run_all();  // handshake, submit with the notification
    ASSERT_EQ(c.h.port.xfers.size(), 1u);
    const uint64_t write = c.h.port.xfers.begin()->first;
    EXPECT_TRUE(c.h.port.xfers.at(write).notification);
    // Release and cancel cannot end it; its blocks stay held.
    EXPECT_EQ(c.producer.end_all(), 0);
    EXPECT_EQ(c.producer.writes_in_flight(), 1u);
    auto answer = decode_reply(c.producer.on_cancel(CancelRequest{"x-p-r1", 0, ""}));
    EXPECT_TRUE(*reply_bool(*answer, "writing"));
    c.h.advance(std::chrono::milliseconds(10001));  // past the hold deadline: no expiry while writing
    c.producer.tick(c.h.now);
    EXPECT_EQ(c.state(), SendState::kWriting);
    EXPECT_TRUE(c.collect().releasable_holds.empty());
    c.h.port.finish(write, write_ok, /*still_in_flight=*/!write_ok);
    c.producer.tick(c.h.now);
    if (!write_ok) {
      EXPECT_EQ(c.state(), SendState::kDraining);
      c.h.tasks.run_all();
      EXPECT_TRUE(c.told().empty());  // our copy may still land in the consumer's blocks
      EXPECT_TRUE(c.collect().releasable_holds.empty());
      c.h.port.let_go(write);
      c.producer.tick(c.h.now);
    }
    EXPECT_EQ(c.state(), SendState::kDone);
    EXPECT_EQ(c.producer.writes_in_flight(), 0u);
    c.h.tasks.run_all();
    EXPECT_EQ(c.told().size(), write_ok ? 0u : 1u);  // a landed write notified; a failed one says load_failed
    EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{send_hold_owner("p-r1")});
  }
}

TEST(PdProducer, ReadModeTheLeaseHoldsUntilReadDoneAndAReleaseMakesReadDoneSayItDidNot) {
  {
    ProducerCase c(TransferMode::kRead);
    c.prefilled();
    ReadStart start{"p-r1", 0, {20, 21, 22}, PromptCheck{40, prompt_hash(c.r.prompt_tokens), "test-layout", 1024}};
    auto ok = decode_reply(c.producer.on_read_start(start));
    ASSERT_TRUE(ok && ok->ok) << (ok ? ok->reason : ok.error().message);
    auto done = decode_reply(c.producer.on_read_done(ReadDone{"p-r1", 0}));
    EXPECT_TRUE(*reply_bool(*done, "held"));
    EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{send_hold_owner("p-r1")});
  }
  {
    ProducerCase c(TransferMode::kRead);
    c.prefilled();
    ReadStart start{"p-r1", 0, {20, 21, 22}, PromptCheck{40, prompt_hash(c.r.prompt_tokens), "test-layout", 1024}};
    ASSERT_TRUE(decode_reply(c.producer.on_read_start(start))->ok);
    EXPECT_EQ(c.producer.end_all(), 1);  // sleep while the consumer reads
    EXPECT_EQ(c.collect().releasable_holds, std::vector<HoldKey>{send_hold_owner("p-r1")});
    auto done = decode_reply(c.producer.on_read_done(ReadDone{"p-r1", 0}));
    EXPECT_FALSE(*reply_bool(*done, "held"));  // the consumer discards what it read
    auto again = decode_reply(c.producer.on_read_start(start));
    EXPECT_FALSE(again->ok);
    EXPECT_NE(again->reason.find("released"), std::string::npos);
  }
}

}  // namespace
}  // namespace siesta::pd
