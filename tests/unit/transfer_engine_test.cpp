// TransferEngine between two processes on loopback, for every backend: this
// test binary spawns itself as the peer (SIESTA_TRANSFER_TEST_PEER=<case>),
// which registers two memfd-backed regions and answers test commands sent as
// opaque peer messages over the side channel.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "common/log.h"
#include "transfer/frame.h"
#include "transfer/messages.h"
#include "transfer/side_channel.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx/ucx_worker.h"
#include "transfer/wire.h"

extern char** environ;

namespace siesta::transfer {
namespace {

using namespace std::chrono_literals;

struct BackendCase {
  const char* name;
  const char* backend;
  const char* transports;
  const char* devices;
  bool peer_error_handling;
  const char* ucx_staging = "auto";       // this process's TransferConfig::ucx_staging
  const char* peer_ucx_staging = nullptr;  // the peer's; null: the same
  bool guarded = true;                     // TransferConfig::ucx_guarded of both
};

// UCX 1.13's shared-memory transports have no peer error handling: that case
// runs without it (the peer's exit is then seen through its pid). The staged
// cases move host memory through the ucx backend's staging path (what CUDA
// memory takes where UCX cannot register it) with chunks small enough that
// entries span several and a batch waits for free ones: on both sides, only
// ours (puts and gets through our chunks), only the peer's (its progress
// thread serves our active messages). Over tcp and shared memory UCX serves
// puts and gets in software on the target, so host regions move over guarded
// messages there; the _one_sided cases turn that off to cover the puts and
// gets between region-table checks that RDMA transports take.
const BackendCase kCases[] = {
    {"ipc", "ipc", "", "", true},
    {"ucx_tcp", "ucx", "tcp", "lo", true},
    {"ucx_sm", "ucx", "sm,self", "", false},
    {"ucx_tcp_one_sided", "ucx", "tcp", "lo", true, "auto", nullptr, false},
    {"ucx_sm_one_sided", "ucx", "sm,self", "", false, "auto", nullptr, false},
    {"ucx_tcp_staged", "ucx", "tcp", "lo", true, "always"},
    {"ucx_sm_staged", "ucx", "sm,self", "", false, "always"},
    {"ucx_tcp_staged_here", "ucx", "tcp", "lo", true, "always", "auto"},
    {"ucx_tcp_staged_there", "ucx", "tcp", "lo", true, "auto", "always"},
};
constexpr size_t kStagingChunkBytes = 16u << 10;
constexpr size_t kStagingChunks = 4;

void PrintTo(const BackendCase& c, std::ostream* os) { *os << c.name; }

const BackendCase* find_case(const std::string& name) {
  for (const BackendCase& c : kCases)
    if (name == c.name) return &c;
  return nullptr;
}

TransferConfig config_for(const BackendCase& c, const std::string& engine_id, bool peer = false) {
  TransferConfig cfg;
  cfg.engine_id = engine_id;
  cfg.backend = parse_backend_kind(c.backend).value();
  cfg.ucx_transports = c.transports;
  cfg.ucx_net_devices = c.devices;
  cfg.ucx_peer_error_handling = c.peer_error_handling;
  cfg.ucx_guarded = c.guarded;
  cfg.ucx_staging =
      parse_ucx_staging(peer && c.peer_ucx_staging != nullptr ? c.peer_ucx_staging : c.ucx_staging).value();
  cfg.ucx_staging_chunk_bytes = kStagingChunkBytes;
  cfg.ucx_staging_chunks = kStagingChunks;
  cfg.side_channel.host = "127.0.0.1";
  cfg.side_channel.port = 0;
  cfg.invalidate_drain_timeout = 2000ms;
  return cfg;
}

// Memory the test owns, backed by a memfd so the ipc backend can export it.
struct MemfdBuffer {
  int fd = -1;
  char* data = nullptr;
  size_t bytes = 0;

  MemfdBuffer(size_t n, const std::string& name) : bytes(n) {
    fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0) std::abort();
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) std::abort();
    data = static_cast<char*>(p);
  }
  ~MemfdBuffer() {
    munmap(data, bytes);
    close(fd);
  }
  MemfdBuffer(const MemfdBuffer&) = delete;
  MemfdBuffer& operator=(const MemfdBuffer&) = delete;

  RegionSpec spec() const {
    RegionSpec s;
    s.base = data;
    s.bytes = bytes;
    s.kind = MemoryKind::kHost;
    s.export_fd = fd;
    return s;
  }
};

uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint8_t>(z ^ (z >> 31));
}

void fill_pattern(char* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>(pattern_byte(seed, i));
}

uint64_t fnv1a(const char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint8_t>(p[i])) * 1099511628211ull;
  return h;
}

constexpr size_t kRegionBytes[2] = {1u << 20, 256u << 10};

// ---------------------------------------------------------------------------
// The peer process.

