#include "transfer/ipc/ipc_peer.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "transfer/ipc/ipc_backend.h"
#include "transfer/ipc/unix_socket.h"
#include "transfer/region_table.h"

namespace siesta::transfer::ipc {

namespace {
// Copies expected to take tens of microseconds run on the submitting thread
// when the copy thread is idle (IpcBackend::enqueue_copy): host copies up to
// 256 KiB, CUDA copies up to 64 MiB (about 40 us device-to-device on an H200).
constexpr uint64_t kInlineHostBytes = 256u << 10;
constexpr uint64_t kInlineCudaBytes = 64u << 20;
}  // namespace

IpcPeer::IpcPeer(IpcBackend& backend, EngineMeta meta, int sock, const uint64_t* table, size_t table_bytes,
                 std::vector<ImportedRegion> regions, int cuda_device)
    : backend_(backend),
      meta_(std::move(meta)),
      sock_(sock),
      table_(table),
      table_bytes_(table_bytes),
      regions_(std::move(regions)),
      cuda_device_(cuda_device) {}

IpcPeer::~IpcPeer() {
  std::lock_guard<std::mutex> lock(mu_);
  unmap_locked();
}

void IpcPeer::unmap_locked() {
  if (unmapped_) return;
  unmapped_ = true;
  for (ImportedRegion& r : regions_) {
    if (r.kind == MemoryKind::kCuda) {
      cuda_release(r.cuda);
    } else if (r.map_base != nullptr) {
      munmap(r.map_base, r.map_bytes);
    }
  }
  regions_.clear();
  if (table_ != nullptr) munmap(const_cast<uint64_t*>(table_), table_bytes_);
  table_ = nullptr;
  if (sock_ >= 0) close(sock_);
  sock_ = -1;
}

void IpcPeer::post(XferPlan plan, XferDone done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) {
      done(unavailable(fmt::format("the memory of peer {} was released after its INVALIDATE; handshake again",
                                   meta_.engine_id)));
      return;
    }
    ++in_flight_;
  }
  uint64_t bytes = 0;
  bool cuda = false;
  for (const XferSegment& s : plan.segments) {
    bytes += s.bytes;
    cuda = cuda || s.local_kind == MemoryKind::kCuda || regions_[s.remote_index].kind == MemoryKind::kCuda;
  }
  bool small = bytes <= (cuda ? kInlineCudaBytes : kInlineHostBytes);
  auto self = shared_from_this();
  const auto posted = Clock::now();
  backend_.enqueue_copy([self, plan = std::move(plan), done = std::move(done), posted](bool stopping) {
    const auto picked = Clock::now();
    Ok result = stopping ? Ok(unavailable("the transfer engine is shutting down")) : self->execute(plan);
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (--self->in_flight_ == 0) self->idle_cv_.notify_all();
    }
    const auto executed = Clock::now();
    done(std::move(result));
    const auto us = [](auto d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); };
    SIESTA_LOG_DEBUG("ipc: a copy waited {} us for the copy thread, ran {} us, its completion took {} us",
                     us(picked - posted), us(executed - picked), us(Clock::now() - executed));
  }, small);
}

Ok IpcPeer::release(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  released_ = true;
  if (!idle_cv_.wait_until(lock, deadline, [&] { return in_flight_ == 0; }))
    return timeout(fmt::format("{} copies with peer {} were still running at the deadline; its memory stays mapped "
                               "until they end",
                               in_flight_, meta_.engine_id));
  unmap_locked();
  return {};
}

Ok IpcPeer::check_peer(const XferPlan& plan, bool alive) const {
  if (alive && peer_hung_up(sock_))
    return unavailable(fmt::format("peer {} exited (its ipc socket closed)", meta_.engine_id));
  size_t words = table_bytes_ / sizeof(uint64_t);
  // A run of segments in one remote region is checked once: a KV transfer
  // has hundreds of segments in one region.
  size_t last = SIZE_MAX;
  for (const XferSegment& s : plan.segments) {
    if (s.remote_index == last) continue;
    last = s.remote_index;
    const RegionDesc& d = meta_.regions[s.remote_index];
    SIESTA_TRY(check_region_live(table_, words, d.slot, d.id, meta_.epoch));
  }
  return {};
}

