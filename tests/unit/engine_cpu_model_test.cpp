// The scheduler and sampler over the real CPU Qwen3 model (models/tiny-qwen3):
// requests batched with others, chunked, preempted under a tiny KV cache and
// sharing prefixes give the same tokens as each request run alone.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "engine/engine_step.h"
#include "engine/random.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/cpu/qwen3_cpu.h"

namespace siesta {
namespace {

class CpuEngine {
 public:
  CpuEngine(int num_blocks, SchedulerOptions o, ThreadPool& threads)
      : pool(num_blocks), sampler({}, RandomGenerator(1)) {
    auto m = CpuQwen3::load(std::string(SIESTA_SOURCE_DIR) + "/models/tiny-qwen3", threads);
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
      for (const RequestOutput& o : *step)
        for (const SampledToken& t : o.new_tokens) out[o.request_id].push_back(t.token);
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

}  // namespace
}  // namespace siesta
