#include "transfer/ucx/ucx_backend.h"

#include <fmt/format.h>

#include <random>

#include "common/log.h"
#include "transfer/region_table.h"
#include "transfer/transfer_config.h"
#include "transfer/ucx/cuda_staging.h"
#include "transfer/ucx/guarded_messages.h"
#include "transfer/ucx/guarded_target.h"
#include "transfer/ucx/staged_messages.h"
#include "transfer/ucx/staged_target.h"
#include "transfer/ucx/staging_pool.h"
#include "transfer/ucx/ucx_peer.h"
#include "transfer/wire.h"

namespace siesta::transfer::ucx {

namespace {

constexpr size_t kMaxBlobBytes = 1u << 16;
constexpr auto kWatchInterval = std::chrono::milliseconds(10);

constexpr uint8_t kBlobRkey = 'R';
constexpr uint8_t kBlobStaged = 'S';
constexpr auto kRemoveWait = std::chrono::seconds(5);

}  // namespace

std::string encode_region_blob(const RegionBlob& blob) {
  WireWriter w;
  if (blob.staged) {
    w.u8(kBlobStaged);
    w.u64(blob.chunk_bytes);
  } else {
    w.u8(kBlobRkey);
    w.raw(blob.rkey);
  }
  return w.take();
}

Result<RegionBlob> decode_region_blob(std::string_view bytes) {
  WireReader r(bytes);
  RegionBlob blob;
  uint8_t tag = r.u8();
  if (tag == kBlobStaged) {
    blob.staged = true;
    blob.chunk_bytes = r.u64();
    if (r.done() && blob.chunk_bytes > 0) return blob;
  } else if (tag == kBlobRkey && r.ok() && !r.at_end()) {
    blob.rkey = std::string(bytes.substr(1));
    return blob;
  }
  return corrupt("a malformed ucx region blob (neither an rkey nor a staged region)");
}

Result<std::unique_ptr<UcxBackend>> UcxBackend::create(const TransferConfig& config, RegionTable& table) {
  std::unique_ptr<UcxBackend> b(new UcxBackend(table));
  b->staging_ = config.ucx_staging;
  if (config.ucx_staging_chunk_bytes == 0 || config.ucx_staging_chunks == 0)
    return invalid_argument("ucx staging needs chunks of at least one byte, and at least one chunk");
  b->chunk_bytes_ = config.ucx_staging_chunk_bytes;
  b->sends_guarded_ = config.ucx_guarded;
  b->chunk_count_ = config.ucx_staging_chunks;
  SIESTA_ASSIGN_OR_RETURN(b->worker_, UcxWorker::create(UcxOptions{config.ucx_transports, config.ucx_net_devices,
                                                                 config.ucx_peer_error_handling}));
  SIESTA_ASSIGN_OR_RETURN(MappedMemory mapped, map_memory(b->worker_->context(), table.base(), table.bytes(),
                                                          UCS_MEMORY_TYPE_HOST, true));
  b->table_memh_ = mapped.memh;
  WireWriter w;
  w.bytes(b->worker_->address());
  w.u64(reinterpret_cast<uint64_t>(table.base()));
  w.u64(table.bytes());
  w.bytes(mapped.rkey);
  b->identity_ = ProcessIdentity::of_this_process();
  b->identity_.encode(w);
  w.u64(kGuardedMessageBytes);  // we serve guarded messages of up to this many bytes
  b->engine_blob_ = w.take();
  b->target_ = std::make_unique<StagedTarget>(*b->worker_, table, config.ucx_peer_error_handling);
  b->guarded_ = std::make_unique<GuardedTarget>(*b->worker_, table, *b->target_);
  b->keys_.seed(std::random_device{}());
  SIESTA_TRY(b->target_->install());
  SIESTA_TRY(b->guarded_->install());
  SIESTA_TRY(b->install_handlers());
  UcxBackend* raw = b.get();
  b->worker_->start([raw] { return raw->tick(); });
  return b;
}

UcxBackend::UcxBackend(RegionTable& table) : table_(table) {}

UcxBackend::~UcxBackend() {
  if (!worker_) return;  // create() failed before the worker: nothing else was made
  worker_->stop();
  if (guarded_) guarded_->stop();  // StagedTarget's destructor still progresses the worker
  if (initiator_pool_) initiator_pool_->stop_growing();
  // Transfers still in flight (a peer that never answered) fail now.
  std::vector<UcxXfer*> stuck(active_.begin(), active_.end());
  for (UcxXfer* x : stuck) {
    std::shared_ptr<UcxPeer> peer = x->peer;
    peer->abandon(x, unavailable("the transfer engine shut down"));
  }
  target_.reset();          // its pool, and what it still held for peers
  initiator_pool_.reset();  // after the transfers that held its chunks
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, memh] : memh_) ucp_mem_unmap(worker_->context(), memh);
    memh_.clear();
    if (table_memh_ != nullptr) ucp_mem_unmap(worker_->context(), table_memh_);
  }
  worker_.reset();  // no UCX callback runs after this
  for (UcxXfer* x : orphans_) delete x;
}

