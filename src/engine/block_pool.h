// BlockPool: the KV cache's blocks, by id: free list, reference counts, the
// prefix cache (chained BlockHash -> block) and holds for remote readers.
//
// Lifecycle
//   BlockPool pool(num_blocks);                        // all blocks free, nothing cached
//   Result<std::vector<BlockId>> b = pool.allocate(3);  // ref 1 each
//   pool.cache(b[0], hash);                            // full, computed block: findable by hash
//   std::optional<BlockId> hit = pool.find_cached(hash);
//   pool.acquire({&*hit, 1});                          // another request shares it (ref 2)
//   pool.release(blocks);                              // ref - 1; at 0 the block is free
//   pool.hold(send_hold_owner("req-7"), blocks) / pool.release_hold(...);   // see below
//   pool.reset_prefix_cache();                         // only while no block is in use
//
// A free block keeps its hash and stays findable until it is reused: free
// blocks form one queue, evicted from the front. Uncached blocks go to the
// front (nothing to lose), cached ones to the back in the order released, so
// the cache is evicted least recently released first; a caller that releases
// a sequence's blocks tail first makes its tail go before its prefix.
//
// Holds: an owner (a HoldKey, e.g. the P/D send of request X) takes one more
// reference on a set of blocks, so they outlive the request that filled them
// (a prefill engine keeps a finished request's blocks until the decode engine
// has read them). release_hold gives those references back. An owner has at
// most one hold.
//
// Ids are 0 .. num_blocks-1 and index the KV cache (KvCacheView). Not
// thread-safe: owned and called by the engine loop.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/block_hash.h"
#include "engine/hold_key.h"

namespace siesta {

using BlockId = int32_t;

struct BlockPoolStats {
  int num_blocks = 0;
  int num_free_blocks = 0;     // ref 0, cached or not (what allocate can take)
  int num_cached_blocks = 0;   // blocks findable by hash, in use or free
  int num_held_blocks = 0;     // references taken by holds (a block in two holds counts twice)
  int num_holds = 0;
  uint64_t prefix_cache_queries = 0;  // tokens looked up
  uint64_t prefix_cache_hits = 0;     // of those, tokens found
  uint64_t evictions = 0;             // cached blocks reused for new data
  // Fraction of blocks in use (vLLM's kv_cache_usage).
  double usage() const { return num_blocks > 0 ? 1.0 - static_cast<double>(num_free_blocks) / num_blocks : 0.0; }
};

class BlockPool {
 public:
  explicit BlockPool(int num_blocks, bool enable_prefix_caching = true);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int num_blocks() const { return static_cast<int>(ref_.size()); }
  int num_free_blocks() const { return num_free_; }
  bool prefix_caching() const { return prefix_caching_; }

  // n free blocks with ref 1, evicting cached free blocks from the front of
  // the queue. kOutOfMemory (nothing taken) when fewer than n are free.
  Result<std::vector<BlockId>> allocate(int n);
  // One more reference each; a free block leaves the free queue (a prefix-cache hit).
  void acquire(std::span<const BlockId> blocks);
  // One reference fewer each; at 0 the block is free (see the queue order above).
  void release(std::span<const BlockId> blocks);
  int ref_count(BlockId block) const { return ref_[block]; }

  // --- prefix cache (no-ops and misses when disabled)
  std::optional<BlockId> find_cached(const BlockHash& hash) const;
  // Makes a full block whose KV is computed findable under `hash`. A block
  // that already has a hash, or a hash that already names another block,
  // leaves the cache as it is.
  void cache(BlockId block, const BlockHash& hash);
  std::optional<BlockHash> hash_of(BlockId block) const;
  // Counts a prefix lookup for the metrics: tokens asked for and found.
  void record_prefix_query(int num_tokens, int num_hit_tokens);
  // Forgets every hash. kConflict while any block is in use, naming how many
  // and how many of them holds keep.
  Result<void> reset_prefix_cache();

  // --- holds
  // kConflict if `owner` already holds blocks; kInvalidArgument for a free block or a bad id.
  Result<void> hold(const HoldKey& owner, std::span<const BlockId> blocks);
  // kNotFound if `owner` holds nothing.
  Result<void> release_hold(const HoldKey& owner);
  const std::vector<BlockId>* held_by(const HoldKey& owner) const;
  std::vector<HoldKey> hold_owners() const;  // sorted
  // Block references taken by holds of this kind.
  int num_held_blocks(HoldKind kind) const;

  BlockPoolStats stats() const;

 private:
  void unlink(BlockId b);
  void push_front(BlockId b);
  void push_back(BlockId b);
  BlockId pop_front();
  void uncache(BlockId b);

  bool prefix_caching_;
  std::vector<int32_t> ref_;
  std::vector<std::optional<BlockHash>> hash_;
  // Free queue: a doubly linked list through prev_/next_, sentinel at index num_blocks.
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
  int num_free_ = 0;
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> cached_;
  std::unordered_map<HoldKey, std::vector<BlockId>, HoldKeyHasher> holds_;
  int num_held_ = 0;
  uint64_t queries_ = 0;
  uint64_t hits_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace siesta
