// The ipc backend's copies of CUDA memory (src/transfer/ipc/piece_copy.h):
// which pieces take the SM gather kernel, and that the kernel and the copy
// engines put every byte where a host reference says, for thousands of random
// pieces (odd sizes, unaligned and differently aligned ends, shuffled order)
// between cudaMalloc buffers, between cuMem allocations (one of them imported
// from its POSIX FD as a peer's is) and through two ipc transfer engines.
// The GPU cases skip, with the reason, where there is no CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "transfer/ipc/cuda_import.h"
#include "transfer/ipc/piece_copy.h"
#include "transfer/transfer_config.h"
#include "transfer/transfer_engine.h"

#ifdef SIESTA_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gather/gather_copy.h"
#endif

namespace siesta::transfer::ipc {
namespace {

#ifdef SIESTA_HAVE_CUDA
using gather::gather_share;
using gather::GatherShare;
using gather::kGatherFewPieces;
using gather::kGatherManyPieces;
#endif

TEST(TransferIpcCopyPath, ParsesItsThreeNamesAndRefusesOthers) {
  for (IpcCopy p : {IpcCopy::kAuto, IpcCopy::kKernel, IpcCopy::kCopyEngine}) {
    auto parsed = parse_ipc_copy(ipc_copy_name(p));
    ASSERT_TRUE(parsed) << parsed.error().message;
    EXPECT_EQ(*parsed, p);
  }
  auto bad = parse_ipc_copy("fast");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.error().message.find("auto, kernel or copy_engine"), std::string::npos) << bad.error().message;
}

TEST(TransferIpcCopyPath, TheKernelOnlyWhereTheCopyingDeviceReachesBothEnds) {
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kThisDevice, 1 << 20));
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kThisDevice, uint64_t{1} << 30));
  // Across GPUs: the kernel for pieces of less than 8 MiB on average (1.75 MiB KV blocks), not above.
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kPeerDevice, uint64_t{7} << 18));
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kPeerDevice, kPeerKernelMaxAverage - 1));
  EXPECT_FALSE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kPeerDevice, kPeerKernelMaxAverage));
  EXPECT_FALSE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kPeerDevice, uint64_t{448} << 20));
  EXPECT_FALSE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kElsewhere, 1 << 20));
  EXPECT_FALSE(copies_with_kernel(IpcCopy::kAuto, PieceEnds::kElsewhere, 4096));
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kKernel, PieceEnds::kPeerDevice, uint64_t{448} << 20));
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kKernel, PieceEnds::kThisDevice, 1 << 20));
  EXPECT_TRUE(copies_with_kernel(IpcCopy::kKernel, PieceEnds::kPeerDevice, 1 << 20));
  EXPECT_FALSE(copies_with_kernel(IpcCopy::kKernel, PieceEnds::kElsewhere, 1 << 20));
  for (PieceEnds e : {PieceEnds::kThisDevice, PieceEnds::kPeerDevice, PieceEnds::kElsewhere})
    EXPECT_FALSE(copies_with_kernel(IpcCopy::kCopyEngine, e, 1 << 20));
}

[[maybe_unused]] TransferConfig engine_config(const std::string& id, const std::string& ipc_copy) {
  TransferConfig c;
  c.engine_id = id;
  c.backend = BackendKind::kIpc;
  c.side_channel.host = "127.0.0.1";
  c.side_channel.port = 0;
  c.ipc_copy = parse_ipc_copy(ipc_copy).value();
  return c;
}

