// rl_rollout_bench: the RL rollout shape on one engine. Many sequences at
// once, each a random prompt and a long output (ignore EOS), as an RL trainer
// rolls out; every decode step set against its floor measured in the same run.
//
//   rl_rollout_bench --model DIR [--shape NAME] [--device cuda|cpu] [--sequences 256] [--prompt 1024]
//                    [--output 4096] [--temperature 0] [--seed 1] [--gpu-memory-utilization 0.9]
//                    [--kv-cache-memory-bytes N] [--max-num-batched-tokens 2048] [--threads N]
//                    [--allow-preemption] [--no-batch-invariant] [--lone-prompt 1024] [--lone-output 64]
//                    [--lone-repeat 3]
//                    [--bin-steps 256] [--timeout-s 3600] [--out FILE.json] [--commit SHA] [--log-level warn]
//
// The engine is made as a vLLM user would start one for this shape:
// --max-num-seqs = --sequences, --max-model-len = prompt + output, the KV
// cache from --gpu-memory-utilization (or --kv-cache-memory-bytes), prefix
// caching on, chunked prefill in steps of --max-num-batched-tokens. If the KV
// cache cannot hold every sequence whole (sequences x (prompt + output)
// tokens) the program stops and says what would fit, unless
// --allow-preemption (the scheduler then preempts and recomputes, as vLLM
// does). Sampling is greedy, or seeded per request with --temperature > 0.
//
// In one run, in this order:
//   1. the limit: device-to-device copy bandwidth (cuda::measure_copy_bandwidth,
//      as cuda_qwen3_bench; --device cpu: a host memcpy), (read + write) bytes / s,
//      and on CUDA cuBLASLt's bf16 GEMM rate (cuda::measure_bf16_gemm_tflops);
//   2. a lone request to the fresh engine (its first request: first-use costs);
//   3. the batch: --sequences requests submitted at once, run to completion:
//      wall time, output tokens/s over the run, the prefill phase (submit to
//      the last first token), and every decode step (steps with no prompt
//      tokens) from the engine's own step records (EngineOptions::step_observer):
//      its period (this step's start to the next one's: what the loop takes per
//      token), the step itself (schedule, forward, sample, update) and the
//      output processing after it; mean, p50, p99, and bins of --bin-steps;
//      each against its floor =
//        (weight bytes read + context tokens x KV bytes per token) / copy bandwidth
//      where the context tokens are the KV positions the step's attention
//      reads (sum over its sequences of start_pos + 1) and the weights read
//      leave out an untied embedding table (a decode step reads only its rows).
//      The goal: floor / period >= 0.8 on average over the run. Beside it, a
//      reference that also counts compute (floor_with_compute_ms): the KV at the
//      copy bandwidth plus the projections and LM head at the slower of their
//      weight reads and their FLOPs at cuBLASLt's bf16 rate measured in the same
//      run (the 8B shape's projections are compute-bound at 256 rows);
//   4. lone requests (--lone-prompt, --lone-output) to the now warm, idle
//      engine, --lone-repeat times: TTFT and its phases from the step
//      records: the wait from submit to the step's start (the loop's wake-up
//      and admission), the prefill step(s), the output processing and the
//      delivery to the consumer; then its first decode step and its steady
//      decode step. The goal: TTFT <= 1.5 x (prefill + one decode step).
// Prints one table; --out writes JSON (machine, date, commit, the limit).
// Exit 3 when the output token counts differ from sequences x output.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_report.h"
#include "common/log.h"
#include "engine/engine.h"
#include "engine/random.h"
#include "memory/tag.h"

#if defined(SIESTA_HAVE_CUDA)
#include "model/cuda/device_allocator.h"
#include "model/cuda/device_limits.h"
#include "model/cuda/qwen3_cuda.h"
#endif

using namespace siesta;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kFloorGoal = 0.8;  // floor / decode step, mean over the run
constexpr double kLoneGoal = 1.5;   // TTFT / (prefill + one decode step)

struct Options {
  std::string model, shape, out, commit, kv_bytes;
  std::string device = "cuda";
  std::string log_level = "warn";
  int sequences = 256, prompt = 1024, output = 4096;
  double temperature = 0.0;
  uint64_t seed = 1;
  double utilization = kDefaultGpuMemoryUtilization;
  int max_num_batched_tokens = 2048;
  size_t threads = 0;
  bool allow_preemption = false;
  bool batch_invariant = true;
  int lone_prompt = 1024, lone_output = 64, lone_repeat = 3;
  int bin_steps = 256;
  double timeout_s = 3600;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "rl_rollout_bench: %s\n"
               "usage: rl_rollout_bench --model DIR [--shape NAME] [--device cuda|cpu] [--sequences N] [--prompt N] "
               "[--output N] [--temperature T] [--seed S] [--gpu-memory-utilization F] [--kv-cache-memory-bytes N] "
               "[--max-num-batched-tokens N] [--threads N] [--allow-preemption] [--no-batch-invariant] [--lone-prompt N] [--lone-output N] "
               "[--lone-repeat N] [--bin-steps N] [--timeout-s S] [--out FILE.json] [--commit SHA] "
               "[--log-level LEVEL]\n",
               why.c_str());
  std::exit(2);
}

