// The CUDA Qwen3 on the tiny model: Hugging Face's golden logits and greedy
// continuations, agreement with the CPU reference, device sampling equal to
// the engine sampler, graphs equal to eager launches, batch and chunk
// invariance in --batch-invariant mode, long batches split into passes.
// Skips without a GPU.
#include <gtest/gtest.h>

#if defined(SIESTA_HAVE_CUDA)

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>

#include "common/thread_pool.h"
#include "engine/random.h"
#include "engine/sampler.h"
#include "model/cpu/qwen3_cpu.h"
#include "model/cuda/qwen3_cuda.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "test_data.h"

namespace siesta {
namespace {

const std::filesystem::path kSource = siesta::testing::test_data_root();
const std::filesystem::path kModelDir = kSource / "models/tiny-qwen3";
const std::filesystem::path kGolden = kSource / "tests/data/golden";

struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> greedy;
};

std::vector<Prompt> golden_prompts() {
  std::ifstream f(kGolden / "tiny-qwen3_golden.json");
  nlohmann::json j = nlohmann::json::parse(f);
  std::vector<Prompt> out;
  for (const auto& p : j["prompts"])
    out.push_back({p["input_ids"].get<std::vector<int32_t>>(), p["greedy_24"].get<std::vector<int32_t>>()});
  return out;
}

// A device KV cache, poisoned with NaN, handing out blocks in scrambled order.
class DeviceCache {
 public:
  DeviceCache(CudaQwen3& model, int num_blocks, uint32_t seed = 7) : layout_(model.kv_layout()) {
    auto buf = model.allocate_kv_cache(num_blocks);
    EXPECT_TRUE(buf) << buf.error().message;
    buf_ = std::move(*buf);
    cudaMemset(buf_.data(), 0xFF, buf_.bytes());
    free_.resize(num_blocks);
    std::iota(free_.begin(), free_.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(free_.begin(), free_.end(), rng);
    num_blocks_ = num_blocks;
  }
  KvCacheView view() { return {buf_.data(), num_blocks_, layout_}; }
  void grow(std::vector<int32_t>& table, size_t tokens) {
    while (table.size() * layout_.block_size < tokens) {
      table.push_back(free_.back());
      free_.pop_back();
    }
  }

 private:
  KvCacheLayout layout_;
  cuda::DeviceBuffer buf_;
  std::vector<int32_t> free_;
  int num_blocks_ = 0;
};

double max_rel_err(std::span<const float> a, std::span<const float> b) {
  double md = 0, mr = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    md = std::max(md, std::abs(static_cast<double>(a[i]) - b[i]));
    mr = std::max(mr, std::abs(static_cast<double>(b[i])));
  }
  return md / mr;
}

// One sequence being generated.
struct Gen {
  std::vector<int32_t> pending;  // tokens not yet in the cache
  std::vector<int32_t> table;
  int32_t pos = 0;
  std::vector<int32_t> out;
};

// One engine-like step over every sequence: each feeds its pending tokens and
// gets one greedy token from the device. Returns the step's logits (per sequence).
ForwardOutput step(CudaQwen3& m, DeviceCache& cache, std::vector<Gen*> seqs) {
  std::vector<SequenceChunk> batch;
  for (Gen* g : seqs) {
    cache.grow(g->table, g->pos + g->pending.size());
    batch.push_back({g->pending, g->pos, g->table, false});
  }
  std::vector<TokenChoice> rows(seqs.size());
  ChosenTokens st;
  auto r = m.forward_choose(batch, cache.view(), rows, st, /*copy_logits=*/true);
  EXPECT_TRUE(r) << r.error().message;
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i]->pos += static_cast<int32_t>(seqs[i]->pending.size());
    seqs[i]->pending = {st.tokens[i]};
    seqs[i]->out.push_back(st.tokens[i]);
  }
  return st.logits;
}

std::vector<int32_t> greedy(CudaQwen3& m, const std::vector<int32_t>& prompt, int n) {
  DeviceCache cache(m, 64);
  Gen g{prompt};
  for (int i = 0; i < n; ++i) step(m, cache, {&g});
  return g.out;
}

