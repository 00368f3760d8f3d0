// engine_sleep_bench: sleep and wake of a whole engine, as an RL trainer or an
// operator parking an instance sees them.
//
//   engine_sleep_bench --model DIR [--device cuda|cpu] [--levels 1,2] [--repeat 3]
//                      [--prompts 8] [--max-tokens 32] [--gpu-memory-utilization 0.9]
//                      [--kv-cache-memory-bytes N] [--no-batch-invariant] [--shape NAME]
//                      [--asleep-s S] [--restore-copy kernel|copy_engine]
//                      [--out FILE.json] [--commit SHA] [--log-level info]
//
// One engine (sleep mode on, prefix caching off so every run computes the
// same chunks) serves a fixed greedy prompt set; that output is the baseline.
// Then, --repeat times per level:
//   level 1: sleep(1) (weights copied to host, everything released), wake_up(all)
//   level 2: sleep(2) (everything released), wake_up(weights), reload_weights
//            (the checkpoint read again), wake_up(kv_cache, scratch)
// and after each wake the prompt set runs again and must give the baseline's
// tokens. --asleep-s S keeps the engine asleep S seconds between the sleep and
// the wake, as an RL trainer's training step does (default 0: wake at once).
// --restore-copy says what copies the weights host->device at wake and
// reload (memory/host_to_device_copy.h: the SMs, or the copy engines); it
// sets SIESTA_HOST_TO_DEVICE_COPY for the engine, and the JSON records it.
// Device memory (cuMemGetInfo; host: MemAvailable) is read awake, asleep and
// after wake. The limits measured in the same run: host<->device
// copy bandwidth through pinned memory (cuMemcpy, what an offload can reach),
// the time to pin host memory, and the host->device rate of a restore from a
// kept, pinned buffer by each HostToDeviceCopy (idle: nothing released or
// mapped just before). From them and the level-2 cycles (which
// only unmap and map):
//   level 1 sleep limit = weights / pinned D->H bandwidth + level-2 sleep (unmapping)
//   level 1 wake limit  = weights / pinned H->D bandwidth + level-2 wake_up(weights) + wake_up(kv_cache) (mapping)
//   reload limit        = checkpoint bytes / pinned H->D bandwidth
// each cycle's time against its limit (the goals: sleep and wake <= 1.3x,
// reload at >= 50% of the bandwidth). The first level-1 sleep allocates the
// host buffer the weights go to (the engine keeps it, pinned in the
// background: EngineOptions::keep_offload_buffers); after it the benchmark
// waits (--settle-s) until the buffer is pinned, and reports the first cycle
// apart. Prints one table; --out writes JSON.
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_report.h"
#include "common/log.h"
#include "engine/engine.h"
#include "engine/random.h"
#include "memory/cuda_backend.h"
#include "memory/host_to_device_copy.h"
#include "memory/memory_pool.h"

using namespace siesta;
using Clock = std::chrono::steady_clock;
using memory::Tag;
using memory::TagSet;

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