int positive(const std::string& flag, const std::string& v) {
  const int n = std::atoi(v.c_str());
  if (n < 1) usage(flag + " must be at least 1, got '" + v + "'");
  return n;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") o.model = next();
    else if (a == "--shape") o.shape = next();
    else if (a == "--device") o.device = next();
    else if (a == "--sequences") o.sequences = positive(a, next());
    else if (a == "--prompt") o.prompt = positive(a, next());
    else if (a == "--output") o.output = positive(a, next());
    else if (a == "--temperature") o.temperature = std::atof(next().c_str());
    else if (a == "--seed") o.seed = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--gpu-memory-utilization") o.utilization = std::atof(next().c_str());
    else if (a == "--kv-cache-memory-bytes") o.kv_bytes = next();
    else if (a == "--max-num-batched-tokens") o.max_num_batched_tokens = positive(a, next());
    else if (a == "--threads") o.threads = static_cast<size_t>(std::atoi(next().c_str()));
    else if (a == "--allow-preemption") o.allow_preemption = true;
    else if (a == "--batch-invariant") o.batch_invariant = true;
    else if (a == "--no-batch-invariant") o.batch_invariant = false;
    else if (a == "--lone-prompt") o.lone_prompt = positive(a, next());
    else if (a == "--lone-output") o.lone_output = std::max(2, positive(a, next()));
    else if (a == "--lone-repeat") o.lone_repeat = positive(a, next());
    else if (a == "--bin-steps") o.bin_steps = positive(a, next());
    else if (a == "--timeout-s") o.timeout_s = std::atof(next().c_str());
    else if (a == "--out") o.out = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--log-level") o.log_level = next();
    else usage("unknown argument " + a);
  }
  if (o.model.empty()) usage("--model is required");
  if (o.temperature < 0) usage("--temperature must be >= 0");
  return o;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "rl_rollout_bench: %s\n", what.c_str());
  std::exit(1);
}
template <class T>
T check(Result<T> r, const std::string& what) {
  if (!r) die(what + ": " + r.error().message);
  return std::move(r).value();
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Mean and percentiles of a series (ms).
json stats(std::vector<double> v) {
  if (v.empty()) return {{"count", 0}};
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) {
    const double at = p / 100.0 * static_cast<double>(v.size() - 1);
    const size_t lo = static_cast<size_t>(at);
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
  };
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return {{"count", v.size()}, {"mean", mean},     {"p50", pct(50)},
          {"p99", pct(99)},    {"min", v.front()}, {"max", v.back()}};
}
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// The engine's step records, as its loop reports them (EngineOptions::step_observer).
class StepLog {
 public:
  void add(const EngineStepRecord& r) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      records_.push_back(r);
      samples_ += r.shape.samples;
    }
    cv_.notify_all();
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return records_.size();
  }
  // The records from index `from` on, once they hold `samples` sampled
  // tokens: a step is reported after its outputs reached the stream, so the
  // last one may come a moment after the consumer saw the end.
  std::vector<EngineStepRecord> since(size_t from, int64_t samples) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] {
      int64_t n = 0;
      for (size_t i = from; i < records_.size(); ++i) n += records_[i].shape.samples;
      return n >= samples;
    });
    return {records_.begin() + static_cast<std::ptrdiff_t>(std::min(from, records_.size())), records_.end()};
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<EngineStepRecord> records_;
  int64_t samples_ = 0;
};

// The limit: (read + write) bytes per second of one large copy.
struct CopyLimit {
  double gb_per_s = 0;
  std::string what;
  double gemm_tflops = 0;  // cuBLASLt's bf16 rate (CUDA), for the reference floor with compute; 0 on the host
  json device;  // the GPU's name and SMs (CUDA)
};

CopyLimit measure_limit(Device device) {
  CopyLimit l;
  if (device == Device::kCuda) {
#if defined(SIESTA_HAVE_CUDA)
    if (!cuda_device_available()) die("--device cuda: no CUDA device (or no driver) on this machine");
    cuda::CudaMallocAllocator alloc;
    const cuda::DeviceInfo info = check(cuda::device_info(0), "reading the device's properties");
    l.device = {{"gpu", info.name},
                {"sm_count", info.sm_count},
                {"memory_bytes", info.memory_bytes},
                {"driver_version", info.driver_version},
                {"cuda_runtime_version", info.runtime_version}};
    l.gb_per_s = check(cuda::measure_copy_bandwidth(alloc), "measuring the device copy bandwidth");
    l.what =
        "device-to-device cudaMemcpyAsync of 2 GiB, median of 20, (read + write) bytes / s "
        "(cuda::measure_copy_bandwidth, as cuda_qwen3_bench)";
    l.gemm_tflops = check(cuda::measure_bf16_gemm_tflops(alloc), "measuring cuBLASLt's bf16 GEMM rate");
#else
    die("--device cuda: this build has no CUDA (nvcc was not found when it was configured)");
#endif
    return l;
  }
  // Host: memcpy of 256 MiB, pages touched first, median of 9.
  const size_t bytes = size_t{256} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::vector<double> gbs;
  for (int i = 0; i < 9; ++i) {
    const auto t = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    gbs.push_back(2.0 * static_cast<double>(bytes) / (ms_between(t, Clock::now()) * 1e-3) / 1e9);
    src[static_cast<size_t>(i)] = dst[bytes - 1 - static_cast<size_t>(i)];  // keep the copies observable
  }
  l.gb_per_s = median(gbs);
  l.what = "host memcpy of 256 MiB, median of 9, (read + write) bytes / s";
  return l;
}

