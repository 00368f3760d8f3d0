// siesta bench transfer --backend ipc|ucx [--memory host|cuda] --sizes 4K,64K,1M,16M,64M --batch N [--json]
//                       [--ucx-staging auto|always|never] [--ipc-copy auto|kernel|copy_engine|both]
//
// Bandwidth and latency of the transfer engine between two processes (this
// one and a copy of itself as the peer), with the limit measured in the same
// run and every byte verified: src/transfer/transfer_bench.h says how. Prints
// one table, or with --json a list with, per size, bytes, gb_per_s,
// limit_gb_per_s, p50_us, p99_us and verified (and, for ipc with CUDA memory,
// ipc_copy: --ipc-copy both gives a row per copy path, measured in the same
// rounds; and entries_limit_gb_per_s: cudaMemcpy of the same entries one call
// each, beside the limit's one call for all of a transfer's bytes).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <string>

#include "bench/transfer/transfer_bench.h"
#include "cli/commands.h"

namespace siesta::cli {

void add_bench_transfer_command(CLI::App& bench);

namespace {

struct Flags {
  std::string backend = "ipc";
  std::string memory = "host";
  std::string sizes = "4K,64K,1M,16M,64M";
  size_t batch = 4;
  std::string op = "write";
  size_t iterations = 0;
  std::string ucx_transports = "tcp";
  std::string ucx_net_devices = "lo";
  bool ucx_peer_error_handling = true;
  std::string ucx_staging = "auto";
  int cuda_device = 0;
  int peer_cuda_device = -1;
  std::string ipc_copy = "auto";
  bool json = false;
  bool serve_peer = false;
};

std::string human(size_t bytes) {
  if (bytes % (size_t{1} << 30) == 0) return fmt::format("{}G", bytes >> 30);
  if (bytes % (size_t{1} << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes % 1024 == 0) return fmt::format("{}K", bytes >> 10);
  return fmt::format("{}", bytes);
}

int run(const Flags& f) {
  if (f.serve_peer) return transfer::serve_transfer_bench_peer();
  transfer::TransferBenchOptions o;
  auto sizes = transfer::parse_byte_sizes(f.sizes);
  if (!sizes) {
    std::cerr << "siesta bench transfer: --sizes: " << sizes.error().message << "\n";
    return kExitUsage;
  }
  o.sizes = *sizes;
  o.backend = f.backend;
  o.memory = f.memory == "cuda" ? transfer::MemoryKind::kCuda : transfer::MemoryKind::kHost;
  o.batch = f.batch;
  o.op = f.op == "read" ? transfer::XferOp::kRead : transfer::XferOp::kWrite;
  o.iterations = f.iterations;
  o.ucx_transports = f.ucx_transports;
  o.ucx_net_devices = f.ucx_net_devices;
  o.ucx_peer_error_handling = f.ucx_peer_error_handling;
  o.ucx_staging = f.ucx_staging;
  o.cuda_device = f.cuda_device;
  o.peer_cuda_device = f.peer_cuda_device;
  o.ipc_copy = f.ipc_copy;
  o.peer_argv = {"/proc/self/exe", "bench", "transfer", "--serve-peer"};
  auto report = transfer::run_transfer_bench(o);
  if (!report) {
    std::cerr << "siesta bench transfer: " << report.error().message << "\n";
    return kExitFailure;
  }
  bool all_verified = true;
  if (f.json) {
    std::cout << "[\n";
    for (size_t i = 0; i < report->rows.size(); ++i) {
      const auto& r = report->rows[i];
      all_verified = all_verified && r.verified;
      std::string path = r.ipc_copy.empty() ? "" : fmt::format(", \"ipc_copy\": \"{}\"", r.ipc_copy);
      if (r.entries_limit_gb_per_s > 0)
        path += fmt::format(", \"entries_limit_gb_per_s\": {:.4f}", r.entries_limit_gb_per_s);
      std::cout << fmt::format(
          "  {{\"bytes\": {}, \"batch\": {}, \"op\": \"{}\", \"iterations\": {}, \"gb_per_s\": {:.4f}, "
          "\"limit_gb_per_s\": {:.4f}, \"p50_us\": {:.1f}, \"p99_us\": {:.1f}, \"verified\": {}{}}}{}\n",
          r.bytes, r.batch, f.op, r.iterations, r.gb_per_s, r.limit_gb_per_s, r.p50_us, r.p99_us,
          r.verified ? "true" : "false", path, i + 1 < report->rows.size() ? "," : "");
    }
    std::cout << "]" << std::endl;
  } else {
    bool paths = !report->rows.empty() && !report->rows.front().ipc_copy.empty();
    std::cout << fmt::format("transfer bench: backend {}, {} memory{}{}, {} of {} entries per transfer\nlimit: {}\n",
                             f.backend, f.memory,
                             f.backend == "ucx" && f.ucx_staging != "auto" ? ", staging " + f.ucx_staging : "",
                             paths ? ", ipc copy " + f.ipc_copy : "", f.op, f.batch, report->limit);
    std::cout << fmt::format("{:>8}{} {:>6} {:>10} {:>10} {:>7} {:>10} {:>10} {:>8}\n", "size",
                             paths ? fmt::format(" {:>11}", "copy") : "", "iters", "GB/s", "limit", "of lim", "p50 us",
                             "p99 us", "verified");
    for (const auto& r : report->rows) {
      all_verified = all_verified && r.verified;
      std::cout << fmt::format("{:>8}{} {:>6} {:>10.3f} {:>10.3f} {:>6.0f}% {:>10.1f} {:>10.1f} {:>8}\n", human(r.bytes),
                               paths ? fmt::format(" {:>11}", r.ipc_copy) : "", r.iterations, r.gb_per_s,
                               r.limit_gb_per_s, 100.0 * r.gb_per_s / r.limit_gb_per_s, r.p50_us, r.p99_us,
                               r.verified ? "yes" : "NO");
    }
  }
  if (!all_verified) {
    std::cerr << "siesta bench transfer: verification FAILED: transferred bytes differ from their source\n";
    return kExitFailure;
  }
  return 0;
}

}  // namespace

void add_bench_transfer_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("transfer", "Bandwidth and latency of the transfer engine between two processes");
  auto f = std::make_shared<Flags>();
  cmd->add_option("--backend", f->backend, "ipc | ucx")->check(CLI::IsMember({"ipc", "ucx"}))->capture_default_str();
  cmd->add_option("--memory", f->memory, "host | cuda")->check(CLI::IsMember({"host", "cuda"}))->capture_default_str();
  cmd->add_option("--sizes", f->sizes, "Entry sizes, comma separated (K, M, G: powers of 1024)")->capture_default_str();
  cmd->add_option("--batch", f->batch, "Entries per transfer")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--op", f->op, "write | read")->check(CLI::IsMember({"write", "read"}))->capture_default_str();
  cmd->add_option("--iters", f->iterations, "Timed transfers per size (default: about 512 MiB worth, 8 GiB for ipc of CUDA memory; 5 to 2000)");
  cmd->add_option("--ucx-transports", f->ucx_transports, "UCX_TLS of both processes (ucx)")->capture_default_str();
  cmd->add_option("--ucx-net-devices", f->ucx_net_devices, "UCX_NET_DEVICES of both processes (ucx)")
      ->capture_default_str();
  cmd->add_flag("!--no-ucx-peer-errors", f->ucx_peer_error_handling,
                "UCX endpoints without peer error handling (UCX 1.13 shared memory needs this)");
  cmd->add_option("--ucx-staging", f->ucx_staging,
                  "auto: CUDA memory through pinned host staging when UCX cannot register it; always: every region "
                  "(host memory too); never (ucx)")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  cmd->add_option("--cuda-device", f->cuda_device, "CUDA device for --memory cuda")->capture_default_str();
  cmd->add_option("--peer-cuda-device", f->peer_cuda_device,
                  "CUDA device of the peer's memory (default: --cuda-device); another GPU measures a cross-GPU "
                  "transfer against cudaMemcpyPeer");
  cmd->add_option("--ipc-copy", f->ipc_copy,
                  "ipc with CUDA memory, how the initiator copies: auto (the SM gather kernel on one GPU, copy engines "
                  "across GPUs), kernel (the kernel across GPUs too), copy_engine (cudaMemcpyAsync per piece), or "
                  "both: kernel and copy_engine in the same rounds, a row each")
      ->check(CLI::IsMember({"auto", "kernel", "copy_engine", "both"}))
      ->capture_default_str();
  cmd->add_flag("--json", f->json, "Print a JSON list instead of the table");
  cmd->add_flag("--serve-peer", f->serve_peer, "Run as the benchmark's peer process (started by the benchmark)")
      ->group("");
  cmd->callback([f] {
    int rc = run(*f);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace siesta::cli
