#include "transfer/ipc/ipc_backend.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "common/log.h"
#include "transfer/ipc/ipc_peer.h"
#include "transfer/ipc/unix_socket.h"
#include "transfer/process_identity.h"
#include "transfer/region_table.h"
#include "transfer/transfer_config.h"
#include "transfer/wire.h"

namespace siesta::transfer::ipc {

namespace {

constexpr uint32_t kHandshakeMagic = 0x31435049;  // "IPC1"

// How long the copy thread polls for the next copy after one ends.
constexpr auto kCopySpin = std::chrono::microseconds(200);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}
constexpr uint8_t kAnswerOk = 0;
constexpr uint8_t kAnswerStale = 1;
constexpr size_t kMaxHandshakeBytes = 1u << 20;
constexpr auto kRequestWait = std::chrono::milliseconds(1000);

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

}  // namespace

IpcBackend::IpcBackend(const TransferConfig& config, RegionTable& table)
    : table_(table),
      engine_id_(config.engine_id),
      identity_(ProcessIdentity::of_this_process()),
      cuda_device_(config.cuda_device) {}

Result<std::unique_ptr<IpcBackend>> IpcBackend::create(const TransferConfig& config, RegionTable& table) {
  std::unique_ptr<IpcBackend> b(new IpcBackend(config, table));
  b->cuda_copy_path_ = config.ipc_copy;
  std::random_device rd;
  b->socket_name_ = fmt::format("siesta-ipc-{}-{}-{:08x}", getpid(), config.engine_id.substr(0, 40), rd());
  SIESTA_ASSIGN_OR_RETURN(b->listen_fd_, listen_abstract(b->socket_name_));
  b->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (b->stop_fd_ < 0) return io_error(fmt::format("ipc: eventfd: {}", std::strerror(errno)));
  IpcBackend* raw = b.get();
  b->serve_thread_ = std::thread([raw] { raw->serve(); });
  b->copy_thread_ = std::thread([raw] { raw->copy_loop(); });
  return b;
}