// Random prompt tokens, away from the special tokens at the top of the vocabulary.
std::vector<int32_t> random_prompt(uint64_t stream, int len, int vocab) {
  const uint64_t range = static_cast<uint64_t>(std::max(64, std::min(vocab, 150000) - 100));
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (int j = 0; j < len; ++j) p[static_cast<size_t>(j)] = static_cast<int32_t>(request_draw(stream, j) % range) + 50;
  return p;
}

EngineRequest make_request(const std::string& id, std::vector<int32_t> prompt, int max_tokens, const Options& o,
                           uint64_t seed) {
  EngineRequest r;
  r.id = id;
  r.prompt_tokens = std::move(prompt);
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.temperature = o.temperature;
  if (o.temperature > 0) r.params.seed = seed;
  return r;
}

// What the consumer of a submission saw.
struct Received {
  std::vector<int64_t> tokens;                 // per request
  std::vector<Clock::time_point> first_token;  // per request
  std::vector<Clock::time_point> finished;     // per request
  std::vector<Clock::time_point> token_times;  // request 0's tokens (lone requests)
  Clock::time_point submitted, done;
};

Received run(Engine& e, std::vector<EngineRequest> reqs, double timeout_s, const std::string& what) {
  const size_t n = reqs.size();
  Received r;
  r.tokens.assign(n, 0);
  r.first_token.assign(n, {});
  r.finished.assign(n, {});
  r.submitted = Clock::now();
  OutputStream s = check(e.submit(std::move(reqs)), "submitting " + what);
  const auto end = r.submitted + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (!s.finished() && Clock::now() < end) {
    for (IndexedDelta& d : s.next(Clock::now() + std::chrono::milliseconds(100))) {
      const auto now = Clock::now();
      if (d.delta.finish && d.delta.finish->error)
        die(what + ": request " + std::to_string(d.index) + ": " + d.delta.finish->error->message);
      if (!d.delta.token_ids.empty()) {
        if (r.tokens[d.index] == 0) r.first_token[d.index] = now;
        r.tokens[d.index] += static_cast<int64_t>(d.delta.token_ids.size());
        if (n == 1) r.token_times.insert(r.token_times.end(), d.delta.token_ids.size(), now);
      }
      if (d.delta.finish) r.finished[d.index] = now;
    }
  }
  if (!s.finished()) die(what + ": not finished after " + fmt::format("{:.0f}", timeout_s) + " s (--timeout-s)");
  r.done = Clock::now();
  return r;
}

// Sizes the floor needs.
struct Bytes {
  double weights = 0;       // the pool's weights
  double weights_read = 0;  // ... that a decode step reads (an untied embedding table left out)
  double kv_per_token = 0;  // K and V of every layer
  double matmul_params = 0;  // the projections' and the LM head's weights: 2 FLOPs each per decode row
};

double floor_ms(const Bytes& b, const StepShape& s, double gb_per_s) {
  return (b.weights_read + static_cast<double>(s.context_tokens) * b.kv_per_token) / (gb_per_s * 1e9) * 1e3;
}

// A reference beside the goal's floor: the KV read at the copy bandwidth plus the
// projections at the slower of their weight reads and their FLOPs at cuBLASLt's
// measured rate (at a few hundred rows they are compute-bound, which floor_ms does
// not count). 0 without a GEMM rate (the host).
double floor_with_compute_ms(const Bytes& b, const StepShape& s, const CopyLimit& l) {
  if (l.gemm_tflops <= 0) return 0.0;
  const double weights_ms = b.weights_read / (l.gb_per_s * 1e9) * 1e3;
  const double flops_ms = 2.0 * b.matmul_params * s.decodes / (l.gemm_tflops * 1e12) * 1e3;
  return static_cast<double>(s.context_tokens) * b.kv_per_token / (l.gb_per_s * 1e9) * 1e3 +
         std::max(weights_ms, flops_ms);
}

