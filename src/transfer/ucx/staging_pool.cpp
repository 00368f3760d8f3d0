#include "transfer/ucx/staging_pool.h"

#include <fmt/format.h>

#include "common/log.h"
#include "transfer/ucx/ucx_worker.h"

namespace siesta::transfer::ucx {

Result<std::unique_ptr<StagingPool>> StagingPool::create(ucp_context_h context, size_t chunk_bytes, size_t chunks,
                                                         bool pinned) {
  if (chunk_bytes == 0 || chunks == 0) return invalid_argument("a staging pool needs at least one chunk of some bytes");
  std::unique_ptr<StagingPool> p(new StagingPool());
  p->context_ = context;
  p->chunk_bytes_ = chunk_bytes;
  p->size_ = chunks;
  p->pinned_ = pinned;
  SIESTA_TRY(p->add_slab(chunks));
  return p;
}

Ok StagingPool::add_slab(size_t chunks) {
  Slab slab;
  SIESTA_ASSIGN_OR_RETURN(slab.memory, StagingMemory::allocate(chunk_bytes_ * chunks, pinned_));
  SIESTA_ASSIGN_OR_RETURN(MappedMemory mapped, map_memory(context_, slab.memory->data(), slab.memory->bytes(),
                                                          UCS_MEMORY_TYPE_HOST, false));
  slab.memh = mapped.memh;
  for (size_t i = 0; i < chunks; ++i) {
    auto c = std::make_unique<StagingChunk>();
    c->data = slab.memory->data() + i * chunk_bytes_;
    c->memh = slab.memh;
    free_.push_back(c.get());
    chunks_.push_back(std::move(c));
  }
  slabs_.push_back(std::move(slab));
  return {};
}

StagingPool::~StagingPool() {
  for (auto& c : chunks_) c->copy.wait();
  for (Slab& s : slabs_) ucp_mem_unmap(context_, s.memh);
}

StagingChunk* StagingPool::acquire() {
  if (free_.empty()) return nullptr;
  StagingChunk* c = free_.front();
  free_.pop_front();
  return c;
}

void StagingPool::release(StagingChunk* chunk) {
  if (chunk == nullptr) return;
  if (chunk->copy.running()) {
    draining_.push_back(chunk);
  } else {
    free_.push_back(chunk);
  }
}

void StagingPool::retire(StagingChunk* chunk) {
  if (chunk == nullptr) return;
  // Its memory stays mapped and allocated until the pool goes; only its place is taken.
  if (!growing_) return;
  if (retired_ >= size_) {
    SIESTA_LOG_WARN("ucx staging: {} chunks were held by requests to dead peers; the pool shrinks", retired_ + 1);
    ++retired_;
    return;
  }
  ++retired_;
  Ok added = add_slab(1);
  if (!added) SIESTA_LOG_WARN("ucx staging: no fresh chunk for a retired one: {}", added.error().message);
}

bool StagingPool::poll() {
  for (size_t i = 0; i < draining_.size();) {
    Result<bool> done = draining_[i]->copy.finished();
    if (done && !*done) {
      ++i;
      continue;
    }
    if (!done) SIESTA_LOG_WARN("ucx staging: a copy of a failed transfer failed too: {}", done.error().message);
    free_.push_back(draining_[i]);
    draining_[i] = draining_.back();
    draining_.pop_back();
  }
  return !draining_.empty();
}

Ok StagingPool::copy_in(StagingChunk* chunk, const void* src, size_t bytes, int device) {
  if (bytes > chunk_bytes_) return internal_error("a staging copy larger than its chunk");
  return chunk->copy.start(chunk->data, src, bytes, device, false, streams_);
}

Ok StagingPool::copy_out(StagingChunk* chunk, void* dst, size_t bytes, int device) {
  if (bytes > chunk_bytes_) return internal_error("a staging copy larger than its chunk");
  return chunk->copy.start(dst, chunk->data, bytes, device, true, streams_);
}

}  // namespace siesta::transfer::ucx
