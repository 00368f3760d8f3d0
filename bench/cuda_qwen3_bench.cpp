// CUDA Qwen3 benchmark: decode throughput and prefill latency, each against
// the roofline measured in the same run (device-to-device copy bandwidth for
// bytes, cuBLASLt bf16 rate for FLOPs), in the default and the batch-invariant
// mode, with the Hugging Face transformers baseline merged in when given.
//
//   cuda_qwen3_bench --model DIR [--out results.json] [--hf hf_baseline.json]
//                    [--batches 1,8,32,128] [--prompt 128] [--gen 128] [--prefill 512,4096]
//                    [--commit SHA] [--no-invariant] [--modes NAME,...] [--profile] [--trace]
//
// Decode: B sequences with random prompts of --prompt tokens are prefilled,
// then --gen steps run through CudaQwen3::forward_choose (greedy on the GPU,
// CUDA graphs), timed on the host clock around the steps: what an engine loop
// would see, host planning and the token's return included. The whole run is
// done once untimed (graph capture stays out of the numbers), then timed
// kDecodeRuns times: the median run is reported, every run's ms per step too.
// Prefill: one sequence of N tokens, logits for the last; median of 10.
// Modes: default (the --no-batch-invariant path, the engine's default until batch invariance
// became it; prefill attention on wgmma where the build has it); without
// programmatic launch; prefill with one query head per CTA; prefill attention
// on the mma.sync kernel, with its query rows per warp chosen per pass by the
// CTA count or fixed at 16 or 32; decode partitions fixed at 64, 128 and 256
// (the default takes 256, staged on tensor cores for decode steps of up to 8 sequences);
// decode projections on cuBLASLt at every batch size (no GEMV); batch-invariant; batch-invariant with
// its decode rows as 1-row prefill tiles (batch_invariant_decode_as_prefill: the path before its
// decode kernel, InstrumentationOptions::invariant_decode_as_prefill); batch-invariant with its
// projections on the TMA fixed GEMM in clusters of two (batch_invariant_gemm_cluster:
// InstrumentationOptions::fixed_gemm_kernel 4; prefill only); batch-invariant with its decode attention on
// 4 warps per CTA at every batch size (batch_invariant_decode_4_warps: invariant_decode_warps; the default
// takes 8 for small batches). --modes runs only the named
// ones (e.g. default,batch_invariant).
// --profile: also a breakdown per kernel group (CUDA events between eager
// launches, so launch gaps are included) of a decode step at each batch size
// and of each prefill, in the default mode, and of each prefill again on the
// mma.sync attention kernel (prefill_N_mma: compare its attention_prefill with
// prefill_N's), and the same decode steps and prefills in the batch-invariant
// mode (invariant_decode_B, invariant_prefill_N; its decode attention is
// attention_decode_invariant, q/k norm + RoPE + KV write included) and its decode
// steps with decode rows as prefill tiles (invariant_as_prefill_decode_B: rope_kv +
// attention_prefill) unless --no-invariant.
// --trace: the timeline of the last batch-1 decode step, graphs and programmatic
// launch on (InstrumentationOptions::trace): per kernel of a layer, when its CTAs
// start, pass the wait for the previous kernel and end, as means over the
// layers, each relative to the previous kernel's end ("trace" in the JSON, which
// also lists every launch's recorded CTAs: SM, start, wait and marks).
// Needs a build with -DSIESTA_CUDA_TRACE=ON (the kernels' marks).
#if defined(SIESTA_HAVE_CUDA)

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "model/cuda/device_limits.h"
#include "model/cuda/qwen3_cuda.h"

namespace {

using siesta::CudaModelOptions;
using siesta::CudaQwen3;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model, out, hf, commit;
  std::vector<std::string> modes;  // empty: every mode
  std::vector<int> batches = {1, 8, 32, 128};
  std::vector<int> prefill = {512, 4096};
  int prompt = 128, gen = 128;
  bool invariant = true;
  bool profile = false;
  bool trace = false;
};

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) v.push_back(std::stoi(item));
  return v;
}

[[noreturn]] void fail(const std::string& what) {
  std::cerr << "cuda_qwen3_bench: " << what << "\n";
  std::exit(1);
}