int run_peer(const BackendCase& c) {
  init_logging("warn");  // to stderr: stdout carries the ADDRESS line
  auto engine = TransferEngine::create(config_for(c, fmt::format("peer-{}", getpid()), true));
  if (!engine) {
    fprintf(stderr, "peer: %s\n", engine.error().message.c_str());
    return 1;
  }
  std::mutex mu;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers;
  std::vector<std::unique_ptr<MemfdBuffer>> extras;  // regions registered by "extra"
  std::vector<RegionId> ids;
  int generation = 0;
  for (size_t i = 0; i < 2; ++i) {
    buffers.push_back(std::make_unique<MemfdBuffer>(kRegionBytes[i], fmt::format("siesta-test-peer-{}-{}-{}", getpid(), i, generation)));
    fill_pattern(buffers[i]->data, kRegionBytes[i], i + 1);
    auto id = (*engine)->register_region(buffers[i]->spec());
    if (!id) return 2;
    ids.push_back(*id);
  }
  std::atomic<int> notes_ok{0}, notes_bad{0};
  std::atomic<bool> stop{false};
  std::thread checker([&] {
    while (!stop) {
      for (const Notification& n : (*engine)->wait_notifications(deadline_after(100ms))) {
        std::istringstream in(n.payload);
        std::string word;
        size_t i = 0, off = 0, len = 0;
        uint64_t hash = 0;
        in >> word >> i >> off >> len >> hash;
        std::lock_guard<std::mutex> lock(mu);
        bool ok = word == "check" && i < buffers.size() && off + len <= buffers[i]->bytes &&
                  fnv1a(buffers[i]->data + off, len) == hash;
        (ok ? notes_ok : notes_bad)++;
      }
    }
  });
  TransferEngine* e = engine->get();
  e->set_message_handler([&](const PeerMessage& m) -> Result<std::string> {
    std::istringstream in(m.payload);
    std::string cmd;
    in >> cmd;
    std::lock_guard<std::mutex> lock(mu);
    if (cmd == "ping") return std::string("pong");
    if (cmd == "ids") return fmt::format("{} {}", ids[0].value, ids[1].value);
    if (cmd == "read") {
      size_t i = 0, off = 0, len = 0;
      in >> i >> off >> len;
      if (i >= buffers.size() || off + len > buffers[i]->bytes) return invalid_argument("bad read");
      return std::string(buffers[i]->data + off, len);
    }
    if (cmd == "notes") return fmt::format("{} {}", notes_ok.load(), notes_bad.load());
    if (cmd == "dereg") {
      size_t i = 0;
      in >> i;
      SIESTA_TRY(e->deregister_region(ids[i]));
      return fmt::format("{}", e->epoch().value);
    }
    if (cmd == "rereg") {
      size_t i = 0;
      in >> i;
      ++generation;
      buffers[i] = std::make_unique<MemfdBuffer>(kRegionBytes[i], fmt::format("siesta-test-peer-{}-{}-{}", getpid(), i, generation));
      fill_pattern(buffers[i]->data, kRegionBytes[i], 100 + i);
      SIESTA_ASSIGN_OR_RETURN(ids[i], e->register_region(buffers[i]->spec()));
      return fmt::format("{} {}", ids[i].value, e->epoch().value);
    }
    if (cmd == "extra") {  // one more region, without telling anyone: the epoch moves on
      extras.push_back(std::make_unique<MemfdBuffer>(4096, fmt::format("siesta-test-peer-{}-extra", getpid())));
      SIESTA_TRY(e->register_region(extras.back()->spec()));
      return fmt::format("{}", e->epoch().value);
    }
    if (cmd == "invalidate") {
      InvalidateReport r = e->invalidate_peers(deadline_after(3000ms));
      std::string acked;
      for (const auto& id : r.acked) acked += id + ",";
      return fmt::format("acked={} unanswered={}", acked, r.unanswered.size());
    }
    return invalid_argument("unknown command " + cmd);
  });
  printf("ADDRESS %s\n", e->address().c_str());
  fflush(stdout);
  dup2(STDERR_FILENO, STDOUT_FILENO);  // the parent stops reading; later output (UCX logs) goes to stderr
  // Serve until the parent closes our stdin (or dies).
  char buf[64];
  while (read(STDIN_FILENO, buf, sizeof(buf)) > 0) {
  }
  stop = true;
  checker.join();
  engine->reset();
  return 0;
}

// UCX 1.13's shared-memory transports have no peer error handling. A staged
// peer that reads a dead initiator's data (CMA) is aborted by UCX itself; and
// an initiator killed while it writes into the peer's receive FIFO can leave
// the element it claimed there unfinished, which the peer's UCX then waits
// for forever, serving no one over shared memory again (seen in 2 to 4 runs
// in 25, one-sided and guarded alike; the peer's own threads stay idle).
constexpr const char* kSharedMemoryKillSkip =
    "UCX 1.13's shared-memory transports do not survive an initiator killed mid-transfer: a staged peer is aborted, "
    "and a killed writer can leave an unfinished element in the peer's receive FIFO that UCX waits for forever";

// Whether the hammer's transfers reach the peer's regions with puts and gets
// that the peer serves in software: UCX 1.13 over tcp emulates RMA on the
// target, and aborts the target when the initiator dies while it answers (a
// fatal "Endpoint timeout" in ucp_put_handler / ucp_get_req_handler). Host
// regions registered directly on both sides move over guarded messages there
// instead, and staged regions through the peer's staging; both are answered
// through endpoints of the peer's own and are not affected. What is left is
// an initiator whose own regions are staged, or which does not send guarded
// messages, writing to or reading from the peer's direct ones.
bool peer_serves_rma_in_software(const BackendCase& c) {
  const char* peer_staging = c.peer_ucx_staging ? c.peer_ucx_staging : c.ucx_staging;
  return std::string(c.backend) == "ucx" && std::string(c.transports) == "tcp" &&
         (!c.guarded || std::string(c.ucx_staging) == "always") && std::string(peer_staging) != "always";
}

// A second initiator (SIESTA_TRANSFER_TEST_HAMMER=<case> <peer address> [small]):
// reads region 0 of the peer and writes its region 1, batch after batch, in
// big entries (or, with "small", batches of 4 KiB entries), until it is
// killed; says ADDRESS once the first batch is done.
int run_hammer(const BackendCase& c, const std::string& address, bool small) {
  init_logging("error");
  auto engine = TransferEngine::create(config_for(c, fmt::format("hammer-{}", getpid())));
  if (!engine) return 1;
  MemfdBuffer memory(1u << 20, "siesta-test-hammer");
  auto local = (*engine)->register_region(memory.spec());
  auto peer = (*engine)->connect(address, deadline_after(10000ms));
  auto ids = (*engine)->send_message(address, "ids", deadline_after(10000ms));
  if (!local || !peer || !ids) return 2;
  RegionId remote[2];
  std::istringstream in(*ids);
  in >> remote[0].value >> remote[1].value;
  for (bool said = false;;) {
    std::vector<XferId> batch;
    for (int i = 0; i < (small ? 32 : 4); ++i) {
      bool read = i % 2 == 0;
      std::vector<XferEntry> entries;
      if (small) {
        for (uint64_t k = 0; k < 4; ++k)
          entries.push_back(XferEntry{*local, (read ? 0u : (512u << 10)) + k * 4096, remote[read ? 0 : 1], k * 8192, 4096});
      } else {
        entries.push_back(
            XferEntry{*local, read ? 0u : (512u << 10), remote[read ? 0 : 1], 0, read ? (512u << 10) : (256u << 10)});
      }
      auto id = (*engine)->submit(*peer, read ? XferOp::kRead : XferOp::kWrite, entries, std::nullopt,
                                  deadline_after(10000ms));
      if (id) batch.push_back(*id);
    }
    for (XferId id : batch) (void)(*engine)->wait(id, deadline_after(15000ms));
    if (!said) {
      printf("ADDRESS hammering\n");
      fflush(stdout);
      said = true;
    }
  }
}

