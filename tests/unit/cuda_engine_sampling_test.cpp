// Tokens chosen on the GPU (run_step over Model::forward_choose) equal the
// host sampler's for every kind of request the engine serves: greedy, seeded
// and unseeded random sampling with temperature, top-k, top-p and min-p,
// min_tokens banning eos and stop ids, and log-probability requests (whose
// steps fall back to the host) batched with the rest. The steps really go
// through the device: a counting wrapper around the model says how many
// forward_choose calls were made and how many rows came back undecided.
// Requests whose logits the host adjusts (penalties, logit_bias,
// allowed_token_ids, bad_words), forced tokens and scored prompts take the
// host path in the steps they are in, with the same tokens.
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
    for (int32_t t : tokens) undecided += t == kChooseOnHost;
    return {};
  }
  int forwards = 0;
  int chooses = 0;
  int undecided = 0;

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
  std::map<RequestId, std::vector<TokenLogprobs>> prompt_logprobs;
  int forwards = 0;
  int chooses = 0;
  int undecided = 0;
};

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

// One scheduler over the model; choose_on_device as run_step takes it.
Outcome run(CudaQwen3& model, bool choose_on_device, bool with_logprobs, bool adjusted = false) {
  CountingModel counting(model);
  const int num_blocks = 256;
  auto kv_buf = model.allocate_kv_cache(num_blocks);
  EXPECT_TRUE(kv_buf) << kv_buf.error().message;
  if (!kv_buf) return {};
  cudaMemset(kv_buf->data(), 0, kv_buf->bytes());
  const KvCacheView kv{kv_buf->data(), num_blocks, model.kv_layout()};
  BlockPool pool(num_blocks, /*prefix_caching=*/false);
  SchedulerOptions o;
  o.max_num_seqs = 8;  // fewer than the requests: admission staggers, prefill and decode mix
  o.max_num_batched_tokens = 96;
  o.max_model_len = 512;
  o.vocab_size = model.config().vocab_size;
  o.eos_token_ids = model.config().eos_token_ids;
  auto sched = Scheduler::create(o, pool);
  EXPECT_TRUE(sched) << sched.error().message;
  Sampler sampler(o.eos_token_ids, RandomGenerator(5));
  ForwardOutput logits;
  Outcome out;
  std::vector<NewRequest> reqs = mixed_requests();
  if (adjusted) adjust(reqs);
  for (NewRequest r : reqs) {
    if (!with_logprobs) r.params.logprobs.reset();
    EXPECT_TRUE((*sched)->add_request(r));
  }
  for (int guard = 0; (*sched)->has_unfinished() && guard < 10000; ++guard) {
    auto step = run_step(**sched, counting, kv, sampler, logits, choose_on_device);
    EXPECT_TRUE(step) << step.error().message;
    if (!step) break;
    for (const RequestOutput& r : *step) {
      for (const SampledToken& t : r.new_tokens) out.tokens[r.request_id].push_back(t.token);
      if (!r.prompt_logprobs.empty()) out.prompt_logprobs[r.request_id] = r.prompt_logprobs;
    }
  }
  EXPECT_FALSE((*sched)->has_unfinished());
  out.forwards = counting.forwards;
  out.chooses = counting.chooses;
  out.undecided = counting.undecided;
  return out;
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

TEST_F(CudaEngineSampling, StepsWithLogprobRequestsFallBackToTheHostWithTheSameTokens) {
  const Outcome host = run(*model_, false, /*with_logprobs=*/true);
  const Outcome mixed = run(*model_, true, /*with_logprobs=*/true);
  EXPECT_GT(mixed.forwards, 0);  // steps holding the logprobs request
  EXPECT_GT(mixed.chooses, 0);   // steps before it was admitted
  EXPECT_EQ(mixed.forwards + mixed.chooses, host.forwards);
  for (const auto& [id, toks] : host.tokens) EXPECT_EQ(mixed.tokens.at(id), toks) << id;
}

TEST_F(CudaEngineSampling, AdjustedLogitsForcedTokensAndScoredPromptsTakeTheHostWithTheSameTokens) {
  const Outcome host = run(*model_, false, false, /*adjusted=*/true);
  const Outcome mixed = run(*model_, true, false, /*adjusted=*/true);
  EXPECT_GT(mixed.forwards, 0);  // the steps holding adjusted, forced or scored rows
  EXPECT_EQ(mixed.forwards + mixed.chooses, host.forwards);
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

}  // namespace
}  // namespace siesta

#endif  // SIESTA_HAVE_CUDA
