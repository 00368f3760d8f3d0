#include "bench/transfer/transfer_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "bench/transfer/bench_memory.h"
#include "bench/transfer/ucx_put_probe.h"
#include "common/log.h"
#include "transfer/ipc/piece_copy.h"
#include "transfer/transfer_engine.h"

extern char** environ;

namespace siesta::transfer {

namespace {

using namespace std::chrono_literals;

constexpr const char* kPeerEnv = "SIESTA_TRANSFER_BENCH_PEER";
constexpr auto kStartWait = std::chrono::seconds(120);
constexpr auto kStepWait = std::chrono::seconds(120);
constexpr size_t kRounds = 10;

// The options' names (--backend, --ucx-staging) as the transfer engine's settings.
Result<TransferConfig> engine_config(const TransferBenchOptions& o, const std::string& id) {
  TransferConfig c;
  c.engine_id = id;
  SIESTA_ASSIGN_OR_RETURN(c.backend, parse_backend_kind(o.backend));
  c.ucx_transports = o.ucx_transports;
  c.ucx_net_devices = o.ucx_net_devices;
  c.ucx_peer_error_handling = o.ucx_peer_error_handling;
  SIESTA_ASSIGN_OR_RETURN(c.ucx_staging, parse_ucx_staging(o.ucx_staging));
  c.cuda_device = o.cuda_device;
  return c;
}

ucx::UcxOptions ucx_options(const TransferBenchOptions& o) {
  return {o.ucx_transports, o.ucx_net_devices, o.ucx_peer_error_handling};
}

int peer_device(const TransferBenchOptions& o) { return o.peer_cuda_device >= 0 ? o.peer_cuda_device : o.cuda_device; }

// The peer's options, as key=value pairs separated by ';'.
std::string encode_peer_options(const TransferBenchOptions& o, size_t region_bytes) {
  return fmt::format("backend={};memory={};region={};tls={};devices={};peer_errors={};staging={};cuda={}", o.backend,
                     memory_kind_name(o.memory), region_bytes, o.ucx_transports, o.ucx_net_devices,
                     o.ucx_peer_error_handling ? 1 : 0, o.ucx_staging, peer_device(o));
}

Result<std::pair<TransferBenchOptions, size_t>> decode_peer_options(const std::string& text) {
  std::map<std::string, std::string> kv;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ';')) {
    size_t eq = item.find('=');
    if (eq != std::string::npos) kv[item.substr(0, eq)] = item.substr(eq + 1);
  }
  TransferBenchOptions o;
  o.backend = kv["backend"];
  o.memory = kv["memory"] == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost;
  o.ucx_transports = kv["tls"];
  o.ucx_net_devices = kv["devices"];
  o.ucx_peer_error_handling = kv["peer_errors"] != "0";
  o.ucx_staging = kv["staging"];
  o.cuda_device = std::atoi(kv["cuda"].c_str());
  size_t region = std::strtoull(kv["region"].c_str(), nullptr, 10);
  if (o.backend.empty() || region == 0) return invalid_argument(fmt::format("malformed {}: '{}'", kPeerEnv, text));
  return std::make_pair(o, region);
}

// The peer process as the initiator sees it.
struct PeerProcess {
  pid_t pid = -1;
  int to_child = -1;
  std::string address;

  PeerProcess() = default;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  // Closing its stdin asks it to exit; it is killed if it does not within 5 s.
  ~PeerProcess() {
    if (to_child >= 0) close(to_child);
    if (pid <= 0) return;
    for (int i = 0; i < 500; ++i) {
      if (waitpid(pid, nullptr, WNOHANG) == pid) return;
      std::this_thread::sleep_for(10ms);
    }
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
};

Result<std::unique_ptr<PeerProcess>> spawn_peer(const TransferBenchOptions& o, size_t region_bytes) {
  if (o.peer_argv.empty()) return invalid_argument("the benchmark needs a command for its peer process");
  std::vector<std::string> args = o.peer_argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, kPeerEnv, std::strlen(kPeerEnv)) != 0) env.emplace_back(*e);
  env.push_back(std::string(kPeerEnv) + "=" + encode_peer_options(o, region_bytes));
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return io_error("pipe for the peer process");
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return io_error("pipe for the peer process");
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
  auto peer = std::make_unique<PeerProcess>();
  int rc = posix_spawn(&peer->pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  peer->to_child = in[1];
  if (rc != 0) {
    close(out[0]);
    peer->pid = -1;
    return io_error(fmt::format("cannot start the peer process {}: {}", args[0], std::strerror(rc)));
  }
  // Its first line that starts with ADDRESS (UCX may print lines of its own).
  std::string line;
  Deadline deadline = Clock::now() + kStartWait;
  char ch;
  while (peer->address.empty() && !expired(deadline)) {
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, millis_left(deadline)) <= 0 || read(out[0], &ch, 1) != 1) break;
    if (ch != '\n') {
      line += ch;
    } else {
      if (line.rfind("ADDRESS ", 0) == 0) peer->address = line.substr(8);
      line.clear();
    }
  }
  close(out[0]);
  if (peer->address.empty()) return unavailable("the benchmark's peer process did not start (see its messages above)");
  return peer;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