const int kPeerMode = [] {
  if (const char* hammer = std::getenv("SIESTA_TRANSFER_TEST_HAMMER")) {
    std::istringstream in(hammer);
    std::string name, address, size;
    in >> name >> address >> size;
    const BackendCase* c = find_case(name);
    std::_Exit(c ? run_hammer(*c, address, size == "small") : 3);
  }
  const char* name = std::getenv("SIESTA_TRANSFER_TEST_PEER");
  if (name == nullptr) return 0;
  const BackendCase* c = find_case(name);
  int rc = c ? run_peer(*c) : 3;
  fflush(stdout);
  fflush(stderr);
  std::_Exit(rc);
}();

// ---------------------------------------------------------------------------
// The parent side.

struct PeerProcess {
  pid_t pid = -1;
  int to_child = -1;
  std::string address;

  static PeerProcess spawn(const BackendCase& c) { return spawn(std::string("SIESTA_TRANSFER_TEST_PEER=") + c.name); }

  // This test binary again, with `mode` (NAME=VALUE) in its environment.
  static PeerProcess spawn(const std::string& mode) {
    PeerProcess p;
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) std::abort();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.push_back(mode);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    int rc = posix_spawn(&p.pid, "/proc/self/exe", &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    if (rc != 0) std::abort();
    p.to_child = in[1];
    // First line: ADDRESS host:port
    std::string line;
    Deadline deadline = deadline_after(20000ms);
    char ch;
    while (!expired(deadline) && p.address.empty()) {
      pollfd pfd{out[0], POLLIN, 0};
      if (poll(&pfd, 1, millis_left(deadline)) <= 0) break;
      if (read(out[0], &ch, 1) != 1) break;
      if (ch != '\n') {
        line += ch;
        continue;
      }
      if (line.rfind("ADDRESS ", 0) == 0) p.address = line.substr(8);
      line.clear();
    }
    close(out[0]);
    return p;
  }

  void kill_now() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }

  // Closing stdin asks the peer to exit; it is killed if it does not.
  void stop() {
    if (to_child >= 0) close(to_child);
    to_child = -1;
    if (pid <= 0) return;
    for (int i = 0; i < 500; ++i) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return;
      }
      std::this_thread::sleep_for(10ms);
    }
    kill_now();
  }
};

bool maps_contain(const std::string& needle) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(needle) != std::string::npos) return true;
  return false;
}

class TransferTwoProcess : public ::testing::TestWithParam<BackendCase> {
 protected:
  void SetUp() override {
    peer_ = PeerProcess::spawn(GetParam());
    ASSERT_FALSE(peer_.address.empty()) << "the peer process did not start";
    auto engine = TransferEngine::create(config_for(GetParam(), fmt::format("test-{}", getpid())));
    ASSERT_TRUE(engine) << engine.error().message;
    engine_ = std::move(*engine);
    local_ = std::make_unique<MemfdBuffer>(1u << 20, "siesta-test-local");
    std::mt19937_64 rng(99);
    for (size_t i = 0; i < local_->bytes; ++i) local_->data[i] = static_cast<char>(rng());
    auto id = engine_->register_region(local_->spec());
    ASSERT_TRUE(id) << id.error().message;
    local_id_ = *id;
    auto peer = engine_->connect(peer_.address, deadline_after(10000ms));
    ASSERT_TRUE(peer) << peer.error().message;
    peer_id_ = *peer;
    std::istringstream ids(command("ids"));
    ids >> remote_[0].value >> remote_[1].value;
    for (size_t i = 0; i < 2; ++i) {
      mirror_[i].resize(kRegionBytes[i]);
      fill_pattern(mirror_[i].data(), kRegionBytes[i], i + 1);
    }
  }

  void TearDown() override {
    engine_.reset();
    peer_.stop();
  }

  std::string command(const std::string& c) {
    auto r = engine_->send_message(peer_.address, c, deadline_after(10000ms));
    EXPECT_TRUE(r) << c << ": " << r.error().message;
    return r ? *r : std::string();
  }

  std::string remote_bytes(size_t i, size_t off, size_t len) {
    return command(fmt::format("read {} {} {}", i, off, len));
  }

  XferStatus run(XferOp op, std::vector<XferEntry> entries, std::optional<std::string> notify = std::nullopt) {
    auto id = engine_->submit(peer_id_, op, entries, std::move(notify), deadline_after(10000ms));
    if (!id) return XferStatus::make_failed(id.error());
    return engine_->wait(*id, deadline_after(15000ms));
  }

  PeerProcess peer_;
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<MemfdBuffer> local_;
  RegionId local_id_;
  std::string peer_id_;
  RegionId remote_[2];
  std::vector<char> mirror_[2];  // what the peer's regions must hold
};