IpcBackend::~IpcBackend() {
  {
    std::lock_guard<std::mutex> lock(copy_mu_);
    stopping_ = true;
    copy_news_.store(true, std::memory_order_release);
  }
  copy_cv_.notify_all();
  if (copy_thread_.joinable()) copy_thread_.join();
  uint64_t one = 1;
  if (stop_fd_ >= 0 && write(stop_fd_, &one, sizeof(one)) < 0) {
    SIESTA_LOG_WARN("ipc: cannot wake the exporter thread: {}", std::strerror(errno));
  }
  if (serve_thread_.joinable()) serve_thread_.join();
  for (int fd : importers_) close(fd);
  for (auto& [id, e] : exports_) close(e.fd);
  if (listen_fd_ >= 0) close(listen_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

std::string IpcBackend::engine_blob() const {
  WireWriter w;
  w.bytes(socket_name_);
  identity_.encode(w);
  return w.take();
}

Result<std::string> IpcBackend::register_region(const LocalRegion& region) {
  const RegionSpec& s = region.spec;
  if (s.export_fd < 0)
    return invalid_argument("the ipc backend shares memory by file descriptor: register the region with its "
                            "export_fd (a memfd for host memory, a cuMem POSIX FD for CUDA memory)");
  uint64_t export_bytes = s.export_bytes;
  if (s.kind == MemoryKind::kHost) {
    struct stat st{};
    if (fstat(s.export_fd, &st) != 0) return io_error(fmt::format("ipc: fstat of export_fd: {}", std::strerror(errno)));
    if (export_bytes == 0) export_bytes = static_cast<uint64_t>(st.st_size);
    if (static_cast<uint64_t>(st.st_size) < s.export_offset + s.bytes)
      return invalid_argument(fmt::format("export_fd holds {} bytes but the region ends at byte {} of it",
                                          st.st_size, s.export_offset + s.bytes));
  } else {
    if (export_bytes == 0) export_bytes = s.export_offset + s.bytes;
  }
  if (export_bytes < s.export_offset + s.bytes)
    return invalid_argument("export_bytes is smaller than export_offset + bytes");
  int fd = fcntl(s.export_fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return io_error(fmt::format("ipc: dup of export_fd: {}", std::strerror(errno)));
  std::lock_guard<std::mutex> lock(mu_);
  exports_[region.id] = Export{region, fd, export_bytes};
  return std::string();
}

void IpcBackend::deregister_region(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = exports_.find(id);
  if (it == exports_.end()) return;
  close(it->second.fd);
  exports_.erase(it);
}

int IpcBackend::local_cuda_device(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = exports_.find(id);
  if (it == exports_.end() || it->second.region.spec.kind != MemoryKind::kCuda) return -1;
  return it->second.region.spec.cuda_device;
}

void IpcBackend::log_cuda_copy_once(size_t by_kernel, size_t by_copy_engine) {
  if (cuda_copy_logged_.exchange(true)) return;
  SIESTA_LOG_INFO("ipc: CUDA copies on device {}, ipc_copy {}: {}. First transfer: {} pieces by the kernel, {} by "
                  "cudaMemcpyAsync",
                  cuda_device_, ipc_copy_name(cuda_copy_path_), ipc_copy_rule(cuda_copy_path_),
                  by_kernel, by_copy_engine);
}

// --- exporter ---------------------------------------------------------------

void IpcBackend::serve() {
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({stop_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (int fd : importers_) fds.push_back({fd, POLLIN | POLLRDHUP, 0});
    int ready = poll(fds.data(), fds.size(), 1000);  // stop_fd_ wakes it at shutdown
    if (ready == 0) continue;
    if (ready < 0) {
      if (errno == EINTR) continue;
      SIESTA_LOG_ERROR("ipc: exporter poll failed: {}; peers can no longer import our memory", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    // An importer that hung up (or sent anything after its handshake) is done.
    std::vector<int> keep;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents != 0) {
        close(fds[i].fd);
      } else {
        keep.push_back(fds[i].fd);
      }
    }
    importers_ = std::move(keep);
    if (fds[1].revents & POLLIN) {
      int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn >= 0) answer(conn);
    }
  }
}

void IpcBackend::answer(int conn) {
  // An abstract socket has no file permissions (and /proc/net/unix lists it):
  // only processes of our own user may import our memory.
  ucred peer{};
  socklen_t peer_len = sizeof(peer);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 || peer.uid != geteuid()) {
    SIESTA_LOG_WARN("ipc: refusing an importer on @{} that runs as uid {} (this engine runs as uid {})", socket_name_,
                    peer.uid, geteuid());
    close(conn);
    return;
  }
  auto request = recv_packet(conn, 4096, nullptr, deadline_after(kRequestWait));
  WireReader r(request ? std::string_view(*request) : std::string_view());
  uint32_t magic = r.u32();
  std::string importer = r.bytes(1024);
  Epoch wanted{r.u64()};
  if (!request || !r.done() || magic != kHandshakeMagic) {
    SIESTA_LOG_WARN("ipc: dropping a malformed handshake on @{}", socket_name_);
    close(conn);
    return;
  }
  // Snapshot under the lock with our own duplicates, send without it.
  std::vector<Export> snapshot;
  std::vector<int> fds;
  Epoch now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    now = table_.epoch();
    if (now == wanted) {
      for (auto& [id, e] : exports_) {
        int dup = fcntl(e.fd, F_DUPFD_CLOEXEC, 0);
        if (dup < 0) {
          SIESTA_LOG_ERROR("ipc: dup for peer {}: {}", importer, std::strerror(errno));
          close_fds(fds);
          close(conn);
          return;
        }
        snapshot.push_back(e);
        fds.push_back(dup);
      }
    }
  }
  WireWriter w;
  if (now != wanted) {
    w.u8(kAnswerStale);
    w.u64(now.value);
    (void)send_packet(conn, w.data());
    close(conn);
    return;
  }
  w.u8(kAnswerOk);
  w.u64(now.value);
  w.u64(table_.bytes());
  w.u32(static_cast<uint32_t>(snapshot.size()));
  for (const Export& e : snapshot) {
    w.u64(e.region.id.value);
    w.u64(e.region.spec.bytes);
    w.u64(e.region.spec.export_offset);
    w.u64(e.export_bytes);
    w.u8(static_cast<uint8_t>(e.region.spec.kind));
  }
  std::vector<int> all;
  all.push_back(table_.fd());
  all.insert(all.end(), fds.begin(), fds.end());
  Ok sent = send_packet(conn, w.data());
  for (size_t i = 0; sent && i < all.size(); i += kMaxFdsPerPacket) {
    size_t n = std::min(kMaxFdsPerPacket, all.size() - i);
    sent = send_packet(conn, "F", std::span<const int>(all.data() + i, n));
  }
  close_fds(fds);
  if (!sent) {
    SIESTA_LOG_WARN("ipc: handshake with {} failed: {}", importer, sent.error().message);
    close(conn);
    return;
  }
  importers_.push_back(conn);
}

// --- importer ---------------------------------------------------------------

Result<std::shared_ptr<BackendPeer>> IpcBackend::connect(const EngineMeta& meta, Deadline deadline) {
  WireReader blob(meta.backend_blob);
  std::string socket_name = blob.bytes(256);
  ProcessIdentity peer = ProcessIdentity::decode(blob);
  uint32_t pid = peer.pid;
  if (!blob.done() || socket_name.empty()) return corrupt("ipc: the peer's backend blob is malformed");
  if (!identity_.same_host(peer))
    return unavailable(fmt::format("peer {} runs on another host (boot id {} vs ours {}); the ipc backend only "
                                   "connects engines on one host: use the ucx backend",
                                   meta.engine_id, peer.boot_id, identity_.boot_id));
  SIESTA_ASSIGN_OR_RETURN(int sock, connect_abstract(socket_name));
  std::vector<int> fds;
  auto fail = [&](Status s) -> Status {
    close_fds(fds);
    close(sock);
    return s;
  };
  WireWriter ask;
  ask.u32(kHandshakeMagic);
  ask.bytes(engine_id_);
  ask.u64(meta.epoch.value);
  Ok sent = send_packet(sock, ask.data());
  if (!sent) return fail(sent.error());
  auto header = recv_packet(sock, kMaxHandshakeBytes, nullptr, deadline);
  if (!header) return fail(header.error().with_context(fmt::format("ipc handshake with peer {} (pid {})", meta.engine_id, pid)));
  WireReader r(*header);
  uint8_t status = r.u8();
  Epoch epoch{r.u64()};
  if (r.ok() && status == kAnswerStale)
    return fail(conflict(fmt::format("peer {} changed its regions during the handshake (epoch {} -> {})",
                                     meta.engine_id, meta.epoch.value, epoch.value)));
  uint64_t table_bytes = r.u64();
  struct Offer {
    RegionId id;
    uint64_t bytes, offset, export_bytes;
    MemoryKind kind;
  };
  uint32_t n = r.count(8 * 4 + 1);
  std::vector<Offer> offers;
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    Offer o{};
    o.id.value = r.u64();
    o.bytes = r.u64();
    o.offset = r.u64();
    o.export_bytes = r.u64();
    uint8_t kind = r.u8();
    o.kind = kind == 1 ? MemoryKind::kCuda : MemoryKind::kHost;
    offers.push_back(o);
  }
  if (!r.done() || status != kAnswerOk || epoch != meta.epoch || table_bytes < region_table_bytes(1))
    return fail(corrupt(fmt::format("ipc: malformed handshake answer from peer {}", meta.engine_id)));
  while (fds.size() < offers.size() + 1) {
    auto more = recv_packet(sock, 16, &fds, deadline);
    if (!more) return fail(more.error().with_context("receiving the peer's memory descriptors"));
  }
  if (fds.size() != offers.size() + 1) return fail(corrupt("ipc: the peer sent more descriptors than regions"));

  // Map the table, then each region the metadata names.
  void* table = mmap(nullptr, table_bytes, PROT_READ, MAP_SHARED, fds[0], 0);
  if (table == MAP_FAILED) return fail(io_error(fmt::format("ipc: mapping the peer's region table: {}", std::strerror(errno))));
  std::vector<ImportedRegion> imported;
  auto unmap_all = [&] {
    for (ImportedRegion& ir : imported) {
      if (ir.kind == MemoryKind::kCuda) cuda_release(ir.cuda);
      else if (ir.map_base) munmap(ir.map_base, ir.map_bytes);
    }
    munmap(table, table_bytes);
  };
  for (const RegionDesc& d : meta.regions) {
    size_t k = 0;
    while (k < offers.size() && offers[k].id != d.id) ++k;
    if (k == offers.size() || offers[k].bytes != d.bytes || offers[k].kind != d.kind) {
      unmap_all();
      return fail(conflict(fmt::format("peer {} no longer offers region {} as its metadata describes it",
                                       meta.engine_id, d.id.value)));
    }
    const Offer& o = offers[k];
    int fd = fds[k + 1];
    ImportedRegion ir;
    ir.kind = o.kind;
    if (o.kind == MemoryKind::kHost) {
      uint64_t aligned = o.offset / page_size() * page_size();
      ir.map_bytes = static_cast<size_t>(o.offset - aligned + o.bytes);
      ir.map_base = mmap(nullptr, ir.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(aligned));
      if (ir.map_base == MAP_FAILED) {
        int err = errno;
        unmap_all();
        return fail(io_error(fmt::format("ipc: mapping region {} of peer {}: {}", d.id.value, meta.engine_id,
                                         std::strerror(err))));
      }
      ir.data = static_cast<char*>(ir.map_base) + (o.offset - aligned);
    } else {
      auto cuda = cuda_import(fd, o.export_bytes, cuda_device_);
      if (!cuda) {
        unmap_all();
        return fail(cuda.error().with_context(fmt::format("ipc: importing CUDA region {} of peer {}", d.id.value,
                                                          meta.engine_id)));
      }
      ir.cuda = *cuda;
      ir.data = reinterpret_cast<char*>(cuda->address) + o.offset;
    }
    imported.push_back(ir);
  }
  // Mappings hold the memory; the descriptors are no longer needed.
  close_fds(fds);
  return std::shared_ptr<BackendPeer>(std::make_shared<IpcPeer>(*this, meta, sock, static_cast<const uint64_t*>(table),
                                                                table_bytes, std::move(imported), cuda_device_));
}