std::string limit_description(const TransferBenchOptions& o) {
  if (o.backend == "ucx")
    return fmt::format("raw UCX put loop (ucp_put_nbx + flush, transports {}){}, same bytes", o.ucx_transports,
                       o.memory == MemoryKind::kCuda ? " between host buffers" : "");
  if (o.memory == MemoryKind::kCuda && peer_device(o) != o.cuda_device)
    return fmt::format("cudaMemcpyPeer from device {} to device {} of each transfer's bytes as one range, in one "
                       "process, same bytes",
                       o.cuda_device, peer_device(o));
  return o.memory == MemoryKind::kCuda
             ? "cudaMemcpy device-to-device of each transfer's bytes as one range, in one process, same bytes"
             : "memcpy in one process, one thread, same bytes";
}

// The initiator's copy paths: one, or with "both" (ipc, CUDA memory) the
// gather kernel and the copy engines.
Result<std::vector<std::string>> ipc_copy_paths(const TransferBenchOptions& o) {
  if (o.ipc_copy != "both") {
    SIESTA_TRY(parse_ipc_copy(o.ipc_copy));
    return std::vector<std::string>{o.ipc_copy};
  }
  if (o.backend != "ipc" || o.memory != MemoryKind::kCuda)
    return invalid_argument("--ipc-copy both compares the ipc backend's copy paths for CUDA memory: use it with "
                            "--backend ipc --memory cuda");
  return std::vector<std::string>{"kernel", "copy_engine"};
}

// One engine of the initiator (one per copy path) and what it registered.
struct Initiator {
  std::string ipc_copy;
  std::unique_ptr<TransferEngine> engine;
  RegionId local_id;
  std::string peer_id;
  std::vector<XferEntry> entries;
};

}  // namespace

Result<std::vector<size_t>> parse_byte_sizes(const std::string& text) {
  std::vector<size_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    size_t mult = 1;
    char last = static_cast<char>(std::toupper(static_cast<unsigned char>(item.back())));
    if (last == 'K' || last == 'M' || last == 'G') {
      mult = last == 'K' ? size_t{1} << 10 : last == 'M' ? size_t{1} << 20 : size_t{1} << 30;
      item.pop_back();
    }
    char* end = nullptr;
    unsigned long long n = std::strtoull(item.c_str(), &end, 10);
    if (item.empty() || end == item.c_str() || *end != '\0' || n == 0)
      return invalid_argument(fmt::format("'{}' is not a size like 4K, 1M or 4096", item + (mult > 1 ? std::string(1, last) : "")));
    out.push_back(static_cast<size_t>(n) * mult);
  }
  if (out.empty()) return invalid_argument("no size given");
  std::sort(out.begin(), out.end());
  return out;
}

bool transfer_bench_peer_requested() { return std::getenv(kPeerEnv) != nullptr; }