// A random checkpoint of the Qwen3-0.6B shape in `dir`. Its special tokens are
// the real Qwen3 tokenizer's (scripts/setup fetches it; device-check points
// SIESTA_ASSETS at its copy).
// A random checkpoint of a make-model shape (layers > 0: that many decoder layers).
void make_shape_model(const std::filesystem::path& dir, const std::string& shape, uint64_t seed, int layers = 0) {
  std::filesystem::remove_all(dir);
  MakeModelOptions mo;
  mo.shape = shape;
  mo.out_dir = dir;
  mo.seed = seed;
  mo.layers = layers;
  const char* assets = std::getenv("SIESTA_ASSETS");
  const char* home = std::getenv("HOME");
  mo.tokenizer = (assets && *assets ? std::filesystem::path(assets)
                                    : std::filesystem::path(home ? home : "/root") / ".cache/siesta/assets") /
                 "qwen3-tokenizer" / "tokenizer.json";
  ASSERT_TRUE(std::filesystem::exists(mo.tokenizer)) << "no Qwen3 tokenizer at " << mo.tokenizer;
  auto made = make_model(mo);
  ASSERT_TRUE(made) << made.error().message;
}

class CudaQwen3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  }
  std::unique_ptr<CudaQwen3> load(CudaModelOptions opt = {}) {
    opt.max_batch_tokens = opt.max_batch_tokens == 8192 ? 1024 : opt.max_batch_tokens;
    auto m = CudaQwen3::load(kModelDir, alloc_, opt);
    EXPECT_TRUE(m) << m.error().message;
    return m ? std::move(*m) : nullptr;
  }
  cuda::CudaMallocAllocator alloc_;
};

// The tiny model's golden logits are HF's fp32 forward. A bf16 model cannot
// be closer to them than bf16 rounding allows: HF's own bf16 model is up to
// 2.9e-2 (relative to the row's largest logit) away from its fp32 logits on
// these prompts (measured on the H200, 2026-11-29), while this model is within
// 1.1e-2 of HF's bf16 logits (tests/unit/cuda_hf_reference_test.cpp).
constexpr double kBf16VsFp32Tolerance = 5e-2;

// Both modes: batch-invariant (the default) and --no-batch-invariant.
CudaModelOptions mode(bool invariant) {
  CudaModelOptions o;
  o.batch_invariant = invariant;
  return o;
}
const char* mode_name(bool invariant) { return invariant ? "batch-invariant" : "no-batch-invariant"; }

TEST_F(CudaQwen3Test, LogitsMatchHuggingFaceAtEveryPosition) {
  for (bool invariant : {true, false}) {
    SCOPED_TRACE(mode_name(invariant));
    auto m = load(mode(invariant));
    ASSERT_TRUE(m);
    auto ref = TensorStore::open_file(kGolden / "tiny-qwen3_logits.safetensors");
    ASSERT_TRUE(ref) << ref.error().message;
    const auto prompts = golden_prompts();
    const int64_t V = m->config().vocab_size;
    double worst = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      DeviceCache cache(*m, 64);
      std::vector<int32_t> table;
      cache.grow(table, prompts[i].ids.size());
      SequenceChunk seq{prompts[i].ids, 0, table, true};
      ForwardOutput out;
      ASSERT_TRUE(m->forward({&seq, 1}, cache.view(), out));
      auto theirs = ref->get_f32("logits_" + std::to_string(i), {static_cast<int64_t>(prompts[i].ids.size()), V});
      ASSERT_TRUE(theirs);
      for (size_t p = 0; p < prompts[i].ids.size(); ++p) {
        const double e = max_rel_err(out.row(0, p), std::span<const float>(theirs->data() + p * V, V));
        worst = std::max(worst, e);
        EXPECT_LE(e, kBf16VsFp32Tolerance) << "prompt " << i << " position " << p;
      }
    }
    std::cout << "[tiny, " << mode_name(invariant) << "] max relative logits error vs HF fp32: " << worst << "\n";
    RecordProperty(std::string("max_rel_err_vs_hf_fp32_") + (invariant ? "invariant" : "default"),
                   std::to_string(worst));
  }
}

// warm_up (the engine's at start) runs in a KV cache of its own: the device
// memory it took is given back, and a forward after it gives the bits of one
// before it.
TEST_F(CudaQwen3Test, WarmUpGivesBackItsMemoryAndChangesNoResult) {
  auto m = load();
  ASSERT_TRUE(m);
  const auto prompts = golden_prompts();
  auto run = [&](ForwardOutput& out) {
    DeviceCache cache(*m, 64);
    std::vector<int32_t> table;
    cache.grow(table, prompts[0].ids.size());
    SequenceChunk seq{prompts[0].ids, 0, table, true};
    ASSERT_TRUE(m->forward({&seq, 1}, cache.view(), out));
  };
  ForwardOutput before, after;
  run(before);
  size_t free0 = 0, free1 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  auto warm = m->warm_up(300);
  ASSERT_TRUE(warm) << warm.error().message;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  // Within 64 MiB: the kernels it loads and the runtime's pools take some.
  EXPECT_LE(free0 - std::min(free0, free1), size_t{64} << 20);
  run(after);
  EXPECT_EQ(before.logits, after.logits);
}