void UcxBackend::drop_orphan(UcxXfer* xfer) {
  orphans_.erase(xfer);
  delete xfer;
}

bool UcxBackend::stages(MemoryKind kind) const {
  switch (staging_) {
    case UcxStaging::kAlways: return true;
    case UcxStaging::kNever: return false;
    case UcxStaging::kAuto: return kind == MemoryKind::kCuda && !worker_->supports_cuda();
  }
  return false;
}

Result<std::string> UcxBackend::register_region(const LocalRegion& region) {
  const RegionSpec& s = region.spec;
  if (s.kind == MemoryKind::kCuda && !worker_->supports_cuda() && staging_ == UcxStaging::kNever)
    return unavailable("this UCX has no CUDA memory support (`ucx_info -d` lists no cuda transport) and ucx_staging "
                       "is \"never\"; set it to \"auto\" to move CUDA memory through pinned host staging, use the "
                       "ipc backend for GPUs on one host, or a UCX built with CUDA");
  if (!stages(s.kind)) {
    ucs_memory_type_t type = s.kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    SIESTA_ASSIGN_OR_RETURN(MappedMemory mapped, map_memory(worker_->context(), s.base, s.bytes, type, true));
    if (s.kind == MemoryKind::kHost) guarded_->add_region(region.id, region.slot, static_cast<char*>(s.base), s.bytes);
    std::lock_guard<std::mutex> lock(mu_);
    memh_[region.id] = mapped.memh;
    return encode_region_blob(RegionBlob{false, std::move(mapped.rkey), 0});
  }
  int device = s.kind == MemoryKind::kCuda ? s.cuda_device : -1;
  std::lock_guard<std::mutex> lock(mu_);
  if (!pools_made_) {
    // Pinned where a GPU is usable (host-memory staging in tests works without one).
    std::string why;
    bool pinned = cuda_staging_usable(&why);
    if (s.kind == MemoryKind::kCuda && !pinned)
      return unavailable(fmt::format("staging CUDA memory for the ucx backend: {}", why));
    SIESTA_ASSIGN_OR_RETURN(auto mine, StagingPool::create(worker_->context(), chunk_bytes_, chunk_count_, pinned));
    SIESTA_ASSIGN_OR_RETURN(auto theirs, StagingPool::create(worker_->context(), chunk_bytes_, chunk_count_, pinned));
    // Handed to the progress thread; its queue runs this before any transfer posted after it.
    auto handover = std::make_shared<std::pair<std::unique_ptr<StagingPool>, std::unique_ptr<StagingPool>>>(
        std::move(mine), std::move(theirs));
    worker_->post([this, handover] {
      initiator_pool_ = std::move(handover->first);
      target_->set_pool(std::move(handover->second));
    });
    pools_made_ = true;
    SIESTA_LOG_INFO("ucx: staging {} memory through {} chunks of {} KiB of {} host memory per direction",
                    memory_kind_name(s.kind), chunk_count_, chunk_bytes_ >> 10, pinned ? "pinned" : "ordinary");
  }
  staged_[region.id] = device;
  target_->add_region(region.id, region.slot, static_cast<char*>(s.base), s.bytes, device);
  return encode_region_blob(RegionBlob{true, {}, chunk_bytes_});
}