int serve_transfer_bench_peer() {
  const char* env = std::getenv(kPeerEnv);
  auto parsed = decode_peer_options(env ? env : "");
  auto fail = [](const Status& s) {
    std::cerr << "siesta bench transfer (peer): " << s.message << "\n";
    return 1;
  };
  if (!parsed) return fail(parsed.error());
  const TransferBenchOptions& o = parsed->first;
  auto config = engine_config(o, fmt::format("bench-target-{}", getpid()));
  if (!config) return fail(config.error());
  auto engine = TransferEngine::create(*config);
  if (!engine) return fail(engine.error());
  auto memory = BenchMemory::create(o.memory, parsed->second, o.cuda_device);
  if (!memory) return fail(memory.error());
  auto region = (*engine)->register_region((*memory)->spec());
  if (!region) return fail(region.error());
  std::unique_ptr<ucx::UcxPutTarget> target;
  std::unique_ptr<BenchMemory> target_memory;  // the put loop's host memory when the region is CUDA memory
  BenchMemory* mem = memory->get();
  std::mutex mu;
  (*engine)->set_message_handler([&](const PeerMessage& m) -> Result<std::string> {
    std::lock_guard<std::mutex> lock(mu);
    std::istringstream in(m.payload);
    std::string cmd;
    size_t off = 0, len = 0;
    uint64_t seed = 0;
    in >> cmd;
    if (cmd == "region") return fmt::format("{}", region->value);
    if (cmd == "fill") {
      in >> off >> len >> seed;
      SIESTA_TRY(mem->fill(off, len, seed));
      return std::string("ok");
    }
    if (cmd == "hash") {
      in >> off >> len;
      SIESTA_ASSIGN_OR_RETURN(uint64_t h, mem->hash(off, len));
      return fmt::format("{}", h);
    }
    if (cmd == "put-target") {
      if (!target) {
        BenchMemory* host = mem;
        if (mem->kind() != MemoryKind::kHost) {
          SIESTA_ASSIGN_OR_RETURN(target_memory, BenchMemory::create(MemoryKind::kHost, mem->bytes(), 0));
          host = target_memory.get();
        }
        SIESTA_ASSIGN_OR_RETURN(target, ucx::UcxPutTarget::create(ucx_options(o), host->base(), host->bytes()));
      }
      return target->descriptor();
    }
    return invalid_argument("unknown benchmark command " + cmd);
  });
  std::cout << "ADDRESS " << (*engine)->address() << std::endl;
  dup2(STDERR_FILENO, STDOUT_FILENO);  // the initiator stopped reading the pipe
  char buf[64];
  while (read(STDIN_FILENO, buf, sizeof(buf)) > 0) {
  }
  target.reset();
  engine->reset();
  return 0;
}