TEST_F(CudaQwen3Test, GreedyContinuationsMatchHuggingFace) {
  for (bool invariant : {true, false}) {
    SCOPED_TRACE(mode_name(invariant));
    auto m = load(mode(invariant));
    ASSERT_TRUE(m);
    const auto prompts = golden_prompts();
    int full = 0, first8 = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto ours = greedy(*m, prompts[i].ids, 24);
      full += ours == prompts[i].greedy;
      first8 += std::equal(ours.begin(), ours.begin() + 8, prompts[i].greedy.begin());
    }
    // The golden continuations come from HF's fp32 model; bf16 rounding can tip
    // a near-tie late in a continuation, so the count over 24 is reported only.
    std::cout << "[tiny, " << mode_name(invariant) << "] greedy vs HF fp32: " << full << "/8 equal over 24 tokens, "
              << first8 << "/8 over 8\n";
    EXPECT_GE(first8, 7);
  }
}

TEST_F(CudaQwen3Test, AgreesWithTheCpuReference) {
  for (bool invariant : {true, false}) {
    SCOPED_TRACE(mode_name(invariant));
    auto m = load(mode(invariant));
    ASSERT_TRUE(m);
    ThreadPool pool(4);
    auto cpu = CpuQwen3::load(kModelDir, pool);
    ASSERT_TRUE(cpu) << cpu.error().message;
    double worst = 0;
    for (const auto& p : golden_prompts()) {
      DeviceCache cache(*m, 64);
      std::vector<int32_t> table;
      cache.grow(table, p.ids.size());
      SequenceChunk seq{p.ids, 0, table, true};
      ForwardOutput gpu_out, cpu_out;
      ASSERT_TRUE(m->forward({&seq, 1}, cache.view(), gpu_out));
      std::vector<float> cpu_kv(64 * (*cpu)->kv_layout().block_elems());
      ASSERT_TRUE((*cpu)->forward({&seq, 1}, KvCacheView{cpu_kv.data(), 64, (*cpu)->kv_layout()}, cpu_out));
      worst = std::max(worst, max_rel_err(gpu_out.logits, cpu_out.logits));
    }
    std::cout << "[tiny, " << mode_name(invariant) << "] max relative logits error vs the CPU fp32 model: " << worst
              << "\n";
    EXPECT_LE(worst, kBf16VsFp32Tolerance);
  }
}

TEST_F(CudaQwen3Test, DeviceSamplingEqualsTheEngineSamplerOnTheSameLogits) {
  auto m = load();
  ASSERT_TRUE(m);
  const auto prompts = golden_prompts();
  DeviceCache cache(*m, 256);
  std::vector<Gen> gens;
  for (int i = 0; i < 8; ++i) gens.push_back({prompts[i].ids});
  std::vector<SamplingParams> params(8);
  std::vector<TokenChoice> rows(8);
  for (int i = 0; i < 8; ++i) {
    params[i].seed = 77 + i;
    params[i].temperature = 0.5 + 0.2 * i;
    params[i].top_k = i % 2 ? 40 : 0;
    params[i].top_p = i % 3 ? 0.8 : 1.0;
    params[i].min_p = i == 5 ? 0.1 : 0.0;
    rows[i] = {params[i].temperature, params[i].top_p, params[i].top_k, params[i].min_p, 0.0, {}};
  }
  RandomGenerator unused(1);
  for (int s = 0; s < 6; ++s) {  // prefill (eager), then decode steps (graphs)
    std::vector<SequenceChunk> batch;
    for (auto& g : gens) {
      cache.grow(g.table, g.pos + g.pending.size());
      batch.push_back({g.pending, g.pos, g.table, false});
    }
    for (int i = 0; i < 8; ++i) rows[i].uniform = to_unit_interval(request_draw(*params[i].seed, s));
    ChosenTokens st;
    ASSERT_TRUE(m->forward_choose(batch, cache.view(), rows, st, true));
    ASSERT_TRUE(st.has_logits);
    for (int i = 0; i < 8; ++i) {
      const int32_t host = sample(st.logits.last(i), params[i], s, unused);
      if (st.tokens[i] != kChooseOnHost) {
        EXPECT_EQ(st.tokens[i], host) << "step " << s << " row " << i;
      }
      gens[i].pos += static_cast<int32_t>(gens[i].pending.size());
      gens[i].pending = {host};
    }
  }
}