void UcxBackend::deregister_region(RegionId id) {
  guarded_->remove_region(id);  // after a guarded copy into or out of it that runs now
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (staged_.erase(id) == 0) {
      auto it = memh_.find(id);
      if (it == memh_.end()) return;
      ucs_status_t st = ucp_mem_unmap(worker_->context(), it->second);
      if (st != UCS_OK) SIESTA_LOG_WARN("ucx: ucp_mem_unmap of region {}: {}", id.value, ucs_status_string(st));
      memh_.erase(it);
      return;
    }
  }
  // Peers' staged requests in flight on it end before the owner may free it.
  target_->remove_region(id, deadline_after(std::chrono::duration_cast<std::chrono::milliseconds>(kRemoveWait)));
}

std::optional<int> UcxBackend::local_staging(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = staged_.find(id);
  if (it == staged_.end()) return std::nullopt;
  return it->second;
}

uint64_t UcxBackend::new_initiator_key() {
  uint64_t key = 0;
  while (key == 0) key = keys_();
  return key;
}

uint64_t UcxBackend::await_reply(StagedPiece* piece) {
  uint64_t token = next_token_++;
  awaiting_[token] = piece;
  return token;
}

void UcxBackend::forget(uint64_t token) { awaiting_.erase(token); }

uint64_t UcxBackend::await_reply(GuardedMessage* message) {
  uint64_t token = next_token_++;
  awaiting_guarded_[token] = message;
  return token;
}

void UcxBackend::forget_guarded(uint64_t token) { awaiting_guarded_.erase(token); }

StagedPiece* UcxBackend::awaiting(uint64_t token) {
  auto it = awaiting_.find(token);
  return it == awaiting_.end() ? nullptr : it->second;
}

Ok UcxBackend::install_handlers() {
  for (unsigned id : {unsigned{kStagedWriteAck}, unsigned{kStagedReadData}}) {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = id == kStagedWriteAck ? on_write_ack : on_read_data;
    p.arg = this;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_->worker(), &p);
    if (st != UCS_OK) return ucx_error("registering the staged-transfer reply handlers", st);
  }
  for (unsigned id : {unsigned{kGuardedWriteAck}, unsigned{kGuardedReadData}}) {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = on_guarded_reply;
    p.arg = this;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_->worker(), &p);
    if (st != UCS_OK) return ucx_error("registering the guarded-transfer reply handlers", st);
  }
  return {};
}

