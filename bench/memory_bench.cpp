// memory_bench: what sleep and wake cost and how much memory they give back.
//
//   memory_bench --backend host|cuda [--out bench/results/memory_<backend>.json]
//                [--sizes 256M,1G,4G] [--layouts single,2M,256M] [--repeat 3]
//                [--offload-layouts single] [--copy-bytes 1G] [--device 0] [--commit SHA]
//                [--offload-mode staged|pinned] [--copy-threads N]
//
// For each region size and physical layout (one allocation, or chunks of 2 MiB
// or 256 MiB) one pool allocation tagged `weights` is measured:
//   map            allocate(): reserve, create, map, zero-fill
//   sleep / freed  sleep at level 2 (release only); freed = RSS drop (host) or
//                  the device's free-memory rise (cuMemGetInfo)
//   wake / back    wake (map again, zero-fill); back = the memory taken again
//   sleep+offload  sleep at level 1 (host copy, then release) and
//   wake+restore   wake with the copy restored; measured for --offload-layouts
//                  only, since the copy does not depend on the layout
// The limit measured in the same run: copy bandwidth between pool memory and
// host memory (pinned on CUDA), which bounds offload and restore, and on CUDA
// the cost of allocating pinned host memory, which sleep with offload pays.
// Timings are medians over --repeat runs (after one untimed warm-up cycle of
// the largest size); freed/back are the smallest seen. --offload-mode (CUDA)
// picks how offloaded contents reach the host: staged (ordinary host memory
// through a pinned staging ring, the default) or pinned (cuMemHostAlloc of
// the whole size per sleep).
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
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_report.h"
#include "common/log.h"
#include "memory/cuda_backend.h"
#include "memory/host_backend.h"
#include "memory/memory_pool.h"
#include "memory/process_memory.h"

using namespace siesta;
using namespace siesta::memory;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

struct Options {
  std::string backend = "host";
  std::string out;
  std::vector<uint64_t> sizes;
  std::vector<std::string> layouts = {"single", "2M", "256M"};
  std::vector<std::string> offload_layouts = {"single"};
  int repeat = 3;
  uint64_t copy_bytes = 0;
  int device = 0;
  std::string commit;
  memory::OffloadMode offload = memory::OffloadMode::kStaged;
  size_t copy_threads = 0;  // staged: host copy threads (0: the backend's default)
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "memory_bench: %s\n"
               "usage: memory_bench --backend host|cuda [--out FILE.json] [--sizes 256M,1G,4G] "
               "[--layouts single,2M,256M] [--offload-layouts single] [--repeat N] [--copy-bytes 1G] [--device N] "
               "[--commit SHA] [--offload-mode staged|pinned] [--copy-threads N]\n",
               why.c_str());
  std::exit(2);
}

uint64_t parse_size(const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit = end ? end : "";
  uint64_t scale = 1;
  if (unit == "K" || unit == "KiB") scale = 1024;
  else if (unit == "M" || unit == "MiB") scale = kMiB;
  else if (unit == "G" || unit == "GiB") scale = kGiB;
  else if (!unit.empty()) usage("bad size '" + text + "' (use e.g. 256M or 4G)");
  if (v <= 0) usage("bad size '" + text + "'");
  return static_cast<uint64_t>(v * static_cast<double>(scale));
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--backend") o.backend = next();
    else if (a == "--out") o.out = next();
    else if (a == "--sizes") for (const auto& s : split(next())) o.sizes.push_back(parse_size(s));
    else if (a == "--layouts") o.layouts = split(next());
    else if (a == "--offload-layouts") o.offload_layouts = split(next());
    else if (a == "--repeat") o.repeat = std::max(1, std::atoi(next().c_str()));
    else if (a == "--copy-bytes") o.copy_bytes = parse_size(next());
    else if (a == "--device") o.device = std::atoi(next().c_str());
    else if (a == "--commit") o.commit = next();
    else if (a == "--copy-threads") o.copy_threads = static_cast<size_t>(std::max(0, std::atoi(next().c_str())));
    else if (a == "--offload-mode") {
      const std::string m = next();
      if (m == "staged") o.offload = memory::OffloadMode::kStaged;
      else if (m == "pinned") o.offload = memory::OffloadMode::kPinned;
      else usage("--offload-mode is staged or pinned");
    }
    else if (a == "-h" || a == "--help") usage("help");
    else usage("unknown argument " + a);
  }
  if (o.backend != "host" && o.backend != "cuda") usage("--backend is host or cuda");
  const bool cuda = o.backend == "cuda";
  if (o.sizes.empty()) o.sizes = cuda ? std::vector<uint64_t>{1 * kGiB, 8 * kGiB, 64 * kGiB}
                                      : std::vector<uint64_t>{256 * kMiB, 1 * kGiB, 4 * kGiB};
  if (o.copy_bytes == 0) o.copy_bytes = cuda ? 8 * kGiB : 1 * kGiB;
  return o;
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

