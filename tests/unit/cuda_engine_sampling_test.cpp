// Tokens chosen on the GPU (run_step over Model::forward_choose) equal the
// host sampler's for every kind of request the engine serves: greedy, seeded
// and unseeded random sampling with temperature, top-k, top-p and min-p,
// min_tokens banning eos and stop ids, and log-probability requests (whose
// steps fall back to the host) batched with the rest. The steps really go
// through the device: a counting wrapper around the model says how many
// forward_choose calls were made and how many rows came back undecided.
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

namespace siesta {
namespace {

const std::filesystem::path kModelDir = std::filesystem::path(SIESTA_SOURCE_DIR) / "models/tiny-qwen3";

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
  int forwards = 0;
  int chooses = 0;
  int undecided = 0;
};

// One scheduler over the model; choose_on_device as run_step takes it.
Outcome run(CudaQwen3& model, bool choose_on_device, bool with_logprobs) {
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
  for (NewRequest r : mixed_requests()) {
    if (!with_logprobs) r.params.logprobs.reset();
    EXPECT_TRUE((*sched)->add_request(r));
  }
  for (int guard = 0; (*sched)->has_unfinished() && guard < 10000; ++guard) {
    auto step = run_step(**sched, counting, kv, sampler, logits, choose_on_device);
    EXPECT_TRUE(step) << step.error().message;
    if (!step) break;
    for (const RequestOutput& r : *step)
      for (const SampledToken& t : r.new_tokens) out.tokens[r.request_id].push_back(t.token);
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

}  // namespace
}  // namespace siesta

#endif  // SIESTA_HAVE_CUDA
