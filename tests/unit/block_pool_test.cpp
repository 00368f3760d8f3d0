// BlockPool and BlockHash: free list, reference counts, prefix cache with LRU
// eviction, holds for remote readers, reset_prefix_cache.
#include "engine/block_pool.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace siesta {
namespace {

std::vector<int32_t> iota_tokens(int n, int32_t first = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

BlockHash h(uint64_t i) { return hash_block(kRootBlockHash, std::vector<int32_t>{static_cast<int32_t>(i)}, 0); }

TEST(BlockHash, ChainsParentTokensAndSalt) {
  const auto a = iota_tokens(16);
  const auto b = iota_tokens(16, 1);
  const BlockHash ha = hash_block(kRootBlockHash, a, 0);
  EXPECT_EQ(ha, hash_block(kRootBlockHash, a, 0));
  EXPECT_NE(ha, hash_block(kRootBlockHash, b, 0));
  EXPECT_NE(hash_block(ha, a, 0), hash_block(kRootBlockHash, a, 0));  // same tokens, other prefix
  EXPECT_NE(ha, hash_block(kRootBlockHash, a, hash_salt("adapter-1")));
  EXPECT_EQ(hash_salt("x"), hash_salt("x"));
  EXPECT_NE(hash_salt("x"), hash_salt("y"));
  EXPECT_NE(hash_salt(""), hash_salt(std::string(1, '\0')));
}

TEST(BlockHash, ExtendCoversOnlyFullBlocksAndIsIncremental) {
  const auto tokens = iota_tokens(40);
  std::vector<BlockHash> all;
  extend_block_hashes(all, tokens, 0, 16);
  ASSERT_EQ(all.size(), 2u);  // 40 tokens: two full blocks
  std::vector<BlockHash> grown;
  for (size_t n = 1; n <= tokens.size(); ++n) extend_block_hashes(grown, std::span(tokens).first(n), 0, 16);
  EXPECT_EQ(grown, all);
  EXPECT_EQ(all[1], hash_block(all[0], std::span(tokens).subspan(16, 16), 0));
}

TEST(BlockPool, AllocatesUntilEmptyThenSaysHowManyAreFree) {
  BlockPool pool(4);
  auto a = pool.allocate(3);
  ASSERT_TRUE(a);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  auto b = pool.allocate(2);
  ASSERT_FALSE(b);
  EXPECT_EQ(b.error().code, ErrorCode::kOutOfMemory);
  EXPECT_NE(b.error().message.find("2 blocks needed, 1 of 4 free"), std::string::npos) << b.error().message;
  EXPECT_EQ(pool.num_free_blocks(), 1);  // a failed allocation takes nothing
  pool.release(*a);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  EXPECT_DOUBLE_EQ(pool.stats().usage(), 0.0);
}

TEST(BlockPool, SharedBlocksAreFreedByTheLastReference) {
  BlockPool pool(2);
  auto a = pool.allocate(1);
  ASSERT_TRUE(a);
  pool.acquire(*a);
  EXPECT_EQ(pool.ref_count((*a)[0]), 2);
  pool.release(*a);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  pool.release(*a);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.release(*a);  // a bug in the caller: logged, ignored
  EXPECT_EQ(pool.num_free_blocks(), 2);
}

TEST(BlockPool, FreedCachedBlocksStayFindableUntilReused) {
  BlockPool pool(3);
  auto a = pool.allocate(1);
  ASSERT_TRUE(a);
  const BlockId blk = (*a)[0];
  pool.cache(blk, h(1));
  pool.release(*a);
  EXPECT_EQ(pool.find_cached(h(1)), blk);
  EXPECT_EQ(pool.stats().num_cached_blocks, 1);
  // A hit takes the block back out of the free queue.
  pool.acquire(std::span(&blk, 1));
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.release(std::span(&blk, 1));
  // Uncached free blocks are used first; the cached one goes last.
  auto two = pool.allocate(2);
  ASSERT_TRUE(two);
  EXPECT_EQ(pool.find_cached(h(1)), blk);
  auto last = pool.allocate(1);
  ASSERT_TRUE(last);
  EXPECT_EQ((*last)[0], blk);
  EXPECT_FALSE(pool.find_cached(h(1)));
  EXPECT_EQ(pool.stats().evictions, 1u);
}

TEST(BlockPool, EvictsTheLeastRecentlyReleasedCachedBlockFirst) {
  BlockPool pool(3);
  auto a = pool.allocate(3);
  ASSERT_TRUE(a);
  for (int i = 0; i < 3; ++i) pool.cache((*a)[i], h(i));
  // Released in the order 2, 0, 1: block 2 goes first, then 0.
  pool.release(std::vector<BlockId>{(*a)[2], (*a)[0], (*a)[1]});
  ASSERT_TRUE(pool.allocate(1));
  EXPECT_FALSE(pool.find_cached(h(2)));
  EXPECT_TRUE(pool.find_cached(h(0)));
  ASSERT_TRUE(pool.allocate(1));
  EXPECT_FALSE(pool.find_cached(h(0)));
  EXPECT_TRUE(pool.find_cached(h(1)));
}

TEST(BlockPool, ASecondBlockWithTheSameHashStaysUncached) {
  BlockPool pool(2);
  auto a = pool.allocate(2);
  ASSERT_TRUE(a);
  pool.cache((*a)[0], h(5));
  pool.cache((*a)[1], h(5));
  EXPECT_EQ(pool.find_cached(h(5)), (*a)[0]);
  EXPECT_FALSE(pool.hash_of((*a)[1]));
  pool.release(*a);
  EXPECT_EQ(pool.stats().num_cached_blocks, 1);
}

TEST(BlockPool, DisabledPrefixCachingNeverFinds) {
  BlockPool pool(2, /*enable_prefix_caching=*/false);
  auto a = pool.allocate(1);
  ASSERT_TRUE(a);
  pool.cache((*a)[0], h(1));
  EXPECT_FALSE(pool.find_cached(h(1)));
  pool.release(*a);
}

TEST(BlockPool, ResetPrefixCacheIsRefusedWhileBlocksAreInUse) {
  BlockPool pool(4);
  auto a = pool.allocate(2);
  ASSERT_TRUE(a);
  pool.cache((*a)[0], h(1));
  auto r = pool.reset_prefix_cache();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, ErrorCode::kConflict);
  EXPECT_NE(r.error().message.find("2 of 4 KV blocks are in use"), std::string::npos) << r.error().message;
  pool.release(*a);
  EXPECT_TRUE(pool.find_cached(h(1)));
  ASSERT_TRUE(pool.reset_prefix_cache());
  EXPECT_FALSE(pool.find_cached(h(1)));
  EXPECT_EQ(pool.stats().num_cached_blocks, 0);
  EXPECT_EQ(pool.num_free_blocks(), 4);
}

TEST(BlockPool, HoldKeepsBlocksAfterTheRequestReleasesThem) {
  BlockPool pool(4);
  auto a = pool.allocate(2);
  ASSERT_TRUE(a);
  ASSERT_TRUE(pool.hold(send_hold_owner("req-1"), *a));
  pool.release(*a);  // the request finished
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_EQ(pool.stats().num_held_blocks, 2);
  ASSERT_NE(pool.held_by(send_hold_owner("req-1")), nullptr);
  EXPECT_EQ(*pool.held_by(send_hold_owner("req-1")), *a);
  EXPECT_EQ(pool.hold_owners(), std::vector<HoldKey>{send_hold_owner("req-1")});

  auto again = pool.hold(send_hold_owner("req-1"), *a);
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, ErrorCode::kConflict);