// An engine's ipc_copy is parsed from the config's text: an unknown name is refused there, naming it.
TEST(TransferIpcCopyPath, AnUnknownIpcCopyIsRefused) {
  auto copy = parse_ipc_copy("sm");
  ASSERT_FALSE(copy);
  EXPECT_EQ(copy.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(copy.error().message.find("ipc_copy"), std::string::npos) << copy.error().message;
  EXPECT_NE(copy.error().message.find("'sm'"), std::string::npos) << copy.error().message;
}

#ifdef SIESTA_HAVE_CUDA

// The kernel's shares: equal, 256-byte multiples, every byte in exactly one,
// no CTA beyond the grid or without bytes; tiny transfers take few CTAs,
// thousands of tiny pieces many.
TEST(TransferIpcGatherShare, EqualSharesCoverEveryByteOnce) {
  for (uint64_t total : {uint64_t{1}, uint64_t{255}, uint64_t{4096}, uint64_t{16} << 10, (uint64_t{16} << 10) + 1,
                         uint64_t{4} << 20, (uint64_t{448} << 20) + 12345, uint64_t{1} << 36}) {
    for (uint64_t pieces : {uint64_t{1}, uint64_t{4}, uint64_t{256}, uint64_t{20000}}) {
      for (int grid : {1, 7, 396}) {
        SCOPED_TRACE(std::to_string(total) + " bytes, " + std::to_string(pieces) + " pieces, grid " +
                     std::to_string(grid));
        GatherShare s = gather_share(total, pieces, grid);
        EXPECT_EQ(s.total, total);
        ASSERT_GE(s.ctas, 1);
        EXPECT_LE(s.ctas, grid);
        EXPECT_EQ(s.per_cta % 256, 0u);
        // CTA b copies [b * per_cta, min(total, (b + 1) * per_cta)): all of it, none empty.
        EXPECT_GE(static_cast<uint64_t>(s.ctas) * s.per_cta, total);
        EXPECT_LT(static_cast<uint64_t>(s.ctas - 1) * s.per_cta, total);
        // Equal: no CTA holds more than its fair part plus the rounding.
        EXPECT_LE(s.per_cta, (total + s.ctas - 1) / s.ctas + 255);
        if (pieces > total) continue;  // every piece has a byte or more
        if (total <= (uint64_t{16} << 10) && pieces <= 8) {
          EXPECT_EQ(s.ctas, 1);
        }
        // Large transfers, or many pieces: the whole grid, less what rounding to 256 bytes takes.
        const uint64_t wanted = std::max((total + (16 << 10) - 1) / (16 << 10), (pieces + 7) / 8);
        if (wanted >= static_cast<uint64_t>(grid)) {
          EXPECT_GE(static_cast<uint64_t>(s.ctas) + 1 + static_cast<uint64_t>(grid) * grid * 256 / total,
                    static_cast<uint64_t>(grid));
        }
      }
    }
  }
  EXPECT_EQ(gather_share(0, 0, 396).ctas, 0);
}

std::string no_gpu_reason() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
  if (n == 0) return "no CUDA device";
  return "";
}

#define SIESTA_REQUIRE_GPU()                         \
  do {                                               \
    std::string why_ = no_gpu_reason();              \
    if (!why_.empty()) GTEST_SKIP() << why_;         \
  } while (0)