TEST_P(TransferTwoProcess, RandomBatchedReadsAndWritesMatchByteForByte) {
  std::mt19937_64 rng(2024);
  for (int iter = 0; iter < 24; ++iter) {
    XferOp op = rng() % 2 ? XferOp::kWrite : XferOp::kRead;
    size_t n = 1 + rng() % 8;
    // Destinations of one batch do not overlap: split the destination space
    // into n slots and put one entry in each.
    std::vector<XferEntry> entries;
    for (size_t k = 0; k < n; ++k) {
      size_t ri = rng() % 2;
      size_t remote_slot = kRegionBytes[ri] / n;
      size_t local_slot = local_->bytes / n;
      size_t len = 1 + rng() % std::min<size_t>({remote_slot, local_slot, 48u << 10});
      size_t roff = op == XferOp::kWrite ? k * remote_slot + rng() % (remote_slot - len + 1)
                                         : rng() % (kRegionBytes[ri] - len + 1);
      size_t loff = op == XferOp::kRead ? k * local_slot + rng() % (local_slot - len + 1)
                                        : rng() % (local_->bytes - len + 1);
      entries.push_back(XferEntry{local_id_, loff, remote_[ri], roff, len});
    }
    XferStatus st = run(op, entries);
    ASSERT_TRUE(st.done()) << xfer_op_name(op) << " iteration " << iter << ": " << st.why.message;
    for (const XferEntry& e : entries) {
      size_t ri = e.remote_region == remote_[0] ? 0 : 1;
      if (op == XferOp::kWrite) {
        std::memcpy(mirror_[ri].data() + e.remote_offset, local_->data + e.local_offset, e.bytes);
      } else {
        ASSERT_EQ(0, std::memcmp(local_->data + e.local_offset, mirror_[ri].data() + e.remote_offset, e.bytes))
            << "READ iteration " << iter << " brought wrong bytes";
      }
    }
    if (iter % 8 == 7) {
      for (size_t i = 0; i < 2; ++i) {
        std::string actual = remote_bytes(i, 0, kRegionBytes[i]);
        ASSERT_EQ(actual.size(), kRegionBytes[i]);
        ASSERT_EQ(0, std::memcmp(actual.data(), mirror_[i].data(), kRegionBytes[i])) << "region " << i << " after iteration " << iter;
      }
    }
  }
}

TEST_P(TransferTwoProcess, NotificationsArriveAfterTheirData) {
  for (int i = 0; i < 10; ++i) {
    size_t off = static_cast<size_t>(i) * 65536, len = 65536 - 17 * i;
    fill_pattern(local_->data + off, len, 500 + i);
    std::string note = fmt::format("check 0 {} {} {}", off + 3, len, fnv1a(local_->data + off, len));
    XferStatus st = run(XferOp::kWrite, {XferEntry{local_id_, off, remote_[0], off + 3, len}}, note);
    ASSERT_TRUE(st.done()) << st.why.message;
  }
  // The peer checks each notification's range against the hash it names as
  // soon as the notification is handed to it.
  std::string notes;
  for (int tries = 0; tries < 200; ++tries) {
    notes = command("notes");
    if (notes.rfind("10 ", 0) == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(notes, "10 0") << "ok/bad notification checks on the peer";
}

TEST_P(TransferTwoProcess, ALateNotificationGoesOutAfterItsDataWhicheverComesFirst) {
  // Odd i: the payload is set at once (usually before the bytes are in
  // place); even i: after the transfer's data is done (it waits for it).
  for (int i = 0; i < 6; ++i) {
    size_t off = static_cast<size_t>(i) * 65536, len = 60000 - 13 * i;
    fill_pattern(local_->data + off, len, 700 + i);
    std::string note = fmt::format("check 0 {} {} {}", off + 5, len, fnv1a(local_->data + off, len));
    auto id = engine_->submit_notify_later(peer_id_, XferOp::kWrite, {XferEntry{local_id_, off, remote_[0], off + 5, len}},
                                           deadline_after(10000ms));
    ASSERT_TRUE(id) << id.error().message;
    if (i % 2 == 0) {
      // Not final without its notification, however long the bytes took.
      std::this_thread::sleep_for(50ms);
      EXPECT_TRUE(engine_->poll(*id).pending()) << "final before its notification was set";
    }
    ASSERT_TRUE(engine_->set_notification(*id, note));
    auto again = engine_->set_notification(*id, note);
    ASSERT_FALSE(again) << "a second payload was taken";
    EXPECT_TRUE(again.error().code == ErrorCode::kConflict || again.error().code == ErrorCode::kNotFound);
    XferStatus st = engine_->wait(*id, deadline_after(15000ms));
    ASSERT_TRUE(st.done()) << st.why.message;
    EXPECT_LE(st.data_at, st.finished_at);
  }
  std::string notes;
  for (int tries = 0; tries < 200; ++tries) {
    notes = command("notes");
    if (notes.rfind("6 ", 0) == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(notes, "6 0") << "ok/bad notification checks on the peer";
  // A transfer submitted with its notification takes no late one.
  auto plain = engine_->submit(peer_id_, XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 64}}, std::nullopt,
                               deadline_after(10000ms));
  ASSERT_TRUE(plain);
  auto refused = engine_->set_notification(*plain, "x");
  ASSERT_FALSE(refused);
  EXPECT_TRUE(refused.error().code == ErrorCode::kConflict || refused.error().code == ErrorCode::kNotFound);
  EXPECT_TRUE(engine_->wait(*plain, deadline_after(15000ms)).done());
}

TEST_P(TransferTwoProcess, ALateNotificationThatNeverComesFailsAtTheDeadline) {
  auto id = engine_->submit_notify_later(peer_id_, XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 4096}},
                                         deadline_after(300ms));
  ASSERT_TRUE(id) << id.error().message;
  XferStatus st = engine_->wait(*id, deadline_after(5000ms));
  ASSERT_TRUE(st.failed());
  EXPECT_EQ(st.why.code, ErrorCode::kTimeout) << st.why.message;
  // The bytes moved long ago: nothing holds the local region any more.
  EXPECT_FALSE(engine_->in_flight(*id));
  EXPECT_FALSE(engine_->set_notification(*id, "late"));
}