PieceEnds IpcPeer::piece_ends(int local_device, const ImportedRegion& remote) const {
  // Our side: memory of the copying device, or memory it may not address
  // (host memory, another GPU: we do not know that it is mapped for this one).
  if (local_device != cuda_device_ || remote.kind != MemoryKind::kCuda) return PieceEnds::kElsewhere;
  if (remote.cuda.owner_device == cuda_device_) return PieceEnds::kThisDevice;
  // The peer's memory on another GPU, mapped for this device too (peer access).
  return remote.cuda.direct ? PieceEnds::kPeerDevice : PieceEnds::kElsewhere;
}

Ok IpcPeer::execute(const XferPlan& plan) {
  if (expired(plan.deadline)) return timeout("the deadline passed before the copy started");
  {
    // release() waits for this copy, so the mappings stay while it runs.
    std::lock_guard<std::mutex> lock(mu_);
    if (unmapped_) return unavailable(fmt::format("the memory of peer {} was released; handshake again", meta_.engine_id));
  }
  const auto started = Clock::now();
  // Before the copy, that every remote region is still the one we mapped;
  // whether the peer is still there is asked after it (one system call less
  // on the way to the first byte; the mapping keeps a dead peer's memory).
  Ok before = check_peer(plan, false);
  if (!before) return before.error().with_context("nothing was copied");

  std::vector<CopyPiece> by_kernel, by_copy_engine;
  by_kernel.reserve(plan.segments.size());
  std::vector<std::pair<RegionId, int>> local_devices;  // looked up once per region
  std::vector<std::pair<CopyPiece, PieceEnds>> cuda_pieces;
  uint64_t peer_bytes = 0, peer_pieces = 0;
  for (const XferSegment& s : plan.segments) {
    const ImportedRegion& r = regions_[s.remote_index];
    char* remote = r.data + s.remote_offset;
    CopyPiece piece = plan.op == XferOp::kWrite ? CopyPiece{remote, s.local, s.bytes} : CopyPiece{s.local, remote, s.bytes};
    if (r.kind != MemoryKind::kCuda && s.local_kind != MemoryKind::kCuda) {
      std::memcpy(piece.dst, piece.src, piece.bytes);
      continue;
    }
    int local_device = -1;
    if (s.local_kind == MemoryKind::kCuda) {
      auto it = std::find_if(local_devices.begin(), local_devices.end(),
                             [&](const auto& d) { return d.first == s.local_region; });
      if (it != local_devices.end()) {
        local_device = it->second;
      } else {
        local_device = backend_.local_cuda_device(s.local_region);
        local_devices.emplace_back(s.local_region, local_device);
      }
    }
    const PieceEnds ends = piece_ends(local_device, r);
    if (ends == PieceEnds::kPeerDevice) {
      peer_bytes += s.bytes;
      ++peer_pieces;
    }
    cuda_pieces.emplace_back(piece, ends);
  }
  const uint64_t peer_average = peer_pieces == 0 ? 0 : peer_bytes / peer_pieces;
  for (const auto& [piece, ends] : cuda_pieces)
    (copies_with_kernel(backend_.cuda_copy_path(), ends, peer_average) ? by_kernel : by_copy_engine).push_back(piece);
  if (!by_kernel.empty() || !by_copy_engine.empty()) {
    backend_.log_cuda_copy_once(by_kernel.size(), by_copy_engine.size());
    const auto copy_started = Clock::now();
    SIESTA_TRY(cuda_copy_pieces(by_kernel, by_copy_engine, cuda_device_));
    const auto us = [](auto d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); };
    SIESTA_LOG_DEBUG("ipc: {} with {}: {} pieces by the kernel, {} by cudaMemcpyAsync; checks {} us, copy {} us",
                     xfer_op_name(plan.op), meta_.engine_id, by_kernel.size(), by_copy_engine.size(),
                     us(copy_started - started), us(Clock::now() - copy_started));
  }

  Ok after = check_peer(plan, true);
  if (!after)
    return after.error().with_context(plan.op == XferOp::kRead ? "the bytes read are not trusted"
                                                               : "the bytes written may not have reached the peer");
  return {};
}

}  // namespace siesta::transfer::ipc