struct DeviceBuffer {
  char* data = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) == cudaSuccess) data = static_cast<char*>(p);
  }
  ~DeviceBuffer() {
    if (data != nullptr) cudaFree(data);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Exportable {
  CudaExportable memory;
  explicit Exportable(size_t bytes) {
    auto m = cuda_alloc_exportable(bytes, 0);
    if (m) memory = *m;
  }
  ~Exportable() { cuda_free_exportable(memory); }
  Exportable(const Exportable&) = delete;
  Exportable& operator=(const Exportable&) = delete;
  char* data() const { return static_cast<char*>(memory.base); }
};

// One piece by offsets into a source and a destination buffer.
struct Span {
  size_t src = 0, dst = 0, bytes = 0;
};

// `count` pieces of random sizes (mostly up to 64 KiB, odd ones among them,
// plus a few of several MiB that span many kernel chunks) laid out in the
// source in order and in the destination in a shuffled order, with random
// gaps: no two sources and no two destinations overlap. Half the pieces have
// both ends 16-byte aligned, a fifth both misaligned alike, the rest ends of
// unrelated alignment (the kernel's 8-, 4- and 1-byte paths).
std::vector<Span> random_layout(std::mt19937_64& rng, size_t count, size_t* src_bytes, size_t* dst_bytes) {
  std::vector<Span> spans(count);
  std::vector<size_t> src_mis(count), dst_mis(count);
  auto uniform = [&](size_t lo, size_t hi) { return std::uniform_int_distribution<size_t>(lo, hi)(rng); };
  for (size_t i = 0; i < count; ++i) {
    size_t kind = uniform(0, 99);
    size_t bytes = kind < 40 ? uniform(1, 4096) * 16 : kind < 70 ? uniform(1, 4095) : uniform(4096, 65536 + 7);
    if (i % 500 == 7) bytes = size_t{7} << 18;               // 1.75 MiB: a Qwen3-0.6B KV block
    if (i % 1000 == 11) bytes = (size_t{9} << 20) + 3;       // several chunks and an odd tail
    spans[i].bytes = bytes;
    size_t align = uniform(0, 9);
    if (align < 5) {
      src_mis[i] = dst_mis[i] = 0;
    } else if (align < 7) {
      src_mis[i] = dst_mis[i] = uniform(1, 15);
    } else {
      src_mis[i] = uniform(0, 15);
      dst_mis[i] = uniform(0, 15);
    }
  }
  size_t cursor = 0;
  for (size_t i = 0; i < count; ++i) {
    cursor = (cursor + uniform(0, 256) + 15) / 16 * 16 + src_mis[i];
    spans[i].src = cursor;
    cursor += spans[i].bytes;
  }
  *src_bytes = cursor + 16;
  std::vector<size_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  cursor = 0;
  for (size_t i : order) {
    cursor = (cursor + uniform(0, 256) + 15) / 16 * 16 + dst_mis[i];
    spans[i].dst = cursor;
    cursor += spans[i].bytes;
  }
  *dst_bytes = cursor + 16;
  std::shuffle(spans.begin(), spans.end(), rng);  // the list is in no particular order either
  return spans;
}

std::vector<char> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

// Where `got` first differs from `want`, with the count of differing bytes.
std::string first_difference(const std::vector<char>& got, const std::vector<char>& want) {
  size_t first = got.size(), count = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first == got.size()) first = i;
      ++count;
    }
  }
  if (count == 0) return "";
  return std::to_string(count) + " bytes differ, the first at offset " + std::to_string(first);
}

// Fills `src` and `dst` (device memory) with random bytes, copies `spans`
// (each with the kernel when `kernel_share` of a coin says so, else with the
// copy engines, all in one call) and compares the whole destination with a
// host reference: every piece landed, nothing else was touched.
void copy_and_check(std::mt19937_64& rng, const std::vector<Span>& spans, char* src, size_t src_bytes, char* dst,
                    size_t dst_bytes, double kernel_share) {
  std::vector<char> host_src = random_bytes(rng, src_bytes);
  std::vector<char> want = random_bytes(rng, dst_bytes);
  ASSERT_TRUE(cuda_copy({{src, host_src.data(), src_bytes}, {dst, want.data(), dst_bytes}}, 0));
  std::vector<CopyPiece> by_kernel, by_copy_engine;
  std::bernoulli_distribution coin(kernel_share);
  for (const Span& s : spans) {
    (coin(rng) ? by_kernel : by_copy_engine).push_back({dst + s.dst, src + s.src, s.bytes});
    std::memcpy(want.data() + s.dst, host_src.data() + s.src, s.bytes);
  }
  Ok copied = cuda_copy_pieces(by_kernel, by_copy_engine, 0);
  ASSERT_TRUE(copied) << copied.error().message;
  std::vector<char> got(dst_bytes);
  ASSERT_TRUE(cuda_copy({{got.data(), dst, dst_bytes}}, 0));
  EXPECT_EQ(first_difference(got, want), "") << by_kernel.size() << " pieces by the kernel, " << by_copy_engine.size()
                                             << " by the copy engines";
}