Result<TransferBenchReport> run_transfer_bench(const TransferBenchOptions& o) {
  if (o.sizes.empty()) return invalid_argument("no entry sizes to measure");
  if (o.batch == 0) return invalid_argument("the batch must hold at least one entry");
  SIESTA_ASSIGN_OR_RETURN(std::vector<std::string> paths, ipc_copy_paths(o));
  const bool cuda_ipc = o.backend == "ipc" && o.memory == MemoryKind::kCuda;
  size_t largest = *std::max_element(o.sizes.begin(), o.sizes.end());
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t region_bytes = (largest * o.batch + page - 1) / page * page;
  bool write = o.op == XferOp::kWrite;

  // Local memory first: without a GPU, --memory cuda fails here, before a peer starts.
  auto made = BenchMemory::create(o.memory, region_bytes, o.cuda_device);
  if (!made)
    return made.error().with_context(fmt::format("--memory {}: {} bytes for the benchmark", memory_kind_name(o.memory),
                                                 region_bytes));
  std::unique_ptr<BenchMemory> local = std::move(*made);
  SIESTA_ASSIGN_OR_RETURN(auto peer, spawn_peer(o, region_bytes));
  std::vector<Initiator> initiators(paths.size());
  for (size_t k = 0; k < paths.size(); ++k) {
    Initiator& in = initiators[k];
    in.ipc_copy = paths[k];
    const std::string id = fmt::format("bench-initiator-{}{}", getpid(), paths.size() > 1 ? "-" + paths[k] : "");
    SIESTA_ASSIGN_OR_RETURN(TransferConfig config, engine_config(o, id));
    SIESTA_ASSIGN_OR_RETURN(config.ipc_copy, parse_ipc_copy(paths[k]));
    SIESTA_ASSIGN_OR_RETURN(in.engine, TransferEngine::create(config));
    SIESTA_ASSIGN_OR_RETURN(in.local_id, in.engine->register_region(local->spec()));
    SIESTA_ASSIGN_OR_RETURN(in.peer_id, in.engine->connect(peer->address, Clock::now() + kStartWait));
  }
  TransferEngine& first = *initiators.front().engine;
  auto ask = [&](const std::string& cmd) -> Result<std::string> {
    auto r = first.send_message(peer->address, cmd, Clock::now() + kStepWait);
    if (!r) return r.error().with_context(fmt::format("benchmark peer, '{}'", cmd.substr(0, cmd.find(' '))));
    return r;
  };
  SIESTA_ASSIGN_OR_RETURN(std::string remote_text, ask("region"));
  RegionId remote{std::strtoull(remote_text.c_str(), nullptr, 10)};

  // The limit: its own buffers (ipc) or a raw UCX connection (ucx).
  std::unique_ptr<BenchMemory> limit_src, limit_dst;
  std::unique_ptr<ucx::UcxPutProbe> probe;
  if (o.backend == "ucx") {
    SIESTA_ASSIGN_OR_RETURN(std::string descriptor, ask("put-target"));
    char* from = local->base();
    if (o.memory != MemoryKind::kHost) {
      SIESTA_ASSIGN_OR_RETURN(limit_src, BenchMemory::create(MemoryKind::kHost, region_bytes, 0));
      from = limit_src->base();
    }
    SIESTA_ASSIGN_OR_RETURN(probe, ucx::UcxPutProbe::connect(ucx_options(o), descriptor, from, region_bytes,
                                                             Clock::now() + kStartWait));
  } else {
    SIESTA_ASSIGN_OR_RETURN(limit_src, BenchMemory::create(o.memory, region_bytes, o.cuda_device));
    SIESTA_ASSIGN_OR_RETURN(limit_dst, BenchMemory::create(o.memory, region_bytes,
                                                           o.memory == MemoryKind::kCuda ? peer_device(o) : 0));
    SIESTA_TRY(limit_src->fill(0, region_bytes, 7));
  }

  TransferBenchReport report;
  report.limit = limit_description(o);
  for (size_t si = 0; si < o.sizes.size(); ++si) {
    size_t size = o.sizes[si];
    size_t per_xfer = size * o.batch;
    // CUDA memory on one host moves ~2 TB/s: 8 GiB of it takes milliseconds,
    // and large sizes get enough transfers for a stable median.
    const size_t budget = o.backend == "ipc" && o.memory == MemoryKind::kCuda ? size_t{8} << 30 : size_t{512} << 20;
    size_t iters = o.iterations != 0 ? o.iterations : std::clamp<size_t>(budget / per_xfer, 5, 2000);
    for (Initiator& in : initiators) {
      in.entries.clear();
      for (size_t i = 0; i < o.batch; ++i) in.entries.push_back({in.local_id, i * size, remote, i * size, size});
    }
    // Fresh content per entry on the source, another on the destination, so
    // verification cannot pass on what an earlier size (or path) left behind.
    auto seed_of = [&](size_t i) -> uint64_t { return 1000 * (si + 1) + i; };
    auto fill_destination = [&]() -> Ok {
      for (size_t i = 0; i < o.batch; ++i) {
        uint64_t dst = seed_of(i) + 500;
        if (write) {
          SIESTA_TRY(ask(fmt::format("fill {} {} {}", i * size, size, dst)));
        } else {
          SIESTA_TRY(local->fill(i * size, size, dst));
        }
      }
      return {};
    };
    for (size_t i = 0; i < o.batch; ++i) {
      uint64_t src = seed_of(i);
      if (write) {
        SIESTA_TRY(local->fill(i * size, size, src));
      } else {
        SIESTA_TRY(ask(fmt::format("fill {} {} {}", i * size, size, src)));
      }
    }
    SIESTA_TRY(fill_destination());
    auto one_transfer = [&](Initiator& in) -> Result<double> {
      auto t0 = Clock::now();
      SIESTA_ASSIGN_OR_RETURN(XferId id,
                              in.engine->submit(in.peer_id, o.op, in.entries, std::nullopt, Clock::now() + kStepWait));
      XferStatus st = in.engine->wait(id, Clock::now() + kStepWait);
      if (st.pending()) return timeout("a benchmark transfer did not finish in 120 s");
      if (st.failed()) return st.why;
      return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    };
    auto limit_once = [&]() -> Ok {
      if (probe) return probe->put_batch(size, o.batch, Clock::now() + kStepWait);
      if (o.memory == MemoryKind::kHost) {
        for (size_t i = 0; i < o.batch; ++i)
          std::memcpy(limit_dst->base() + i * size, limit_src->base() + i * size, size);
        return {};
      }
      return ipc::cuda_copy({{limit_dst->base(), limit_src->base(), per_xfer}}, o.cuda_device);
    };
    // CUDA memory: also the same entries as separate copies, one each.
    const bool entries_limit = !probe && o.memory == MemoryKind::kCuda;
    auto entries_limit_once = [&]() -> Ok {
      std::vector<ipc::CopyPiece> pieces;
      for (size_t i = 0; i < o.batch; ++i)
        pieces.push_back({limit_dst->base() + i * size, limit_src->base() + i * size, size});
      return ipc::cuda_copy(pieces, o.cuda_device);
    };
    if (entries_limit)
      for (int w = 0; w < 2; ++w) SIESTA_TRY(entries_limit_once());
    for (Initiator& in : initiators)
      for (int w = 0; w < 2; ++w) SIESTA_TRY(one_transfer(in));
    for (int w = 0; w < 2; ++w) SIESTA_TRY(limit_once());
    // The engine (each of its copy paths) and its limit take turns in rounds,
    // so that load from elsewhere on the machine falls on all alike.
    size_t rounds = std::min<size_t>(kRounds, iters);
    std::vector<std::vector<double>> latencies(initiators.size());
    std::vector<double> seconds(initiators.size(), 0.0);
    double limit_seconds = 0, entries_limit_seconds = 0;
    for (size_t r = 0; r < rounds; ++r) {
      size_t n = iters * (r + 1) / rounds - iters * r / rounds;
      for (size_t k = 0; k < initiators.size(); ++k) {
        auto start = Clock::now();
        for (size_t i = 0; i < n; ++i) {
          SIESTA_ASSIGN_OR_RETURN(double us, one_transfer(initiators[k]));
          latencies[k].push_back(us);
        }
        seconds[k] += std::chrono::duration<double>(Clock::now() - start).count();
      }
      auto limit_start = Clock::now();
      for (size_t i = 0; i < n; ++i) SIESTA_TRY(limit_once());
      limit_seconds += std::chrono::duration<double>(Clock::now() - limit_start).count();
      if (entries_limit) {
        auto entries_start = Clock::now();
        for (size_t i = 0; i < n; ++i) SIESTA_TRY(entries_limit_once());
        entries_limit_seconds += std::chrono::duration<double>(Clock::now() - entries_start).count();
      }
    }

    auto verify = [&]() -> Result<bool> {
      for (size_t i = 0; i < o.batch; ++i) {
        SIESTA_ASSIGN_OR_RETURN(uint64_t mine, local->hash(i * size, size));
        SIESTA_ASSIGN_OR_RETURN(std::string theirs, ask(fmt::format("hash {} {}", i * size, size)));
        if (std::to_string(mine) != theirs || mine != local->expected_hash(size, seed_of(i))) return false;
      }
      return true;
    };
    double moved = static_cast<double>(per_xfer) * static_cast<double>(iters);
    for (size_t k = 0; k < initiators.size(); ++k) {
      // One path: its timed transfers left the bytes. Several: each path
      // copies over a fresh destination once more, and is verified alone.
      if (initiators.size() > 1) {
        SIESTA_TRY(fill_destination());
        SIESTA_TRY(one_transfer(initiators[k]));
      }
      TransferBenchRow row;
      SIESTA_ASSIGN_OR_RETURN(row.verified, verify());
      row.bytes = size;
      row.batch = o.batch;
      row.iterations = iters;
      row.gb_per_s = moved / seconds[k] / 1e9;
      row.limit_gb_per_s = moved / limit_seconds / 1e9;
      if (entries_limit) row.entries_limit_gb_per_s = moved / entries_limit_seconds / 1e9;
      row.p50_us = percentile(latencies[k], 0.50);
      row.p99_us = percentile(latencies[k], 0.99);
      if (cuda_ipc) row.ipc_copy = initiators[k].ipc_copy;
      report.rows.push_back(row);
    }
  }
  return report;
}

}  // namespace siesta::transfer
