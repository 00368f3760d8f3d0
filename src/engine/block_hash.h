// BlockHash: the prefix-cache key of one full KV block.
//
// Chained: a block's hash covers its parent's hash (the block before it in the
// sequence), its token ids and a salt, so equal hashes mean equal whole
// prefixes. The salt separates caches that must not share KV (a request's
// cache_salt today, an adapter name later); the empty salt is the default.
// 128 bits, so that an accidental collision (which would serve another
// prefix's KV) is out of reach; not a cryptographic hash.
//
//   uint64_t salt = hash_salt(request.cache_salt);
//   extend_block_hashes(request.block_hashes, request.tokens, salt);   // as tokens arrive
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace siesta {

struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
};

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const noexcept { return static_cast<size_t>(h.lo ^ (h.hi >> 1)); }
};

// The parent of a sequence's first block.
inline constexpr BlockHash kRootBlockHash{0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL};

uint64_t hash_salt(std::string_view salt);

BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens, uint64_t salt);

// Appends the hashes of the full blocks of `tokens` that `hashes` does not
// cover yet (hashes[i] is block i's, chained from kRootBlockHash).
void extend_block_hashes(std::vector<BlockHash>& hashes, std::span<const int32_t> tokens, uint64_t salt,
                         int block_size);

}  // namespace siesta
