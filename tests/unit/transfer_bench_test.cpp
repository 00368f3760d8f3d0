// The transfer benchmark end to end (what `siesta bench transfer` runs):
// this test binary is its own peer process (the static initializer below
// serves when the benchmark starts it).
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/log.h"
#include "bench/transfer/bench_memory.h"
#include "bench/transfer/transfer_bench.h"

namespace siesta::transfer {
namespace {

const int kPeerMode = [] {
  if (!transfer_bench_peer_requested()) return 0;
  init_logging("warn");
  std::_Exit(serve_transfer_bench_peer());
}();

TransferBenchOptions options(const std::string& backend, std::vector<size_t> sizes, size_t batch) {
  TransferBenchOptions o;
  o.backend = backend;
  o.sizes = std::move(sizes);
  o.batch = batch;
  o.iterations = 5;
  o.peer_argv = {"/proc/self/exe"};
  return o;
}

// `paths`: the initiator's copy paths, a row each per size (ipc with CUDA memory).
void expect_rows(const Result<TransferBenchReport>& report, const std::vector<size_t>& sizes, size_t batch,
                 const std::vector<std::string>& paths = {""}) {
  ASSERT_TRUE(report) << report.error().message;
  ASSERT_EQ(report->rows.size(), sizes.size() * paths.size());
  EXPECT_FALSE(report->limit.empty());
  for (size_t i = 0; i < report->rows.size(); ++i) {
    const TransferBenchRow& r = report->rows[i];
    EXPECT_EQ(r.bytes, sizes[i / paths.size()]);
    EXPECT_EQ(r.ipc_copy, paths[i % paths.size()]);
    EXPECT_EQ(r.batch, batch);
    EXPECT_EQ(r.iterations, 5u);
    EXPECT_TRUE(r.verified) << "size " << r.bytes;
    EXPECT_GT(r.gb_per_s, 0);
    EXPECT_GT(r.limit_gb_per_s, 0);
    EXPECT_GT(r.p99_us, 0);
    EXPECT_LE(r.p50_us, r.p99_us);
  }
}

TEST(TransferBench, IpcWritesAndReadsVerifyEveryByte) {
  expect_rows(run_transfer_bench(options("ipc", {4096, 1u << 20}, 3)), {4096, 1u << 20}, 3);
  TransferBenchOptions read = options("ipc", {65536}, 2);
  read.op = XferOp::kRead;
  expect_rows(run_transfer_bench(read), {65536}, 2);
}

TEST(TransferBench, UcxOverTcpAgainstTheRawPutLoop) {
  TransferBenchOptions o = options("ucx", {4096, 256u << 10}, 2);
  o.ucx_transports = "tcp";
  o.ucx_net_devices = "lo";
  expect_rows(run_transfer_bench(o), {4096, 256u << 10}, 2);
}

// Host memory through the staging path that CUDA memory takes where UCX
// cannot register it: every byte verified, writes and reads.
TEST(TransferBench, UcxStagedOverTcpVerifiesEveryByte) {
  TransferBenchOptions o = options("ucx", {4096, 1u << 20, 6u << 20}, 2);
  o.ucx_staging = "always";
  expect_rows(run_transfer_bench(o), {4096, 1u << 20, 6u << 20}, 2);
  o.op = XferOp::kRead;
  expect_rows(run_transfer_bench(o), {4096, 1u << 20, 6u << 20}, 2);
}

// CUDA memory over ucx: staged where this UCX has no CUDA support. Without a
// GPU the benchmark refuses at once and says why.
TEST(TransferBench, UcxCudaMemoryOrAClearRefusal) {
  TransferBenchOptions o = options("ucx", {4096, 1u << 20, 16u << 20}, 3);
  o.memory = MemoryKind::kCuda;
  auto probe = BenchMemory::create(MemoryKind::kCuda, 1u << 20, 0);
  if (!probe) {
    auto report = run_transfer_bench(o);
    ASSERT_FALSE(report);
    EXPECT_NE(report.error().message.find("--memory cuda"), std::string::npos) << report.error().message;
    EXPECT_NE(report.error().message.find("CUDA"), std::string::npos) << report.error().message;
    return;
  }
  probe->reset();
  expect_rows(run_transfer_bench(o), {4096, 1u << 20, 16u << 20}, 3);
  o.op = XferOp::kRead;
  expect_rows(run_transfer_bench(o), {4096, 1u << 20, 16u << 20}, 3);
}

// Runs where a GPU is (the device machine); skipped elsewhere. The default
// (the gather kernel on one GPU), then both copy paths in the same rounds, each
// verified on its own, with entries of an odd size too (every entry after the
// first then starts at an unaligned offset).
TEST(TransferBench, IpcCudaMemoryBetweenTwoProcesses) {
  auto probe = BenchMemory::create(MemoryKind::kCuda, 1u << 20, 0);
  if (!probe) GTEST_SKIP() << "no CUDA memory here: " << probe.error().message;
  probe->reset();
  const std::vector<size_t> sizes = {4093, 1u << 20, 16u << 20};
  TransferBenchOptions o = options("ipc", sizes, 3);
  o.memory = MemoryKind::kCuda;
  expect_rows(run_transfer_bench(o), sizes, 3, {"auto"});
  o.ipc_copy = "both";
  expect_rows(run_transfer_bench(o), sizes, 3, {"kernel", "copy_engine"});
  o.op = XferOp::kRead;
  expect_rows(run_transfer_bench(o), sizes, 3, {"kernel", "copy_engine"});
}

// Comparing copy paths only means something for CUDA memory over ipc.
TEST(TransferBench, IpcCopyBothNeedsCudaMemoryOverIpc) {
  TransferBenchOptions o = options("ipc", {4096}, 1);
  o.ipc_copy = "both";
  auto report = run_transfer_bench(o);
  ASSERT_FALSE(report);
  EXPECT_NE(report.error().message.find("--memory cuda"), std::string::npos) << report.error().message;
  o.memory = MemoryKind::kCuda;
  o.ipc_copy = "fastest";
  report = run_transfer_bench(o);
  ASSERT_FALSE(report);
  EXPECT_NE(report.error().message.find("ipc_copy"), std::string::npos) << report.error().message;
}

TEST(TransferBench, ParsesSizesAndRefusesNonsense) {
  auto sizes = parse_byte_sizes("64M,4K,1m,4096");
  ASSERT_TRUE(sizes);
  EXPECT_EQ(*sizes, (std::vector<size_t>{4096, 4096, 1u << 20, 64u << 20}));
  auto bad = parse_byte_sizes("4Q");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("4Q"), std::string::npos) << bad.error().message;
  EXPECT_FALSE(parse_byte_sizes(""));
  EXPECT_FALSE(parse_byte_sizes("K"));
}

}  // namespace
}  // namespace siesta::transfer
