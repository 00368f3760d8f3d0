// run_step over a model that chooses tokens on its device: each sequence is
// chosen where its own request says, whatever it is batched with. A fake
// device model picks tokens by a rule of its own (not the host sampler's), so
// a seeded request whose step fell back to the host would get other tokens:
// beside requests that need their logits here (prompt_logprobs, logprobs,
// penalties, a P/D producer's kept row, a row the device cannot decide) it
// must get exactly the tokens it gets alone, from the device, and the others
// the host sampler's tokens and log-probabilities in the steps that need the
// host, in one forward_choose per step (forward is never called).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine_step.h"
#include "engine/hold_key.h"
#include "engine/random.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"

namespace siesta {
namespace {

constexpr int kVocab = 64;
constexpr int32_t kEos = 1;

// The logits of the row whose sequence so far is `tokens` (its last is the
// position the row is computed at): a hash of every token and position.
std::vector<float> row_for(std::span<const int32_t> tokens) {
  uint64_t h = 0x1234;
  for (size_t q = 0; q < tokens.size(); ++q)
    h = mix64(h ^ static_cast<uint64_t>(tokens[q]) ^ (static_cast<uint64_t>(q) << 32));
  std::vector<float> row(kVocab);
  for (int v = 0; v < kVocab; ++v)
    row[v] = static_cast<float>(mix64(h + v) >> 40) / static_cast<float>(1 << 24) * 8.0f - 4.0f;
  return row;
}

// The fake device's own sampler: greedy is the first maximum (as on the
// host), anything else takes the draw uniformly over its 8 most likely
// allowed tokens, which the host sampler would not. top_k 3 stands for a row
// the device cannot decide (a real device's too-large top-p nucleus).
int32_t device_pick(std::span<const float> row, const TokenChoice& c) {
  if (c.top_k == 3 && c.temperature >= 1e-5) return kChooseOnHost;
  std::vector<int32_t> ids;
  for (int32_t v = 0; v < kVocab; ++v)
    if (std::find(c.banned.begin(), c.banned.end(), v) == c.banned.end()) ids.push_back(v);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  if (c.temperature < 1e-5) return ids[0];
  const size_t n = std::min<size_t>(8, ids.size());
  return ids[std::min(n - 1, static_cast<size_t>(c.uniform * static_cast<double>(n)))];
}

// Keeps each position's token in its KV slot and computes the row of
// position p from the tokens read back for positions 0..p, so a sequence's
// logits depend on its own tokens only.
class FakeDeviceModel final : public Model {
 public:
  FakeDeviceModel() {
    cfg_.model_type = "fake";
    cfg_.vocab_size = kVocab;
    cfg_.num_layers = 1;
    cfg_.num_heads = 1;
    cfg_.num_kv_heads = 1;
    cfg_.head_dim = 2;
    cfg_.eos_token_ids = {kEos};
  }
  const ModelConfig& config() const override { return cfg_; }
  KvCacheLayout kv_layout() const override { return KvCacheLayout{1, 1, 2, kBlockSize, sizeof(float)}; }

  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override {
    ++forwards;
    std::vector<bool> all(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) all[i] = batch[i].all_logits;
    return compute(batch, kv, all, out);
  }

