// KvCacheMemory: the bytes of the paged KV cache. The one place the engine
// allocates them, so that the sleep-capable memory pool (src/memory) can take
// over here without touching the rest: the engine only ever uses view().
//
//   Result<KvCacheMemory> kv = KvCacheMemory::allocate(model.kv_layout(), num_blocks);
//   model.forward(batch, kv->view(), out);
//   // destroyed with the engine
//
// Today: heap memory from calloc, so large caches are zero pages that the OS
// commits only as they are written. Owned and used by the engine loop; view()
// may be read from any thread (it never changes after allocate).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "common/status.h"
#include "model/forward.h"

namespace siesta {

class KvCacheMemory {
 public:
  // kOutOfMemory naming the bytes when the allocation fails.
  static Result<KvCacheMemory> allocate(const KvCacheLayout& layout, int32_t num_blocks);

  KvCacheView view() const { return KvCacheView{base_.get(), num_blocks_, layout_}; }
  uint64_t bytes() const { return bytes_; }
  int32_t num_blocks() const { return num_blocks_; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  KvCacheMemory(std::unique_ptr<void, Free> base, const KvCacheLayout& layout, int32_t num_blocks, uint64_t bytes)
      : base_(std::move(base)), layout_(layout), num_blocks_(num_blocks), bytes_(bytes) {}

  std::unique_ptr<void, Free> base_;
  KvCacheLayout layout_;
  int32_t num_blocks_ = 0;
  uint64_t bytes_ = 0;
};

}  // namespace siesta
