// How the CUDA model flattens a batch into kernel metadata: pass splitting,
// slots, decode/prefill routing, padding for graphs and the packed image.
// Host code only: runs without a GPU (wherever the CUDA library is built).
#include <gtest/gtest.h>

#if defined(SIESTA_HAVE_CUDA)

#include <cstring>
#include <numeric>
#include <vector>

#include "model/cuda/step_plan.h"

namespace siesta::cuda {
namespace {

std::vector<int32_t> iota_tokens(int n, int first = 1) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(CudaStepPlan, LongPromptIsCutIntoPassesThatOnlyTheLastGivesLogits) {
  const auto prompt = iota_tokens(70);
  const std::vector<int32_t> table = {5, 9, 2, 7, 11};
  const SequenceChunk seq{prompt, 3, table, false};
  const auto passes = split_into_passes({&seq, 1}, {32, 8});
  ASSERT_EQ(passes.size(), 3u);
  EXPECT_EQ(passes[0][0].chunk.tokens.size(), 32u);
  EXPECT_EQ(passes[1][0].chunk.start_pos, 3 + 32);
  EXPECT_EQ(passes[2][0].chunk.tokens.size(), 6u);
  EXPECT_EQ(passes[0][0].logits, LogitsWanted::kNone);
  EXPECT_EQ(passes[1][0].logits, LogitsWanted::kNone);
  EXPECT_EQ(passes[2][0].logits, LogitsWanted::kLast);
  EXPECT_EQ(passes[2][0].chunk.tokens[0], prompt[64]);
}

TEST(CudaStepPlan, PassesRespectTheSequenceLimitAndKeepOrder) {
  std::vector<std::vector<int32_t>> tok(5, std::vector<int32_t>{1});
  const std::vector<int32_t> table = {0};
  std::vector<SequenceChunk> batch;
  for (auto& t : tok) batch.push_back({t, 0, table, true});
  const auto passes = split_into_passes(batch, {100, 2});
  ASSERT_EQ(passes.size(), 3u);
  EXPECT_EQ(passes[2].size(), 1u);
  EXPECT_EQ(passes[2][0].seq, 4u);
  EXPECT_EQ(passes[1][0].logits, LogitsWanted::kAll);
}

TEST(CudaStepPlan, SlotsFollowTheBlockTableAndRoutingFollowsTheChunkLength) {
  const auto prompt = iota_tokens(20);
  const std::vector<int32_t> t0 = {4, 1};   // positions 0..19
  const std::vector<int32_t> t1 = {3, 8, 6};  // decode at position 40
  const std::vector<int32_t> one = {77};
  std::vector<PassChunk> chunks = {{0, {prompt, 0, t0, false}, LogitsWanted::kLast},
                                   {1, {one, 40, t1, false}, LogitsWanted::kLast}};
  auto plan = plan_pass(chunks, 0, StepShape{});
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_EQ(plan->num_tokens, 21);
  EXPECT_EQ(plan->slots[0], 4 * 16 + 0);
  EXPECT_EQ(plan->slots[17], 1 * 16 + 1);
  EXPECT_EQ(plan->slots[20], 6 * 16 + 8);  // position 40: block 2 of its table, offset 8
  EXPECT_EQ(plan->positions[20], 40);
  EXPECT_EQ(plan->kv_len, (std::vector<int32_t>{20, 41}));
  EXPECT_EQ(plan->decode_seqs, (std::vector<int32_t>{1}));
  EXPECT_EQ(plan->prefill_items, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(plan->max_partitions, 1);
  EXPECT_EQ(plan->logits_rows, (std::vector<int32_t>{19, 20}));
  // Only the blocks that cover the context are copied.
  EXPECT_EQ(plan->block_tables, (std::vector<int32_t>{4, 1, 3, 8, 6}));
  EXPECT_EQ(plan->table_start, (std::vector<int32_t>{0, 2}));
  EXPECT_FALSE(plan->logits_rows_are_all_tokens());
}

TEST(CudaStepPlan, PrefillTilesAreOrderedByWorkAndLongDecodesSplit) {
  const auto a = iota_tokens(130), b = iota_tokens(10);
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int32_t> one = {1};
  std::vector<PassChunk> chunks = {{0, {a, 0, table, false}, LogitsWanted::kLast},
                                   {1, {b, 500, table, false}, LogitsWanted::kLast},
                                   {2, {one, 600, table, false}, LogitsWanted::kLast}};
  auto plan = plan_pass(chunks, 0, StepShape{256, 64});
  ASSERT_TRUE(plan) << plan.error().message;
  // Work: (1, tile 0) sees 510 positions, (0, 2) 130, (0, 1) 128, (0, 0) 64.
  EXPECT_EQ(plan->prefill_items, (std::vector<int32_t>{1, 0, 0, 2, 0, 1, 0, 0}));
  EXPECT_EQ(plan->max_partitions, 3);  // 601 positions in partitions of 256
}

TEST(CudaStepPlan, DecodePaddingAddsCachelessRowsAndKeepsOffsetsFixed) {
  const std::vector<int32_t> one = {9}, table = {2};
  std::vector<PassChunk> three(3, PassChunk{0, {one, 5, table, false}, LogitsWanted::kLast});
  std::vector<PassChunk> five(5, PassChunk{0, {one, 7, table, false}, LogitsWanted::kLast});
  auto p3 = plan_pass(three, 8, StepShape{});
  auto p5 = plan_pass(five, 8, StepShape{});
  ASSERT_TRUE(p3 && p5);
  EXPECT_EQ(p3->num_seqs, 8);
  EXPECT_EQ(p3->num_real_seqs, 3);
  EXPECT_EQ(p3->slots[7], -1);
  EXPECT_EQ(p3->kv_len[7], 0);
  EXPECT_TRUE(p3->logits_rows_are_all_tokens());
  // A graph captured for one padded step must fit the next: same offsets.
  const StepLayout l3 = step_layout(*p3, p3->logits_rows.size()), l5 = step_layout(*p5, p5->logits_rows.size());
  EXPECT_EQ(l3.block_tables, l5.block_tables);
  EXPECT_EQ(l3.sampling, l5.sampling);
  EXPECT_EQ(l3.banned, l5.banned);
  EXPECT_EQ(l3.sync, l5.sync);
  EXPECT_EQ(l3.decode_seqs % 16, 0u);

  const auto prompt = iota_tokens(3);
  std::vector<PassChunk> prefill = {{0, {prompt, 0, table, false}, LogitsWanted::kLast}};
  EXPECT_FALSE(plan_pass(prefill, 4, StepShape{}));  // padding is for decode only
}

// Batch-invariant mode: one-token chunks (and graph padding) become 1-row
// prefill tiles, so every row takes the prefill kernel's arithmetic.
TEST(CudaStepPlan, OneTokenAsPrefillRoutesEveryRowToPrefillTiles) {
  const auto prompt = iota_tokens(70);
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int32_t> one = {5};
  StepShape shape{256, 64};
  shape.one_token_as_prefill = true;
  std::vector<PassChunk> mixed = {{0, {one, 600, table, false}, LogitsWanted::kLast},
                                  {1, {prompt, 0, table, false}, LogitsWanted::kLast},
                                  {2, {one, 9, table, false}, LogitsWanted::kLast}};
  auto plan = plan_pass(mixed, 0, shape);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_TRUE(plan->decode_seqs.empty());
  EXPECT_EQ(plan->max_partitions, 0);
  // Work: (0, 0) sees 601 positions, (1, 1) 70, (1, 0) 64, (2, 0) 10.
  EXPECT_EQ(plan->prefill_items, (std::vector<int32_t>{0, 0, 1, 1, 1, 0, 2, 0}));
  EXPECT_EQ(plan->q_len, (std::vector<int32_t>{1, 70, 1}));
  EXPECT_EQ(plan->kv_len, (std::vector<int32_t>{601, 70, 10}));
  EXPECT_EQ(plan->logits_rows, (std::vector<int32_t>{0, 70, 71}));

  // A padded decode step: real and padding rows are all 1-row tiles, and the
  // image's offsets still depend only on the padded size (graphs stay valid).
  std::vector<PassChunk> three(3, PassChunk{0, {one, 5, table, false}, LogitsWanted::kLast});
  std::vector<PassChunk> five(5, PassChunk{0, {one, 300, table, false}, LogitsWanted::kLast});
  auto p3 = plan_pass(three, 8, shape);
  auto p5 = plan_pass(five, 8, shape);
  ASSERT_TRUE(p3 && p5);
  EXPECT_TRUE(p3->decode_seqs.empty());
  ASSERT_EQ(p3->prefill_items.size(), 16u);
  ASSERT_EQ(p5->prefill_items.size(), 16u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(p3->prefill_items[2 * i + 1], 0);  // tile 0 of each sequence
  // Padding (kv_len 0, slot -1, no work) sorts last.
  EXPECT_EQ(p3->prefill_items[0], 0);
  EXPECT_EQ(p3->prefill_items[14], 7);
  EXPECT_EQ(p3->kv_len[7], 0);
  EXPECT_EQ(p3->slots[7], -1);
  EXPECT_TRUE(p3->logits_rows_are_all_tokens());
  const StepLayout l3 = step_layout(*p3, p3->logits_rows.size()), l5 = step_layout(*p5, p5->logits_rows.size());
  EXPECT_EQ(l3.prefill_items, l5.prefill_items);
  EXPECT_EQ(l3.logits_rows, l5.logits_rows);
  EXPECT_EQ(l3.sampling, l5.sampling);
  EXPECT_EQ(l3.block_tables, l5.block_tables);

  // The default shape keeps one-token chunks on the decode kernel.
  auto plain = plan_pass(mixed, 0, StepShape{256, 64});
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->decode_seqs, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(plain->prefill_items, (std::vector<int32_t>{1, 1, 1, 0}));
}

// Batch-invariant mode's decode kernel: one-token chunks stay decode rows, one
// CTA per (kv head, row) over the whole context (no partitions, so one decode
// graph per batch size whatever the contexts), listed longest context first;
// chunks of more tokens are prefill tiles as always.
TEST(CudaStepPlan, DecodeWholeContextKeepsDecodeRowsUnsplitLongestFirst) {
  const auto prompt = iota_tokens(70);
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int32_t> one = {5};
  StepShape shape{256, 64};
  shape.decode_whole_context = true;
  std::vector<PassChunk> mixed = {{0, {one, 9, table, false}, LogitsWanted::kLast},
                                  {1, {prompt, 0, table, false}, LogitsWanted::kLast},
                                  {2, {one, 600, table, false}, LogitsWanted::kLast},
                                  {3, {one, 40, table, false}, LogitsWanted::kLast}};
  auto plan = plan_pass(mixed, 0, shape);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_EQ(plan->decode_seqs, (std::vector<int32_t>{2, 3, 0}));  // 601, 41 and 10 positions
  EXPECT_EQ(plan->max_partitions, 1);                             // 601 positions, one CTA per kv head
  EXPECT_EQ(plan->prefill_items, (std::vector<int32_t>{1, 1, 1, 0}));
  EXPECT_EQ(plan->kv_len, (std::vector<int32_t>{10, 70, 601, 41}));
  EXPECT_EQ(plan->logits_rows, (std::vector<int32_t>{0, 70, 71, 72}));

  // A padded decode step: padding rows (kv_len 0) are decode rows too, after
  // every real one, and the offsets depend only on the padded size.
  std::vector<PassChunk> three = {{0, {one, 5, table, false}, LogitsWanted::kLast},
                                  {1, {one, 300, table, false}, LogitsWanted::kLast},
                                  {2, {one, 70, table, false}, LogitsWanted::kLast}};
  std::vector<PassChunk> five(5, PassChunk{0, {one, 900, table, false}, LogitsWanted::kLast});
  auto p3 = plan_pass(three, 8, shape);
  auto p5 = plan_pass(five, 8, shape);
  ASSERT_TRUE(p3 && p5);
  EXPECT_EQ(p3->decode_seqs, (std::vector<int32_t>{1, 2, 0, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p3->max_partitions, 1);
  EXPECT_EQ(p5->max_partitions, 1);
  EXPECT_TRUE(p3->prefill_items.empty());
  EXPECT_TRUE(p3->logits_rows_are_all_tokens());
  const StepLayout l3 = step_layout(*p3, true), l5 = step_layout(*p5, true);
  EXPECT_EQ(l3.decode_seqs, l5.decode_seqs);
  EXPECT_EQ(l3.logits_rows, l5.logits_rows);
  EXPECT_EQ(l3.sampling, l5.sampling);
  EXPECT_EQ(l3.block_tables, l5.block_tables);

  // The default shape splits long decode contexts into partitions.
  auto plain = plan_pass(mixed, 0, StepShape{256, 64});
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->decode_seqs, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(plain->max_partitions, 3);
}

TEST(CudaStepPlan, ImageHoldsTheArraysAndSamplingRecords) {
  const std::vector<int32_t> one = {9}, table = {2};
  std::vector<PassChunk> two(2, PassChunk{0, {one, 5, table, false}, LogitsWanted::kLast});
  auto plan = plan_pass(two, 4, StepShape{});
  ASSERT_TRUE(plan);
  const StepLayout l = step_layout(*plan, plan->logits_rows.size());
  const std::vector<int32_t> banned = {3, 4};
  std::vector<TokenChoice> rows(2);
  rows[1].temperature = 0.7;
  rows[1].top_k = 5;
  rows[1].uniform = 0.25;
  rows[1].banned = banned;
  auto img = pack_step(*plan, l, rows);
  ASSERT_TRUE(img) << img.error().message;
  ASSERT_EQ(img->size(), l.end);
  int32_t tok = 0;
  std::memcpy(&tok, img->data() + l.tokens, 4);
  EXPECT_EQ(tok, 9);
  SamplingRecord rec;
  std::memcpy(&rec, img->data() + l.sampling + sizeof(SamplingRecord), sizeof rec);
  EXPECT_EQ(rec.temperature, 0.7);
  EXPECT_EQ(rec.top_k, 5);
  EXPECT_EQ(rec.banned_end - rec.banned_begin, 2);
  int32_t b0 = 0;
  std::memcpy(&b0, img->data() + l.banned + rec.banned_begin * 4, 4);
  EXPECT_EQ(b0, 3);
  std::memcpy(&rec, img->data() + l.sampling + 3 * sizeof(SamplingRecord), sizeof rec);
  EXPECT_EQ(rec.temperature, 0.0);  // padding rows are greedy
  // The argmax keys and partition counters start at zero in every image.
  ASSERT_LE(l.sync + kStepSyncWords * 4, l.block_tables);
  for (int w = 0; w < kStepSyncWords; ++w) {
    int32_t word = -1;
    std::memcpy(&word, img->data() + l.sync + w * 4, 4);
    ASSERT_EQ(word, 0) << "sync word " << w;
  }

  std::vector<int32_t> too_many(40, 1);
  rows[0].banned = too_many;
  EXPECT_FALSE(pack_step(*plan, l, rows));
}

// A pass with a chunk whose every row goes to the host: only the device's
// rows get sampling records, so the image's sampling sections stay as small
// as the sequences, however many rows the host takes.
TEST(CudaStepPlan, SamplingRecordsOnlyForTheDevicesRows) {
  const auto prompt = iota_tokens(40);
  std::vector<int32_t> table(4);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int32_t> one = {9};
  std::vector<PassChunk> c = {{0, {one, 5, table, false}, LogitsWanted::kLast},
                              {1, {prompt, 0, table, true}, LogitsWanted::kAll},
                              {2, {one, 7, table, false}, LogitsWanted::kLast}};
  auto plan = plan_pass(c, 0, StepShape{});
  ASSERT_TRUE(plan) << plan.error().message;
  ASSERT_EQ(plan->logits_rows.size(), 42u);
  EXPECT_EQ(plan->first_row, (std::vector<size_t>{0, 1, 41}));
  const StepLayout none = step_layout(*plan, 0), two = step_layout(*plan, 2);
  EXPECT_EQ(none.banned - none.sampling, 0u);
  EXPECT_EQ(none.sync - none.banned, 0u);
  EXPECT_EQ(two.banned - two.sampling, 2 * sizeof(SamplingRecord));
  EXPECT_EQ(two.sync - two.banned, 2u * kMaxBannedIdsPerRow * 4);
  std::vector<TokenChoice> rows(2);
  rows[1].temperature = 0.9;
  rows[1].uniform = 0.5;
  auto img = pack_step(*plan, two, rows);
  ASSERT_TRUE(img) << img.error().message;
  SamplingRecord rec;
  std::memcpy(&rec, img->data() + two.sampling + sizeof(SamplingRecord), sizeof rec);
  EXPECT_EQ(rec.temperature, 0.9);
  EXPECT_EQ(rec.uniform, 0.5);
  EXPECT_EQ(rec.banned_begin, kMaxBannedIdsPerRow);  // record 1's banned ids
  // More choices than records, or more records than logits rows, is an error.
  rows.resize(3);
  EXPECT_FALSE(pack_step(*plan, two, rows));
  EXPECT_FALSE(pack_step(*plan, step_layout(*plan, 43), {}));
}

TEST(CudaStepPlan, ShortBlockTableIsAnError) {
  const auto prompt = iota_tokens(20);
  const std::vector<int32_t> table = {1};
  std::vector<PassChunk> c = {{0, {prompt, 0, table, false}, LogitsWanted::kLast}};
  auto plan = plan_pass(c, 0, StepShape{});
  ASSERT_FALSE(plan);
  EXPECT_NE(plan.error().message.find("block table"), std::string::npos);
}

}  // namespace
}  // namespace siesta::cuda

#else

TEST(CudaStepPlan, NotBuilt) { GTEST_SKIP() << "siesta was built without CUDA (nvcc not found)"; }

#endif