  bool chooses_tokens() const override { return true; }
  Result<void> forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                              std::span<const TokenChoice> choices, std::vector<int32_t>& tokens,
                              ForwardOutput& logits) override {
    ++chooses;
    if (choices.size() != batch.size()) return invalid_argument("fake: one choice per sequence");
    ForwardOutput rows;
    std::vector<bool> all(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) all[i] = batch[i].all_logits && choices[i].on_host;
    SIESTA_TRY(compute(batch, kv, all, rows));
    // Only the host's rows come back, in sequence order.
    tokens.assign(batch.size(), kChooseOnHost);
    logits.vocab_size = kVocab;
    logits.logits.clear();
    logits.first_row.assign(batch.size(), 0);
    logits.num_rows.assign(batch.size(), 0);
    Call call;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!choices[i].on_host) {
        tokens[i] = device_pick(rows.last(i), choices[i]);
        if (tokens[i] != kChooseOnHost) ++call.device;
      }
      if (choices[i].on_host) (all[i] ? call.host_all_rows : call.host_last_row) += 1;
      if (tokens[i] != kChooseOnHost) continue;
      call.undecided += !choices[i].on_host;
      if (choose_host_rows_too && choices[i].on_host) tokens[i] = 0;  // breaks the contract
      logits.first_row[i] = logits.logits.size() / kVocab;
      logits.num_rows[i] = rows.num_rows[i];
      const std::span<const float> src(rows.logits.data() + rows.first_row[i] * kVocab, rows.num_rows[i] * kVocab);
      logits.logits.insert(logits.logits.end(), src.begin(), src.end());
    }
    calls.push_back(call);
    return {};
  }

  // What one forward_choose call had: sequences chosen on the device, the
  // host's with every row or their last, rows the device left undecided.
  struct Call {
    int device = 0;
    int host_all_rows = 0;
    int host_last_row = 0;
    int undecided = 0;
  };
  int forwards = 0;
  int chooses = 0;
  std::vector<Call> calls;
  bool choose_host_rows_too = false;

 private:
  Result<void> compute(std::span<const SequenceChunk> batch, const KvCacheView& kv, const std::vector<bool>& all,
                       ForwardOutput& out) const {
    SIESTA_TRY(validate_batch(cfg_, batch, kv));
    auto* base = static_cast<float*>(kv.base);
    auto slot = [&](std::span<const int32_t> table, int32_t pos) {
      return base + kv.layout.offset(table[pos / kBlockSize], 0, 0) + (pos % kBlockSize) * kv.layout.slot_elems();
    };
    out.vocab_size = kVocab;
    out.logits.clear();
    out.first_row.clear();
    out.num_rows.clear();
    for (size_t i = 0; i < batch.size(); ++i) {
      const SequenceChunk& seq = batch[i];
      for (size_t t = 0; t < seq.tokens.size(); ++t) {
        float* s = slot(seq.block_table, seq.start_pos + static_cast<int32_t>(t));
        s[0] = static_cast<float>(seq.tokens[t]);
        s[1] = static_cast<float>(seq.start_pos + static_cast<int32_t>(t));
      }
      const int32_t end = seq.start_pos + static_cast<int32_t>(seq.tokens.size());
      std::vector<int32_t> seen;
      for (int32_t q = 0; q < end; ++q) {
        const float* s = slot(seq.block_table, q);
        if (s[1] != static_cast<float>(q))
          return internal_error("fake: the slot of position " + std::to_string(q) + " holds another");
        seen.push_back(static_cast<int32_t>(s[0]));
      }
      out.first_row.push_back(out.logits.size() / kVocab);
      const int32_t first = all[i] ? seq.start_pos : end - 1;
      for (int32_t p = first; p < end; ++p) {
        const std::vector<float> row = row_for(std::span<const int32_t>(seen.data(), static_cast<size_t>(p) + 1));
        out.logits.insert(out.logits.end(), row.begin(), row.end());
      }
      out.num_rows.push_back(static_cast<size_t>(end - first));
    }
    return {};
  }

  ModelConfig cfg_;
};

struct Served {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;         // of each token, when asked
  std::vector<TokenLogprobs> prompt_logprobs;  // when asked
  std::vector<LogitsRow> kept;                 // SampledToken::logits
};

struct Outcome {
  std::map<RequestId, Served> results;
  int forwards = 0;
  int chooses = 0;
  std::vector<FakeDeviceModel::Call> calls;
};