TEST_P(TransferTwoProcess, InvalidateAckDeregisterThenNewEpochHandshake) {
  ASSERT_TRUE(run(XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 4096}}).done());
  Epoch before = engine_->peer_meta(peer_id_)->epoch;

  std::string report = command("invalidate");
  EXPECT_EQ(report, fmt::format("acked={}, unanswered=0", engine_->engine_id()));
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kInvalid);
  // Nothing of the peer's memory is mapped here any more.
  EXPECT_FALSE(maps_contain(fmt::format("siesta-test-peer-{}-", peer_.pid)));

  command("dereg 0");
  std::istringstream rereg(command("rereg 0"));
  RegionId fresh;
  uint64_t epoch = 0;
  rereg >> fresh.value >> epoch;
  std::vector<char> expected(kRegionBytes[0]);
  fill_pattern(expected.data(), expected.size(), 100);

  // The old region id is gone from the new metadata: refused before any byte moves.
  XferStatus old = run(XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 4096}});
  ASSERT_TRUE(old.failed());
  EXPECT_NE(old.why.message.find("no region"), std::string::npos) << old.why.message;

  XferStatus st = run(XferOp::kWrite, {XferEntry{local_id_, 8192, fresh, 100, 5000}});
  ASSERT_TRUE(st.done()) << st.why.message;
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kReady);
  EXPECT_GT(engine_->peer_meta(peer_id_)->epoch, before);
  EXPECT_EQ(engine_->peer_meta(peer_id_)->epoch.value, epoch);
  std::memcpy(expected.data() + 100, local_->data + 8192, 5000);
  std::string actual = remote_bytes(0, 0, kRegionBytes[0]);
  ASSERT_EQ(actual.size(), expected.size());
  EXPECT_EQ(0, std::memcmp(actual.data(), expected.data(), expected.size()));
}

TEST_P(TransferTwoProcess, InvalidateReportsFetchersThatDidNotAnswer) {
  // A second engine fetches the peer's metadata, then goes away without a word.
  {
    auto bystander = TransferEngine::create(config_for(GetParam(), fmt::format("bystander-{}", getpid())));
    ASSERT_TRUE(bystander) << bystander.error().message;
    MemfdBuffer memory(4096, "siesta-test-bystander");
    ASSERT_TRUE((*bystander)->register_region(memory.spec()));
    ASSERT_TRUE((*bystander)->connect(peer_.address, deadline_after(10000ms)));
  }
  auto start = Clock::now();
  EXPECT_EQ(command("invalidate"), fmt::format("acked={}, unanswered=1", engine_->engine_id()));
  EXPECT_LT(Clock::now() - start, 3000ms) << "a closed listener must not cost the whole deadline";
}

TEST_P(TransferTwoProcess, DeregisteredWithoutInvalidationFailsAndPutsPeerInError) {
  ASSERT_TRUE(run(XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 4096}}).done());
  std::memcpy(mirror_[0].data(), local_->data, 4096);
  command("dereg 0");  // no INVALIDATE: our descriptor still names region 0

  fill_pattern(local_->data, 65536, 77);
  XferStatus w = run(XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 65536}});
  ASSERT_TRUE(w.failed());
  EXPECT_NE(w.why.message.find("deregistered"), std::string::npos) << w.why.message;
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kError);

  // Not a byte of either region changed.
  for (size_t i = 0; i < 2; ++i) {
    std::string actual = remote_bytes(i, 0, kRegionBytes[i]);
    ASSERT_EQ(0, std::memcmp(actual.data(), mirror_[i].data(), kRegionBytes[i])) << "region " << i;
  }
  // Fails fast while in error, even for a live region.
  auto fast = engine_->submit(peer_id_, XferOp::kRead, {XferEntry{local_id_, 0, remote_[1], 0, 4096}}, std::nullopt,
                              deadline_after(10000ms));
  ASSERT_FALSE(fast);
  EXPECT_EQ(fast.error().code, ErrorCode::kUnavailable);
  EXPECT_NE(fast.error().message.find("error state"), std::string::npos) << fast.error().message;

  // A new handshake clears it.
  ASSERT_TRUE(engine_->connect(peer_.address, deadline_after(10000ms)));
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kReady);
  ASSERT_TRUE(run(XferOp::kRead, {XferEntry{local_id_, 0, remote_[1], 0, kRegionBytes[1]}}).done());
  EXPECT_EQ(0, std::memcmp(local_->data, mirror_[1].data(), kRegionBytes[1]));
}

TEST_P(TransferTwoProcess, ReadFromDeregisteredRegionLeavesLocalBytesAlone) {
  command("dereg 1");
  std::vector<char> before(local_->data, local_->data + 65536);
  XferStatus r = run(XferOp::kRead, {XferEntry{local_id_, 0, remote_[1], 0, 65536}});
  ASSERT_TRUE(r.failed());
  EXPECT_NE(r.why.message.find("deregistered"), std::string::npos) << r.why.message;
  EXPECT_EQ(0, std::memcmp(local_->data, before.data(), before.size()));
}

TEST_P(TransferTwoProcess, PeerKilledMidTransferFailsBeforeTheDeadline) {
  auto start = Clock::now();
  Deadline deadline = deadline_after(8000ms);
  std::vector<XferId> ids;
  for (int i = 0; i < 8; ++i) {
    auto id = engine_->submit(peer_id_, XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 1u << 20}},
                              std::string("n"), deadline);
    ASSERT_TRUE(id) << id.error().message;
    ids.push_back(*id);
  }
  peer_.kill_now();
  size_t refused_at_submit = 0;
  std::vector<XferId> after;
  for (int i = 0; i < 8; ++i) {
    auto id = engine_->submit(peer_id_, XferOp::kRead, {XferEntry{local_id_, 0, remote_[1], 0, 4096}}, std::nullopt,
                              deadline);
    if (id) {
      after.push_back(*id);
    } else {
      ++refused_at_submit;
    }
  }
  for (XferId id : ids) {
    XferStatus st = engine_->wait(id, deadline);
    EXPECT_FALSE(st.pending());
  }
  for (XferId id : after) {
    XferStatus st = engine_->wait(id, deadline);
    EXPECT_TRUE(st.failed()) << "a transfer submitted after the peer died did not fail";
  }
  EXPECT_EQ(after.size() + refused_at_submit, 8u);
  EXPECT_LT(Clock::now() - start, 8000ms);
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kError);
}