TEST(TransferIpcPieceCopy, ThousandsOfRandomPiecesBetweenDeviceBuffers) {
  SIESTA_REQUIRE_GPU();
  std::mt19937_64 rng(20240607);
  size_t src_bytes = 0, dst_bytes = 0;
  std::vector<Span> spans = random_layout(rng, 3000, &src_bytes, &dst_bytes);
  DeviceBuffer src(src_bytes), dst(dst_bytes);
  ASSERT_NE(src.data, nullptr);
  ASSERT_NE(dst.data, nullptr);
  // Every piece by the kernel, then the same list split between the kernel
  // and the copy engines in one call, then every piece by the copy engines.
  for (double kernel_share : {1.0, 0.5, 0.0}) {
    SCOPED_TRACE("share of pieces by the kernel: " + std::to_string(kernel_share));
    copy_and_check(rng, spans, src.data, src_bytes, dst.data, dst_bytes, kernel_share);
  }
}

TEST(TransferIpcPieceCopy, ManyTinyPiecesAndPiecesOfNoBytes) {
  SIESTA_REQUIRE_GPU();
  std::mt19937_64 rng(7);
  // 20000 pieces of 1 to 3 bytes: more chunks than CTAs, every one a byte path.
  std::vector<Span> spans;
  size_t cursor = 0;
  for (size_t i = 0; i < 20000; ++i) {
    size_t n = 1 + i % 3;
    spans.push_back({cursor, cursor, n});
    cursor += n + i % 5;
  }
  std::shuffle(spans.begin(), spans.end(), rng);
  DeviceBuffer src(cursor), dst(cursor);
  ASSERT_NE(src.data, nullptr);
  ASSERT_NE(dst.data, nullptr);
  copy_and_check(rng, spans, src.data, cursor, dst.data, cursor, 1.0);

  EXPECT_TRUE(cuda_copy_pieces({}, {}, 0));
  std::vector<CopyPiece> empty = {{dst.data, src.data, 0}, {dst.data + 1, src.data + 1, 0}};
  EXPECT_TRUE(cuda_copy_pieces(empty, empty, 0));
}

// Up to kGatherFewPieces pieces travel in a small launch, up to
// kGatherManyPieces in a large one, more in an uploaded table: both sides of
// each line, with pieces of many
// chunks each (a chunk finds its piece by binary search) and with zero-byte
// pieces among them, which take no entry.
TEST(TransferIpcPieceCopy, PiecesInTheLaunchParametersAndJustTooMany) {
  SIESTA_REQUIRE_GPU();
  std::mt19937_64 rng(31337);
  for (size_t count : {size_t{1}, size_t{2}, size_t{17}, size_t{kGatherFewPieces - 1}, size_t{kGatherFewPieces},
                       size_t{kGatherFewPieces + 1}, size_t{kGatherManyPieces}, size_t{kGatherManyPieces + 1}}) {
    SCOPED_TRACE("pieces: " + std::to_string(count));
    size_t src_bytes = 0, dst_bytes = 0;
    std::vector<Span> spans = random_layout(rng, count, &src_bytes, &dst_bytes);
    DeviceBuffer src(src_bytes), dst(dst_bytes);
    ASSERT_NE(src.data, nullptr);
    ASSERT_NE(dst.data, nullptr);
    copy_and_check(rng, spans, src.data, src_bytes, dst.data, dst_bytes, 1.0);
  }
  // Large pieces: a few MiB each and odd, so that each spans several chunks.
  for (size_t count : {size_t{3}, size_t{kGatherFewPieces}}) {
    SCOPED_TRACE("large pieces: " + std::to_string(count));
    std::vector<Span> spans;
    size_t cursor = 0;
    for (size_t i = 0; i < count; ++i) {
      size_t bytes = (size_t{1} << 20) * (1 + i % 5) + 16 * i + (i % 3);
      spans.push_back({cursor, cursor + (i % 4), bytes});
      cursor += bytes + 64;
    }
    std::shuffle(spans.begin(), spans.end(), rng);
    DeviceBuffer src(cursor + 16), dst(cursor + 16);
    ASSERT_NE(src.data, nullptr);
    ASSERT_NE(dst.data, nullptr);
    copy_and_check(rng, spans, src.data, cursor + 16, dst.data, cursor + 16, 1.0);
  }
  // Zero-byte pieces between real ones do not count against the parameters.
  DeviceBuffer src(1 << 20), dst(1 << 20);
  ASSERT_NE(src.data, nullptr);
  ASSERT_NE(dst.data, nullptr);
  std::vector<Span> spans;
  for (size_t i = 0; i < kGatherFewPieces; ++i) spans.push_back({i * 4096, i * 4096, 4000 + i});
  for (size_t i = 0; i < 3 * kGatherFewPieces; ++i) spans.push_back({i, i, 0});
  std::shuffle(spans.begin(), spans.end(), rng);
  copy_and_check(rng, spans, src.data, 1 << 20, dst.data, 1 << 20, 1.0);
}