// One engine (scheduler, block pool, KV memory, sampler) serving `requests`
// to the end, all admitted at once.
Outcome serve(const std::vector<NewRequest>& requests, bool choose_on_device = true) {
  FakeDeviceModel model;
  const int num_blocks = 128;
  BlockPool pool(num_blocks, /*prefix_caching=*/false);
  std::vector<float> kv_mem(static_cast<size_t>(num_blocks) * model.kv_layout().block_elems(), -1.0f);
  const KvCacheView kv{kv_mem.data(), num_blocks, model.kv_layout()};
  SchedulerOptions o;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 24;  // prompts take several steps, beside the others' decodes
  o.max_model_len = 128;
  o.vocab_size = kVocab;
  o.eos_token_ids = {kEos};
  o.max_prompt_logprob_tokens = 12;  // a scored prompt in several all-logits chunks
  auto sched = Scheduler::create(o, pool);
  EXPECT_TRUE(sched) << sched.error().message;
  if (!sched) return {};
  Sampler sampler(o.eos_token_ids, RandomGenerator(1));
  ForwardOutput logits;
  Outcome run;
  for (const NewRequest& r : requests) EXPECT_TRUE((*sched)->add_request(r));
  for (int guard = 0; (*sched)->has_unfinished() && guard < 1000; ++guard) {
    auto step = run_step(**sched, model, kv, sampler, logits, choose_on_device);
    EXPECT_TRUE(step) << step.error().message;
    if (!step) break;
    for (const RequestOutput& out : *step) {
      Served& r = run.results[out.request_id];
      for (const SampledToken& t : out.new_tokens) {
        r.tokens.push_back(t.token);
        if (t.logprobs) r.logprobs.push_back(*t.logprobs);
        r.kept.push_back(t.logits);
      }
      if (!out.prompt_logprobs.empty()) r.prompt_logprobs = out.prompt_logprobs;
    }
  }
  EXPECT_FALSE((*sched)->has_unfinished());
  for (const NewRequest& r : requests) {
    if (r.hold_blocks_for_remote_reader) {
      EXPECT_TRUE((*sched)->release_hold(send_hold_owner(r.id)));
    }
  }
  EXPECT_EQ(pool.num_free_blocks(), pool.num_blocks());
  run.forwards = model.forwards;
  run.chooses = model.chooses;
  run.calls = model.calls;
  return run;
}

NewRequest request(const std::string& id, int prompt_len, uint64_t salt) {
  NewRequest r;
  r.id = id;
  for (int j = 0; j < prompt_len; ++j) r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(salt, j) % 60) + 2);
  r.params.max_tokens = 12;
  r.params.ignore_eos = true;
  return r;
}

// Seeded and greedy requests the device chooses, and requests the host does.
std::vector<NewRequest> mixed_requests() {
  std::vector<NewRequest> out;
  NewRequest seeded = request("seeded", 9, 1);
  seeded.params.temperature = 0.8;
  seeded.params.top_p = 0.9;
  seeded.params.seed = 7;
  out.push_back(seeded);
  NewRequest seeded_k = request("seeded-top-k", 30, 2);
  seeded_k.params.temperature = 1.2;
  seeded_k.params.top_k = 10;
  seeded_k.params.seed = 99;
  out.push_back(seeded_k);
  NewRequest greedy = request("greedy", 14, 3);
  greedy.params.temperature = 0.0;
  out.push_back(greedy);
  NewRequest banned = request("min-tokens", 5, 4);  // eos banned on the device for 6 steps
  banned.params.temperature = 1.0;
  banned.params.seed = 21;
  banned.params.ignore_eos = false;
  banned.params.min_tokens = 6;
  banned.params.max_tokens = 6;
  out.push_back(banned);

  NewRequest scored = request("prompt-logprobs", 40, 5);
  scored.params.prompt_logprobs = 2;
  scored.params.temperature = 0.8;
  scored.params.seed = 3;
  out.push_back(scored);
  NewRequest logprobs = request("logprobs", 11, 6);
  logprobs.params.logprobs = 3;
  logprobs.params.temperature = 0.7;
  logprobs.params.seed = 5;
  out.push_back(logprobs);
  NewRequest penalty = request("penalties", 7, 7);
  penalty.params.presence_penalty = 1.0;
  penalty.params.frequency_penalty = 0.5;
  penalty.params.temperature = 0.9;
  penalty.params.seed = 11;
  out.push_back(penalty);
  NewRequest producer = request("producer", 20, 8);  // a P/D producer keeps its first row
  producer.params.max_tokens = 1;
  producer.params.temperature = 0.6;
  producer.params.seed = 17;
  producer.hold_blocks_for_remote_reader = true;
  out.push_back(producer);
  NewRequest undecided = request("undecided", 6, 9);  // rows the device leaves to the host
  undecided.params.temperature = 1.0;
  undecided.params.top_k = 3;
  undecided.params.seed = 13;
  out.push_back(undecided);
  return out;
}

