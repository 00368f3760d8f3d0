// Tokens chosen on the GPU (run_step over Model::forward_choose) equal the
// host sampler's for every kind of request the engine serves: greedy, seeded
// and unseeded random sampling with temperature, top-k, top-p and min-p,
// min_tokens banning eos and stop ids, and log-probability requests batched
// with the rest. The steps really go through the device: a counting wrapper
// around the model says how many forward and forward_choose calls were made,
// how many rows the host chose and how many came back undecided.
// Requests whose logits the host adjusts (penalties, logit_bias,
// allowed_token_ids, bad_words), forced tokens, scored prompts and
// log-probabilities have their rows sampled on the host inside the same
// forward_choose call, while their batch-mates are still chosen on the
// device: a seeded or greedy request gets the same tokens alone and beside
// them.
// Skips without a GPU (or a build without CUDA).
#include <gtest/gtest.h>

#if defined(SIESTA_HAVE_CUDA)

#include <cuda_runtime.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "engine/engine_step.h"
#include "engine/random.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/cuda/qwen3_cuda.h"
#include "test_data.h"

namespace siesta {
namespace {

const std::filesystem::path kModelDir = siesta::testing::tiny_model_dir();

// Forwards to the CUDA model and counts how tokens were chosen.
class CountingModel final : public Model {
 public:
  explicit CountingModel(CudaQwen3& m) : m_(m) {}
  const ModelConfig& config() const override { return m_.config(); }
  KvCacheLayout kv_layout() const override { return m_.kv_layout(); }
  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override {
    ++forwards;
    return m_.forward(batch, kv, out);
  }
  bool chooses_tokens() const override { return true; }
  Result<void> forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                              std::span<const TokenChoice> choices, std::vector<int32_t>& tokens,
                              ForwardOutput& logits) override {
    ++chooses;
    SIESTA_TRY(m_.forward_choose(batch, kv, choices, tokens, logits));
    int device = 0, host = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (choices[i].on_host) {
        ++host;
        if (tokens[i] != kChooseOnHost) return internal_error("the model chose a row the host chooses");
        const size_t rows = batch[i].all_logits ? batch[i].tokens.size() : 1;
        if (logits.num_rows[i] != rows) return internal_error("the model returned the wrong rows for the host");
        all_rows += batch[i].all_logits;
        continue;
      }
      if (tokens[i] == kChooseOnHost) {
        ++undecided;
        if (logits.num_rows[i] != 1) return internal_error("an undecided row did not come back");
      } else {
        ++device;
        if (logits.num_rows[i] != 0) return internal_error("a row chosen on the device was copied");
      }
    }
    host_rows += host;
    mixed += host > 0 && device > 0;
    return {};
  }
  int forwards = 0;
  int chooses = 0;
  int undecided = 0;
  int host_rows = 0;  // sequences the host chose
  int all_rows = 0;   // of which with every row of their chunk (a scored prompt)
  int mixed = 0;      // calls that chose rows on both sides

 private:
  CudaQwen3& m_;
};

std::vector<NewRequest> mixed_requests() {
  std::vector<NewRequest> out;
  for (int i = 0; i < 12; ++i) {
    NewRequest r;
    r.id = "r";
    r.id += std::to_string(i);
    const int len = 4 + (i * 13) % 70;
    for (int j = 0; j < len; ++j) r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(300 + i, j) % 4000) + 10);
    SamplingParams& p = r.params;
    p.max_tokens = 20;
    p.ignore_eos = true;
    switch (i % 6) {
      case 0: p.temperature = 0.0; break;
      case 1: p.temperature = 0.8; p.top_p = 0.9; p.seed = 11 + i; break;
      case 2: p.temperature = 1.3; p.top_k = 20; p.seed = 11 + i; break;
      case 3: p.temperature = 1.0; p.min_p = 0.05; break;  // unseeded: the engine's stream
      case 4:  // min_tokens: eos and the stop ids are banned for the first 8 tokens
        p.temperature = 1.5;
        p.seed = 11 + i;
        p.ignore_eos = false;
        p.min_tokens = 8;
        p.stop_token_ids = {static_cast<int32_t>(request_draw(9, i) % 4000) + 10, 77, 78};
        break;
      case 5: p.temperature = 0.7; p.seed = 11 + i; break;
    }
    // The last request, admitted once others finish, asks for log-probabilities:
    // the host picks the steps it is in.
    if (i == 11) p.logprobs = 3;
    out.push_back(std::move(r));
  }
  return out;
}

