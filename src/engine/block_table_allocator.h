// BlockTableAllocator: gives requests their block tables from a BlockPool.
// Prefix-cache lookup, slot allocation for the tokens of a step, publishing
// of full computed blocks, freeing.
//
//   BlockTableAllocator alloc(pool);
//   CachedPrefix p = alloc.find_cached_prefix(req);          // request without blocks
//   if (!alloc.allocate(req, num_new_tokens, p)) { ...preempt someone or wait... }
//   ... forward ...; req.num_computed_tokens += num_new_tokens;
//   alloc.publish_computed_blocks(req);                      // full blocks become hits for others
//   alloc.free(req);                                         // finished, preempted or aborted
//
// Not thread-safe; used by the scheduler on the engine loop.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/block_pool.h"
#include "engine/request.h"

namespace siesta {

struct CachedPrefix {
  std::vector<BlockId> blocks;  // not yet acquired
  int32_t num_tokens = 0;       // blocks.size() * block_size
};

class BlockTableAllocator {
 public:
  explicit BlockTableAllocator(BlockPool& pool, int block_size);

  // The longest run of the request's leading full blocks found in the cache,
  // never all of its tokens (the last one must be computed for its logits).
  // Extends req.block_hashes; does not count the lookup (the scheduler does,
  // once the request is admitted).
  CachedPrefix find_cached_prefix(Request& req) const;

  // Blocks for `num_new_tokens` more tokens. With a prefix (only for a request
  // that holds no blocks), its blocks become the head of the table and
  // num_computed_tokens moves past them. false, changing nothing, when the
  // pool lacks free blocks.
  bool allocate(Request& req, int32_t num_new_tokens, const CachedPrefix& prefix = {});

  // Blocks the allocation above would take from the free queue.
  int32_t blocks_needed(const Request& req, int32_t num_new_tokens, const CachedPrefix& prefix = {}) const;

  // Publishes the request's full, computed blocks in the prefix cache.
  void publish_computed_blocks(Request& req);

  // Releases the request's blocks, tail first (so its prefix is evicted last).
  void free(Request& req);

  BlockPool& pool() { return pool_; }
  int block_size() const { return block_size_; }

 private:
  BlockPool& pool_;
  int block_size_;
};

}  // namespace siesta