// The sequence a request's step k reads: its prompt and its first k tokens.
std::vector<int32_t> context(const NewRequest& r, const std::vector<int32_t>& out, size_t k) {
  std::vector<int32_t> c = r.prompt_tokens;
  c.insert(c.end(), out.begin(), out.begin() + static_cast<std::ptrdiff_t>(k));
  return c;
}

void expect_same_logprobs(const TokenLogprobs& a, const TokenLogprobs& b, const std::string& what) {
  EXPECT_EQ(a.chosen.token, b.chosen.token) << what;
  EXPECT_EQ(a.chosen.logprob, b.chosen.logprob) << what;
  EXPECT_EQ(a.chosen.rank, b.chosen.rank) << what;
  ASSERT_EQ(a.top.size(), b.top.size()) << what;
  for (size_t i = 0; i < a.top.size(); ++i) {
    EXPECT_EQ(a.top[i].token, b.top[i].token) << what << " top " << i;
    EXPECT_EQ(a.top[i].logprob, b.top[i].logprob) << what << " top " << i;
  }
}

TEST(EngineStepChoice, EachSequenceIsChosenWhereItsOwnRequestSaysWhateverItIsBatchedWith) {
  const std::vector<NewRequest> requests = mixed_requests();
  const Outcome batched = serve(requests);
  EXPECT_EQ(batched.forwards,
            0);  // no step fell back to forward for all its rows
  EXPECT_GT(batched.chooses, 0);
  // The steps really mixed the two kinds: device choices beside a scored
  // prompt's all-logits chunk, beside last rows for the host, and beside
  // rows the device left undecided.
  int with_all_rows = 0, with_last_rows = 0, with_undecided = 0;
  for (const FakeDeviceModel::Call& c : batched.calls) {
    with_all_rows += c.device > 0 && c.host_all_rows > 0;
    with_last_rows += c.device > 0 && c.host_last_row > 0;
    with_undecided += c.device > 0 && c.undecided > 0;
  }
  EXPECT_GT(with_all_rows, 1);
  EXPECT_GT(with_last_rows, 5);
  EXPECT_GT(with_undecided, 5);

  for (const NewRequest& r : requests) {
    const Outcome alone = serve({r});
    EXPECT_EQ(alone.forwards, 0) << r.id;
    const Served& a = alone.results.at(r.id);
    const Served& b = batched.results.at(r.id);
    EXPECT_EQ(a.tokens.size(), static_cast<size_t>(*r.params.max_tokens)) << r.id;
    EXPECT_EQ(b.tokens, a.tokens) << r.id << ": batched differs from alone";
    ASSERT_EQ(b.logprobs.size(), a.logprobs.size()) << r.id;
    for (size_t k = 0; k < a.logprobs.size(); ++k)
      expect_same_logprobs(b.logprobs[k], a.logprobs[k], r.id + " token " + std::to_string(k));
    ASSERT_EQ(b.prompt_logprobs.size(), a.prompt_logprobs.size()) << r.id;
    for (size_t k = 0; k < a.prompt_logprobs.size(); ++k)
      expect_same_logprobs(b.prompt_logprobs[k], a.prompt_logprobs[k], r.id + " prompt token " + std::to_string(k));
  }

  // Who picked each token: the device's rule for the requests it can
  // choose, the host sampler (with the request's own draw and history) for
  // the others; and the host's requests got their log-probabilities.
  RandomGenerator unused(2);
  const std::vector<int32_t> eos = {kEos};
  for (const NewRequest& r : requests) {
    const Served& got = batched.results.at(r.id);
    for (size_t k = 0; k < got.tokens.size(); ++k) {
      // A scored prompt and a producer's kept row make the host pick the
      // first token only: the later steps neither score nor keep.
      const bool on_host = r.params.logprobs || r.params.adjusts_logits() || r.params.top_k == 3 ||
                           (k == 0 && (r.params.prompt_logprobs || r.hold_blocks_for_remote_reader));
      const std::vector<int32_t> ctx = context(r, got.tokens, k);
      const std::vector<float> row = row_for(ctx);
      const std::vector<int32_t> output(got.tokens.begin(), got.tokens.begin() + static_cast<std::ptrdiff_t>(k));
      const TokenHistory history{r.prompt_tokens, output};
      const int32_t host = sample(row, r.params, k, unused, eos, history);
      if (on_host) {
        EXPECT_EQ(got.tokens[k], host) << r.id << " token " << k << ": not the host sampler's";
      } else {
        TokenChoice c;
        c.temperature = r.params.greedy() ? 0.0 : r.params.temperature;
        c.top_k = r.params.top_k;
        c.uniform = r.params.greedy() ? 0.0 : to_unit_interval(request_draw(*r.params.seed, k));
        std::vector<int32_t> banned;
        if (k < static_cast<size_t>(r.params.min_tokens)) banned = eos;
        c.banned = banned;
        EXPECT_EQ(got.tokens[k], device_pick(row, c)) << r.id << " token " << k << ": not the device's";
      }
      if (r.params.logprobs) {
        ASSERT_EQ(got.logprobs.size(), got.tokens.size()) << r.id;
        expect_same_logprobs(got.logprobs[k], compute_logprobs(row, got.tokens[k], *r.params.logprobs),
                             r.id + " token " + std::to_string(k));
      }
      if (r.hold_blocks_for_remote_reader && k == 0) {
        ASSERT_TRUE(got.kept[0]) << r.id << ": the producer's row was not kept";
        EXPECT_EQ(*got.kept[0], row) << r.id;
      }
    }
    if (r.params.prompt_logprobs) {
      ASSERT_EQ(got.prompt_logprobs.size(), r.prompt_tokens.size() - 1) << r.id;
      for (size_t p = 0; p + 1 < r.prompt_tokens.size(); ++p) {
        const std::vector<float> row =
            row_for(std::span<const int32_t>(r.prompt_tokens.data(), p + 1));  // position p predicts p + 1
        expect_same_logprobs(got.prompt_logprobs[p], compute_logprobs(row, r.prompt_tokens[p + 1], 2),
                             r.id + " prompt token " + std::to_string(p + 1));
      }
    }
  }
}