struct Outcome {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, std::vector<TokenLogprobs>> logprobs;  // of each token, when asked
  std::map<RequestId, std::vector<TokenLogprobs>> prompt_logprobs;
  int forwards = 0;
  int chooses = 0;
  int undecided = 0;
  int host_rows = 0;
  int all_rows = 0;
  int mixed = 0;
};

SchedulerOptions mixed_options(const ModelConfig& cfg) {
  SchedulerOptions o;
  o.max_num_seqs = 8;  // fewer than the requests: admission staggers, prefill and decode mix
  o.max_num_batched_tokens = 96;
  o.max_model_len = 512;
  o.vocab_size = cfg.vocab_size;
  o.eos_token_ids = cfg.eos_token_ids;
  return o;
}

// One scheduler over the model serving `reqs` to the end; choose_on_device
// as run_step takes it.
Outcome serve(CudaQwen3& model, const std::vector<NewRequest>& reqs, const SchedulerOptions& o, bool choose_on_device) {
  CountingModel counting(model);
  const int num_blocks = 256;
  auto kv_buf = model.allocate_kv_cache(num_blocks);
  EXPECT_TRUE(kv_buf) << kv_buf.error().message;
  if (!kv_buf) return {};
  cudaMemset(kv_buf->data(), 0, kv_buf->bytes());
  const KvCacheView kv{kv_buf->data(), num_blocks, model.kv_layout()};
  BlockPool pool(num_blocks, /*prefix_caching=*/false);
  auto sched = Scheduler::create(o, pool);
  EXPECT_TRUE(sched) << sched.error().message;
  if (!sched) return {};
  Sampler sampler(o.eos_token_ids, RandomGenerator(5));
  ForwardOutput logits;
  Outcome out;
  for (const NewRequest& r : reqs) EXPECT_TRUE((*sched)->add_request(r));
  for (int guard = 0; (*sched)->has_unfinished() && guard < 10000; ++guard) {
    auto step = run_step(**sched, counting, kv, sampler, logits, choose_on_device);
    EXPECT_TRUE(step) << step.error().message;
    if (!step) break;
    for (const RequestOutput& r : *step) {
      for (const SampledToken& t : r.new_tokens) {
        out.tokens[r.request_id].push_back(t.token);
        if (t.logprobs) out.logprobs[r.request_id].push_back(*t.logprobs);
      }
      if (!r.prompt_logprobs.empty()) out.prompt_logprobs[r.request_id] = r.prompt_logprobs;
    }
  }
  EXPECT_FALSE((*sched)->has_unfinished());
  out.forwards = counting.forwards;
  out.chooses = counting.chooses;
  out.undecided = counting.undecided;
  out.host_rows = counting.host_rows;
  out.all_rows = counting.all_rows;
  out.mixed = counting.mixed;
  return out;
}

// vLLM's logit adjustments, forced tokens and a scored prompt on some of the requests.
void adjust(std::vector<NewRequest>& reqs) {
  reqs[2].params.repetition_penalty = 1.4;
  reqs[3].params.presence_penalty = 1.0;
  reqs[3].params.frequency_penalty = 0.5;
  reqs[5].params.logit_bias = {{100, 5.0}, {200, -100.0}};
  reqs[6].params.bad_words_token_ids = {{300}, {301, 302}};
  reqs[6].params.prompt_logprobs = 2;
  reqs[8].params.allowed_token_ids = {40, 41, 42, 43, 44};
  reqs[9].params.forced_tokens = {7, 8, 9};
  reqs[10].params.forced_tokens = {11, 12};
  reqs[10].params.force_after_token = 400;  // hardly ever comes: the device path holds
}

Outcome run(CudaQwen3& model, bool choose_on_device, bool with_logprobs, bool adjusted = false) {
  std::vector<NewRequest> reqs = mixed_requests();
  if (adjusted) adjust(reqs);
  if (!with_logprobs)
    for (NewRequest& r : reqs) r.params.logprobs.reset();
  return serve(model, reqs, mixed_options(model.config()), choose_on_device);
}

class CudaEngineSampling : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    CudaModelOptions opt;
    opt.max_batch_tokens = 1024;
    opt.batch_invariant = true;  // the same logits whichever path asks for them
    auto m = CudaQwen3::load(kModelDir, alloc_, opt);
    ASSERT_TRUE(m) << m.error().message;
    model_ = std::move(*m);
  }
  cuda::CudaMallocAllocator alloc_;
  std::unique_ptr<CudaQwen3> model_;
};