TEST_F(CudaQwen3Test, GraphReplaysGiveTheSameResultsAsEagerLaunches) {
  auto with = load();
  CudaModelOptions no_graphs;
  no_graphs.cuda_graphs = false;
  auto without = load(no_graphs);
  ASSERT_TRUE(with && without);
  const auto prompts = golden_prompts();
  DeviceCache c1(*with, 128), c2(*without, 128);
  std::vector<Gen> g1, g2;
  for (int i = 0; i < 3; ++i) {
    g1.push_back({prompts[i].ids});
    g2.push_back({prompts[i].ids});
  }
  for (int s = 0; s < 10; ++s) {
    auto l1 = step(*with, c1, {&g1[0], &g1[1], &g1[2]});
    auto l2 = step(*without, c2, {&g2[0], &g2[1], &g2[2]});
    ASSERT_EQ(l1.logits, l2.logits) << "step " << s;  // both small-batch paths: per-row identical
  }
  EXPECT_GT(with->num_graphs(), 0u);
  EXPECT_EQ(without->num_graphs(), 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(g1[i].out, g2[i].out);
}

// InstrumentationOptions::time_graphs adds two event nodes to each decode graph: the
// results must not move, and each replay's GPU time must be counted, positive
// and below the host's time around the same call.
TEST_F(CudaQwen3Test, GraphTimingChangesNoResultAndTimesEachReplay) {
  CudaModelOptions timed;
  timed.instrumentation.time_graphs = true;
  auto with = load(timed);
  auto plain = load();
  ASSERT_TRUE(with && plain);
  const auto prompts = golden_prompts();
  DeviceCache c1(*with, 128), c2(*plain, 128);
  std::vector<Gen> g1, g2;
  for (int i = 0; i < 3; ++i) {
    g1.push_back({prompts[i].ids});
    g2.push_back({prompts[i].ids});
  }
  double host_ms = 0;
  for (int s = 0; s < 10; ++s) {
    // Step 0 is the prefill, step 1 captures the graph: replays from step 2 on.
    if (s == 2) {
      EXPECT_EQ(with->instrumentation().graph_step_ms(), 0.0) << "no replay yet";
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto l1 = step(*with, c1, {&g1[0], &g1[1], &g1[2]});
    if (s >= 2) host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    auto l2 = step(*plain, c2, {&g2[0], &g2[1], &g2[2]});
    ASSERT_EQ(l1.logits, l2.logits) << "step " << s;
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(g1[i].out, g2[i].out);
  const double gpu_ms = with->instrumentation().graph_step_ms();
  EXPECT_GT(gpu_ms, 0.0);
  EXPECT_LT(gpu_ms, host_ms / 8) << "a replay's GPU time is part of its call's host time";
  EXPECT_EQ(plain->instrumentation().graph_step_ms(), 0.0) << "not timed without the option";
  with->instrumentation().reset();
  EXPECT_EQ(with->instrumentation().graph_step_ms(), 0.0);
}

// Overlapped launches (programmatic dependent launch) must wait for their
// inputs: any missing wait shows up as a difference from plain launches.
TEST_F(CudaQwen3Test, OverlappedLaunchesGiveTheSameResultsAsPlainLaunches) {
  for (bool invariant : {false, true}) {
    CudaModelOptions on, off;
    on.batch_invariant = off.batch_invariant = invariant;
    off.programmatic_launch = false;
    auto a = load(on);
    auto b = load(off);
    ASSERT_TRUE(a && b);
    const auto prompts = golden_prompts();
    for (int batch : {1, 5, 20}) {
      DeviceCache c1(*a, 512), c2(*b, 512);
      std::vector<Gen> g1, g2;
      for (int i = 0; i < batch; ++i) {
        g1.push_back({prompts[i % 8].ids});
        g2.push_back({prompts[i % 8].ids});
      }
      std::vector<Gen*> p1, p2;
      for (int i = 0; i < batch; ++i) {
        p1.push_back(&g1[i]);
        p2.push_back(&g2[i]);
      }
      for (int s = 0; s < 8; ++s) {
        const auto l1 = step(*a, c1, p1), l2 = step(*b, c2, p2);
        ASSERT_EQ(l1.logits, l2.logits) << (invariant ? "invariant, " : "") << "batch " << batch << ", step " << s;
      }
    }
  }
}

// Runs sequence A (prompt 0) for 12 steps, each step batched with `others`
// more sequences (whose prompts start prefilling at different steps), and
// returns A's logits at every step.
std::vector<std::vector<float>> run_a_with_company(CudaQwen3& m, int others, int first_chunk) {
  const auto prompts = golden_prompts();
  DeviceCache cache(m, 1024, 11 + others);
  Gen a;
  std::vector<Gen> company(others);
  for (int i = 0; i < others; ++i) company[i].pending = prompts[1 + i % 7].ids;
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> prompt = prompts[0].ids;
  for (int s = 0; s < 12; ++s) {
    std::vector<Gen*> batch;
    if (s == 0) {
      // A's prompt, possibly in two chunks (the first one without logits).
      if (first_chunk > 0) {
        Gen head{std::vector<int32_t>(prompt.begin(), prompt.begin() + first_chunk)};
        cache.grow(head.table, first_chunk);
        SequenceChunk c{head.pending, 0, head.table, false};
        ForwardOutput ignored;
        EXPECT_TRUE(m.forward({&c, 1}, cache.view(), ignored));
        a.table = head.table;
        a.pos = first_chunk;
        a.pending.assign(prompt.begin() + first_chunk, prompt.end());
      } else {
        a.pending = prompt;
      }
    }
    batch.push_back(&a);
    // Company joins a few at a time, so A's steps mix with prefills and decodes.
    for (int i = 0; i < others; ++i)
      if (i % 4 <= s) batch.push_back(&company[i]);
    std::rotate(batch.begin(), batch.begin() + s % batch.size(), batch.end());  // A's row moves around
    const auto out = step(m, cache, batch);
    const size_t ai = std::find(batch.begin(), batch.end(), &a) - batch.begin();
    logits.emplace_back(out.last(ai).begin(), out.last(ai).end());
  }
  return logits;
}

TEST_F(CudaQwen3Test, BatchInvariantModeGivesBitIdenticalLogitsWhateverTheBatch) {
  CudaModelOptions opt;
  opt.batch_invariant = true;
  auto m = load(opt);
  ASSERT_TRUE(m);
  const auto alone = run_a_with_company(*m, 0, 0);
  for (int others : {2, 16, 40}) {
    const auto batched = run_a_with_company(*m, others, 0);
    for (size_t s = 0; s < alone.size(); ++s) ASSERT_EQ(alone[s], batched[s]) << others << " others, step " << s;
  }
  // Prefill in two chunks: the same last-position logits and continuation.
  const auto chunked = run_a_with_company(*m, 5, 9);
  for (size_t s = 0; s < alone.size(); ++s) ASSERT_EQ(alone[s], chunked[s]) << "chunked prompt, step " << s;
}

// Batch-invariant mode's decode attention kernel (launch_decode_attention_invariant)
// gives the bits of the path it replaced, decode rows as 1-row prefill tiles after
// the q/k norm + RoPE launch (InstrumentationOptions::invariant_decode_as_prefill):
// the same logits at every step of a sequence decoded alone (pure decode passes:
// the kernel does q/k norm, RoPE and the KV write itself) and among 16 others
// that prefill beside its decode steps (mixed passes: it reads what the q/k norm
// launch wrote), graph replays and eager steps.
void expect_decode_kernel_gives_the_prefill_paths_bits(CudaQwen3& kernel, CudaQwen3& prefill_path,
                                                       const std::string& label) {
  for (int others : {0, 16}) {
    const auto got = run_a_with_company(kernel, others, 0);
    const auto want = run_a_with_company(prefill_path, others, 0);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < got.size(); ++s)
      ASSERT_TRUE(got[s] == want[s]) << label << ", " << others << " others, step " << s
                                     << ": max relative difference " << max_rel_err(got[s], want[s]);
  }
}

TEST_F(CudaQwen3Test, BatchInvariantDecodeKernelGivesThePrefillPathsBits) {
  for (bool graphs : {true, false}) {
    CudaModelOptions opt;
    opt.batch_invariant = true;
    opt.cuda_graphs = graphs;
    CudaModelOptions old = opt;
    old.instrumentation.invariant_decode_as_prefill = true;
    auto kernel = load(opt);
    auto prefill_path = load(old);
    ASSERT_TRUE(kernel && prefill_path);
    expect_decode_kernel_gives_the_prefill_paths_bits(*kernel, *prefill_path, graphs ? "tiny" : "tiny, no graphs");
    if (graphs) {
      EXPECT_GT(kernel->num_graphs(), 0u);
    }
  }
}

// Chunk invariance (batch-invariant mode): how a prompt is cut into chunks —
// and whether its last token comes alone, as a P/D decode engine computes it
// over the KV it received — must not change a bit of its logits.
enum class Chunking {
  kWhole,            // (a) one chunk
  kLastAlone,        // (b) n-1 tokens, then the last one alone
  kSixteens,         // (c) chunks of 16, then the rest
  kWholeInBusy,      // (d) one chunk, in steps with other sequences decoding and prefilling
  kLastAloneInBusy,  // (b) inside decode steps with others (graph replays, padded batches)
};

struct ChunkRun {
  std::vector<std::vector<float>> logits;  // the prompt's last position, then each decode step
  std::vector<int32_t> tokens;
};

// Feeds `prompt` as `how` says, then decodes 8 greedy tokens; `company`
// prompts share the steps in the busy variants.
ChunkRun run_chunked(CudaQwen3& m, const std::vector<int32_t>& prompt, Chunking how,
                     const std::vector<std::vector<int32_t>>& company_prompts, uint32_t seed) {
  DeviceCache cache(m, 1024, seed);
  const bool busy = how == Chunking::kWholeInBusy || how == Chunking::kLastAloneInBusy;
  std::vector<int> cuts;  // sizes of the chunks before the last one
  const int n = static_cast<int>(prompt.size());
  if (how == Chunking::kLastAlone || how == Chunking::kLastAloneInBusy) cuts.push_back(n - 1);
  if (how == Chunking::kSixteens)
    for (int at = 0; at + 16 < n; at += 16) cuts.push_back(16);
  Gen a;
  for (int len : cuts) {
    cache.grow(a.table, a.pos + len);
    SequenceChunk c{std::span<const int32_t>(prompt).subspan(a.pos, len), a.pos, a.table, false};
    ForwardOutput ignored;
    EXPECT_TRUE(m.forward({&c, 1}, cache.view(), ignored));
    a.pos += len;
  }
  a.pending.assign(prompt.begin() + a.pos, prompt.end());

  // Company: two already prefilled (they decode), the rest prefill alongside
  // A, one more joining every step (in kLastAloneInBusy, from step 1: step 0
  // is A's last prompt token with two decodes, a graph padded from 3 to 4).
  std::vector<Gen> company(busy ? company_prompts.size() : 0);
  const size_t warm = std::min<size_t>(2, company.size());
  for (size_t i = 0; i < company.size(); ++i) company[i].pending = company_prompts[i];
  if (warm > 0) {
    std::vector<Gen*> first;
    for (size_t i = 0; i < warm; ++i) first.push_back(&company[i]);
    step(m, cache, first);
  }
  ChunkRun run;
  for (int s = 0; s < 9; ++s) {
    std::vector<Gen*> batch{&a};
    for (size_t i = 0; i < company.size(); ++i) {
      // kLastAloneInBusy keeps its first step all-decode (a padded graph step).
      const bool joins = i < warm || (how == Chunking::kWholeInBusy ? static_cast<int>(i - warm) <= s
                                                                     : s > 0 && static_cast<int>(i - warm) < s);
      if (joins) batch.push_back(&company[i]);
    }
    std::rotate(batch.begin(), batch.begin() + s % batch.size(), batch.end());
    const auto out = step(m, cache, batch);
    const size_t ai = std::find(batch.begin(), batch.end(), &a) - batch.begin();
    run.logits.emplace_back(out.last(ai).begin(), out.last(ai).end());
  }
  run.tokens = a.out;
  return run;
}

bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

void expect_chunk_invariant(CudaQwen3& m, const std::string& label) {
  const auto golden = golden_prompts();
  std::vector<std::vector<int32_t>> prompts = {golden[0].ids, golden[3].ids};
  // A longer prompt: its rows cross several 64-key tiles and a 256-token decode partition.
  std::vector<int32_t> longer;
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) longer.push_back(static_cast<int32_t>(rng() % 4000));
  prompts.push_back(longer);
  std::vector<std::vector<int32_t>> company;
  for (int i = 1; i < 8; ++i) company.push_back(golden[i].ids);
  for (size_t p = 0; p < prompts.size(); ++p) {
    const ChunkRun whole = run_chunked(m, prompts[p], Chunking::kWhole, company, 3);
    ASSERT_EQ(whole.logits.size(), 9u);
    for (Chunking how : {Chunking::kLastAlone, Chunking::kSixteens, Chunking::kWholeInBusy, Chunking::kLastAloneInBusy}) {
      const ChunkRun other = run_chunked(m, prompts[p], how, company, 17 + static_cast<uint32_t>(how));
      ASSERT_EQ(other.logits.size(), whole.logits.size());
      for (size_t s = 0; s < whole.logits.size(); ++s)
        ASSERT_TRUE(same_bits(whole.logits[s], other.logits[s]))
            << label << ", prompt " << p << ", chunking " << static_cast<int>(how)
            << (s == 0 ? ", last prompt position" : ", decode step " + std::to_string(s))
            << ": max relative difference " << max_rel_err(other.logits[s], whole.logits[s]);
      EXPECT_EQ(whole.tokens, other.tokens) << label << ", prompt " << p << ", chunking " << static_cast<int>(how);
    }
  }
}

TEST_F(CudaQwen3Test, BatchInvariantModeGivesBitIdenticalLogitsWhateverTheChunking) {
  CudaModelOptions opt;
  opt.batch_invariant = true;
  auto m = load(opt);
  ASSERT_TRUE(m);
  expect_chunk_invariant(*m, "tiny");
  EXPECT_GT(m->num_graphs(), 0u);  // the decode steps went through graphs
  // Without graphs too (eager decode steps take the same kernels).
  opt.cuda_graphs = false;
  auto eager = load(opt);
  ASSERT_TRUE(eager);
  expect_chunk_invariant(*eager, "tiny, no graphs");
}

// Chunk and batch invariance, and the decode kernel against the prefill path, on a random-weight
// checkpoint of a make-model shape (layers > 0: that many decoder layers).
void expect_invariant_random_model(cuda::CudaMallocAllocator& alloc, const std::string& shape, uint64_t seed,
                                   int layers, int group, const std::string& label) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("siesta_cuda_" + shape + "_" + std::to_string(::getpid()));
  make_shape_model(dir, shape, seed, layers);
  if (::testing::Test::HasFatalFailure()) return;
  {
    CudaModelOptions opt;
    opt.batch_invariant = true;
    opt.max_batch_tokens = 1024;
    opt.max_model_len = 2048;
    auto m = CudaQwen3::load(dir, alloc, opt);
    ASSERT_TRUE(m) << m.error().message;
    ASSERT_EQ((*m)->config().num_heads / (*m)->config().num_kv_heads, group) << label;
    expect_chunk_invariant(**m, label);
    // Here the decode kernel matches the wgmma prefill kernel (sm_90a builds).
    opt.instrumentation.invariant_decode_as_prefill = true;
    auto prefill_path = CudaQwen3::load(dir, alloc, opt);
    ASSERT_TRUE(prefill_path) << prefill_path.error().message;
    expect_decode_kernel_gives_the_prefill_paths_bits(**m, **prefill_path, label);
  }
  std::filesystem::remove_all(dir);
}