// The memory the ipc backend copies between: cuMem allocations, one side
// imported from its POSIX FD as a peer's region is.
TEST(TransferIpcPieceCopy, ThousandsOfRandomPiecesBetweenCuMemAllocations) {
  SIESTA_REQUIRE_GPU();
  std::mt19937_64 rng(99);
  size_t src_bytes = 0, dst_bytes = 0;
  std::vector<Span> spans = random_layout(rng, 2000, &src_bytes, &dst_bytes);
  Exportable src(src_bytes), dst(dst_bytes);
  ASSERT_NE(src.data(), nullptr);
  ASSERT_NE(dst.data(), nullptr);
  copy_and_check(rng, spans, src.data(), src_bytes, dst.data(), dst_bytes, 1.0);

  // Into an imported mapping of the destination; read back through the owner's.
  auto imported = cuda_import(dst.memory.fd, dst.memory.bytes, 0);
  ASSERT_TRUE(imported) << imported.error().message;
  EXPECT_EQ(imported->owner_device, 0);
  char* alias = reinterpret_cast<char*>(imported->address);
  std::vector<char> host_src = random_bytes(rng, src_bytes);
  std::vector<char> want = random_bytes(rng, dst_bytes);
  ASSERT_TRUE(cuda_copy({{src.data(), host_src.data(), src_bytes}, {dst.data(), want.data(), dst_bytes}}, 0));
  std::vector<CopyPiece> pieces;
  for (const Span& s : spans) {
    pieces.push_back({alias + s.dst, src.data() + s.src, s.bytes});
    std::memcpy(want.data() + s.dst, host_src.data() + s.src, s.bytes);
  }
  Ok copied = cuda_copy_pieces(pieces, {}, 0);
  ASSERT_TRUE(copied) << copied.error().message;
  std::vector<char> got(dst_bytes);
  ASSERT_TRUE(cuda_copy({{got.data(), dst.data(), dst_bytes}}, 0));
  EXPECT_EQ(first_difference(got, want), "");
  cuda_release(*imported);
}

// Two ipc engines in this process, each with a cuMem region: random batches
// of entries (odd sizes, unaligned offsets) written and read through the
// backend with each ipc_copy, every byte of both regions checked.
class TransferIpcCudaEngines : public ::testing::TestWithParam<const char*> {};