// kGuardedWriteAck and kGuardedReadData: the transfer knows which it awaits.
ucs_status_t UcxBackend::on_guarded_reply(void* arg, const void* header, size_t header_length, void* data,
                                          size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  Result<StagedReply> reply = decode_staged_reply(header, header_length);
  if (!reply) return UCS_OK;
  auto it = self->awaiting_guarded_.find(reply->token);
  if (it == self->awaiting_guarded_.end()) return UCS_OK;  // a late reply: its transfer ended
  GuardedMessage* message = it->second;
  self->awaiting_guarded_.erase(it);
  message->xfer->peer->on_guarded_reply(message, reply->result, data, length,
                                        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
  return UCS_OK;
}

ucs_status_t UcxBackend::on_write_ack(void* arg, const void* header, size_t header_length, void*, size_t,
                                      const ucp_am_recv_param_t*) {
  auto* self = static_cast<UcxBackend*>(arg);
  Result<StagedReply> reply = decode_staged_reply(header, header_length);
  if (!reply) return UCS_OK;
  StagedPiece* piece = self->awaiting(reply->token);
  if (piece != nullptr) piece->xfer->peer->on_write_ack(piece, reply->result);
  return UCS_OK;
}

ucs_status_t UcxBackend::on_read_data(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  Result<StagedReply> reply = decode_staged_reply(header, header_length);
  if (!reply) return UCS_OK;  // a late or unknown reply: its data is dropped
  StagedPiece* piece = self->awaiting(reply->token);
  if (piece == nullptr) return UCS_OK;
  return piece->xfer->peer->on_read_data(piece, reply->result, data, length,
                                         (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
}

ucp_mem_h UcxBackend::local_memh(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = memh_.find(id);
  return it == memh_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<BackendPeer>> UcxBackend::connect(const EngineMeta& meta, Deadline deadline) {
  WireReader r(meta.backend_blob);
  std::string address = r.bytes(kMaxBlobBytes);
  RemoteTable table;
  table.address = r.u64();
  table.bytes = r.u64();
  table.rkey = r.bytes(kMaxBlobBytes);
  ProcessIdentity identity = ProcessIdentity::decode(r);
  uint64_t guarded_bytes = r.ok() && r.at_end() ? 0 : r.u64();  // absent: it serves no guarded messages
  if (!r.done() || address.empty() || table.bytes < region_table_bytes(1))
    return corrupt(fmt::format("the ucx backend blob of peer {} is malformed", meta.engine_id));
  for (const RegionDesc& d : meta.regions)
    if (d.backend_blob.empty())
      return corrupt(fmt::format("region {} of peer {} carries no rkey", d.id.value, meta.engine_id));
  // A peer process in our pid namespace is watched, so its exit fails its
  // transfers even where UCX's own peer error handling is off.
  int watch = identity_.same_pid_namespace(identity) ? open_process_watch(identity.pid) : -1;
  auto peer = std::make_shared<UcxPeer>(*this, meta, std::move(address), std::move(table), guarded_bytes, watch);
  auto opened = std::make_shared<Waiter<Ok>>();
  worker_->post([peer, opened] { peer->open([opened](Ok r) { opened->set(std::move(r)); }); });
  std::optional<Ok> result = opened->wait_until(deadline);
  if (!result || !*result) {
    Status why = result ? result->error()
                        : timeout(fmt::format("UCX did not connect to peer {} before the deadline", meta.engine_id));
    (void)peer->release(deadline_after(std::chrono::milliseconds(500)));
    return why;
  }
  return std::shared_ptr<BackendPeer>(peer);
}

void UcxBackend::ready(UcxXfer* xfer) {
  if (xfer->queued) return;
  xfer->queued = true;
  ready_.push_back(xfer);
}

bool UcxBackend::tick() {
  Clock::time_point now = Clock::now();
  if (now - last_watch_ >= kWatchInterval) {
    last_watch_ = now;
    std::set<UcxPeer*> busy;
    for (UcxXfer* x : active_) busy.insert(x->peer.get());
    for (UcxPeer* peer : busy)
      if (peer->process_exited()) peer->break_connection(
          unavailable(fmt::format("peer {} exited during the transfer", peer->meta().engine_id)), true);
  }
  // Staged pieces move every tick: their copies are polled, chunks freed.
  bool staging = false;
  for (UcxXfer* x : active_)
    if (x->staged()) {
      x->peer->pump(x);
      staging = true;
    }
  if (initiator_pool_ && initiator_pool_->poll()) staging = true;
  if (target_->tick()) staging = true;
  while (!ready_.empty()) {
    std::vector<UcxXfer*> batch;
    batch.swap(ready_);
    for (UcxXfer* x : batch) {
      UcxPeer* peer = x->peer.get();
      peer->advance(x);
    }
  }
  // Deadlines: a transfer still in flight at its deadline breaks its peer's
  // connection, which cancels its requests (and fails the others to that peer).
  std::vector<std::shared_ptr<UcxPeer>> late;
  for (UcxXfer* x : active_)
    if (!x->failure && now >= x->plan.deadline) late.push_back(x->peer);
  for (auto& peer : late)
    peer->break_connection(timeout(fmt::format("a transfer with peer {} passed its deadline", peer->meta().engine_id)),
                           false);
  return !active_.empty() || staging;
}

}  // namespace siesta::transfer::ucx