TEST_F(CudaEngineSampling, TokensChosenOnTheDeviceEqualTheHostSamplers) {
  const Outcome host = run(*model_, /*choose_on_device=*/false, /*with_logprobs=*/false);
  const Outcome device = run(*model_, /*choose_on_device=*/true, /*with_logprobs=*/false);
  EXPECT_EQ(host.chooses, 0);
  EXPECT_GT(host.forwards, 0);
  // Every step chose on the device. It decides every row but those of the
  // two top-p requests (r1, r7: 20 tokens each), whose nuclei hold more than
  // the device's 1024-token sort on this random tiny model (the 0.6B shape's
  // too); those rows come back to the host sampler with the same draw, which
  // the equal tokens below show.
  EXPECT_EQ(device.forwards, 0);
  EXPECT_EQ(device.chooses, host.forwards);
  EXPECT_LE(device.undecided, 40);
  ASSERT_EQ(host.tokens.size(), 12u);
  for (const auto& [id, toks] : host.tokens) {
    EXPECT_EQ(toks.size(), 20u) << id;
    EXPECT_EQ(device.tokens.at(id), toks) << id;
  }
}

TEST_F(CudaEngineSampling, LogprobRequestsAreSampledOnTheHostBesideDeviceChoicesWithTheSameTokens) {
  const Outcome host = run(*model_, false, /*with_logprobs=*/true);
  const Outcome mixed = run(*model_, true, /*with_logprobs=*/true);
  EXPECT_EQ(mixed.forwards, 0);  // no step falls back as a whole
  EXPECT_EQ(mixed.chooses, host.forwards);
  EXPECT_GE(mixed.host_rows, 20);  // r11's tokens
  EXPECT_GT(mixed.mixed, 0);       // beside rows chosen on the device
  for (const auto& [id, toks] : host.tokens) EXPECT_EQ(mixed.tokens.at(id), toks) << id;
  ASSERT_EQ(mixed.logprobs.at("r11").size(), 20u);
  for (size_t k = 0; k < 20; ++k)
    EXPECT_EQ(mixed.logprobs.at("r11")[k].chosen.logprob, host.logprobs.at("r11")[k].chosen.logprob) << k;
}

TEST_F(CudaEngineSampling, AdjustedLogitsForcedTokensAndScoredPromptsAreSampledOnTheHostWithTheSameTokens) {
  const Outcome host = run(*model_, false, false, /*adjusted=*/true);
  const Outcome mixed = run(*model_, true, false, /*adjusted=*/true);
  EXPECT_EQ(mixed.forwards, 0);
  EXPECT_EQ(mixed.chooses, host.forwards);
  EXPECT_GT(mixed.all_rows, 0);  // the scored prompt's chunks
  EXPECT_GT(mixed.mixed, 0);
  for (const auto& [id, toks] : host.tokens) EXPECT_EQ(mixed.tokens.at(id), toks) << id;
  // The adjustments took effect.
  EXPECT_EQ(std::vector<int32_t>(host.tokens.at("r9").begin(), host.tokens.at("r9").begin() + 3),
            (std::vector<int32_t>{7, 8, 9}));
  for (int32_t t : host.tokens.at("r8")) EXPECT_TRUE(t >= 40 && t <= 44) << t;
  for (int32_t t : host.tokens.at("r6")) EXPECT_NE(t, 300);
  ASSERT_EQ(host.prompt_logprobs.count("r6"), 1u);
  ASSERT_EQ(mixed.prompt_logprobs.count("r6"), 1u);
  const auto& a = host.prompt_logprobs.at("r6");
  const auto& b = mixed.prompt_logprobs.at("r6");
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(a[k].chosen.logprob, b[k].chosen.logprob) << k;
}