TEST_P(TransferTwoProcess, InitiatorKilledMidTransferLeavesThePeerServing) {
  // Another initiator keeps big reads and writes in flight to the peer (for
  // a staged peer: requests queued for its chunks, data on the wire, copies
  // running) and is killed among them.
  const BackendCase& c = GetParam();
  if (!c.peer_error_handling)
    GTEST_SKIP() << kSharedMemoryKillSkip;
  if (peer_serves_rma_in_software(c))
    GTEST_SKIP() << "the initiator reaches the peer's direct regions with puts and gets (its regions are staged, or "
                    "it sends no guarded messages), which UCX 1.13 over tcp serves in software on the peer, and "
                    "aborts it when the initiator dies while it answers";
  PeerProcess hammer =
      PeerProcess::spawn(fmt::format("SIESTA_TRANSFER_TEST_HAMMER={} {}", GetParam().name, peer_.address));
  ASSERT_EQ(hammer.address, "hammering") << "the second initiator did not get a transfer through";
  std::this_thread::sleep_for(30ms);
  hammer.kill_now();
  // The peer goes on serving us, byte for byte, well within the deadline.
  auto start = Clock::now();
  for (int i = 0; i < 4; ++i) {
    size_t off = static_cast<size_t>(i) * (128u << 10);
    fill_pattern(local_->data + off, 128u << 10, 900 + i);
    ASSERT_TRUE(run(XferOp::kWrite, {XferEntry{local_id_, off, remote_[0], off, 128u << 10}}).done());
    ASSERT_TRUE(run(XferOp::kRead, {XferEntry{local_id_, off + (512u << 10), remote_[0], off, 128u << 10}}).done());
    EXPECT_EQ(0, std::memcmp(local_->data + off, local_->data + off + (512u << 10), 128u << 10)) << "round " << i;
  }
  EXPECT_LT(Clock::now() - start, 5000ms);
  EXPECT_EQ(command("ping"), "pong");
}

// Batches of many small entries (KV blocks of a small model): on the guarded
// path (ucx over tcp or shared memory) a batch is cut into several messages
// where it has more ranges or bytes than one holds.
TEST_P(TransferTwoProcess, SmallEntriesInRandomBatchesMatchByteForByte) {
  std::mt19937_64 rng(77);
  for (int iter = 0; iter < 40; ++iter) {
    XferOp op = iter % 2 ? XferOp::kWrite : XferOp::kRead;
    size_t n = 1 + rng() % 90;
    size_t max_len = iter % 4 < 2 ? 64 : 4096 + 512;
    std::vector<XferEntry> entries;
    for (size_t k = 0; k < n; ++k) {
      size_t ri = rng() % 2;
      size_t remote_slot = kRegionBytes[ri] / n;
      size_t local_slot = local_->bytes / n;
      size_t len = 1 + rng() % std::min<size_t>({remote_slot, local_slot, max_len});
      size_t roff = op == XferOp::kWrite ? k * remote_slot + rng() % (remote_slot - len + 1)
                                         : rng() % (kRegionBytes[ri] - len + 1);
      size_t loff = op == XferOp::kRead ? k * local_slot + rng() % (local_slot - len + 1)
                                        : rng() % (local_->bytes - len + 1);
      entries.push_back(XferEntry{local_id_, loff, remote_[ri], roff, len});
    }
    if (op == XferOp::kWrite)
      for (const XferEntry& e : entries) fill_pattern(local_->data + e.local_offset, e.bytes, 3000 + iter);
    XferStatus st = run(op, entries);
    ASSERT_TRUE(st.done()) << xfer_op_name(op) << " iteration " << iter << ": " << st.why.message;
    for (const XferEntry& e : entries) {
      size_t ri = e.remote_region == remote_[0] ? 0 : 1;
      if (op == XferOp::kWrite) {
        std::memcpy(mirror_[ri].data() + e.remote_offset, local_->data + e.local_offset, e.bytes);
      } else {
        ASSERT_EQ(0, std::memcmp(local_->data + e.local_offset, mirror_[ri].data() + e.remote_offset, e.bytes))
            << "READ iteration " << iter << " brought wrong bytes";
      }
    }
    if (iter % 10 == 9) {
      for (size_t i = 0; i < 2; ++i) {
        std::string actual = remote_bytes(i, 0, kRegionBytes[i]);
        ASSERT_EQ(actual.size(), kRegionBytes[i]);
        ASSERT_EQ(0, std::memcmp(actual.data(), mirror_[i].data(), kRegionBytes[i]))
            << "region " << i << " after iteration " << iter;
      }
    }
  }
}

// Transfers of one message, of several and of many (on the guarded path)
// through a descriptor of a region the peer deregistered without
// invalidating us: each fails, names the deregistration, puts the peer in
// error, and moves no byte in either direction.
TEST_P(TransferTwoProcess, SmallAndLargeTransfersThroughADeregisteredRegionMoveNothing) {
  uint64_t seed = 1;  // what the peer's region 0 holds
  int round = 0;
  for (XferOp op : {XferOp::kWrite, XferOp::kRead}) {
    for (size_t bytes : {size_t{100}, size_t{4096} * 4, size_t{512} << 10}) {
      SCOPED_TRACE(fmt::format("{} of {} bytes", xfer_op_name(op), bytes));
      ASSERT_TRUE(engine_->connect(peer_.address, deadline_after(10000ms)));
      std::istringstream ids(command("ids"));
      RegionId doomed;
      ids >> doomed.value;
      command("dereg 0");  // no INVALIDATE: our descriptor still names it
      fill_pattern(local_->data, bytes, 700 + round);
      std::vector<char> before(local_->data, local_->data + bytes);
      XferStatus st = run(op, {XferEntry{local_id_, 0, doomed, 0, bytes}});
      ASSERT_TRUE(st.failed());
      EXPECT_NE(st.why.message.find("deregistered"), std::string::npos) << st.why.message;
      EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kError);
      EXPECT_EQ(0, std::memcmp(local_->data, before.data(), bytes)) << "a failed transfer changed our bytes";
      std::vector<char> expected(kRegionBytes[0]);
      fill_pattern(expected.data(), expected.size(), seed);
      std::string actual = remote_bytes(0, 0, kRegionBytes[0]);  // the deregistered memory, still mapped there
      ASSERT_EQ(actual.size(), expected.size());
      EXPECT_EQ(0, std::memcmp(actual.data(), expected.data(), expected.size()))
          << "a transfer through a deregistered region wrote into it";
      command("rereg 0");
      seed = 100;
      ++round;
    }
  }
}