// The same on a wider random-weight model of the Qwen3-0.6B shape (head_dim
// 128, two query heads per kv head: the prefill kernel's two-heads-per-CTA path).
TEST_F(CudaQwen3Test, BatchInvariantChunkInvarianceOnAWiderRandomModel) {
  expect_invariant_random_model(alloc_, "qwen3-0.6b", 21, 0, 2, "qwen3-0.6b shape");
}

// And on a GQA-group-5 shape: Qwen3-14B's widths (40 query heads over 8 KV heads, hidden 5120,
// intermediate 17408, untied embeddings) with 2 decoder layers.
TEST_F(CudaQwen3Test, BatchInvariantChunkInvarianceOnAGqaGroup5Model) {
  expect_invariant_random_model(alloc_, "qwen3-14b", 23, 2, 5, "qwen3-14b shape, 2 layers");
}

// Default mode, decode steps of up to 8 sequences: every projection is the
// GEMV, whose values do not depend on how many rows it takes, and decode
// attention's on the sequence alone; so a sequence's decode logits are the same
// bits whatever else is decoded with it, and wherever its row is. (Each prompt
// is prefilled alone: prefill passes take cuBLASLt, which rounds by M.)
TEST_F(CudaQwen3Test, SmallDecodeStepsGiveTheSameBitsWhateverTheBatch) {
  const auto prompts = golden_prompts();
  for (bool graphs : {true, false}) {
    CudaModelOptions opt;
    opt.batch_invariant = false;  // the GEMV path's own property (invariant mode has it at every size)
    opt.cuda_graphs = graphs;
    auto m = load(opt);
    ASSERT_TRUE(m);
    auto run = [&](int others) {
      DeviceCache cache(*m, 256, 3 + others);
      std::vector<Gen> g(1 + others);
      for (int i = 0; i <= others; ++i) {
        g[i].pending = prompts[i % 8].ids;
        step(*m, cache, {&g[i]});
      }
      std::vector<std::vector<float>> logits;
      for (int s = 0; s < 12; ++s) {
        std::vector<Gen*> batch;
        for (Gen& x : g) batch.push_back(&x);
        std::rotate(batch.begin(), batch.begin() + s % batch.size(), batch.end());
        const auto out = step(*m, cache, batch);
        const size_t ai = std::find(batch.begin(), batch.end(), &g[0]) - batch.begin();
        logits.emplace_back(out.last(ai).begin(), out.last(ai).end());
      }
      return logits;
    };
    const auto alone = run(0);
    for (int others : {1, 4, 7}) {
      const auto batched = run(others);
      ASSERT_EQ(batched.size(), alone.size());
      for (size_t s = 0; s < alone.size(); ++s)
        ASSERT_TRUE(alone[s] == batched[s]) << others << " others, step " << s << (graphs ? "" : ", no graphs")
                                            << ": max relative difference " << max_rel_err(batched[s], alone[s]);
    }
  }
}