struct Options {
  std::string model, out, commit, shape, kv_bytes;
  std::string device = "cuda";
  std::string log_level = "warn";
  std::vector<int> levels = {1, 2};
  int repeat = 3;
  int prompts = 8;
  int max_tokens = 32;
  double utilization = kDefaultGpuMemoryUtilization;
  bool batch_invariant = true;
  bool keep_offload_buffers = true;
  double settle_s = 120;
  double asleep_s = 0;
  std::string restore_copy;  // empty: SIESTA_HOST_TO_DEVICE_COPY as set, else the kernel
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "engine_sleep_bench: %s\n"
               "usage: engine_sleep_bench --model DIR [--device cuda|cpu] [--levels 1,2] [--repeat N] [--prompts N] "
               "[--max-tokens N] [--gpu-memory-utilization F] [--kv-cache-memory-bytes N] [--no-batch-invariant] "
               "[--no-keep-offload-buffers] [--settle-s S] [--asleep-s S] [--restore-copy kernel|copy_engine] "
               "[--shape NAME] [--out FILE.json] [--commit SHA] [--log-level LEVEL]\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") o.model = next();
    else if (a == "--device") o.device = next();
    else if (a == "--levels") {
      o.levels.clear();
      for (char c : next())
        if (c == '1' || c == '2') o.levels.push_back(c - '0');
    } else if (a == "--repeat") o.repeat = std::max(1, std::atoi(next().c_str()));
    else if (a == "--prompts") o.prompts = std::max(1, std::atoi(next().c_str()));
    else if (a == "--max-tokens") o.max_tokens = std::max(1, std::atoi(next().c_str()));
    else if (a == "--gpu-memory-utilization") o.utilization = std::atof(next().c_str());
    else if (a == "--kv-cache-memory-bytes") o.kv_bytes = next();
    else if (a == "--batch-invariant") o.batch_invariant = true;
    else if (a == "--no-batch-invariant") o.batch_invariant = false;
    else if (a == "--no-keep-offload-buffers") o.keep_offload_buffers = false;
    else if (a == "--settle-s") o.settle_s = std::atof(next().c_str());
    else if (a == "--asleep-s") o.asleep_s = std::max(0.0, std::atof(next().c_str()));
    else if (a == "--restore-copy") o.restore_copy = next();
    else if (a == "--shape") o.shape = next();
    else if (a == "--out") o.out = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--log-level") o.log_level = next();
    else usage("unknown argument " + a);
  }
  if (o.model.empty()) usage("--model is required");
  if (o.levels.empty()) usage("--levels: 1, 2 or 1,2");
  if (!o.restore_copy.empty()) {
    Result<memory::HostToDeviceCopy> r = memory::parse_host_to_device_copy(o.restore_copy);
    if (!r) usage("--restore-copy: " + r.error().message);
  }
  return o;
}

[[noreturn]] void die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "engine_sleep_bench: %s: %s\n", what.c_str(), s.message.c_str());
  std::exit(1);
}
template <class T>
T check(Result<T> r, const std::string& what) {
  if (!r) die(what, r.error());
  return std::move(r).value();
}

void check(Result<void> r, const std::string& what) {
  if (!r) die(what, r.error());
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}
double gib(uint64_t b) { return static_cast<double>(b) / static_cast<double>(kGiB); }
double gib(int64_t b) { return static_cast<double>(b) / static_cast<double>(kGiB); }

using bench::machine;
using bench::run_command;
using bench::utc_now;

Deadline later() { return Clock::now() + std::chrono::minutes(10); }

// The fixed prompt set: lengths 24..24+20*(n-1) tokens of ids drawn from a
// fixed stream, away from the special tokens at the top of the vocabulary.
std::vector<std::vector<int32_t>> prompt_set(int n, int vocab) {
  std::vector<std::vector<int32_t>> out;
  const uint64_t range = static_cast<uint64_t>(std::max(64, std::min(vocab, 150000) - 100));
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j < 24 + 20 * i; ++j) p.push_back(static_cast<int32_t>(request_draw(1000 + i, j) % range) + 100);
    out.push_back(std::move(p));
  }
  return out;
}

struct RunResult {
  std::vector<std::vector<int32_t>> tokens;
  double ms = 0;
};