// One lone request: TTFT and where it went, from the client's clock and the step records.
json lone_request(Engine& e, StepLog& log, const Options& o, const Bytes& b, double gb_per_s, uint64_t stream,
                  const std::string& label) {
  const int vocab = e.model_config().vocab_size;
  std::vector<EngineRequest> reqs;
  reqs.push_back(make_request(label, random_prompt(stream, o.lone_prompt, vocab), o.lone_output, o, stream));
  const size_t from = log.size();
  const Received got = run(e, std::move(reqs), 600, "the lone request " + label);
  const std::vector<EngineStepRecord> steps = log.since(from, o.lone_output);
  if (got.tokens[0] != o.lone_output)
    die(fmt::format("the lone request {} got {} tokens, asked for {}", label, got.tokens[0], o.lone_output));
  // The prefill: the steps with prompt tokens, up to the one that sampled the first token.
  size_t first_decode = 0;
  double prefill_ms = 0;
  int prefill_steps = 0;
  while (first_decode < steps.size() && steps[first_decode].shape.prefill_tokens > 0) {
    prefill_ms += ms_between(steps[first_decode].start, steps[first_decode].computed);
    ++prefill_steps;
    ++first_decode;
  }
  if (prefill_steps == 0 || first_decode >= steps.size()) die("the lone request " + label + ": no prefill step seen");
  const EngineStepRecord& pre_first = steps.front();
  const EngineStepRecord& pre_last = steps[first_decode - 1];
  std::vector<double> decode_periods;
  for (size_t i = first_decode + 1; i + 1 < steps.size(); ++i)
    decode_periods.push_back(ms_between(steps[i].start, steps[i + 1].start));
  const EngineStepRecord& d1 = steps[first_decode];
  const double first_decode_ms = ms_between(d1.start, d1.computed);
  const double decode_step_ms = decode_periods.empty() ? first_decode_ms : median(decode_periods);
  const double ttft = ms_between(got.submitted, got.first_token[0]);
  std::vector<double> itl;
  for (size_t i = 1; i < got.token_times.size(); ++i)
    itl.push_back(ms_between(got.token_times[i - 1], got.token_times[i]));
  const double ratio = ttft / (prefill_ms + decode_step_ms);
  json j = {{"label", label},
            {"prompt_tokens", o.lone_prompt},
            {"output_tokens", got.tokens[0]},
            {"ttft_ms", ttft},
            {"phases_ms",
             {{"submit_to_step_start", ms_between(got.submitted, pre_first.start)},
              {"prefill_steps", prefill_ms},
              {"between_prefill_steps", ms_between(pre_first.start, pre_last.computed) - prefill_ms},
              {"step_end_to_consumer", ms_between(pre_last.computed, got.first_token[0])}}},
            {"output_processing_ms", ms_between(pre_last.computed, pre_last.delivered)},
            {"prefill_ms", prefill_ms},
            {"prefill_step_count", prefill_steps},
            {"first_decode_step_ms", first_decode_ms},
            {"first_decode_step_floor_ms", floor_ms(b, d1.shape, gb_per_s)},
            {"decode_step_ms", decode_step_ms},
            {"itl_ms", stats(itl)},
            {"e2e_ms", ms_between(got.submitted, got.finished[0])},
            {"ttft_over_prefill_plus_decode_step", ratio},
            {"goal", kLoneGoal},
            {"goal_met", ratio <= kLoneGoal}};
  std::fprintf(stderr,
               "lone %-6s: TTFT %.2f ms = submit->step %.2f + prefill %.2f (%d steps) + step end->consumer %.2f; "
               "first decode step %.2f ms, then %.3f ms; ratio %.2f\n",
               label.c_str(), ttft, j["phases_ms"]["submit_to_step_start"].get<double>(), prefill_ms, prefill_steps,
               j["phases_ms"]["step_end_to_consumer"].get<double>(), first_decode_ms, decode_step_ms, ratio);
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  init_logging(o.log_level);
  const Device device = check(parse_device(o.device), "--device");

  // 1. The limit, before the engine takes its memory.
  const CopyLimit limit = measure_limit(device);
  std::fprintf(stderr, "limit: %s: %.0f GB/s; cuBLASLt bf16 %.0f TFLOP/s\n", limit.what.c_str(), limit.gb_per_s,
               limit.gemm_tflops);

  // 2. The engine, as a vLLM user would start it for this shape.
  StepLog log;
  EngineOptions eo;
  eo.model_dir = o.model;
  eo.device = device;
  eo.threads = o.threads;
  eo.max_num_seqs = o.sequences;
  eo.max_model_len = o.prompt + o.output;
  eo.max_num_batched_tokens = o.max_num_batched_tokens;
  eo.gpu_memory_utilization = o.utilization;
  if (!o.kv_bytes.empty()) eo.kv_cache_memory_bytes = static_cast<uint64_t>(std::strtod(o.kv_bytes.c_str(), nullptr));
  eo.seed = o.seed;
  eo.batch_invariant = o.batch_invariant;
  eo.step_observer = [&log](const EngineStepRecord& r) { log.add(r); };
  auto t = Clock::now();
  std::unique_ptr<Engine> engine = check(Engine::create(eo), "creating the engine");
  const double create_ms = ms_between(t, Clock::now());
  Engine& e = *engine;
  const ModelConfig& cfg = e.model_config();
  const EngineLimits& lim = e.limits();
  const EngineMemoryReport mem = e.memory_report(Clock::now() + std::chrono::seconds(30));

  Bytes b;
  b.weights = static_cast<double>(mem.pool[memory::Tag::kWeights].total_bytes());
  b.kv_per_token = static_cast<double>(lim.kv_cache_bytes) / (static_cast<double>(lim.num_kv_blocks) * lim.block_size);
  const double elem_bytes = b.kv_per_token / (2.0 * cfg.num_layers * cfg.kv_dim());
  b.weights_read =
      b.weights - (cfg.tie_word_embeddings ? 0.0 : static_cast<double>(cfg.vocab_size) * cfg.hidden_size * elem_bytes);
  b.matmul_params = static_cast<double>(cfg.num_layers) * cfg.hidden_size *
                        (cfg.q_dim() + 2.0 * cfg.kv_dim() + cfg.q_dim() + 3.0 * cfg.intermediate_size) +
                    static_cast<double>(cfg.vocab_size) * cfg.hidden_size;
  std::fprintf(stderr,
               "engine: %s, created in %.0f ms; weights %.2f GiB, KV cache %.2f GiB (%d blocks, %.0f B/token)\n",
               mem.backend_description.c_str(), create_ms, b.weights / kGiB,
               static_cast<double>(lim.kv_cache_bytes) / kGiB, lim.num_kv_blocks, b.kv_per_token);

  // Every sequence whole in the KV cache, or a clear stop.
  const int64_t blocks_per_seq = (o.prompt + o.output + lim.block_size - 1) / lim.block_size;
  const int64_t blocks_needed = blocks_per_seq * o.sequences;
  const double need_bytes = static_cast<double>(blocks_needed) * lim.block_size * b.kv_per_token;
  if (blocks_needed > lim.num_kv_blocks) {
    const int64_t fit_output = static_cast<int64_t>(lim.num_kv_blocks) / o.sequences * lim.block_size - o.prompt;
    const int64_t fit_seqs = static_cast<int64_t>(lim.num_kv_blocks) / blocks_per_seq;
    std::string msg = fmt::format(
        "the KV cache holds {} tokens ({}: {} blocks of {}), but {} sequences of {} + {} tokens need {} ({} at {:.0f} "
        "bytes per token)",
        static_cast<int64_t>(lim.num_kv_blocks) * lim.block_size, memory::format_bytes(lim.kv_cache_bytes),
        lim.num_kv_blocks, lim.block_size, o.sequences, o.prompt, o.output, blocks_needed * lim.block_size,
        memory::format_bytes(static_cast<uint64_t>(need_bytes)), b.kv_per_token);
    if (device == Device::kCuda && mem.device && need_bytes + b.weights > static_cast<double>(mem.device->total_bytes))
      msg += fmt::format(
          "; with the weights that is more than the whole device ({}), so no "
          "--gpu-memory-utilization fits",
          memory::format_bytes(mem.device->total_bytes));
    else msg += "; raise --gpu-memory-utilization or --kv-cache-memory-bytes";
    msg += ". What fits this cache: ";
    msg += fit_output > 0 ? fmt::format("--output {} for {} sequences, or ", fit_output, o.sequences) : "";
    msg += fmt::format("--sequences {} of {} + {}", fit_seqs, o.prompt, o.output);
    if (!o.allow_preemption) die(msg + " (or --allow-preemption: the scheduler then preempts and recomputes)");
    std::fprintf(stderr, "rl_rollout_bench: %s; running anyway (--allow-preemption)\n", msg.c_str());
  }

  // 3. A lone request to the fresh engine: its first request.
  json fresh = lone_request(e, log, o, b, limit.gb_per_s, 900001, "fresh");

  // 4. The batch: every sequence at once.
  std::vector<EngineRequest> reqs;
  reqs.reserve(static_cast<size_t>(o.sequences));
  for (int i = 0; i < o.sequences; ++i)
    reqs.push_back(make_request(fmt::format("rollout{}", i),
                                random_prompt(1000 + static_cast<uint64_t>(i), o.prompt, cfg.vocab_size), o.output, o,
                                o.seed * 1000003 + static_cast<uint64_t>(i)));
  const EngineMetricsSnapshot before = e.metrics();
  const size_t from = log.size();
  std::fprintf(stderr, "batch: %d sequences of %d + %d tokens...\n", o.sequences, o.prompt, o.output);
  const Received got = run(e, std::move(reqs), o.timeout_s, "the batch");
  const int64_t expected = static_cast<int64_t>(o.sequences) * o.output;
  const int64_t out_tokens = std::accumulate(got.tokens.begin(), got.tokens.end(), int64_t{0});
  const std::vector<EngineStepRecord> steps = log.since(from, out_tokens);
  const EngineMetricsSnapshot after = e.metrics();
  const double wall_s = ms_between(got.submitted, got.done) * 1e-3;
  const auto last_first = *std::max_element(got.first_token.begin(), got.first_token.end());
  std::vector<double> ttfts;
  for (const auto& ft : got.first_token) ttfts.push_back(ms_between(got.submitted, ft));

  // The prefill phase: the steps with prompt tokens (chunked prefill mixes decodes in).
  int prefill_phase_steps = 0;
  int64_t prefill_tokens = 0;
  for (const EngineStepRecord& s : steps)
    if (s.shape.prefill_tokens > 0) {
      ++prefill_phase_steps;
      prefill_tokens += s.shape.prefill_tokens;
    }
  // Decode steps: no prompt tokens. Period: to the next step's start (the last: to its delivery).
  struct DecodeStep {
    double period, step, output, floor, floor_c;
    int32_t seqs;
    int64_t context;
  };
  std::vector<DecodeStep> ds;
  for (size_t i = 0; i < steps.size(); ++i) {
    const EngineStepRecord& s = steps[i];
    if (s.shape.prefill_tokens > 0 || s.shape.decodes == 0) continue;
    const auto end = i + 1 < steps.size() ? steps[i + 1].start : s.delivered;
    ds.push_back({ms_between(s.start, end), ms_between(s.start, s.computed), ms_between(s.computed, s.delivered),
                  floor_ms(b, s.shape, limit.gb_per_s), floor_with_compute_ms(b, s.shape, limit), s.shape.decodes,
                  s.shape.context_tokens});
  }
  std::vector<double> periods, step_ms, output_ms, floors, ratios, floors_c, ratios_c;
  double sum_period = 0, sum_floor = 0;
  int64_t decode_tokens = 0;
  for (const DecodeStep& d : ds) {
    periods.push_back(d.period);
    step_ms.push_back(d.step);
    output_ms.push_back(d.output);
    floors.push_back(d.floor);
    ratios.push_back(d.floor / d.period);
    floors_c.push_back(d.floor_c);
    ratios_c.push_back(d.floor_c / d.period);
    sum_period += d.period;
    sum_floor += d.floor;
    decode_tokens += d.seqs;
  }
  const double ratio_mean =
      ratios.empty() ? 0.0 : std::accumulate(ratios.begin(), ratios.end(), 0.0) / static_cast<double>(ratios.size());
  const double ratio_c_mean =
      ratios_c.empty() ? 0.0
                       : std::accumulate(ratios_c.begin(), ratios_c.end(), 0.0) / static_cast<double>(ratios_c.size());
  json bins = json::array();
  for (size_t at = 0; at < ds.size(); at += static_cast<size_t>(o.bin_steps)) {
    const size_t end = std::min(ds.size(), at + static_cast<size_t>(o.bin_steps));
    double p = 0, st = 0, f = 0, fc = 0, ctx = 0, seqs = 0;
    for (size_t i = at; i < end; ++i) {
      p += ds[i].period;
      st += ds[i].step;
      f += ds[i].floor;
      fc += ds[i].floor_c;
      ctx += static_cast<double>(ds[i].context);
      seqs += ds[i].seqs;
    }
    const double n = static_cast<double>(end - at);
    bins.push_back({{"first_step", at},
                    {"steps", end - at},
                    {"period_ms", p / n},
                    {"step_ms", st / n},
                    {"floor_ms", f / n},
                    {"floor_ratio", f / p},
                    {"floor_with_compute_ms", fc / n},
                    {"sequences", seqs / n},
                    {"context_per_sequence", seqs > 0 ? ctx / seqs : 0.0}});
  }
  const json decode = {
      {"steps", ds.size()},
      {"tokens", decode_tokens},
      {"tokens_per_s", sum_period > 0 ? static_cast<double>(decode_tokens) / (sum_period * 1e-3) : 0.0},
      {"period_ms", stats(periods)},
      {"step_ms", stats(step_ms)},
      {"output_processing_ms", stats(output_ms)},
      {"floor_ms", stats(floors)},
      {"floor_ratio_mean", ratio_mean},
      {"floor_ratio_total", sum_period > 0 ? sum_floor / sum_period : 0.0},
      {"floor_with_compute_ms", stats(floors_c)},
      {"floor_with_compute_ratio_mean", ratio_c_mean},
      {"goal", kFloorGoal},
      {"goal_met", ratio_mean >= kFloorGoal}};

  // 5. Lone requests to the warm, idle engine.
  json warm = json::array();
  std::vector<double> warm_ttft, warm_ratio;
  for (int i = 0; i < o.lone_repeat; ++i) {
    warm.push_back(
        lone_request(e, log, o, b, limit.gb_per_s, 900100 + static_cast<uint64_t>(i), fmt::format("warm{}", i + 1)));
    warm_ttft.push_back(warm.back()["ttft_ms"].get<double>());
    warm_ratio.push_back(warm.back()["ttft_over_prefill_plus_decode_step"].get<double>());
  }
  const double warm_ratio_median = median(warm_ratio);
  // The fresh request's compute is the warm requests' (same shapes): its TTFT
  // against their prefill + decode step, which is what the goal asks of a
  // lone request; against its own (first-use) prefill time it would always pass.
  std::vector<double> warm_compute;
  for (const json& l : warm) warm_compute.push_back(l["prefill_ms"].get<double>() + l["decode_step_ms"].get<double>());
  const double fresh_ratio = warm_compute.empty() ? 0.0 : fresh["ttft_ms"].get<double>() / median(warm_compute);
  if (!warm_compute.empty()) {
    fresh["ttft_over_warm_prefill_plus_decode_step"] = fresh_ratio;
    fresh["goal_met"] = fresh_ratio <= kLoneGoal;
  }

  // The table.
  const std::string commit = !o.commit.empty()              ? o.commit
                             : std::getenv("SIESTA_COMMIT") ? std::getenv("SIESTA_COMMIT")
                                                            : bench::run_command("git rev-parse HEAD 2>/dev/null");
  const double tok_s = static_cast<double>(out_tokens) / wall_s;
  std::printf("RL rollout, %s, model %s (%s): %d sequences x (%d prompt + %d output), %s\n", o.device.c_str(),
              o.model.c_str(), o.shape.empty() ? "?" : o.shape.c_str(), o.sequences, o.prompt, o.output,
              o.temperature > 0 ? fmt::format("temperature {}, seeded", o.temperature).c_str() : "greedy");
  std::printf("limit: %.0f GB/s copy; weights read per step %.2f GB, KV %.0f B/token\n", limit.gb_per_s,
              b.weights_read / 1e9, b.kv_per_token);
  std::printf("%-40s %14s  %s\n", "figure", "measured", "notes");
  auto row = [](const std::string& name, const std::string& v, const std::string& note) {
    std::printf("%-40s %14s  %s\n", name.c_str(), v.c_str(), note.c_str());
  };
  row("wall time", fmt::format("{:.2f} s", wall_s),
      fmt::format("{} output tokens of {} expected", out_tokens, expected));
  row("output tokens/s over the run", fmt::format("{:.0f}", tok_s), "");
  row("prefill phase (submit to last 1st token)", fmt::format("{:.0f} ms", ms_between(got.submitted, last_first)),
      fmt::format("{} steps with prompt tokens, {} prompt tokens", prefill_phase_steps, prefill_tokens));
  row("decode tokens/s (decode steps)", fmt::format("{:.0f}", decode["tokens_per_s"].get<double>()),
      fmt::format("{} steps", ds.size()));
  if (!ds.empty()) {
    row("decode step period mean / p50 / p99", fmt::format("{:.2f} ms", decode["period_ms"]["mean"].get<double>()),
        fmt::format("{:.2f} / {:.2f} ms; step alone {:.2f} ms, output processing {:.2f} ms",
                    decode["period_ms"]["p50"].get<double>(), decode["period_ms"]["p99"].get<double>(),
                    decode["step_ms"]["mean"].get<double>(), decode["output_processing_ms"]["mean"].get<double>()));
    row("floor per decode step (mean)", fmt::format("{:.2f} ms", decode["floor_ms"]["mean"].get<double>()),
        "(weights read + KV read) / copy bandwidth");
    row("floor / period, mean over the run", fmt::format("{:.3f}", ratio_mean),
        fmt::format("goal >= {}: {}; time-weighted {:.3f}", kFloorGoal, ratio_mean >= kFloorGoal ? "met" : "MISSED",
                    decode["floor_ratio_total"].get<double>()));
    if (limit.gemm_tflops > 0)
      row("floor with compute / period, mean", fmt::format("{:.3f}", ratio_c_mean),
          fmt::format("reference, not the goal: KV / copy bandwidth + max(weights / copy bandwidth, projection FLOPs "
                      "at cuBLASLt's {:.0f} TFLOP/s); {:.2f} ms per step (mean)",
                      limit.gemm_tflops, decode["floor_with_compute_ms"]["mean"].get<double>()));
  }
  for (const json& bin : bins)
    row(fmt::format("  steps {}-{}", bin["first_step"].get<size_t>(),
                    bin["first_step"].get<size_t>() + bin["steps"].get<size_t>() - 1),
        fmt::format("{:.2f} ms", bin["period_ms"].get<double>()),
        fmt::format("floor {:.2f} ms ({:.2f}), context {:.0f}", bin["floor_ms"].get<double>(),
                    bin["floor_ratio"].get<double>(), bin["context_per_sequence"].get<double>()));
  row("preemptions", std::to_string(after.num_preemptions - before.num_preemptions), "");
  auto lone_row = [&](const json& l) {
    row("lone request " + l["label"].get<std::string>() + " TTFT", fmt::format("{:.2f} ms", l["ttft_ms"].get<double>()),
        fmt::format("prefill {:.2f} ms, decode step {:.3f} ms: ratio {:.2f} (goal <= {})",
                    l["prefill_ms"].get<double>(), l["decode_step_ms"].get<double>(),
                    l["ttft_over_prefill_plus_decode_step"].get<double>(), kLoneGoal));
  };
  lone_row(fresh);
  if (!warm_compute.empty())
    row("lone request fresh TTFT / warm compute", fmt::format("{:.2f}", fresh_ratio),
        fmt::format("the warm requests' prefill + decode step {:.2f} ms (goal <= {}: {})", median(warm_compute),
                    kLoneGoal, fresh_ratio <= kLoneGoal ? "met" : "MISSED"));
  for (const json& l : warm) lone_row(l);

  bool ok = out_tokens == expected;
  for (int64_t n : got.tokens) ok &= n == o.output;
  if (!ok) std::printf("OUTPUT TOKEN COUNTS DIFFER from %d per sequence\n", o.output);

  if (!o.out.empty()) {
    json machine = bench::machine();
    for (auto it = limit.device.begin(); it != limit.device.end(); ++it) machine[it.key()] = it.value();
    auto histogram_mean = [](const Histogram& a, const Histogram& z) {
      return z.count > a.count ? (z.sum - a.sum) / static_cast<double>(z.count - a.count) * 1e3 : 0.0;
    };
    const json doc = {
        {"benchmark", "rl_rollout"},
        {"device", o.device},
        {"backend_description", mem.backend_description},
        {"machine", machine},
        {"date", bench::utc_now()},
        {"commit", commit.empty() ? "unknown" : commit},
        {"model",
         {{"dir", o.model},
          {"shape", o.shape},
          {"layers", cfg.num_layers},
          {"hidden_size", cfg.hidden_size},
          {"kv_heads", cfg.num_kv_heads},
          {"head_dim", cfg.head_dim},
          {"vocab_size", cfg.vocab_size},
          {"tie_word_embeddings", cfg.tie_word_embeddings},
          {"weights_bytes", b.weights},
          {"weights_read_per_decode_step_bytes", b.weights_read},
          {"kv_bytes_per_token", b.kv_per_token}}},
        {"engine",
         {{"create_ms", create_ms},
          {"max_num_seqs", lim.max_num_seqs},
          {"max_model_len", lim.max_model_len},
          {"max_num_batched_tokens", lim.max_num_batched_tokens},
          {"num_kv_blocks", lim.num_kv_blocks},
          {"kv_cache_bytes", lim.kv_cache_bytes},
          {"kv_cache_tokens", static_cast<int64_t>(lim.num_kv_blocks) * lim.block_size},
          {"gpu_memory_utilization", o.utilization},
          {"kv_cache_memory_bytes_flag", o.kv_bytes},
          {"prefix_caching", lim.enable_prefix_caching}}},
        {"workload",
         {{"sequences", o.sequences},
          {"prompt", o.prompt},
          {"output", o.output},
          {"temperature", o.temperature},
          {"seed", o.seed},
          {"ignore_eos", true},
          {"kv_tokens_needed", blocks_needed * lim.block_size},
          {"allow_preemption", o.allow_preemption},
          {"batch_invariant", o.batch_invariant}}},
        {"limit",
         {{"what", limit.what},
          {"copy_gb_per_s", limit.gb_per_s},
          {"gemm_tflops", limit.gemm_tflops},
          {"gemm_what", "cuBLASLt bf16 GEMM 8192^3, random data (cuda::measure_bf16_gemm_tflops)"}}},
        {"batch",
         {{"wall_s", wall_s},
          {"output_tokens", out_tokens},
          {"expected_output_tokens", expected},
          {"output_tokens_per_s", tok_s},
          {"prefill_phase",
           {{"ms", ms_between(got.submitted, last_first)},
            {"steps", prefill_phase_steps},
            {"prompt_tokens", prefill_tokens},
            {"ttft_ms", stats(ttfts)}}},
          {"decode", decode},
          {"bins", bins},
          {"bin_steps", o.bin_steps},
          {"steps", steps.size()},
          {"preemptions", after.num_preemptions - before.num_preemptions},
          {"engine_metrics",
           {{"generation_tokens", after.generation_tokens - before.generation_tokens},
            {"mean_ttft_ms", histogram_mean(before.time_to_first_token, after.time_to_first_token)},
            {"mean_itl_ms", histogram_mean(before.inter_token_latency, after.inter_token_latency)}}}}},
        {"lone",
         {{"prompt", o.lone_prompt},
          {"output", o.lone_output},
          {"fresh", fresh},
          {"warm", warm},
          {"warm_median_ttft_ms", median(warm_ttft)},
          {"warm_median_ratio", warm_ratio_median},
          {"fresh_ratio_to_warm_compute", fresh_ratio},
          {"goal", kLoneGoal},
          {"goal_met", warm_ratio_median <= kLoneGoal && (warm_compute.empty() || fresh_ratio <= kLoneGoal)}}},
        {"outputs_complete", ok},
        {"columns",
         {{"period_ms", "a decode step's start to the next step's start: what the engine loop takes per token"},
          {"step_ms", "run_step alone: schedule, forward, sampling, Scheduler::update"},
          {"output_processing_ms", "after run_step: detokenization, stop checks, deltas pushed to the streams"},
          {"floor_ms",
           "(weights read + sum of start_pos + 1 over the step's sequences x KV bytes per token) / copy "
           "bandwidth"},
          {"floor_ratio_mean", "mean over the decode steps of floor_ms / period_ms (the goal)"},
          {"floor_with_compute_ms",
           "a reference, not the goal: the KV read at the copy bandwidth + the larger of the weights read at "
           "the copy bandwidth and the projections' and LM head's FLOPs (2 per weight per decode row) at "
           "cuBLASLt's measured bf16 rate"},
          {"phases_ms",
           "a lone request's TTFT, whole: submit to the step's start (loop wake-up, admission), the "
           "prefill step(s) (schedule, forward, sampling, update), the gaps between them, and the end of "
           "the last to the consumer's next() returning the token (output processing, stream push, "
           "wake-up)"}}},
    };
    std::ofstream out(o.out);
    out << doc.dump(2) << "\n";
    if (!out) die("cannot write " + o.out);
    std::fprintf(stderr, "wrote %s\n", o.out.c_str());
  }
  return ok ? 0 : 3;
}