// The check above means something: the fake device's choices are not the
// host sampler's, so a seeded request that fell back to the host for a step
// would change its tokens.
TEST(EngineStepChoice, TheFakeDeviceSamplesOtherwiseThanTheHost) {
  const NewRequest seeded = mixed_requests()[0];
  const Outcome device = serve({seeded});
  const Outcome host = serve({seeded}, /*choose_on_device=*/false);
  EXPECT_EQ(host.chooses, 0);
  EXPECT_GT(host.forwards, 0);
  EXPECT_NE(device.results.at("seeded").tokens, host.results.at("seeded").tokens);
}

TEST(EngineStepChoice, AModelThatChoosesAHostSequencesTokenIsAnError) {
  FakeDeviceModel model;
  model.choose_host_rows_too = true;
  const int num_blocks = 16;
  BlockPool pool(num_blocks, false);
  std::vector<float> kv_mem(static_cast<size_t>(num_blocks) * model.kv_layout().block_elems(), -1.0f);
  const KvCacheView kv{kv_mem.data(), num_blocks, model.kv_layout()};
  SchedulerOptions o;
  o.max_model_len = 64;
  o.vocab_size = kVocab;
  auto sched = Scheduler::create(o, pool);
  ASSERT_TRUE(sched);
  NewRequest r = request("logprobs", 5, 1);
  r.params.logprobs = 1;
  ASSERT_TRUE((*sched)->add_request(r));
  Sampler sampler({kEos}, RandomGenerator(1));
  ForwardOutput logits;
  auto step = run_step(**sched, model, kv, sampler, logits);
  ASSERT_FALSE(step);
  EXPECT_NE(step.error().message.find("which the host chooses"), std::string::npos) << step.error().message;
  EXPECT_TRUE((*sched)->abort("logprobs"));
}

}  // namespace
}  // namespace siesta