// Requests the device chooses (seeded at several seeds with temperature,
// top-p, top-k and min-p; greedy) get the same tokens alone and batched in
// the same steps with requests whose rows the host samples (prompt_logprobs,
// logprobs, presence_penalty, logit_bias); so do those. A model of small
// passes and logits windows (max_seqs 16: 64 rows) makes the scored prompt's
// chunks span several windows and steps span several passes; decode steps
// holding a host row stay on the decode graphs.
TEST(CudaEngineSamplingInvariance, DeviceChosenRequestsGetTheSameTokensAloneAndBesideHostSampledOnes) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaMallocAllocator alloc;
  CudaModelOptions opt;
  opt.max_batch_tokens = 128;
  opt.max_seqs = 16;
  opt.batch_invariant = true;  // a row's logits do not depend on its batch
  auto loaded = CudaQwen3::load(kModelDir, alloc, opt);
  ASSERT_TRUE(loaded) << loaded.error().message;
  CudaQwen3& model = **loaded;

  auto make = [](const std::string& id, int len, uint64_t salt) {
    NewRequest r;
    r.id = id;
    for (int j = 0; j < len; ++j) r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(salt, j) % 4000) + 10);
    r.params.max_tokens = 24;
    r.params.ignore_eos = true;
    return r;
  };
  std::vector<NewRequest> device;  // what the device chooses
  for (int i = 0; i < 4; ++i) {
    NewRequest r = make("top-p-" + std::to_string(i), 5 + 17 * i, 100 + i);
    r.params.temperature = 0.8;
    r.params.top_p = 0.9;
    r.params.seed = 1000 + i;
    device.push_back(r);
  }
  for (int i = 0; i < 2; ++i) {
    NewRequest r = make("top-k-" + std::to_string(i), 30 + 11 * i, 200 + i);
    r.params.temperature = 1.0;
    r.params.top_k = 40;
    r.params.min_p = 0.02;
    r.params.seed = 2000 + i;
    device.push_back(r);
    NewRequest g = make("greedy-" + std::to_string(i), 12 + 40 * i, 300 + i);
    g.params.temperature = 0.0;
    device.push_back(g);
  }
  std::vector<NewRequest> host;  // what the host samples
  NewRequest r = make("prompt-logprobs", 230, 400);
  r.params.prompt_logprobs = 3;
  r.params.temperature = 0.8;
  r.params.seed = 4001;
  host.push_back(r);
  r = make("logprobs", 25, 401);
  r.params.logprobs = 5;
  r.params.temperature = 0.8;
  r.params.top_p = 0.9;
  r.params.seed = 4002;
  host.push_back(r);
  r = make("greedy-logprobs", 9, 402);
  r.params.temperature = 0.0;
  r.params.logprobs = 2;
  host.push_back(r);
  r = make("presence-penalty", 18, 403);
  r.params.presence_penalty = 1.2;
  r.params.temperature = 0.8;
  r.params.seed = 4003;
  host.push_back(r);
  r = make("logit-bias", 40, 404);
  r.params.logit_bias = {{7, -50.0}, {100, 4.0}};
  r.params.temperature = 0.9;
  r.params.seed = 4004;
  host.push_back(r);

  SchedulerOptions o = mixed_options(model.config());
  o.max_num_seqs = 16;                // everything runs at once
  o.max_num_batched_tokens = 160;     // two passes of the model in the prefill steps
  o.max_prompt_logprob_tokens = 100;  // scored chunks of 100 rows: two logits windows
  std::vector<NewRequest> all = device;
  all.insert(all.end(), host.begin(), host.end());
  const Outcome batched = serve(model, all, o, true);
  EXPECT_EQ(batched.forwards, 0);
  EXPECT_GT(batched.all_rows, 1);
  EXPECT_GT(batched.mixed, 10);  // prefill and decode steps with rows on both sides
  auto same = [](const std::vector<TokenLogprobs>& a, const std::vector<TokenLogprobs>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].chosen.token, b[k].chosen.token) << what << " " << k;
      EXPECT_EQ(a[k].chosen.logprob, b[k].chosen.logprob) << what << " " << k;
      ASSERT_EQ(a[k].top.size(), b[k].top.size()) << what << " " << k;
      for (size_t t = 0; t < a[k].top.size(); ++t) {
        EXPECT_EQ(a[k].top[t].token, b[k].top[t].token) << what << " " << k;
        EXPECT_EQ(a[k].top[t].logprob, b[k].top[t].logprob) << what << " " << k;
      }
    }
  };
  for (const NewRequest& req : all) {
    const Outcome alone = serve(model, {req}, o, true);
    EXPECT_EQ(alone.forwards, 0) << req.id;
    ASSERT_EQ(alone.tokens.at(req.id).size(), 24u) << req.id;
    EXPECT_EQ(batched.tokens.at(req.id), alone.tokens.at(req.id)) << req.id << ": batched differs from alone";
    if (req.params.logprobs) same(batched.logprobs.at(req.id), alone.logprobs.at(req.id), req.id + " logprobs");
    if (req.params.prompt_logprobs) {
      ASSERT_EQ(alone.prompt_logprobs.at(req.id).size(), req.prompt_tokens.size() - 1);
      same(batched.prompt_logprobs.at(req.id), alone.prompt_logprobs.at(req.id), req.id + " prompt_logprobs");
    }
  }
}

}  // namespace
}  // namespace siesta

#endif  // SIESTA_HAVE_CUDA
