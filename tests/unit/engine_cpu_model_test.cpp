// The scheduler and sampler over the real CPU Qwen3 model (models/tiny-qwen3):
// requests batched with others, chunked, preempted under a tiny KV cache and
// sharing prefixes give the same tokens as each request run alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "engine/engine_step.h"
#include "engine/random.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/cpu/qwen3_cpu.h"
#include "test_data.h"

namespace siesta {
namespace {

class CpuEngine {
 public:
  CpuEngine(int num_blocks, SchedulerOptions o, ThreadPool& threads)
      : pool(num_blocks), sampler({}, RandomGenerator(1)) {
    auto m = CpuQwen3::load(siesta::testing::tiny_model_dir().string(), threads);
    EXPECT_TRUE(m) << m.error().message;
    model = std::move(*m);
    kv_mem.assign(static_cast<size_t>(num_blocks) * model->kv_layout().block_elems(), 0.0f);
    kv = KvCacheView{kv_mem.data(), num_blocks, model->kv_layout()};
    o.vocab_size = model->config().vocab_size;
    o.eos_token_ids = model->config().eos_token_ids;
    sampler = Sampler(o.eos_token_ids, RandomGenerator(1));
    auto s = Scheduler::create(o, pool);
    EXPECT_TRUE(s) << s.error().message;
    sched = std::move(*s);
  }

  std::map<RequestId, std::vector<int32_t>> run(const std::vector<NewRequest>& reqs) {
    for (const NewRequest& r : reqs) EXPECT_TRUE(sched->add_request(r));
    std::map<RequestId, std::vector<int32_t>> out;
    while (sched->has_unfinished()) {
      auto step = run_step(*sched, *model, kv, sampler, logits);
      EXPECT_TRUE(step) << step.error().message;
      if (!step) break;
      for (const RequestOutput& o : *step) {
        for (const SampledToken& t : o.new_tokens) out[o.request_id].push_back(t.token);
        if (!o.prompt_logprobs.empty()) prompt_logprobs[o.request_id] = o.prompt_logprobs;
      }
    }
    return out;
  }

  BlockPool pool;
  std::unique_ptr<CpuQwen3> model;
  std::vector<float> kv_mem;
  KvCacheView kv;
  Sampler sampler;
  ForwardOutput logits;
  std::unique_ptr<Scheduler> sched;
  std::map<RequestId, std::vector<TokenLogprobs>> prompt_logprobs;
};

std::vector<NewRequest> requests() {
  std::vector<int32_t> shared;
  for (int i = 0; i < 40; ++i) shared.push_back(static_cast<int32_t>(request_draw(1, i) % 4000) + 10);
  std::vector<NewRequest> out;
  for (int i = 0; i < 6; ++i) {
    NewRequest r;
    r.id = "r";
    r.id += std::to_string(i);
    if (i % 3 == 0) r.prompt_tokens = shared;
    const int len = 3 + i * 11;
    for (int j = 0; j < len; ++j) r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(100 + i, j) % 4000) + 10);
    r.params.max_tokens = 14;
    r.params.ignore_eos = true;
    if (i % 2 == 1) {
      r.params.temperature = 0.8;
      r.params.top_p = 0.95;
      r.params.seed = 7 + i;
    } else {
      r.params.temperature = 0.0;
    }
    out.push_back(std::move(r));
  }
  return out;
}

TEST(EngineOnCpuModel, BatchedChunkedPreemptedAndCachedRequestsMatchRunsAlone) {
  ThreadPool threads(2);
  SchedulerOptions roomy;
  roomy.max_model_len = 256;
  roomy.max_num_batched_tokens = 512;
  std::map<RequestId, std::vector<int32_t>> alone;
  for (const NewRequest& r : requests()) {
    CpuEngine e(64, roomy, threads);
    alone[r.id] = e.run({r})[r.id];
    ASSERT_EQ(alone[r.id].size(), 14u) << r.id;
    EXPECT_EQ(e.pool.num_free_blocks(), 64);
  }

  SchedulerOptions tight;
  tight.max_model_len = 128;
  tight.max_num_batched_tokens = 24;  // prompts are chunked
  tight.max_num_seqs = 4;
  CpuEngine e(10, tight, threads);   // 160 token slots for 6 requests: preemptions
  const auto batched = e.run(requests());
  EXPECT_EQ(batched, alone);
  EXPECT_GT(e.sched->stats().num_preemptions, 0u);
  EXPECT_GT(e.pool.stats().prefix_cache_hits, 0u);
  EXPECT_EQ(e.pool.num_free_blocks(), 10);
}