template <class T>
T check(siesta::Result<T> r, const std::string& what) {
  if (!r) fail(what + ": " + r.error().message);
  return std::move(*r);
}
void check(siesta::Result<void> r, const std::string& what) {
  if (!r) fail(what + ": " + r.error().message);
}

using siesta::seconds_since;

// Sizes of the model, for the roofline.
struct Shape {
  double layer_params, lm_head_params, weight_bytes, kv_bytes_per_token;
  int L, heads, hd, vocab;
};

Shape shape_of(const siesta::ModelConfig& c, size_t weight_bytes) {
  const double H = c.hidden_size, I = c.intermediate_size, QD = c.q_dim(), KVD = c.kv_dim();
  Shape s;
  s.layer_params = (QD + 2 * KVD) * H + H * QD + 3 * I * H;
  s.lm_head_params = static_cast<double>(c.vocab_size) * H;
  s.weight_bytes = static_cast<double>(weight_bytes);
  s.kv_bytes_per_token = 2.0 * c.num_layers * KVD * 2;  // K and V, bf16, every layer
  s.L = c.num_layers;
  s.heads = c.num_heads;
  s.hd = c.head_dim;
  s.vocab = c.vocab_size;
  return s;
}

// Timed decode runs per batch size, after the warm-up; the median is reported.
constexpr int kDecodeRuns = 5;

struct DecodeResult {
  double seconds = 0, tok_s = 0, ms_per_step = 0;
};

// Prefill B random prompts, then `gen` greedy decode steps; returns the decode timing.
// The KV cache is the caller's, the same for the warm-up and the timed run:
// graphs are captured per cache address.
DecodeResult run_decode(CudaQwen3& m, const siesta::cuda::DeviceBuffer& kv, int B, int prompt, int gen,
                        uint32_t seed) {
  const int per_seq_blocks = (prompt + gen + 15) / 16;
  const int blocks = B * per_seq_blocks;
  const siesta::KvCacheView view{kv.data(), blocks, m.kv_layout()};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, std::min(m.config().vocab_size, 150000) - 1);
  std::vector<std::vector<int32_t>> tables(B), pending(B);
  for (int b = 0; b < B; ++b) {
    tables[b].resize(per_seq_blocks);
    std::iota(tables[b].begin(), tables[b].end(), b * per_seq_blocks);
    pending[b].resize(prompt);
    for (auto& t : pending[b]) t = tok(rng);
  }
  const std::vector<siesta::TokenChoice> rows(B);  // greedy
  std::vector<siesta::SequenceChunk> batch(B);
  siesta::ChosenTokens st;
  auto step = [&](int32_t pos) {
    for (int b = 0; b < B; ++b) batch[b] = {pending[b], pos, tables[b], false};
    check(m.forward_choose(batch, view, rows, st), "decode step");
    for (int b = 0; b < B; ++b) pending[b] = {st.tokens[b]};
  };
  step(0);  // prefill
  const auto t0 = Clock::now();
  for (int i = 0; i < gen; ++i) step(prompt + i);
  DecodeResult r;
  r.seconds = seconds_since(t0);
  r.tok_s = B * gen / r.seconds;
  r.ms_per_step = r.seconds * 1e3 / gen;
  return r;
}