// A descriptor made before the peer's regions changed (it registered one
// more and told nobody) is refused for small and large transfers alike, even
// to a region that is still live; a new handshake makes it usable again.
TEST_P(TransferTwoProcess, TransfersUnderAStaleEpochAreRefusedUntilAHandshake) {
  int round = 0;
  for (XferOp op : {XferOp::kWrite, XferOp::kRead}) {
    for (size_t bytes : {size_t{4096}, size_t{512} << 10}) {
      SCOPED_TRACE(fmt::format("{} of {} bytes", xfer_op_name(op), bytes));
      Epoch held = engine_->peer_meta(peer_id_)->epoch;
      uint64_t now = std::stoull(command("extra"));
      ASSERT_GT(now, held.value);
      fill_pattern(local_->data, bytes, 800 + round);
      std::vector<char> before(local_->data, local_->data + bytes);
      XferEntry e{local_id_, 0, remote_[0], 4096, bytes};
      XferStatus stale = run(op, {e});
      ASSERT_TRUE(stale.failed());
      EXPECT_NE(stale.why.message.find("epoch"), std::string::npos) << stale.why.message;
      EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kError);
      EXPECT_EQ(0, std::memcmp(local_->data, before.data(), bytes));
      std::string actual = remote_bytes(0, 0, kRegionBytes[0]);
      ASSERT_EQ(0, std::memcmp(actual.data(), mirror_[0].data(), kRegionBytes[0])) << "a refused write landed";

      ASSERT_TRUE(engine_->connect(peer_.address, deadline_after(10000ms)));
      EXPECT_EQ(engine_->peer_meta(peer_id_)->epoch.value, now);
      XferStatus fresh = run(op, {e});
      ASSERT_TRUE(fresh.done()) << fresh.why.message;
      if (op == XferOp::kWrite) {
        std::memcpy(mirror_[0].data() + 4096, local_->data, bytes);
        actual = remote_bytes(0, 0, kRegionBytes[0]);
        EXPECT_EQ(0, std::memcmp(actual.data(), mirror_[0].data(), kRegionBytes[0]));
      } else {
        EXPECT_EQ(0, std::memcmp(local_->data, mirror_[0].data() + 4096, bytes));
      }
      ++round;
    }
  }
}

TEST_P(TransferTwoProcess, PeerKilledDuringSmallTransfersFailsBeforeTheDeadline) {
  auto start = Clock::now();
  Deadline deadline = deadline_after(8000ms);
  std::vector<XferId> ids;
  for (int i = 0; i < 32; ++i) {
    std::vector<XferEntry> entries;
    for (uint64_t k = 0; k < 4; ++k) entries.push_back(XferEntry{local_id_, k * 4096, remote_[i % 2], k * 8192, 4096});
    auto id = engine_->submit(peer_id_, i % 2 ? XferOp::kRead : XferOp::kWrite, entries, std::nullopt, deadline);
    ASSERT_TRUE(id) << id.error().message;
    ids.push_back(*id);
  }
  peer_.kill_now();
  size_t refused_at_submit = 0;
  std::vector<XferId> after;
  for (int i = 0; i < 8; ++i) {
    auto id = engine_->submit(peer_id_, i % 2 ? XferOp::kRead : XferOp::kWrite,
                              {XferEntry{local_id_, 0, remote_[1], 0, 4096}}, std::nullopt, deadline);
    if (id) {
      after.push_back(*id);
    } else {
      ++refused_at_submit;
    }
  }
  for (XferId id : ids) EXPECT_FALSE(engine_->wait(id, deadline).pending());
  for (XferId id : after)
    EXPECT_TRUE(engine_->wait(id, deadline).failed()) << "a transfer submitted after the peer died did not fail";
  EXPECT_EQ(after.size() + refused_at_submit, 8u);
  EXPECT_LT(Clock::now() - start, 8000ms);
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kError);
}

TEST_P(TransferTwoProcess, InitiatorKilledMidSmallTransfersLeavesThePeerServing) {
  const BackendCase& c = GetParam();
  if (!c.peer_error_handling)
    GTEST_SKIP() << kSharedMemoryKillSkip;
  if (peer_serves_rma_in_software(c))
    GTEST_SKIP() << "the initiator reaches the peer's direct regions with puts and gets (its regions are staged, or "
                    "it sends no guarded messages), which UCX 1.13 over tcp serves in software on the peer, and "
                    "aborts it when the initiator dies while it answers";
  PeerProcess hammer =
      PeerProcess::spawn(fmt::format("SIESTA_TRANSFER_TEST_HAMMER={} {} small", GetParam().name, peer_.address));
  ASSERT_EQ(hammer.address, "hammering") << "the second initiator did not get a transfer through";
  std::this_thread::sleep_for(30ms);
  hammer.kill_now();
  auto start = Clock::now();
  for (int i = 0; i < 8; ++i) {
    size_t off = static_cast<size_t>(i) * 4096;
    fill_pattern(local_->data + off, 4096, 950 + i);
    ASSERT_TRUE(run(XferOp::kWrite, {XferEntry{local_id_, off, remote_[0], off, 4096}}).done());
    ASSERT_TRUE(run(XferOp::kRead, {XferEntry{local_id_, off + (512u << 10), remote_[0], off, 4096}}).done());
    EXPECT_EQ(0, std::memcmp(local_->data + off, local_->data + off + (512u << 10), 4096)) << "round " << i;
  }
  EXPECT_LT(Clock::now() - start, 5000ms);
  EXPECT_EQ(command("ping"), "pong");
}

int connect_raw(const std::string& address) {
  size_t colon = address.rfind(':');
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void send_raw_and_hang_up(const std::string& address, const std::string& bytes) {
  int fd = connect_raw(address);
  if (fd < 0) return;
  (void)!write(fd, bytes.data(), bytes.size());
  close(fd);
}

// Raw bytes to a side channel; returns true when the server closed the connection.
bool send_raw_and_see_close(const std::string& address, const std::string& bytes) {
  int fd = connect_raw(address);
  if (fd < 0) return false;
  (void)!write(fd, bytes.data(), bytes.size());
  bool closed = false;
  char buf[4096];
  Deadline deadline = deadline_after(5000ms);
  while (!expired(deadline)) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, millis_left(deadline)) <= 0) break;
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) {
      closed = true;
      break;
    }
  }
  close(fd);
  return closed;
}

