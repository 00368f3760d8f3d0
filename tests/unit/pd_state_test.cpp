// The P/D connector's state machines (send states of a producer, load states
// of a consumer: each table in full), its protocol messages, and how a
// request's blocks become transfer entries.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <utility>

#include "engine/sampler.h"
#include "pd/kv_blocks.h"
#include "pd/load_state.h"
#include "pd/pd_messages.h"
#include "pd/send_state.h"

namespace siesta::pd {
namespace {

TEST(SendState, TheWholeTable) {
  using S = SendState;
  using E = SendEvent;
  // (from, event) -> to, as send_state.h and src/pd/README.md print it; every pair not listed is refused.
  const std::map<std::pair<S, E>, S> allowed = {
      {{S::kWaiting, E::kPrefilled}, S::kReady},     {{S::kWaiting, E::kFailed}, S::kDone},
      {{S::kWaiting, E::kAborted}, S::kDone},        {{S::kWaiting, E::kCancelled}, S::kDone},
      {{S::kWaiting, E::kReleased}, S::kDone},       {{S::kReady, E::kWriteStarted}, S::kWriting},
      {{S::kReady, E::kSent}, S::kDone},             {{S::kReady, E::kFailed}, S::kDone},
      {{S::kReady, E::kAborted}, S::kDone},          {{S::kReady, E::kCancelled}, S::kDone},
      {{S::kReady, E::kExpired}, S::kDone},          {{S::kReady, E::kReleased}, S::kDone},
      {{S::kWriting, E::kSent}, S::kDone},           {{S::kWriting, E::kFailed}, S::kDraining},
      {{S::kDraining, E::kDrained}, S::kDone},
  };
  for (S from : {S::kWaiting, S::kReady, S::kWriting, S::kDraining, S::kDone}) {
    for (E e : {E::kPrefilled, E::kWriteStarted, E::kSent, E::kFailed, E::kAborted, E::kCancelled, E::kExpired,
                E::kReleased, E::kDrained}) {
      auto next = next_send_state(from, e);
      auto it = allowed.find({from, e});
      if (it == allowed.end()) {
        ASSERT_FALSE(next) << send_state_name(from) << " + " << send_event_name(e);
        EXPECT_EQ(next.error().code, ErrorCode::kConflict);
        EXPECT_NE(next.error().message.find(send_state_name(from)), std::string::npos);
      } else {
        ASSERT_TRUE(next) << send_state_name(from) << " + " << send_event_name(e);
        EXPECT_EQ(*next, it->second);
      }
    }
  }
  // Blocks are held from READY until DONE.
  EXPECT_FALSE(send_holds_blocks(S::kWaiting));
  EXPECT_TRUE(send_holds_blocks(S::kReady));
  EXPECT_TRUE(send_holds_blocks(S::kWriting));
  EXPECT_TRUE(send_holds_blocks(S::kDraining));
  EXPECT_FALSE(send_holds_blocks(S::kDone));
}

TEST(SendState, AWriteInFlightIsEndedOnlyByItsOwnEnd) {
  // A cancel, an expiry or a release cannot end a send whose write may still read the blocks.
  for (SendEvent e : {SendEvent::kAborted, SendEvent::kCancelled, SendEvent::kExpired, SendEvent::kReleased})
    EXPECT_FALSE(next_send_state(SendState::kWriting, e)) << send_event_name(e);
  // The hold deadline starts at READY: a send still prefilling does not expire.
  EXPECT_FALSE(next_send_state(SendState::kWaiting, SendEvent::kExpired));
  EXPECT_STREQ(send_state_name(SendState::kReady), "READY");
  EXPECT_NE(std::string(send_end_reason(SendEvent::kExpired)).find("expired"), std::string::npos);
}

TEST(LoadState, TheWholeTable) {
  using S = LoadState;
  using E = LoadEvent;
  const std::map<std::pair<S, E>, S> allowed = {
      {{S::kPending, E::kAllocated}, S::kStarting},         {{S::kPending, E::kFailed}, S::kFailed},
      {{S::kPending, E::kProducerEnded}, S::kFailed},       {{S::kStarting, E::kAsked}, S::kAsked},
      {{S::kStarting, E::kReadStarted}, S::kReading},       {{S::kStarting, E::kKvInPlace}, S::kLoaded},
      {{S::kStarting, E::kFailed}, S::kFailed},             {{S::kStarting, E::kProducerEnded}, S::kFailed},
      {{S::kAsked, E::kAccepted}, S::kAwaitingWrite},       {{S::kAsked, E::kKvInPlace}, S::kLoaded},
      {{S::kAsked, E::kFailed}, S::kEnding},                {{S::kAsked, E::kProducerEnded}, S::kFailed},
      {{S::kAwaitingWrite, E::kKvInPlace}, S::kLoaded},     {{S::kAwaitingWrite, E::kFailed}, S::kEnding},
      {{S::kAwaitingWrite, E::kProducerEnded}, S::kFailed}, {{S::kReading, E::kReadDone}, S::kConfirming},
      {{S::kReading, E::kFailed}, S::kEnding},              {{S::kConfirming, E::kKvInPlace}, S::kLoaded},
      {{S::kConfirming, E::kFailed}, S::kFailed},           {{S::kConfirming, E::kProducerEnded}, S::kFailed},
      {{S::kEnding, E::kQuiet}, S::kFailed},
  };
  for (S from : {S::kPending, S::kStarting, S::kAsked, S::kAwaitingWrite, S::kReading, S::kConfirming, S::kLoaded,
                 S::kEnding, S::kFailed}) {
    for (E e : {E::kAllocated, E::kAsked, E::kAccepted, E::kReadStarted, E::kReadDone, E::kKvInPlace, E::kFailed,
                E::kProducerEnded, E::kQuiet}) {
      auto next = next_load_state(from, e);
      auto it = allowed.find({from, e});
      ASSERT_EQ(bool(next), it != allowed.end()) << load_state_name(from) << " + " << load_event_name(e);
      if (next) {
        EXPECT_EQ(*next, it->second);
      }
    }
  }
  // Ended: the request no longer waits; final: nothing touches the blocks.
  EXPECT_TRUE(load_ended(S::kEnding));
  EXPECT_FALSE(load_final(S::kEnding));
  EXPECT_TRUE(load_final(S::kLoaded));
  EXPECT_TRUE(load_final(S::kFailed));
  EXPECT_FALSE(load_ended(S::kConfirming));
  EXPECT_FALSE(load_ended(S::kAsked));
}

TEST(PdMessages, EachMessageRoundTrips) {
  WriteRequest w;
  w.x_request_id = "req-1";
  w.choice = 2;
  w.consumer_request = "cmpl-9-2";
  w.consumer_engine = "decode-0";
  w.consumer_address = "127.0.0.1:4000";
  w.region = 18446744073709551615ull;  // 64-bit values survive JSON
  w.epoch = 7;
  w.first_block = 1;
  w.blocks = {5, 6, 9};
  w.prompt = PromptCheck{40, 0xfedcba9876543210ull, "layers=4", 65536};
  w.deadline_unix_ms = 1'800'000'000'000;
  auto m = decode_message(encode(w));
  ASSERT_TRUE(m) << m.error().message;
  const auto& back = std::get<WriteRequest>(*m);
  EXPECT_EQ(back.x_request_id, "req-1");
  EXPECT_EQ(back.choice, 2);
  EXPECT_EQ(back.consumer_request, "cmpl-9-2");
  EXPECT_EQ(back.consumer_address, "127.0.0.1:4000");
  EXPECT_EQ(back.region, w.region);
  EXPECT_EQ(back.epoch, 7u);
  EXPECT_EQ(back.first_block, 1);
  EXPECT_EQ(back.blocks, w.blocks);
  EXPECT_EQ(back.prompt, w.prompt);
  EXPECT_EQ(back.deadline_unix_ms, w.deadline_unix_ms);

  auto c = decode_message(encode(CancelRequest{"req-1", 0, ""}));
  ASSERT_TRUE(c);
  EXPECT_EQ(std::get<CancelRequest>(*c).x_request_id, "req-1");
  auto s = decode_message(encode(ReadStart{"cmpl-1-0", 2, {4, 8, 15}, w.prompt}));
  ASSERT_TRUE(s);
  EXPECT_EQ(std::get<ReadStart>(*s).blocks, (std::vector<int32_t>{4, 8, 15}));
  auto d = decode_message(encode(ReadDone{"cmpl-1-0"}));
  ASSERT_TRUE(d);
  EXPECT_EQ(std::get<ReadDone>(*d).producer_request, "cmpl-1-0");
  auto f = decode_message(encode(LoadFailed{"cmpl-9-2", "aborted"}));
  ASSERT_TRUE(f);
  EXPECT_EQ(std::get<LoadFailed>(*f).reason, "aborted");
  auto n = decode_written(encode(Written{"cmpl-9-2", 196608}));
  ASSERT_TRUE(n);
  EXPECT_EQ(n->bytes, 196608u);
  EXPECT_EQ(n->logits, nullptr);
}

TEST(PdMessages, LogitsTravelBitForBit) {
  // Every float32 bit pattern class: signs, zeros, subnormals, infinities, NaN.
  auto values = std::make_shared<std::vector<float>>();
  for (float v : {0.0f, -0.0f, 1.5f, -3.25e-3f, 1e-45f, -1e38f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    values->push_back(v);
  for (int i = 0; i < 151936 - 9; ++i) values->push_back(static_cast<float>(i) * 0.001f - 7.0f);
  const LogitsRow row = values;
  auto same = [&](const LogitsRow& got) {
    ASSERT_NE(got, nullptr);
    ASSERT_EQ(got->size(), row->size());
    EXPECT_EQ(std::memcmp(got->data(), row->data(), row->size() * sizeof(float)), 0);
  };
  auto w = decode_written(encode(Written{"cmpl-9-2", 4096, row}));
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(w->consumer_request, "cmpl-9-2");
  same(w->logits);
  auto r = decode_reply(encode_ok({{"held", true}}, row));
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(*reply_bool(*r, "held"));
  same(r->logits);
  auto plain = decode_reply(encode_ok({{"held", false}}));
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->logits, nullptr);
}

TEST(PdMessages, TheBestEntriesGiveTheSameGreedyTokenAsTheWholeRow) {
  const float inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    auto row = std::make_shared<std::vector<float>>(1000);
    // Few distinct values, so ties between ids are common; then NaN and +inf.
    for (float& v : *row) v = static_cast<float>(static_cast<int>(rng() % 7)) * 0.5f - 1.0f;
    if (trial % 5 == 1) (*row)[rng() % 1000] = std::numeric_limits<float>::quiet_NaN();
    if (trial % 7 == 2) (*row)[rng() % 1000] = inf;
    const LogitsRow whole = row;
    for (int32_t top : {1, 3}) {
      auto w = decode_written(encode(Written{"r", 1, whole, top}));
      ASSERT_TRUE(w) << w.error().message;
      ASSERT_NE(w->logits, nullptr);
      ASSERT_EQ(w->logits->size(), whole->size());
      int finite = 0;
      for (float v : *w->logits) finite += v != -inf;
      EXPECT_EQ(finite, top);
      // The greedy pick of the expanded row is the whole row's.
      SamplingParams greedy;
      greedy.temperature = 0.0;
      RandomGenerator unseeded(1);
      EXPECT_EQ(sample(*w->logits, greedy, 0, unseeded), sample(*whole, greedy, 0, unseeded)) << trial;
    }
  }
  // A row whose best entries include -inf goes whole.
  auto degenerate = std::make_shared<std::vector<float>>(16, -inf);
  (*degenerate)[4] = 1.0f;
  auto w = decode_written(encode(Written{"r", 1, degenerate, 3}));
  ASSERT_TRUE(w);
  EXPECT_EQ(*w->logits, *degenerate);
  // Requests carry the wish; absent means the whole row.
  auto m = decode_message(encode(ReadDone{"p-1", 1}));
  ASSERT_TRUE(m);
  EXPECT_EQ(std::get<ReadDone>(*m).logits_top, 1);
  EXPECT_EQ(std::get<ReadDone>(*decode_message(encode(ReadDone{"p-1"}))).logits_top, 0);
  for (const char* bad : {R"({"v": 2, "op": "read_done", "producer_request": "x", "logits_top": -1})",
                          R"({"v": 2, "op": "read_done", "producer_request": "x", "logits_top": 100000})"})
    EXPECT_FALSE(decode_message(bad)) << bad;
  auto r = decode_reply(encode_ok({{"held", true}}, degenerate, 1));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->logits->size(), 16u);
}

TEST(PdMessages, BadMessagesAreRefusedWithoutThrowing) {
  for (const char* bad : {"", "{", "[]", R"({"v": 2})", R"({"v": 99, "op": "read_done", "producer_request": "x"})",
                          R"({"v": 2, "op": "launch"})", R"({"v": 2, "op": "read_done", "producer_request": 5})",
                          R"({"v": 2, "op": "cancel", "x_request_id": "", "choice": 0, "producer_request": ""})",
                          R"({"v": 2, "op": "read_start", "producer_request": "x", "first_block": -1,
                              "blocks": [1], "prompt": {}})",
                          R"({"v": 2, "op": "read_start", "producer_request": "x", "first_block": 0,
                              "blocks": [-3], "prompt": {}})"}) {
    auto m = decode_message(bad);
    EXPECT_FALSE(m) << bad;
    if (!m) {
      EXPECT_EQ(m.error().code, ErrorCode::kCorrupt) << bad;
    }
  }
  EXPECT_FALSE(decode_written(encode(ReadDone{"x"})));
  // Logits that do not match what the text announces.
  const std::string good = encode(Written{"r", 64, std::make_shared<const std::vector<float>>(8, 0.5f)});
  const size_t nul = good.find('\0');
  ASSERT_NE(nul, std::string::npos);
  for (const std::string& bad : {good.substr(0, good.size() - 1), good + "x", good.substr(0, nul + 1),
                                 std::string(R"({"v": 2, "op": "written", "consumer_request": "r", "bytes": 1})") +
                                     std::string(1, '\0') + "abcd",
                                 std::string(R"({"v": 2, "op": "written", "consumer_request": "r", "bytes": 1,
                                     "logits": -1})") + std::string(1, '\0')}) {
    auto w = decode_written(bad);
    ASSERT_FALSE(w);
    EXPECT_EQ(w.error().code, ErrorCode::kCorrupt);
  }
  EXPECT_FALSE(decode_reply(encode_ok({{"held", true}}, std::make_shared<const std::vector<float>>(3, 1.0f)) + "zz"));
}