double run_prefill_ms(CudaQwen3& m, int n, uint32_t seed) {
  const int blocks = (n + 15) / 16;
  siesta::cuda::DeviceBuffer kv = check(m.allocate_kv_cache(blocks), "allocating the KV cache");
  const siesta::KvCacheView view{kv.data(), blocks, m.kv_layout()};
  std::vector<int32_t> table(blocks), tokens(n);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(seed);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % std::min(m.config().vocab_size, 150000));
  const siesta::SequenceChunk seq{tokens, 0, table, false};
  siesta::ForwardOutput out;
  std::vector<double> ms;
  for (int i = 0; i < 12; ++i) {
    const auto t0 = Clock::now();
    check(m.forward({&seq, 1}, view, out), "prefill");
    if (i >= 2) ms.push_back(seconds_since(t0) * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail(k + " needs a value");
      return argv[++i];
    };
    if (k == "--model") a.model = next();
    else if (k == "--out") a.out = next();
    else if (k == "--hf") a.hf = next();
    else if (k == "--commit") a.commit = next();
    else if (k == "--batches") a.batches = parse_list(next());
    else if (k == "--prefill") a.prefill = parse_list(next());
    else if (k == "--prompt") a.prompt = std::stoi(next());
    else if (k == "--gen") a.gen = std::stoi(next());
    else if (k == "--no-invariant") a.invariant = false;
    else if (k == "--modes") {
      std::stringstream ss(next());
      for (std::string m; std::getline(ss, m, ',');) a.modes.push_back(m);
    }
    else if (k == "--profile") a.profile = true;
    else if (k == "--trace") a.trace = true;
    else fail("unknown argument " + k);
  }
  if (a.model.empty()) fail("--model DIR is required");
  if (a.commit.empty() && std::getenv("SIESTA_COMMIT")) a.commit = std::getenv("SIESTA_COMMIT");
  if (!siesta::cuda_device_available()) fail("no CUDA device");

  siesta::cuda::CudaMallocAllocator alloc;
  const auto info = check(siesta::cuda::device_info(0), "device info");
  const double bw_gbps = check(siesta::cuda::measure_copy_bandwidth(alloc), "copy bandwidth");
  const double gemm_tflops = check(siesta::cuda::measure_bf16_gemm_tflops(alloc), "GEMM rate");
  std::printf("device: %s, %d SMs; D2D copy %.0f GB/s; cuBLASLt bf16 %.0f TFLOP/s\n", info.name.c_str(),
              info.sm_count, bw_gbps, gemm_tflops);

  const int max_b = *std::max_element(a.batches.begin(), a.batches.end());
  const int max_p = *std::max_element(a.prefill.begin(), a.prefill.end());
  json modes;
  Shape shape{};
  siesta::ModelConfig cfg;
  // Options sized for every batch and prefill length of the run.
  // Mode "default" (and the profile, graph timing and trace without a prefix) is the
  // --no-batch-invariant path (cuBLASLt, split-KV decode attention): the engine's
  // default before it became batch-invariant; "batch_invariant" is the engine's default.
  auto sized_options = [&] {
    CudaModelOptions opt;
    opt.batch_invariant = false;
    opt.max_seqs = std::max(256, max_b);
    opt.max_batch_tokens = std::max({8192, max_p, max_b});
    opt.max_model_len = std::max(max_p, a.prompt + a.gen);
    return opt;
  };
  struct Mode {
    const char* name;
    bool invariant, overlap, decode, prefill;
    int prefill_heads_per_cta;
    int prefill_warp_rows;
    int decode_partition_tokens;
    bool prefill_wgmma = true;
    int gemv_max_rows = -1;
    bool invariant_decode_as_prefill = false;
    int fixed_gemm_kernel = 0;
    int invariant_decode_warps = 0;
  };
  const Mode mode_list[] = {
      {"default", false, true, true, true, 0, 0, 0},
      {"default_without_overlap", false, false, true, false, 0, 0, 0},
      {"default_prefill_1_head_per_cta", false, true, false, true, 1, 0, 0},
      {"default_prefill_mma", false, true, false, true, 0, 0, 0, false},
      {"default_prefill_mma_16_rows_per_warp", false, true, false, true, 0, 16, 0, false},
      {"default_prefill_mma_32_rows_per_warp", false, true, false, true, 0, 32, 0, false},
      {"default_decode_partition_64", false, true, true, false, 0, 0, 64},
      {"default_decode_partition_128", false, true, true, false, 0, 0, 128},
      {"default_decode_partition_256", false, true, true, false, 0, 0, 256},
      {"default_decode_without_gemv", false, true, true, false, 0, 0, 0, true, 0},
      {"batch_invariant", true, true, true, true, 0, 0, 0},
      {"batch_invariant_decode_as_prefill", true, true, true, false, 0, 0, 0, true, -1, true},
      {"batch_invariant_gemm_cluster", true, true, false, true, 0, 0, 0, true, -1, false, 4},
      {"batch_invariant_decode_4_warps", true, true, true, false, 0, 0, 0, true, -1, false, 0, 4}};
  for (const std::string& name : a.modes)
    if (std::none_of(std::begin(mode_list), std::end(mode_list), [&](const Mode& m) { return name == m.name; }))
      fail("--modes: no mode " + name);
  for (const Mode& md : mode_list) {
    const bool invariant = md.invariant;
    if (invariant && !a.invariant) continue;
    if (!a.modes.empty() && std::find(a.modes.begin(), a.modes.end(), md.name) == a.modes.end()) continue;
    CudaModelOptions opt = sized_options();
    opt.batch_invariant = invariant;
    opt.programmatic_launch = md.overlap;
    opt.instrumentation.prefill_heads_per_cta = md.prefill_heads_per_cta;
    opt.instrumentation.prefill_warp_rows = md.prefill_warp_rows;
    opt.instrumentation.decode_partition_tokens = md.decode_partition_tokens;
    opt.instrumentation.prefill_wgmma = md.prefill_wgmma;
    opt.instrumentation.gemv_max_rows = md.gemv_max_rows;
    opt.instrumentation.invariant_decode_as_prefill = md.invariant_decode_as_prefill;
    opt.instrumentation.fixed_gemm_kernel = md.fixed_gemm_kernel;
    opt.instrumentation.invariant_decode_warps = md.invariant_decode_warps;
    auto model = check(CudaQwen3::load(a.model, alloc, opt), "loading " + a.model);
    cfg = model->config();
    shape = shape_of(cfg, model->weight_bytes());
    json mode;
    for (int B : a.batches) {
      if (!md.decode) break;
      const int blocks = B * ((a.prompt + a.gen + 15) / 16);
      const siesta::cuda::DeviceBuffer kv = check(model->allocate_kv_cache(blocks), "allocating the KV cache");
      run_decode(*model, kv, B, a.prompt, a.gen, 1);  // warm-up: captures the graphs
      // The median of kDecodeRuns timed runs: one run moved by up to 4% with
      // the machine's state (batch 1 of the same configuration measured 0.563
      // and 0.540 ms per step in two modes of one run).
      std::vector<DecodeResult> runs;
      for (int i = 0; i < kDecodeRuns; ++i) runs.push_back(run_decode(*model, kv, B, a.prompt, a.gen, 2));
      std::sort(runs.begin(), runs.end(),
                [](const DecodeResult& x, const DecodeResult& y) { return x.seconds < y.seconds; });
      const DecodeResult r = runs[runs.size() / 2];
      json run_ms = json::array();
      for (const DecodeResult& x : runs) run_ms.push_back(x.ms_per_step);
      // Roofline of one step at the average context of the timed steps.
      const double ctx = a.prompt + (a.gen + 1) / 2.0;
      const double bytes = shape.weight_bytes + B * ctx * shape.kv_bytes_per_token + B * shape.kv_bytes_per_token +
                           2.0 * B * shape.vocab * 4;  // fp32 logits written and read by the sampler
      const double flops = 2.0 * B * (shape.L * shape.layer_params + shape.lm_head_params) +
                           4.0 * B * ctx * shape.heads * shape.hd * shape.L;
      const double floor_ms = std::max(bytes / (bw_gbps * 1e9), flops / (gemm_tflops * 1e12)) * 1e3;
      mode["decode"][std::to_string(B)] = {{"tokens_per_s", r.tok_s},
                                           {"ms_per_step", r.ms_per_step},
                                           {"runs_ms_per_step", run_ms},
                                           {"floor_ms_per_step", floor_ms},
                                           {"floor_bound", bytes / (bw_gbps * 1e9) > flops / (gemm_tflops * 1e12) ? "memory" : "compute"},
                                           {"fraction_of_floor", floor_ms / r.ms_per_step},
                                           {"bytes_per_step", bytes},
                                           {"flops_per_step", flops}};
      std::printf("%s decode batch %d: %.0f tok/s, %.3f ms/step (floor %.3f ms)\n", md.name, B, r.tok_s,
                  r.ms_per_step, floor_ms);
    }
    for (int n : a.prefill) {
      if (!md.prefill) break;
      const double ms = run_prefill_ms(*model, n, 3);
      const double flops = 2.0 * n * shape.L * shape.layer_params + 2.0 * shape.lm_head_params +
                           4.0 * (n * (n + 1.0) / 2.0) * shape.heads * shape.hd * shape.L;
      const double bytes = shape.weight_bytes + n * shape.kv_bytes_per_token;
      const double floor_ms = std::max(flops / (gemm_tflops * 1e12), bytes / (bw_gbps * 1e9)) * 1e3;
      mode["prefill"][std::to_string(n)] = {{"ms", ms},
                                            {"floor_ms", floor_ms},
                                            {"tflops", flops / (ms * 1e-3) / 1e12},
                                            {"fraction_of_floor", floor_ms / ms},
                                            {"flops", flops}};
      std::printf("%s prefill %d: %.2f ms (floor %.2f ms, %.0f TFLOP/s)\n", md.name, n, ms, floor_ms,
                  flops / (ms * 1e-3) / 1e12);
    }
    modes[md.name] = mode;
  }

  // The GPU's part of a decode step: the default configuration once more, its
  // graphs captured between two event nodes (InstrumentationOptions::time_graphs),
  // against the host's clock around the same steps. The difference is the
  // host's share: the metadata copy, the graph launch, the synchronisation and
  // the planning.
  json graph_timing;
  {
    CudaModelOptions opt = sized_options();
    opt.instrumentation.time_graphs = true;
    auto model = check(CudaQwen3::load(a.model, alloc, opt), "loading " + a.model);
    for (int B : a.batches) {
      if (B > 8) continue;  // the small steps, where the host's share matters
      const int blocks = B * ((a.prompt + a.gen + 15) / 16);
      const siesta::cuda::DeviceBuffer kv = check(model->allocate_kv_cache(blocks), "allocating the KV cache");
      run_decode(*model, kv, B, a.prompt, a.gen, 1);  // warm-up: captures the graphs
      model->instrumentation().reset();
      double seconds = 0;
      for (int i = 0; i < kDecodeRuns; ++i) seconds += run_decode(*model, kv, B, a.prompt, a.gen, 2).seconds;
      // Each run's first step is its prefill (no graph): the graph steps are the decode steps.
      const double host_ms = seconds * 1e3 / (kDecodeRuns * a.gen), gpu_ms = model->instrumentation().graph_step_ms();
      graph_timing[std::to_string(B)] = {
          {"host_ms_per_step", host_ms}, {"graph_ms_per_step", gpu_ms}, {"host_share_ms", host_ms - gpu_ms}};
      std::printf("graph timing, batch %d: %.3f ms per step on the host clock, %.3f in the graph (%.1f us outside)\n",
                  B, host_ms, gpu_ms, (host_ms - gpu_ms) * 1e3);
    }
  }

  json profile;
  if (a.profile) {
    CudaModelOptions opt = sized_options();
    opt.instrumentation.profile = true;
    auto model = check(CudaQwen3::load(a.model, alloc, opt), "loading " + a.model);
    auto take = [&](CudaQwen3& m, const std::string& name, double divide) {
      json j;
      double total = 0;
      for (const auto& [label, ms] : m.instrumentation().profile()) {
        j[label] = ms / divide;
        total += ms / divide;
      }
      j["total"] = total;
      profile[name] = j;
      std::printf("profile %s (ms):", name.c_str());
      for (const auto& [label, ms] : m.instrumentation().profile()) std::printf(" %s %.3f", label.c_str(), ms / divide);
      std::printf(" | total %.3f\n", total);
      m.instrumentation().reset();
    };
    auto profile_decode = [&](CudaQwen3& m, int B, const std::string& name) {
      const int blocks = B * ((a.prompt + a.gen + 15) / 16);
      const siesta::cuda::DeviceBuffer kv = check(m.allocate_kv_cache(blocks), "allocating the KV cache");
      run_decode(m, kv, B, a.prompt, 8, 1);  // warm-up
      m.instrumentation().reset();
      run_decode(m, kv, B, a.prompt, 16, 2);
      // The first step of run_decode is the prefill: subtract it by profiling it alone.
      const auto with_prefill = m.instrumentation().profile();
      m.instrumentation().reset();
      run_decode(m, kv, B, a.prompt, 0, 2);
      const auto prefill_only = m.instrumentation().profile();
      m.instrumentation().reset();
      json j;
      double total = 0;
      for (const auto& [label, ms] : with_prefill) {
        double pre = 0;
        for (const auto& [l2, ms2] : prefill_only)
          if (l2 == label) pre = ms2;
        j[label] = (ms - pre) / 16;
        total += (ms - pre) / 16;
      }
      j["total"] = total;
      profile[name] = j;
      std::printf("profile %s (ms per step):", name.c_str());
      for (auto it = j.begin(); it != j.end(); ++it) std::printf(" %s %.4f", it.key().c_str(), it.value().get<double>());
      std::printf("\n");
    };
    for (int B : a.batches) profile_decode(*model, B, "decode_" + std::to_string(B));
    for (int n : a.prefill) {
      run_prefill_ms(*model, n, 3);  // 12 runs
      model->instrumentation().reset();
      run_prefill_ms(*model, n, 3);
      take(*model, "prefill_" + std::to_string(n), 12);
    }
    // The same prefills with the mma.sync attention kernel (its rows per warp chosen per pass).
    model.reset();
    opt.instrumentation.prefill_wgmma = false;
    auto model_mma = check(CudaQwen3::load(a.model, alloc, opt), "loading " + a.model);
    for (int n : a.prefill) {
      run_prefill_ms(*model_mma, n, 3);
      model_mma->instrumentation().reset();
      run_prefill_ms(*model_mma, n, 3);
      take(*model_mma, "prefill_" + std::to_string(n) + "_mma", 12);
    }
    // And the batch-invariant mode's decode steps and prefills (prefix "invariant_").
    if (a.invariant) {
      model_mma.reset();
      CudaModelOptions inv = sized_options();
      inv.instrumentation.profile = true;
      inv.batch_invariant = true;
      auto model_inv = check(CudaQwen3::load(a.model, alloc, inv), "loading " + a.model);
      for (int B : a.batches) profile_decode(*model_inv, B, "invariant_decode_" + std::to_string(B));
      for (int n : a.prefill) {
        run_prefill_ms(*model_inv, n, 3);
        model_inv->instrumentation().reset();
        run_prefill_ms(*model_inv, n, 3);
        take(*model_inv, "invariant_prefill_" + std::to_string(n), 12);
      }
      model_inv.reset();
      inv.instrumentation.invariant_decode_as_prefill = true;
      auto model_old = check(CudaQwen3::load(a.model, alloc, inv), "loading " + a.model);
      for (int B : a.batches) profile_decode(*model_old, B, "invariant_as_prefill_decode_" + std::to_string(B));
    }
  }

  json trace;
  if (a.trace) {
    CudaModelOptions opt;
    opt.batch_invariant = false;
    opt.instrumentation.trace = true;
    opt.max_model_len = a.prompt + a.gen;
    auto model = check(CudaQwen3::load(a.model, alloc, opt), "loading " + a.model);
    const siesta::cuda::DeviceBuffer kv =
        check(model->allocate_kv_cache((a.prompt + a.gen + 15) / 16), "allocating the KV cache");
    run_decode(*model, kv, 1, a.prompt, a.gen, 1);
    const DecodeResult r = run_decode(*model, kv, 1, a.prompt, a.gen, 1);
    const std::vector<siesta::cuda::KernelTrace> t = model->instrumentation().trace();
    // Per kernel of a layer (layers 1 to L - 2): ns from the previous kernel's
    // end to this one's first / last CTA start, first / last CTA past the wait, its
    // marks and its end (negative: before the previous kernel ended).
    constexpr int kWords = siesta::cuda::KernelTrace::kMarks, kEnd = kWords - 1;
    static const char* const kMarks[kWords] = {"start", "start_last", "wait_first", "wait_last",
                                               "mark3", "mark4",      "mark5",      "end"};
    json per_kernel = json::array();
    std::vector<std::string> order;
    std::map<std::string, std::vector<double>> sums;
    std::map<std::string, int> counts;
    for (size_t i = 1; i < t.size(); ++i) {
      if (t[i].layer < 1 || t[i].layer > cfg.num_layers - 2) continue;
      const double prev_end = t[i - 1].marks[kEnd];
      auto& v = sums[t[i].kernel];
      if (v.empty()) {
        v.assign(kWords, 0.0);
        order.push_back(t[i].kernel);
      }
      for (int j = 0; j < kWords; ++j) v[j] += t[i].marks[j] < 0 ? 0.0 : t[i].marks[j] - prev_end;
      ++counts[t[i].kernel];
    }
    std::printf("trace, batch 1 (%.3f ms/step): ns after the previous kernel's end, mean over layers\n", r.ms_per_step);
    double layer_ns = 0;
    for (const std::string& k : order) {
      json j = {{"kernel", k}};
      std::printf("  %-10s", k.c_str());
      for (int m = 0; m < kWords; ++m) {
        const double ns = sums[k][m] / counts[k];
        j[kMarks[m]] = ns;
        std::printf(" %s %7.0f", kMarks[m], ns);
      }
      std::printf("\n");
      layer_ns += j["end"].get<double>();
      per_kernel.push_back(j);
    }
    std::printf("  layer: %.0f ns from one down projection's end to the next\n", layer_ns);
    json launches = json::array();
    for (const auto& k : t) {
      json ctas = json::array();  // per recorded CTA: SM, start, wait, marks 3 .. end
      for (const auto& c : k.ctas) {
        json row = {c.sm};
        for (double ns : c.ns) row.push_back(ns);
        ctas.push_back(row);
      }
      launches.push_back({{"kernel", k.kernel},
                          {"layer", k.layer},
                          {"marks_ns", std::vector<double>(k.marks, k.marks + kWords)},
                          {"ctas", ctas}});
    }
    trace = {{"ms_per_step", r.ms_per_step}, {"per_kernel_mean_ns", per_kernel}, {"layer_ns", layer_ns},
             {"launches", launches}};
  }

  json hf;
  if (!a.hf.empty()) {
    std::ifstream f(a.hf);
    if (f) hf = json::parse(f, nullptr, false);
  }

  // Targets from issue 5.
  json targets = json::array();
  auto target = [&](const std::string& name, double value, double limit, bool at_most, const std::string& unit) {
    const bool met = at_most ? value <= limit : value >= limit;
    targets.push_back({{"name", name}, {"measured", value}, {"target", limit}, {"unit", unit}, {"met", met},
                       {"ratio", value / limit}});
  };
  const json& d = modes["default"];
  if (d.contains("decode") && d["decode"].contains("1"))
    target("decode batch 1 ms/token", d["decode"]["1"]["ms_per_step"].get<double>(), 0.5, true, "ms");
  if (d.contains("decode") && d["decode"].contains("128"))
    target("decode batch 128 tok/s", d["decode"]["128"]["tokens_per_s"].get<double>(), 40000, false, "tok/s");
  if (d.contains("prefill") && d["prefill"].contains("4096"))
    target("prefill 4096 ms", d["prefill"]["4096"]["ms"].get<double>(), 12, true, "ms");

  json result = {
      {"benchmark", "cuda_qwen3"},
      {"date", now_utc()},
      {"commit", a.commit},
      {"machine", {{"gpu", info.name}, {"sm_count", info.sm_count}, {"memory_bytes", info.memory_bytes},
                   {"driver_version", info.driver_version}, {"cuda_runtime_version", info.runtime_version}}},
      {"model", {{"dir", a.model}, {"layers", cfg.num_layers}, {"hidden", cfg.hidden_size}, {"vocab", cfg.vocab_size},
                 {"weight_bytes", shape.weight_bytes}}},
      {"workload", {{"prompt", a.prompt}, {"gen", a.gen}, {"batches", a.batches}, {"prefill", a.prefill}}},
      {"limits", {{"d2d_copy_GBps", bw_gbps}, {"cublaslt_bf16_TFLOPs", gemm_tflops}}},
      {"modes", modes},
      {"mode_names",
       {{"default", "--no-batch-invariant: cuBLASLt projections, split-KV decode attention (results vary with the batch)"},
        {"batch_invariant", "the engine's default: fixed-order projections, one attention arithmetic per row"}}},
      {"hf_baseline", hf},
      {"graph_timing", graph_timing},
      {"profile", profile},
      {"trace", trace},
      {"targets", targets}};

  // One table.
  std::printf("\n%-34s %14s %14s %14s %12s\n", "measurement", "siesta", "invariant", "HF baseline", "floor");
  auto hfv = [&](const char* group, const std::string& key) -> double {
    if (!hf.is_object() || !hf.contains(group) || !hf[group].contains(key)) return NAN;
    return hf[group][key].get<double>();
  };
  auto mv = [&](const char* mode, const char* kind, const std::string& key, const char* field) -> double {
    if (!modes.contains(mode) || !modes[mode].contains(kind) || !modes[mode][kind].contains(key)) return NAN;
    return modes[mode][kind][key][field].get<double>();
  };
  for (int B : a.batches) {
    const std::string k = std::to_string(B);
    const double floor_tok = B / (mv("default", "decode", k, "floor_ms_per_step") * 1e-3);
    std::printf("%-34s %14.0f %14.0f %14.0f %12.0f\n", ("decode tok/s, batch " + k).c_str(),
                mv("default", "decode", k, "tokens_per_s"), mv("batch_invariant", "decode", k, "tokens_per_s"),
                hfv("transformers_generate", k), floor_tok);
  }
  for (int n : a.prefill) {
    const std::string k = std::to_string(n);
    std::printf("%-34s %14.2f %14.2f %14.2f %12.2f\n", ("prefill ms, " + k + " tokens").c_str(),
                mv("default", "prefill", k, "ms"), mv("batch_invariant", "prefill", k, "ms"), hfv("prefill_ms", k),
                mv("default", "prefill", k, "floor_ms"));
  }
  // Batch-invariant decode against the default, and with decode rows as prefill tiles (its path
  // before the invariant decode kernel), in the same run.
  for (int B : a.batches) {
    const std::string k = std::to_string(B);
    const double def = mv("default", "decode", k, "tokens_per_s");
    std::printf("decode batch %s: batch-invariant / default %.3f (decode rows as prefill tiles: %.3f)\n", k.c_str(),
                mv("batch_invariant", "decode", k, "tokens_per_s") / def,
                mv("batch_invariant_decode_as_prefill", "decode", k, "tokens_per_s") / def);
  }
  // Decode with every projection on cuBLASLt (no GEMV), in the same run.
  for (int B : a.batches) {
    const std::string k = std::to_string(B);
    if (B > 8) continue;  // larger steps take cuBLASLt anyway
    std::printf("%-34s %14.0f %14s %14s %12s\n", ("decode tok/s, batch " + k + ", cuBLASLt").c_str(),
                mv("default_decode_without_gemv", "decode", k, "tokens_per_s"), "", "", "");
  }
  // Prefill on the mma.sync attention kernel, measured in the same run (siesta column; default mode).
  for (int n : a.prefill) {
    const std::string k = std::to_string(n);
    std::printf("%-34s %14.2f %14s %14s %12.2f\n", ("prefill ms, " + k + ", mma.sync attn").c_str(),
                mv("default_prefill_mma", "prefill", k, "ms"), "", "", mv("default", "prefill", k, "floor_ms"));
  }
  for (const auto& t : targets)
    std::printf("target %-27s %14.3f %14s %14.3f %12s\n", t["name"].get<std::string>().c_str(),
                t["measured"].get<double>(), t["met"].get<bool>() ? "met" : "MISSED", t["target"].get<double>(), "");
  if (!a.out.empty()) std::ofstream(a.out) << result.dump(1) << "\n";
  return 0;
}

#else

#include <cstdio>

int main() {
  std::fprintf(stderr, "cuda_qwen3_bench: siesta was built without CUDA (nvcc not found)\n");
  return 0;
}

#endif