TEST_P(TransferTwoProcess, MalformedFramesCloseOnlyTheirConnection) {
  WireWriter oversized;
  oversized.u32(kFrameMagic);
  oversized.u16(kFrameVersion);
  oversized.u16(static_cast<uint16_t>(FrameType::kMessage));
  oversized.u32(0x7fffffff);
  std::string wrong_version = encode_frame(to_frame(PeerMessage{"x", "ping"}));
  wrong_version[4] = 2;
  std::string bad_payload = encode_frame(FrameType::kGetMeta, "\xff\xff\xff\xff");
  std::string unexpected = encode_frame(to_frame(AckMsg{"x", Epoch{1}}));
  std::string garbage = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  for (const std::string& bytes : {oversized.data(), wrong_version, bad_payload, unexpected, garbage}) {
    EXPECT_TRUE(send_raw_and_see_close(peer_.address, bytes));
    EXPECT_EQ(command("ping"), "pong");
  }
  // Half a frame, then hang up.
  send_raw_and_hang_up(peer_.address, encode_frame(to_frame(PeerMessage{"x", std::string(1000, 'a')})).substr(0, 500));
  EXPECT_EQ(command("ping"), "pong");
  // Transfers still work.
  EXPECT_TRUE(run(XferOp::kRead, {XferEntry{local_id_, 0, remote_[0], 0, 4096}}).done());
}

TEST_P(TransferTwoProcess, StaleInvalidateIsRefusedAndKeepsThePeerReady) {
  // Our own side channel receives an INVALIDATE naming an epoch older than the
  // descriptor we hold of the peer (a delayed message from before a wake).
  Epoch held = engine_->peer_meta(peer_id_)->epoch;
  ASSERT_GT(held.value, 1u);
  auto side = SideChannel::start(SideChannelOptions{}, [](const Frame&, const RequestOrigin&) -> Result<Frame> {
    return internal_error("unused");
  });
  ASSERT_TRUE(side);
  auto answer = (*side)->request(engine_->address(), to_frame(InvalidateMsg{peer_id_, Epoch{held.value - 1}}),
                                 deadline_after(5000ms));
  ASSERT_TRUE(answer);
  ASSERT_EQ(answer->type, FrameType::kError);
  EXPECT_NE(decode_error(answer->payload)->message.find("stale"), std::string::npos);
  EXPECT_EQ(*engine_->peer_state(peer_id_), PeerState::kReady);
  // A notification naming an old epoch of the peer is refused by the peer.
  auto note = (*side)->request(peer_.address, to_frame(NotifyMsg{"someone", Epoch{0}, "x"}), deadline_after(5000ms));
  ASSERT_TRUE(note);
  EXPECT_EQ(note->type, FrameType::kError);
  EXPECT_TRUE(run(XferOp::kWrite, {XferEntry{local_id_, 0, remote_[0], 0, 4096}}).done());
}

// The guarded path is taken where an endpoint has no RMA lane, that is where
// UCX serves puts in software on the target, whose CPU then copies every byte
// anyway. The detection is checked against what it stands for: a put whose
// target never progresses completes only where RMA is native.
TEST(UcxLanes, SoftwareRmaIsSeenWhereAPutWaitsForTheTarget) {
  for (auto [transports, devices] : {std::pair{"tcp", "lo"}, std::pair{"sm", ""}}) {
    SCOPED_TRACE(transports);
    auto target = ucx::UcxWorker::create(ucx::UcxOptions{transports, devices, false});
    auto initiator = ucx::UcxWorker::create(ucx::UcxOptions{transports, devices, false});
    ASSERT_TRUE(target && initiator);
    std::vector<char> to(4096, 0), from(4096, 7);
    auto mapped = ucx::map_memory((*target)->context(), to.data(), to.size(), UCS_MEMORY_TYPE_HOST, true);
    ASSERT_TRUE(mapped) << mapped.error().message;
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = reinterpret_cast<const ucp_address_t*>((*target)->address().data());
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ucp_ep_h ep = nullptr;
    ASSERT_EQ(ucp_ep_create((*initiator)->worker(), &p, &ep), UCS_OK);
    ucp_rkey_h rkey = nullptr;
    ASSERT_EQ(ucp_ep_rkey_unpack(ep, mapped->rkey.data(), &rkey), UCS_OK);
    auto both = [&](ucs_status_ptr_t sp) {  // progress both sides until `sp` completes
      if (sp == nullptr || UCS_PTR_IS_ERR(sp)) return;
      while (ucp_request_check_status(sp) == UCS_INPROGRESS) {
        ucp_worker_progress((*initiator)->worker());
        ucp_worker_progress((*target)->worker());
      }
      ucp_request_free(sp);
    };
    ucp_request_param_t none{};
    both(ucp_ep_flush_nbx(ep, &none));  // connected
    ucs_status_ptr_t put =
        ucp_put_nbx(ep, from.data(), from.size(), reinterpret_cast<uint64_t>(to.data()), rkey, &none);
    ucs_status_ptr_t flush = ucp_ep_flush_nbx(ep, &none);
    bool landed_alone = flush == nullptr;
    for (Deadline d = deadline_after(300ms); !landed_alone && !expired(d);) {
      ucp_worker_progress((*initiator)->worker());
      landed_alone = ucp_request_check_status(flush) != UCS_INPROGRESS;
    }
    EXPECT_EQ(ucx::rma_in_software(ep), !landed_alone);
    both(put);
    both(flush);
    EXPECT_EQ(to[4095], 7);
    ucp_rkey_destroy(rkey);
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    both(ucp_ep_close_nbx(ep, &close));
    ucp_mem_unmap((*target)->context(), mapped->memh);
  }
}

std::string case_name(const ::testing::TestParamInfo<BackendCase>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Backends, TransferTwoProcess, ::testing::ValuesIn(kCases), case_name);

}  // namespace
}  // namespace siesta::transfer