// --- copies -----------------------------------------------------------------

void IpcBackend::enqueue_copy(std::function<void(bool)> copy, bool small) {
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lock(copy_mu_);
    stopping = stopping_;
    bool inline_copy = small && copies_.empty() && !copying_;
    if (!stopping && !inline_copy) {
      copies_.push_back(std::move(copy));
      copy_news_.store(true, std::memory_order_release);
      copy_cv_.notify_one();
      return;
    }
  }
  copy(stopping);
}

void IpcBackend::copy_loop() {
  std::unique_lock<std::mutex> lock(copy_mu_);
  for (;;) {
    if (copies_.empty() && !stopping_) {
      // A transfer often follows another within microseconds (a benchmark,
      // a P/D producer's next request): poll for it a while, where waking
      // from the condition variable costs 10-30 us.
      copy_news_.store(false, std::memory_order_relaxed);
      lock.unlock();
      const auto until = Clock::now() + kCopySpin;
      while (!copy_news_.load(std::memory_order_acquire) && Clock::now() < until) cpu_relax();
      lock.lock();
    }
    // Woken by enqueue_copy or the destructor; the timeout only bounds the wait.
    if (!copy_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_ || !copies_.empty(); })) continue;
    if (copies_.empty()) return;
    auto copy = std::move(copies_.front());
    copies_.pop_front();
    bool stopping = stopping_;
    copying_ = true;
    lock.unlock();
    copy(stopping);
    copy = nullptr;  // drop the peer reference outside the lock
    lock.lock();
    copying_ = false;
  }
}

}  // namespace siesta::transfer::ipc