TEST(PdMessages, RepliesSayOkOrWhy) {
  auto ok = decode_reply(encode_ok({{"held", true}, {"epoch", "12"}}));
  ASSERT_TRUE(ok);
  EXPECT_TRUE(ok->ok);
  EXPECT_TRUE(*reply_bool(*ok, "held"));
  EXPECT_EQ(*reply_u64(*ok, "epoch"), 12u);
  EXPECT_FALSE(reply_bool(*ok, "writing"));
  auto no = decode_reply(encode_refusal("request r expired"));
  ASSERT_TRUE(no);
  EXPECT_FALSE(no->ok);
  EXPECT_EQ(no->reason, "request r expired");
  EXPECT_FALSE(decode_reply("not json"));
}

TEST(PdMessages, ThePromptHashSeesEveryToken) {
  EXPECT_EQ(prompt_hash({1, 2, 3}), prompt_hash({1, 2, 3}));
  EXPECT_NE(prompt_hash({1, 2, 3}), prompt_hash({1, 2, 4}));
  EXPECT_NE(prompt_hash({1, 2, 3}), prompt_hash({1, 2, 3, 0}));
  EXPECT_NE(prompt_hash({256}), prompt_hash({1}));
}

TEST(KvBlocks, RunsConsecutiveOnBothSidesBecomeOneEntry) {
  const transfer::RegionId local{1}, remote{9};
  auto e = block_entries(local, std::vector<int32_t>{3, 4, 5, 9, 10}, remote, std::vector<int32_t>{7, 8, 2, 3, 4}, 100);
  ASSERT_TRUE(e) << e.error().message;
  // 3,4 -> 7,8 (one run); 5 -> 2 (remote jumps back); 9,10 -> 3,4 (local jumps).
  ASSERT_EQ(e->size(), 3u);
  EXPECT_EQ((*e)[0].local_offset, 300u);
  EXPECT_EQ((*e)[0].remote_offset, 700u);
  EXPECT_EQ((*e)[0].bytes, 200u);
  EXPECT_EQ((*e)[1].local_offset, 500u);
  EXPECT_EQ((*e)[1].remote_offset, 200u);
  EXPECT_EQ((*e)[1].bytes, 100u);
  EXPECT_EQ((*e)[2].local_offset, 900u);
  EXPECT_EQ((*e)[2].remote_offset, 300u);
  EXPECT_EQ((*e)[2].bytes, 200u);
  EXPECT_EQ((*e)[2].local_region, local);
  EXPECT_EQ((*e)[2].remote_region, remote);
  EXPECT_FALSE(block_entries(local, std::vector<int32_t>{1, 2}, remote, std::vector<int32_t>{1}, 100));
  EXPECT_FALSE(block_entries(local, std::vector<int32_t>{}, remote, std::vector<int32_t>{}, 100));
  EXPECT_FALSE(block_entries(local, std::vector<int32_t>{-1}, remote, std::vector<int32_t>{1}, 100));
}

}  // namespace
}  // namespace siesta::pd