TEST_F(CudaQwen3Test, NonInvariantModeVariesWithTheBatchOnlyByRounding) {
  auto m = load(mode(false));
  ASSERT_TRUE(m);
  const auto alone = run_a_with_company(*m, 0, 0);
  const auto batched = run_a_with_company(*m, 40, 0);
  // Compare while both runs fed A the same tokens (greedy = the argmax).
  double worst = 0;
  size_t identical = 0, compared = 0;
  for (size_t s = 0; s < alone.size(); ++s) {
    worst = std::max(worst, max_rel_err(batched[s], alone[s]));
    identical += alone[s] == batched[s];
    ++compared;
    if (std::max_element(alone[s].begin(), alone[s].end()) - alone[s].begin() !=
        std::max_element(batched[s].begin(), batched[s].end()) - batched[s].begin())
      break;
  }
  std::cout << "[tiny] default mode, alone vs 40 others: max relative difference " << worst << ", " << identical
            << "/" << compared << " steps bit-identical\n";
  // Alone, A's steps take the GEMV and the staged decode attention (probabilities
  // rounded to bf16); with 40 others, cuBLASLt and the fp32 attention item. Each is
  // held to bf16 tolerance (2e-2) of HF's logits elsewhere, so the two may differ by
  // up to the sum; a wrong row or sequence would differ by far more. H200: 0.0187
  // with the staged item on 4 warps, 0.0214 on 16.
  EXPECT_LE(worst, 3e-2);
}