template <class T>
T check(Result<T> r, const char* what) {
  if (!r) {
    std::fprintf(stderr, "memory_bench: %s: %s\n", what, r.error().message.c_str());
    std::exit(1);
  }
  return std::move(r).value();
}
void check(Ok r, const char* what) {
  if (!r) {
    std::fprintf(stderr, "memory_bench: %s: %s\n", what, r.error().message.c_str());
    std::exit(1);
  }
}

using bench::machine;
using bench::run_command;
using bench::utc_now;

// What "memory given back" means on each backend: the process's RSS on the
// host, the device's free memory on CUDA. Returned as "in use" (bigger = more held).
struct MemoryGauge {
  MemoryPool* pool;
  bool cuda;
  int64_t in_use() {
    if (cuda) {
      DeviceMemoryInfo info = check(pool->backend().memory_info(), "cuMemGetInfo");
      return -static_cast<int64_t>(info.free_bytes);
    }
    return static_cast<int64_t>(check(process_resident_bytes(), "reading RSS"));
  }
};

struct CopyLimit {
  double to_host_gb_s = 0;
  double from_host_gb_s = 0;
  double host_alloc_gb_s = 0;
};

CopyLimit measure_copy(MemoryPool& pool, uint64_t bytes, bool cuda) {
  Allocation a = check(pool.allocate(bytes, Tag::kScratch, {.single_allocation = true, .name = "copy limit"}),
                       "allocating the copy-bandwidth region");
  CopyLimit limit;
  auto t = Clock::now();
  std::unique_ptr<HostBuffer> host = check(pool.backend().allocate_host(bytes), "allocating host memory");
  // Pinned memory is resident once allocated; plain host memory only once
  // touched, which a sleep with offload pays during its copy.
  if (!cuda) std::memset(host->data(), 1, bytes);
  limit.host_alloc_gb_s = static_cast<double>(bytes) / 1e6 / ms_since(t);
  if (cuda) std::memset(host->data(), 1, bytes);
  std::vector<double> to, from;
  for (int i = 0; i < 3; ++i) {
    t = Clock::now();
    check(pool.backend().copy_to_host(host->data(), a.base, bytes), "copy to host");
    to.push_back(static_cast<double>(bytes) / 1e6 / ms_since(t));
    t = Clock::now();
    check(pool.backend().copy_from_host(a.base, host->data(), bytes), "copy from host");
    from.push_back(static_cast<double>(bytes) / 1e6 / ms_since(t));
  }
  limit.to_host_gb_s = median(to);
  limit.from_host_gb_s = median(from);
  host.reset();
  check(pool.free(a.id), "freeing the copy-bandwidth region");
  return limit;
}

struct Row {
  uint64_t size = 0;
  std::string layout;
  uint64_t piece_bytes = 0;
  size_t pieces = 0;
  std::vector<double> map_ms, sleep_ms, wake_ms, sleep_offload_ms, wake_restore_ms;
  int64_t freed = INT64_MAX, back = INT64_MAX;
};

