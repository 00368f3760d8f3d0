#include "engine/block_table_allocator.h"

#include <algorithm>

namespace siesta {

BlockTableAllocator::BlockTableAllocator(BlockPool& pool, int block_size) : pool_(pool), block_size_(block_size) {}

CachedPrefix BlockTableAllocator::find_cached_prefix(Request& req) const {
  CachedPrefix out;
  if (!pool_.prefix_caching() || !req.block_table.empty()) return out;
  extend_block_hashes(req.block_hashes, req.tokens, req.salt_hash, block_size_);
  const size_t max_blocks = static_cast<size_t>(std::max(req.num_tokens() - 1, 0)) / block_size_;
  for (size_t i = 0; i < std::min(max_blocks, req.block_hashes.size()); ++i) {
    std::optional<BlockId> b = pool_.find_cached(req.block_hashes[i]);
    if (!b) break;
    out.blocks.push_back(*b);
  }
  out.num_tokens = static_cast<int32_t>(out.blocks.size()) * block_size_;
  return out;
}

int32_t BlockTableAllocator::blocks_needed(const Request& req, int32_t num_new_tokens,
                                           const CachedPrefix& prefix) const {
  const int64_t end = static_cast<int64_t>(req.num_computed_tokens) + prefix.num_tokens + num_new_tokens;
  const int64_t total = (end + block_size_ - 1) / block_size_;
  const int64_t have = static_cast<int64_t>(req.block_table.size() + prefix.blocks.size());
  int64_t needed = std::max<int64_t>(total - have, 0);
  // Free cached blocks that become hits leave the free queue too.
  for (BlockId b : prefix.blocks) needed += pool_.ref_count(b) == 0;
  return static_cast<int32_t>(needed);
}

bool BlockTableAllocator::allocate(Request& req, int32_t num_new_tokens, const CachedPrefix& prefix) {
  if (blocks_needed(req, num_new_tokens, prefix) > pool_.num_free_blocks()) return false;
  if (!prefix.blocks.empty()) {
    pool_.acquire(prefix.blocks);
    req.block_table.insert(req.block_table.end(), prefix.blocks.begin(), prefix.blocks.end());
    req.num_published_blocks = static_cast<int32_t>(req.block_table.size());
    req.num_computed_tokens += prefix.num_tokens;
  }
  const int64_t end = static_cast<int64_t>(req.num_computed_tokens) + num_new_tokens;
  const int64_t total = (end + block_size_ - 1) / block_size_;
  const int64_t missing = total - static_cast<int64_t>(req.block_table.size());
  if (missing > 0) {
    Result<std::vector<BlockId>> fresh = pool_.allocate(static_cast<int>(missing));
    if (!fresh) return false;  // cannot happen after the check above
    req.block_table.insert(req.block_table.end(), fresh->begin(), fresh->end());
  }
  return true;
}

void BlockTableAllocator::publish_computed_blocks(Request& req) {
  if (!pool_.prefix_caching()) return;
  extend_block_hashes(req.block_hashes, req.tokens, req.salt_hash, block_size_);
  const size_t full = std::min({static_cast<size_t>(req.num_computed_tokens / block_size_), req.block_hashes.size(),
                                req.block_table.size()});
  for (size_t i = static_cast<size_t>(req.num_published_blocks); i < full; ++i)
    pool_.cache(req.block_table[i], req.block_hashes[i]);
  req.num_published_blocks = static_cast<int32_t>(std::max<size_t>(full, req.num_published_blocks));
}

void BlockTableAllocator::free(Request& req) {
  std::vector<BlockId> tail_first(req.block_table.rbegin(), req.block_table.rend());
  pool_.release(tail_first);
  req.block_table.clear();
  req.num_published_blocks = 0;
}

}  // namespace siesta