  auto reset = pool.reset_prefix_cache();
  ASSERT_FALSE(reset);
  EXPECT_NE(reset.error().message.find("held for remote readers"), std::string::npos) << reset.error().message;

  ASSERT_TRUE(pool.release_hold(send_hold_owner("req-1")));
  EXPECT_EQ(pool.num_free_blocks(), 4);
  EXPECT_EQ(pool.stats().num_holds, 0);
  EXPECT_EQ(pool.release_hold(send_hold_owner("req-1")).error().code, ErrorCode::kNotFound);
}

TEST(BlockPool, HoldingAFreeBlockIsRefused) {
  BlockPool pool(2);
  std::vector<BlockId> free_block{0};
  auto r = pool.hold(send_hold_owner("x"), free_block);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  std::vector<BlockId> bad{7};
  EXPECT_FALSE(pool.hold(send_hold_owner("y"), bad));
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_EQ(pool.stats().num_holds, 0);
}

TEST(BlockPool, StatsCountQueriesHitsAndUsage) {
  BlockPool pool(8);
  pool.record_prefix_query(64, 32);
  pool.record_prefix_query(16, 0);
  auto a = pool.allocate(2);
  ASSERT_TRUE(a);
  const BlockPoolStats s = pool.stats();
  EXPECT_EQ(s.prefix_cache_queries, 80u);
  EXPECT_EQ(s.prefix_cache_hits, 32u);
  EXPECT_DOUBLE_EQ(s.usage(), 0.25);
  pool.release(*a);
}

}  // namespace
}  // namespace siesta