std::string gib(int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / kGiB); }
std::string ms_cell(const std::vector<double>& v) { return v.empty() ? "-" : fmt::format("{:.1f}", median(v)); }

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse(argc, argv);
  init_logging("warn");
  const bool cuda = opt.backend == "cuda";
  std::unique_ptr<MemoryBackend> backend =
      cuda ? check(make_cuda_backend({.device = opt.device, .offload = opt.offload, .copy_threads = opt.copy_threads}), "CUDA backend") : check(make_host_backend(), "host backend");
  const std::string description = backend->description();
  MemoryPool pool(std::move(backend));
  MemoryGauge gauge{&pool, cuda};
  std::fprintf(stderr, "memory_bench: %s\n", description.c_str());

  CopyLimit limit = measure_copy(pool, opt.copy_bytes, cuda);
  std::fprintf(stderr, "copy limit: to host %.1f GB/s, from host %.1f GB/s, host allocation %.1f GB/s\n",
               limit.to_host_gb_s, limit.from_host_gb_s, limit.host_alloc_gb_s);

  // Warm-up, untimed: on a virtual machine the first touch of guest memory
  // the VM never used costs the hypervisor's time, not the pool's.
  {
    const uint64_t largest = *std::max_element(opt.sizes.begin(), opt.sizes.end());
    Allocation a = check(pool.allocate(largest, Tag::kWeights, {.single_allocation = true, .name = "warm-up"}),
                         "warm-up allocation");
    check(pool.sleep({Tag::kWeights}), "warm-up sleep");
    check(pool.wake(TagSet::all()), "warm-up wake");
    check(pool.free(a.id), "warm-up free");
  }

  std::vector<Row> rows;
  for (uint64_t size : opt.sizes) {
    for (const std::string& layout : opt.layouts) {
      AllocationOptions ao{.name = "bench"};
      if (layout == "single") ao.single_allocation = true;
      else ao.chunk_bytes = parse_size(layout);
      const bool offload = std::find(opt.offload_layouts.begin(), opt.offload_layouts.end(), layout) !=
                           opt.offload_layouts.end();
      Row row{size, layout};
      for (int r = 0; r < opt.repeat; ++r) {
        auto t = Clock::now();
        Allocation a = check(pool.allocate(size, Tag::kWeights, ao), "allocate");
        row.map_ms.push_back(ms_since(t));
        row.piece_bytes = a.piece_bytes;
        row.pieces = a.pieces;

        const int64_t awake = gauge.in_use();
        t = Clock::now();
        check(pool.sleep({}), "sleep");
        row.sleep_ms.push_back(ms_since(t));
        const int64_t asleep = gauge.in_use();
        t = Clock::now();
        check(pool.wake(TagSet::all()), "wake");
        row.wake_ms.push_back(ms_since(t));
        row.freed = std::min(row.freed, awake - asleep);
        row.back = std::min(row.back, gauge.in_use() - asleep);

        if (offload) {
          t = Clock::now();
          check(pool.sleep({Tag::kWeights}), "sleep with offload");
          row.sleep_offload_ms.push_back(ms_since(t));
          t = Clock::now();
          check(pool.wake(TagSet::all()), "wake with restore");
          row.wake_restore_ms.push_back(ms_since(t));
        }
        check(pool.free(a.id), "free");
      }
      std::fprintf(stderr, "  %s %s: map %s ms, sleep %s ms, wake %s ms\n", gib(size).c_str(), layout.c_str(),
                   ms_cell(row.map_ms).c_str(), ms_cell(row.sleep_ms).c_str(), ms_cell(row.wake_ms).c_str());
      rows.push_back(std::move(row));
    }
  }

  const std::string commit = !opt.commit.empty()           ? opt.commit
                             : std::getenv("SIESTA_COMMIT") ? std::getenv("SIESTA_COMMIT")
                                                            : run_command("git rev-parse HEAD 2>/dev/null");
  const char* gauge_name = cuda ? "device free memory (cuMemGetInfo)" : "process RSS (/proc/self/statm)";

  std::printf("memory sleep/wake, %s backend: %s\n", opt.backend.c_str(), description.c_str());
  std::printf("limit: copy to host %.1f GB/s, from host %.1f GB/s (%s), host allocation %.1f GB/s; freed/back from %s\n",
              limit.to_host_gb_s, limit.from_host_gb_s, cuda ? offload_mode_name(opt.offload) : "memcpy", limit.host_alloc_gb_s, gauge_name);
  std::printf("%9s %7s %7s %9s %9s %10s %9s %10s %14s %14s\n", "size_GiB", "layout", "pieces", "map_ms", "sleep_ms",
              "freed_GiB", "wake_ms", "back_GiB", "sleep+offl_ms", "wake+restr_ms");
  nlohmann::json results = nlohmann::json::array();
  for (const Row& row : rows) {
    std::printf("%9s %7s %7zu %9s %9s %10s %9s %10s %14s %14s\n", gib(row.size).c_str(), row.layout.c_str(), row.pieces,
                ms_cell(row.map_ms).c_str(), ms_cell(row.sleep_ms).c_str(), gib(row.freed).c_str(),
                ms_cell(row.wake_ms).c_str(), gib(row.back).c_str(), ms_cell(row.sleep_offload_ms).c_str(),
                ms_cell(row.wake_restore_ms).c_str());
    nlohmann::json j = {
        {"size_bytes", row.size},
        {"layout", row.layout},
        {"piece_bytes", row.piece_bytes},
        {"pieces", row.pieces},
        {"map_ms", median(row.map_ms)},
        {"sleep_ms", median(row.sleep_ms)},
        {"freed_bytes", row.freed},
        {"freed_fraction", static_cast<double>(row.freed) / static_cast<double>(row.size)},
        {"wake_ms", median(row.wake_ms)},
        {"back_bytes", row.back},
        {"samples", {{"map_ms", row.map_ms}, {"sleep_ms", row.sleep_ms}, {"wake_ms", row.wake_ms}}},
    };
    if (!row.sleep_offload_ms.empty()) {
      j["sleep_offload_ms"] = median(row.sleep_offload_ms);
      j["wake_restore_ms"] = median(row.wake_restore_ms);
      j["samples"]["sleep_offload_ms"] = row.sleep_offload_ms;
      j["samples"]["wake_restore_ms"] = row.wake_restore_ms;
    }
    results.push_back(std::move(j));
  }

  if (!opt.out.empty()) {
    nlohmann::json doc = {
        {"benchmark", "memory_sleep_wake"},
        {"backend", opt.backend},
        {"backend_description", description},
        {"offload_mode", cuda ? offload_mode_name(opt.offload) : "memcpy"},
        {"copy_threads", opt.copy_threads},
        {"machine", machine()},
        {"date", utc_now()},
        {"commit", commit.empty() ? "unknown" : commit},
        {"repeat", opt.repeat},
        {"gauge", gauge_name},
        {"limit",
         {{"what", cuda ? (opt.offload == OffloadMode::kPinned
                               ? "pinned host <-> device copy (cuMemcpyDtoH/HtoD), and cuMemHostAlloc speed"
                               : "staged copy between device and ordinary host memory (first touch included in "
                                 "the first of the runs), and host allocation speed")
                        : "memcpy between pool memory and host memory, and host allocation + first touch speed"},
          {"bytes", opt.copy_bytes},
          {"to_host_gb_per_s", limit.to_host_gb_s},
          {"from_host_gb_per_s", limit.from_host_gb_s},
          {"host_alloc_gb_per_s", limit.host_alloc_gb_s}}},
        {"columns",
         {{"map_ms", "allocate(): reserve + create + map + zero-fill"},
          {"sleep_ms", "sleep at level 2: release only"},
          {"freed_bytes", "memory given back by sleep, by the gauge"},
          {"wake_ms", "wake: create + map + zero-fill"},
          {"back_bytes", "memory taken again by wake, by the gauge"},
          {"sleep_offload_ms", "sleep at level 1: host allocation + copy + release"},
          {"wake_restore_ms", "wake: create + map + copy back + host free"}}},
        {"results", results},
    };
    std::ofstream out(opt.out);
    out << doc.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "memory_bench: cannot write %s\n", opt.out.c_str());
      return 1;
    }
    std::fprintf(stderr, "wrote %s\n", opt.out.c_str());
  }
  return 0;
}