RunResult run_prompts(Engine& e, const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  static int round = 0;
  ++round;
  std::vector<EngineRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.id = fmt::format("bench{}_{}", round, i);
    r.prompt_tokens = prompts[i];
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.temperature = 0.0;
    reqs.push_back(std::move(r));
  }
  const auto t = Clock::now();
  OutputStream s = check(e.submit(std::move(reqs)), "submitting the prompt set");
  RunResult out;
  out.tokens.resize(s.size());
  const auto end = Clock::now() + std::chrono::minutes(5);
  while (!s.finished() && Clock::now() < end)
    for (IndexedDelta& d : s.next(Clock::now() + std::chrono::milliseconds(100))) {
      if (d.delta.finish && d.delta.finish->error) die("a request of the prompt set", *d.delta.finish->error);
      out.tokens[d.index].insert(out.tokens[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
    }
  if (!s.finished()) die("the prompt set", timeout("did not finish in 5 minutes"));
  out.ms = ms_since(t);
  return out;
}

struct Gauge {
  uint64_t free = 0, total = 0;
  uint64_t used() const { return total - free; }
};

Gauge device_memory(Engine& e) {
  EngineMemoryReport r = e.memory_report(later());
  if (!r.device) die("reading device memory", unavailable("the engine reported no device memory"));
  return Gauge{r.device->free_bytes, r.device->total_bytes};
}

// Pinned host <-> device copies, and pinning itself, measured with a pool of
// its own (OffloadMode::kPinned): the ceiling of an offload's copy.
nlohmann::json measure_copy_limit(uint64_t bytes) {
  auto backend = memory::make_cuda_backend({.device = 0, .offload = memory::OffloadMode::kPinned});
  if (!backend) return {{"error", backend.error().message}};
  memory::MemoryPool pool(std::move(*backend));
  memory::Allocation a = check(pool.allocate(bytes, Tag::kScratch, {.single_allocation = true, .name = "copy limit"}),
                               "allocating the copy-limit region");
  auto t = Clock::now();
  auto host = check(pool.backend().allocate_host(bytes), "pinning host memory");
  const double pin_gb_s = static_cast<double>(bytes) / 1e6 / ms_since(t);
  std::vector<double> to, from;
  for (int i = 0; i < 3; ++i) {
    t = Clock::now();
    check(pool.backend().copy_to_host(host->data(), a.base, bytes), "copy to host");
    to.push_back(static_cast<double>(bytes) / 1e6 / ms_since(t));
    t = Clock::now();
    check(pool.backend().copy_from_host(a.base, host->data(), bytes), "copy from host");
    from.push_back(static_cast<double>(bytes) / 1e6 / ms_since(t));
  }
  host.reset();
  check(pool.free(a.id), "freeing the copy-limit region");
  return {{"what", "pinned host <-> device copies (cuMemcpyDtoH / HtoD) and pinning (cuMemHostAlloc)"},
          {"bytes", bytes},
          {"to_host_gb_per_s", median(to)},
          {"from_host_gb_per_s", median(from)},
          {"pin_gb_per_s", pin_gb_s}};
}

// Host->device from a kept, pinned buffer (the CUDA backend's direct path at
// level-1 wake) by one HostToDeviceCopy, with a pool of its own: GB/s, the
// median of 3, or the error.
nlohmann::json measure_kept_restore(uint64_t bytes, memory::HostToDeviceCopy how) {
  auto backend = memory::make_cuda_backend({.device = 0, .host_to_device = how});
  if (!backend) return backend.error().message;
  memory::MemoryPool pool(std::move(*backend));
  memory::Allocation a = check(pool.allocate(bytes, Tag::kScratch, {.single_allocation = true, .name = "restore rate"}),
                               "allocating the restore-rate region");
  auto host = check(pool.backend().allocate_host(bytes), "allocating a host buffer");
  std::memset(host->data(), 1, bytes);
  pool.backend().retain_host(*host);  // pinned in the background
  const auto until = Clock::now() + std::chrono::minutes(2);
  while (host->pinned_bytes() < host->bytes() && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (host->pinned_bytes() < host->bytes()) return "the host buffer was not pinned in 2 minutes";
  std::vector<double> from;
  for (int i = 0; i < 3; ++i) {
    const auto t = Clock::now();
    check(pool.backend().copy_from_host(a.base, host->data(), bytes), "restore from a kept buffer");
    from.push_back(static_cast<double>(bytes) / 1e6 / ms_since(t));
  }
  host.reset();
  check(pool.free(a.id), "freeing the restore-rate region");
  return median(from);
}

struct Cycle {
  int level = 0;
  bool first = false;          // level 1: the sleep that allocated the host buffer
  uint64_t pinned_at_sleep = 0;  // host bytes of the offload reachable by direct DMA when the sleep began
  double reload_gb_per_s = 0;  // level 2: the checkpoint's bytes / reload_weights' write time
  uint64_t reload_bytes = 0;
  double sleep_ms = 0, wake_ms = 0;
  double wake_weights_ms = 0, reload_ms = 0, wake_rest_ms = 0;  // level 2
  double offload_bytes = 0, released_bytes = 0;
  Gauge asleep, after;
  bool identical = false;
  std::string first_difference;
};

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  init_logging(opt.log_level);
  EngineOptions eo;
  eo.model_dir = opt.model;
  eo.device = check(parse_device(opt.device), "--device");
  eo.enable_sleep_mode = true;
  eo.enable_prefix_caching = false;
  eo.seed = 1;
  eo.gpu_memory_utilization = opt.utilization;
  eo.batch_invariant = opt.batch_invariant;
  eo.keep_offload_buffers = opt.keep_offload_buffers;
  eo.max_num_seqs = std::max(opt.prompts, 16);
  if (!opt.kv_bytes.empty()) eo.kv_cache_memory_bytes = static_cast<uint64_t>(std::strtod(opt.kv_bytes.c_str(), nullptr));
  const bool cuda = eo.device == Device::kCuda;
  // The engine's backend and model take it from the environment (memory/host_to_device_copy.h).
  if (!opt.restore_copy.empty()) ::setenv(memory::kHostToDeviceCopyEnv, opt.restore_copy.c_str(), 1);
  const std::string restore_copy = memory::host_to_device_copy_name(memory::resolve_host_to_device_copy());

  nlohmann::json limit = cuda ? measure_copy_limit(1 * kGiB) : nlohmann::json{{"what", "none (host backend)"}};
  if (cuda && limit.contains("to_host_gb_per_s")) {
    nlohmann::json kept = nlohmann::json::object();
    for (memory::HostToDeviceCopy how : {memory::HostToDeviceCopy::kKernel, memory::HostToDeviceCopy::kCopyEngine})
      kept[memory::host_to_device_copy_name(how)] = measure_kept_restore(1 * kGiB, how);
    limit["kept_restore_gb_per_s"] = kept;
    limit["kept_restore_is"] = "host->device from a kept, pinned offload buffer by each restore copy, idle";
    std::fprintf(stderr, "limit: pinned copy to host %.1f GB/s, from host %.1f GB/s; pinning %.1f GB/s; restore from "
                 "a kept buffer: kernel %s GB/s, copy engines %s GB/s\n",
                 limit["to_host_gb_per_s"].get<double>(), limit["from_host_gb_per_s"].get<double>(),
                 limit["pin_gb_per_s"].get<double>(), kept["kernel"].dump().c_str(),
                 kept["copy_engine"].dump().c_str());
  }

  auto t = Clock::now();
  std::unique_ptr<Engine> engine = check(Engine::create(eo), "creating the engine");
  const double create_ms = ms_since(t);
  Engine& e = *engine;
  const ModelConfig& cfg = e.model_config();
  const EngineMemoryReport awake_report = e.memory_report(later());
  const uint64_t weights = awake_report.pool[Tag::kWeights].total_bytes();
  const uint64_t kv = awake_report.pool[Tag::kKvCache].total_bytes();
  const uint64_t scratch = awake_report.pool[Tag::kScratch].total_bytes();
  std::fprintf(stderr, "engine: %s, created in %.0f ms; weights %.2f GiB, KV cache %.2f GiB, scratch %.2f GiB\n",
               awake_report.backend_description.c_str(), create_ms, gib(weights), gib(kv), gib(scratch));
  std::fprintf(stderr, "restore copy: %s; asleep %.1f s per cycle\n", restore_copy.c_str(), opt.asleep_s);

  const auto prompts = prompt_set(opt.prompts, cfg.vocab_size);
  const RunResult baseline = run_prompts(e, prompts, opt.max_tokens);
  const Gauge awake = device_memory(e);
  std::fprintf(stderr, "baseline: %d prompts x %d tokens in %.0f ms; device used %.2f GiB of %.2f\n", opt.prompts,
               opt.max_tokens, baseline.ms, gib(awake.used()), gib(awake.total));

  std::vector<Cycle> cycles;
  double settle_ms = 0;
  bool first_level1 = true;
  for (int level : opt.levels) {
    for (int r = 0; r < opt.repeat; ++r) {
      Cycle c;
      c.level = level;
      c.first = level == 1 && first_level1;
      c.pinned_at_sleep = e.memory_report(later()).pinned_host_bytes;
      t = Clock::now();
      EngineStatus s = check(e.sleep(level, PauseMode::kKeep, later()), fmt::format("sleep level {}", level));
      c.sleep_ms = ms_since(t);
      c.offload_bytes = static_cast<double>(memory::sum(s.call.offloaded_bytes));
      c.released_bytes = static_cast<double>(memory::sum(s.call.released_bytes));
      c.asleep = device_memory(e);
      // The trainer's step: the engine stays asleep (its memory released) this long.
      if (opt.asleep_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(opt.asleep_s));
      if (level == 1) {
        t = Clock::now();
        check(e.wake_up(TagSet::all(), later()), "wake_up after level 1");
        c.wake_ms = ms_since(t);
      } else {
        t = Clock::now();
        check(e.wake_up(TagSet{Tag::kWeights}, later()), "wake_up(weights) after level 2");
        c.wake_weights_ms = ms_since(t);
        t = Clock::now();
        EngineStatus rs = check(e.reload_weights(std::nullopt, later()), "reload_weights after level 2");
        c.reload_ms = ms_since(t);
        if (rs.call.weights_update) {
          c.reload_gb_per_s = rs.call.weights_update->gb_per_s();
          c.reload_bytes = rs.call.weights_update->bytes;
        }
        t = Clock::now();
        check(e.wake_up(TagSet{Tag::kKvCache, Tag::kScratch}, later()), "wake_up(kv_cache) after level 2");
        c.wake_rest_ms = ms_since(t);
        c.wake_ms = c.wake_weights_ms + c.reload_ms + c.wake_rest_ms;
      }
      c.after = device_memory(e);
      const RunResult again = run_prompts(e, prompts, opt.max_tokens);
      c.identical = again.tokens == baseline.tokens;
      for (size_t i = 0; i < again.tokens.size() && c.first_difference.empty(); ++i)
        if (again.tokens[i] != baseline.tokens[i]) c.first_difference = fmt::format("prompt {} differs", i);
      std::fprintf(stderr, "  level %d #%d: sleep %.0f ms, wake %.0f ms, device used asleep %.2f GiB, after %.2f GiB, %s\n",
                   level, r + 1, c.sleep_ms, c.wake_ms, gib(c.asleep.used()), gib(c.after.used()),
                   c.identical ? "outputs identical" : "OUTPUTS DIFFER");
      cycles.push_back(c);
      if (c.first) first_level1 = false;
      if (c.first && opt.keep_offload_buffers) {
        // The kept host buffer is pinned in the background: wait for it, so
        // that the later cycles show what a settled engine does.
        const auto t0 = Clock::now();
        const auto until = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.settle_s));
        for (;;) {
          const EngineMemoryReport m = e.memory_report(later());
          const uint64_t kept = m.pool[Tag::kWeights].kept_host_bytes;
          if (kept == 0 || m.pinned_host_bytes >= kept || Clock::now() >= until) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        settle_ms = ms_since(t0);
        std::fprintf(stderr, "  kept offload buffer pinned after %.0f ms\n", settle_ms);
      }
    }
  }

  const std::string commit = !opt.commit.empty()           ? opt.commit
                             : std::getenv("SIESTA_COMMIT") ? std::getenv("SIESTA_COMMIT")
                                                            : run_command("git rev-parse HEAD 2>/dev/null");
  bool all_identical = true;
  std::printf("engine sleep/wake, %s, model %s (%s): weights %.2f GiB, KV %.2f GiB, scratch %.2f GiB\n",
              opt.device.c_str(), opt.model.c_str(), opt.shape.empty() ? "?" : opt.shape.c_str(), gib(weights),
              gib(kv), gib(scratch));
  std::printf("restore copy %s, asleep %.1f s per cycle\n", restore_copy.c_str(), opt.asleep_s);
  if (limit.contains("to_host_gb_per_s"))
    std::printf("limit: pinned copy %.1f GB/s to host, %.1f GB/s from host; weights / that = %.0f ms + %.0f ms\n",
                limit["to_host_gb_per_s"].get<double>(), limit["from_host_gb_per_s"].get<double>(),
                static_cast<double>(weights) / 1e6 / limit["to_host_gb_per_s"].get<double>(),
                static_cast<double>(weights) / 1e6 / limit["from_host_gb_per_s"].get<double>());
  std::printf("%5s %3s %9s %9s %10s %9s %10s %10s %10s %9s\n", "level", "#", "sleep_ms", "wake_ms", "(w/rl/kv)",
              "used_GiB", "asleep_GiB", "freed_GiB", "after_GiB", "same_out");
  nlohmann::json jc = nlohmann::json::array();
  std::map<int, std::vector<double>> sleep_ms, wake_ms;
  int n = 0;
  for (const Cycle& c : cycles) {
    all_identical &= c.identical;
    sleep_ms[c.level].push_back(c.sleep_ms);
    wake_ms[c.level].push_back(c.wake_ms);
    const std::string parts =
        c.level == 2 ? fmt::format("{:.0f}/{:.0f}/{:.0f}", c.wake_weights_ms, c.reload_ms, c.wake_rest_ms) : "-";
    std::printf("%5d %3d %9.0f %9.0f %10s %9.2f %10.2f %10.2f %10.2f %9s\n", c.level, ++n, c.sleep_ms, c.wake_ms,
                parts.c_str(), gib(awake.used()), gib(c.asleep.used()),
                gib(static_cast<int64_t>(c.asleep.free) - static_cast<int64_t>(awake.free)), gib(c.after.used()),
                c.identical ? "yes" : "NO");
    nlohmann::json j = {{"level", c.level},
                        {"sleep_ms", c.sleep_ms},
                        {"wake_ms", c.wake_ms},
                        {"offloaded_bytes", c.offload_bytes},
                        {"released_bytes", c.released_bytes},
                        {"device_used_asleep_bytes", c.asleep.used()},
                        {"device_freed_bytes", static_cast<int64_t>(c.asleep.free) - static_cast<int64_t>(awake.free)},
                        {"device_used_after_bytes", c.after.used()},
                        {"outputs_identical", c.identical}};
    j["first_level1"] = c.first;
    j["pinned_host_bytes_at_sleep"] = c.pinned_at_sleep;
    if (c.level == 2) {
      j["reload_gb_per_s"] = c.reload_gb_per_s;
      j["reload_bytes"] = c.reload_bytes;
      j["wake_weights_ms"] = c.wake_weights_ms;
      j["reload_weights_ms"] = c.reload_ms;
      j["wake_kv_cache_ms"] = c.wake_rest_ms;
    }
    if (!c.first_difference.empty()) j["first_difference"] = c.first_difference;
    jc.push_back(std::move(j));
  }
  nlohmann::json summary = nlohmann::json::object();
  for (auto& [level, v] : sleep_ms)
    summary[fmt::format("level_{}", level)] = {{"sleep_ms_median", median(v)}, {"wake_ms_median", median(wake_ms[level])}};
  // Each figure against its limit, measured in this run (see the header).
  nlohmann::json limits = nlohmann::json::object();
  if (limit.contains("to_host_gb_per_s")) {
    const double to_ms = static_cast<double>(weights) / 1e6 / limit["to_host_gb_per_s"].get<double>();
    const double from_ms = static_cast<double>(weights) / 1e6 / limit["from_host_gb_per_s"].get<double>();
    std::vector<double> unmap, map, l1_sleep, l1_wake, reload_gbs, l1_first_sleep, l1_first_wake;
    for (const Cycle& c : cycles) {
      if (c.level == 2) {
        unmap.push_back(c.sleep_ms);
        map.push_back(c.wake_weights_ms + c.wake_rest_ms);
        if (c.reload_gb_per_s > 0) reload_gbs.push_back(c.reload_gb_per_s);
      } else if (c.first) {
        l1_first_sleep.push_back(c.sleep_ms);
        l1_first_wake.push_back(c.wake_ms);
      } else {
        l1_sleep.push_back(c.sleep_ms);
        l1_wake.push_back(c.wake_ms);
      }
    }
    auto row = [&](const char* name, double measured, double lim, double goal, const char* how) {
      const double ratio = lim > 0 ? measured / lim : 0;
      limits[name] = {{"measured", measured}, {"limit", lim}, {"ratio", ratio}, {"goal_ratio", goal}, {"limit_is", how}};
      std::printf("%-22s %10.1f %10.1f %7.2f %6.2f  %s\n", name, measured, lim, ratio, goal, how);
    };
    std::printf("%-22s %10s %10s %7s %6s  %s\n", "figure", "measured", "limit", "ratio", "goal", "limit measured as");
    if (!unmap.empty() && (!l1_sleep.empty() || !l1_first_sleep.empty())) {
      const double lim_sleep = to_ms + median(unmap), lim_wake = from_ms + median(map);
      if (!l1_sleep.empty()) {
        row("level1_sleep_ms", median(l1_sleep), lim_sleep, 1.3, "weights at pinned D->H + level-2 sleep (unmap)");
        row("level1_wake_ms", median(l1_wake), lim_wake, 1.3, "weights at pinned H->D + level-2 wakes (map)");
      }
      if (!l1_first_sleep.empty()) {
        row("level1_first_sleep_ms", l1_first_sleep[0], lim_sleep, 0, "the same; this sleep allocates the host buffer");
        row("level1_first_wake_ms", l1_first_wake[0], lim_wake, 0, "the same");
      }
    }
    if (!reload_gbs.empty())
      row("reload_gb_per_s", median(reload_gbs), limit["from_host_gb_per_s"].get<double>(), 0.5,
          "pinned H->D bandwidth (ratio: >= goal)");
    limits["settle_ms"] = settle_ms;
  }
  std::printf("outputs after every wake identical to before the first sleep: %s\n", all_identical ? "yes" : "NO");

  if (!opt.out.empty()) {
    nlohmann::json doc = {
        {"benchmark", "engine_sleep_wake"},
        {"device", opt.device},
        {"backend_description", awake_report.backend_description},
        {"machine", machine()},
        {"date", utc_now()},
        {"commit", commit.empty() ? "unknown" : commit},
        {"model", {{"dir", opt.model},
                   {"shape", opt.shape},
                   {"layers", cfg.num_layers},
                   {"hidden_size", cfg.hidden_size},
                   {"vocab_size", cfg.vocab_size}}},
        {"engine", {{"create_ms", create_ms},
                    {"weights_bytes", weights},
                    {"kv_cache_bytes", kv},
                    {"scratch_bytes", scratch},
                    {"gpu_memory_utilization", opt.utilization},
                    {"kv_cache_memory_bytes_flag", opt.kv_bytes},
                    {"batch_invariant", opt.batch_invariant}}},
        {"prompts", {{"count", opt.prompts}, {"max_tokens", opt.max_tokens}, {"greedy", true},
                     {"baseline_ms", baseline.ms}}},
        {"device_memory_awake", {{"used_bytes", awake.used()}, {"total_bytes", awake.total}}},
        {"limit", limit},
        {"limits", limits},
        {"keep_offload_buffers", opt.keep_offload_buffers},
        {"restore_copy", restore_copy},
        {"asleep_s", opt.asleep_s},
        {"repeat", opt.repeat},
        {"cycles", jc},
        {"summary", summary},
        {"outputs_identical", all_identical},
        {"columns",
         {{"sleep_ms", "Engine::sleep: pause, release_transfer_kv, block pool emptied, pool sleep (level 1: weights "
                       "copied to host first)"},
          {"wake_ms", "level 1: wake_up(all), weights restored; level 2: wake_up(weights) + reload_weights + "
                      "wake_up(kv_cache, scratch)"},
          {"restore_copy", "what copies host->device at wake and reload: kernel (the SMs read pinned host memory "
                           "through its device mapping) or copy_engine (cuMemcpyHtoDAsync / cudaMemcpyAsync)"},
          {"asleep_s", "seconds the engine stays asleep between each sleep and its wake (not in sleep_ms or "
                       "wake_ms)"},
          {"device_used_asleep_bytes", "total - free from cuMemGetInfo while asleep (CUDA context and other "
                                       "processes included)"}}},
    };
    std::ofstream out(opt.out);
    out << doc.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "engine_sleep_bench: cannot write %s\n", opt.out.c_str());
      return 1;
    }
    std::fprintf(stderr, "wrote %s\n", opt.out.c_str());
  }
  return all_identical ? 0 : 3;
}