// Penalties, bias, allowed and bad tokens read only the request's own history:
// batching, chunking and preemption change nothing they sample.
std::vector<NewRequest> adjusted_requests() {
  std::vector<NewRequest> out = requests();
  for (size_t i = 0; i < out.size(); ++i) {
    SamplingParams& p = out[i].params;
    switch (i % 3) {
      case 0: p.repetition_penalty = 1.3; p.frequency_penalty = 0.4; break;
      case 1: p.presence_penalty = 1.5; p.logit_bias = {{11, 4.0}, {12, -50.0}}; break;
      default: p.bad_words_token_ids = {{20}, {21, 22}}; break;
    }
  }
  out[4].params.allowed_token_ids = {30, 31, 32, 33};
  return out;
}

TEST(EngineOnCpuModel, AdjustedSamplingIsTheSameBatchedAndAlone) {
  ThreadPool threads(2);
  SchedulerOptions roomy;
  roomy.max_model_len = 256;
  roomy.max_num_batched_tokens = 512;
  std::map<RequestId, std::vector<int32_t>> alone, plain;
  for (const NewRequest& r : adjusted_requests()) {
    CpuEngine e(64, roomy, threads);
    alone[r.id] = e.run({r})[r.id];
    ASSERT_EQ(alone[r.id].size(), 14u) << r.id;
  }
  for (const NewRequest& r : requests()) {
    CpuEngine e(64, roomy, threads);
    plain[r.id] = e.run({r})[r.id];
  }
  // The adjustments took effect.
  for (int32_t t : alone["r4"]) EXPECT_TRUE(t >= 30 && t <= 33) << t;
  for (const auto& [id, toks] : alone) EXPECT_EQ(std::count(toks.begin(), toks.end(), 20), 0) << id;
  // (The penalties' arithmetic is sampler_test's; this model rarely repeats in 14 tokens.)
  EXPECT_NE(alone["r4"], plain["r4"]);

  SchedulerOptions tight;
  tight.max_model_len = 128;
  tight.max_num_batched_tokens = 24;
  tight.max_num_seqs = 4;
  CpuEngine e(10, tight, threads);
  EXPECT_EQ(e.run(adjusted_requests()), alone);
  EXPECT_GT(e.sched->stats().num_preemptions, 0u);
}

// prompt_logprobs: every prompt token after the first, as one forward of the
// whole prompt gives them, whatever the chunks, the preemptions and the
// prefix cache (which a scored prompt never reads).
TEST(EngineOnCpuModel, PromptLogprobsEqualTheWholePromptsForward) {
  ThreadPool threads(2);
  std::vector<NewRequest> reqs = requests();
  for (NewRequest& r : reqs) r.params.prompt_logprobs = 2;
  reqs[1].params.prompt_logprobs.reset();

  SchedulerOptions roomy;
  roomy.max_model_len = 256;
  roomy.max_num_batched_tokens = 512;
  CpuEngine ref(64, roomy, threads);
  SchedulerOptions tight;
  tight.max_model_len = 128;
  tight.max_num_batched_tokens = 24;
  tight.max_num_seqs = 4;
  tight.max_prompt_logprob_tokens = 8;
  CpuEngine e(10, tight, threads);
  e.run(reqs);
  EXPECT_GT(e.sched->stats().num_preemptions, 0u);
  EXPECT_FALSE(e.prompt_logprobs.count("r1"));
  for (const NewRequest& r : reqs) {
    if (!r.params.prompt_logprobs) continue;
    SCOPED_TRACE(r.id);
    ASSERT_TRUE(e.prompt_logprobs.count(r.id));
    const std::vector<TokenLogprobs>& got = e.prompt_logprobs[r.id];
    ASSERT_EQ(got.size(), r.prompt_tokens.size() - 1);
    std::vector<int32_t> table(16);
    for (int i = 0; i < 16; ++i) table[i] = i;
    SequenceChunk whole{r.prompt_tokens, 0, table, /*all_logits=*/true};
    ForwardOutput out;
    ASSERT_TRUE(ref.model->forward({&whole, 1}, ref.kv, out));
    for (size_t k = 0; k < got.size(); ++k) {
      const TokenLogprobs want = compute_logprobs(out.row(0, k), r.prompt_tokens[k + 1], 2);
      EXPECT_EQ(got[k].chosen.token, r.prompt_tokens[k + 1]);
      EXPECT_EQ(got[k].chosen.logprob, want.chosen.logprob) << k;
      EXPECT_EQ(got[k].chosen.rank, want.chosen.rank) << k;
      ASSERT_EQ(got[k].top.size(), 2u);
      EXPECT_EQ(got[k].top[0].token, want.top[0].token) << k;
    }
  }
}

}  // namespace
}  // namespace siesta
