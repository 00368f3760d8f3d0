#include "engine/block_pool.h"

#include <algorithm>

#include "common/log.h"

namespace siesta {

BlockPool::BlockPool(int num_blocks, bool enable_prefix_caching)
    : prefix_caching_(enable_prefix_caching),
      ref_(std::max(num_blocks, 0), 0),
      hash_(ref_.size()),
      prev_(ref_.size() + 1),
      next_(ref_.size() + 1) {
  const int sentinel = this->num_blocks();
  prev_[sentinel] = next_[sentinel] = sentinel;
  for (BlockId b = 0; b < this->num_blocks(); ++b) push_back(b);
}

void BlockPool::unlink(BlockId b) {
  next_[prev_[b]] = next_[b];
  prev_[next_[b]] = prev_[b];
  --num_free_;
}

void BlockPool::push_front(BlockId b) {
  const int s = num_blocks();
  prev_[b] = s;
  next_[b] = next_[s];
  prev_[next_[s]] = b;
  next_[s] = b;
  ++num_free_;
}

void BlockPool::push_back(BlockId b) {
  const int s = num_blocks();
  next_[b] = s;
  prev_[b] = prev_[s];
  next_[prev_[s]] = b;
  prev_[s] = b;
  ++num_free_;
}

BlockId BlockPool::pop_front() {
  const BlockId b = next_[num_blocks()];
  unlink(b);
  return b;
}

void BlockPool::uncache(BlockId b) {
  if (!hash_[b]) return;
  auto it = cached_.find(*hash_[b]);
  if (it != cached_.end() && it->second == b) cached_.erase(it);
  hash_[b].reset();
}

Result<std::vector<BlockId>> BlockPool::allocate(int n) {
  if (n < 0) return invalid_argument("KV cache: cannot allocate " + std::to_string(n) + " blocks");
  if (n > num_free_)
    return out_of_memory("KV cache: " + std::to_string(n) + " blocks needed, " + std::to_string(num_free_) +
                         " of " + std::to_string(num_blocks()) + " free");
  std::vector<BlockId> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) {
    const BlockId b = pop_front();
    if (hash_[b]) {
      uncache(b);
      ++evictions_;
    }
    ref_[b] = 1;
    out.push_back(b);
  }
  return out;
}

void BlockPool::acquire(std::span<const BlockId> blocks) {
  for (BlockId b : blocks) {
    if (ref_[b]++ == 0) unlink(b);
  }
}

void BlockPool::release(std::span<const BlockId> blocks) {
  for (BlockId b : blocks) {
    if (ref_[b] <= 0) {
      SIESTA_LOG_ERROR("KV cache: block {} released while free (a bug in its owner); ignored", b);
      continue;
    }
    if (--ref_[b] == 0) {
      if (hash_[b])
        push_back(b);
      else
        push_front(b);
    }
  }
}

std::optional<BlockId> BlockPool::find_cached(const BlockHash& hash) const {
  if (!prefix_caching_) return std::nullopt;
  auto it = cached_.find(hash);
  if (it == cached_.end()) return std::nullopt;
  return it->second;
}

void BlockPool::cache(BlockId block, const BlockHash& hash) {
  if (!prefix_caching_ || hash_[block]) return;
  if (!cached_.emplace(hash, block).second) return;  // another block has this prefix
  hash_[block] = hash;
}

std::optional<BlockHash> BlockPool::hash_of(BlockId block) const { return hash_[block]; }

void BlockPool::record_prefix_query(int num_tokens, int num_hit_tokens) {
  queries_ += static_cast<uint64_t>(std::max(num_tokens, 0));
  hits_ += static_cast<uint64_t>(std::max(num_hit_tokens, 0));
}

Result<void> BlockPool::reset_prefix_cache() {
  const int in_use = num_blocks() - num_free_;
  if (in_use > 0) {
    std::string msg = "cannot reset the prefix cache: " + std::to_string(in_use) + " of " +
                      std::to_string(num_blocks()) + " KV blocks are in use";
    if (!holds_.empty())
      msg += " (" + std::to_string(num_held_) + " references held for remote readers by " +
             std::to_string(holds_.size()) + " transfers)";
    return conflict(msg);
  }
  for (BlockId b = 0; b < num_blocks(); ++b) hash_[b].reset();
  cached_.clear();
  // Free blocks all become uncached; their queue order no longer matters.
  return {};
}

Result<void> BlockPool::hold(const HoldKey& owner, std::span<const BlockId> blocks) {
  if (holds_.count(owner)) return conflict("KV cache: '" + to_string(owner) + "' already holds blocks");
  for (BlockId b : blocks) {
    if (b < 0 || b >= num_blocks())
      return invalid_argument("KV cache: cannot hold block " + std::to_string(b) + ": no such block");
    if (ref_[b] == 0)
      return invalid_argument("KV cache: cannot hold block " + std::to_string(b) + " for '" + to_string(owner) +
                              "': it is free (its data may already be overwritten)");
  }
  acquire(blocks);
  holds_.emplace(owner, std::vector<BlockId>(blocks.begin(), blocks.end()));
  num_held_ += static_cast<int>(blocks.size());
  return {};
}

Result<void> BlockPool::release_hold(const HoldKey& owner) {
  auto it = holds_.find(owner);
  if (it == holds_.end()) return not_found("KV cache: '" + to_string(owner) + "' holds no blocks");
  std::vector<BlockId> blocks = std::move(it->second);
  holds_.erase(it);
  num_held_ -= static_cast<int>(blocks.size());
  std::reverse(blocks.begin(), blocks.end());  // tail first, as a request frees them
  release(blocks);
  return {};
}

const std::vector<BlockId>* BlockPool::held_by(const HoldKey& owner) const {
  auto it = holds_.find(owner);
  return it == holds_.end() ? nullptr : &it->second;
}

std::vector<HoldKey> BlockPool::hold_owners() const {
  std::vector<HoldKey> out;
  out.reserve(holds_.size());
  for (const auto& [owner, blocks] : holds_) out.push_back(owner);
  std::sort(out.begin(), out.end());
  return out;
}

int BlockPool::num_held_blocks(HoldKind kind) const {
  int n = 0;
  for (const auto& [owner, blocks] : holds_)
    if (owner.kind == kind) n += static_cast<int>(blocks.size());
  return n;
}

BlockPoolStats BlockPool::stats() const {
  BlockPoolStats s;
  s.num_blocks = num_blocks();
  s.num_free_blocks = num_free_;
  s.num_cached_blocks = static_cast<int>(cached_.size());
  s.num_held_blocks = num_held_;
  s.num_holds = static_cast<int>(holds_.size());
  s.prefix_cache_queries = queries_;
  s.prefix_cache_hits = hits_;
  s.evictions = evictions_;
  return s;
}

}  // namespace siesta