TEST_P(TransferIpcCudaEngines, RandomBatchesLandByteForByte) {
  SIESTA_REQUIRE_GPU();
  using namespace std::chrono_literals;
  constexpr size_t kBytes = size_t{48} << 20;
  Exportable mine(kBytes), theirs(kBytes);
  ASSERT_NE(mine.data(), nullptr);
  ASSERT_NE(theirs.data(), nullptr);
  auto spec = [](const Exportable& e) {
    RegionSpec s;
    s.base = e.data();
    s.bytes = e.memory.bytes;
    s.kind = MemoryKind::kCuda;
    s.export_fd = e.memory.fd;
    s.export_bytes = e.memory.bytes;
    s.cuda_device = 0;
    return s;
  };
  auto initiator = TransferEngine::create(engine_config(std::string("copy-initiator-") + GetParam(), GetParam()));
  ASSERT_TRUE(initiator) << initiator.error().message;
  auto target = TransferEngine::create(engine_config(std::string("copy-target-") + GetParam(), "auto"));
  ASSERT_TRUE(target) << target.error().message;
  auto local = (*initiator)->register_region(spec(mine));
  auto remote = (*target)->register_region(spec(theirs));
  ASSERT_TRUE(local && remote);
  auto peer = (*initiator)->connect((*target)->address(), Clock::now() + 30s);
  ASSERT_TRUE(peer) << peer.error().message;

  std::mt19937_64 rng(4242);
  std::vector<char> host_mine = random_bytes(rng, kBytes), host_theirs = random_bytes(rng, kBytes);
  ASSERT_TRUE(cuda_copy({{mine.data(), host_mine.data(), kBytes}, {theirs.data(), host_theirs.data(), kBytes}}, 0));
  for (int round = 0; round < 6; ++round) {
    XferOp op = round % 2 == 0 ? XferOp::kWrite : XferOp::kRead;
    size_t a = 0, b = 0;
    std::vector<Span> spans = random_layout(rng, 400, &a, &b);
    spans.erase(std::remove_if(spans.begin(), spans.end(),
                               [&](const Span& s) { return s.src + s.bytes > kBytes || s.dst + s.bytes > kBytes; }),
                spans.end());
    std::vector<XferEntry> entries;
    for (const Span& s : spans) {
      // src offsets on the side that is read, dst offsets on the side written.
      if (op == XferOp::kWrite) {
        entries.push_back({*local, s.src, *remote, s.dst, s.bytes});
        std::memcpy(host_theirs.data() + s.dst, host_mine.data() + s.src, s.bytes);
      } else {
        entries.push_back({*local, s.dst, *remote, s.src, s.bytes});
        std::memcpy(host_mine.data() + s.dst, host_theirs.data() + s.src, s.bytes);
      }
    }
    ASSERT_FALSE(entries.empty());
    auto id = (*initiator)->submit(*peer, op, entries, std::nullopt, Clock::now() + 60s);
    ASSERT_TRUE(id) << id.error().message;
    XferStatus st = (*initiator)->wait(*id, Clock::now() + 60s);
    ASSERT_TRUE(st.done()) << (st.failed() ? st.why.message : "still pending");
    std::vector<char> got_mine(kBytes), got_theirs(kBytes);
    ASSERT_TRUE(cuda_copy({{got_mine.data(), mine.data(), kBytes}, {got_theirs.data(), theirs.data(), kBytes}}, 0));
    EXPECT_EQ(first_difference(got_theirs, host_theirs), "") << "round " << round << " (" << entries.size()
                                                             << " entries), the target's region";
    EXPECT_EQ(first_difference(got_mine, host_mine), "") << "round " << round << ", the initiator's region";
  }
}

INSTANTIATE_TEST_SUITE_P(IpcCopy, TransferIpcCudaEngines, ::testing::Values("auto", "kernel", "copy_engine"));

#else  // !SIESTA_HAVE_CUDA

TEST(TransferIpcPieceCopy, NeedsACudaBuild) { GTEST_SKIP() << "this build has no CUDA"; }

#endif

}  // namespace
}  // namespace siesta::transfer::ipc