TEST_F(CudaQwen3Test, BatchesLargerThanOnePassAreSplitTransparently) {
  CudaModelOptions small;
  small.max_batch_tokens = 48;
  small.max_seqs = 3;
  auto split = load(small);
  auto whole = load();
  ASSERT_TRUE(split && whole);
  const auto prompts = golden_prompts();
  DeviceCache c1(*split, 256), c2(*whole, 256);
  std::vector<std::vector<int32_t>> t1(8), t2(8);
  std::vector<SequenceChunk> b1, b2;
  for (int i = 0; i < 8; ++i) {
    c1.grow(t1[i], prompts[i].ids.size());
    c2.grow(t2[i], prompts[i].ids.size());
    b1.push_back({prompts[i].ids, 0, t1[i], i == 3});
    b2.push_back({prompts[i].ids, 0, t2[i], i == 3});
  }
  ForwardOutput o1, o2;
  ASSERT_TRUE(split->forward(b1, c1.view(), o1));
  ASSERT_TRUE(whole->forward(b2, c2.view(), o2));
  ASSERT_EQ(o1.num_rows, o2.num_rows);
  EXPECT_EQ(o1.num_rows[3], prompts[3].ids.size());
  EXPECT_LE(max_rel_err(o1.logits, o2.logits), 2e-2);
}

TEST_F(CudaQwen3Test, BadInputIsAnErrorNotAWrite) {
  auto m = load();
  ASSERT_TRUE(m);
  DeviceCache cache(*m, 4);
  const std::vector<int32_t> tokens = {1, 2, 3}, bad_table = {9};
  SequenceChunk seq{tokens, 0, bad_table, false};
  ForwardOutput out;
  EXPECT_FALSE(m->forward({&seq, 1}, cache.view(), out));
  KvCacheView f32_view = cache.view();
  f32_view.layout.elem_bytes = 4;
  const std::vector<int32_t> ok_table = {0};
  SequenceChunk ok{tokens, 0, ok_table, false};
  EXPECT_FALSE(m->forward({&ok, 1}, f32_view, out));
  EXPECT_TRUE(m->forward({&ok, 1}, cache.view(), out));
}

}  // namespace
}  // namespace siesta

#else

TEST(CudaQwen3Test, NotBuilt) { GTEST_SKIP() << "siesta was built without CUDA (nvcc not found)"; }

#endif
