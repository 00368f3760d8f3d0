// The tensor-parallel layout (src/model/tensor_parallel.h) of the Qwen3 shapes
// siesta serves: every tensor's shards tile it exactly (replicated KV heads
// and norms excepted, which every holder has whole), each rank's query heads
// attend to KV heads it holds, and shapes that do not divide are refused by name.
#include "model/tensor_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace siesta {
namespace {

ModelConfig shape(int heads, int kv_heads, int hidden, int intermediate, int vocab, int layers = 2) {
  ModelConfig c;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 128;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.vocab_size = vocab;
  c.num_layers = layers;
  return c;
}
const ModelConfig kQwen3_06b = shape(16, 8, 1024, 3072, 151936, 28);
const ModelConfig kQwen3_8b = shape(32, 8, 4096, 12288, 151936, 36);
const ModelConfig kGroup5 = shape(40, 8, 5120, 17408, 151936);

// Every tensor of the checkpoint with its [rows, cols].
std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim(), hd = c.head_dim;
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> t = {
      {"model.embed_tokens.weight", {c.vocab_size, H}}, {"lm_head.weight", {c.vocab_size, H}}, {"model.norm.weight", {H, 1}}};
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "self_attn.q_proj.weight", {Q, H}});
    t.push_back({p + "self_attn.k_proj.weight", {KV, H}});
    t.push_back({p + "self_attn.v_proj.weight", {KV, H}});
    t.push_back({p + "self_attn.o_proj.weight", {H, Q}});
    t.push_back({p + "self_attn.q_norm.weight", {hd, 1}});
    t.push_back({p + "self_attn.k_norm.weight", {hd, 1}});
    t.push_back({p + "mlp.gate_proj.weight", {I, H}});
    t.push_back({p + "mlp.up_proj.weight", {I, H}});
    t.push_back({p + "mlp.down_proj.weight", {H, I}});
    t.push_back({p + "input_layernorm.weight", {H, 1}});
    t.push_back({p + "post_attention_layernorm.weight", {H, 1}});
  }
  return t;
}

void expect_tiling(const ModelConfig& c, int tp) {
  SCOPED_TRACE("tp " + std::to_string(tp));
  auto planned = plan_tensor_parallel(c, tp);
  ASSERT_TRUE(planned) << planned.error().message;
  const TensorParallelLayout& l = *planned;
  const int group = c.num_heads / c.num_kv_heads;
  for (int r = 0; r < tp; ++r) {  // a rank's query heads use only the KV heads it holds
    for (int h = l.q_head_begin(r); h < l.q_head_begin(r) + l.q_heads; ++h) {
      EXPECT_GE(h / group, l.kv_head_begin(r)) << "rank " << r << " head " << h;
      EXPECT_LT(h / group, l.kv_head_begin(r) + l.kv_heads) << "rank " << r << " head " << h;
    }
  }
  for (const auto& [name, dims] : tensors(c)) {
    SCOPED_TRACE(name);
    std::map<std::pair<int64_t, int64_t>, int> holders;  // [begin, end) -> ranks holding it
    int dim = -2;
    for (int r = 0; r < tp; ++r) {
      auto s = tensor_shard(l, c, name, r);
      ASSERT_TRUE(s) << s.error().message;
      if (dim == -2) dim = s->dim;
      ASSERT_EQ(s->dim, dim) << "rank " << r;
      if (s->dim >= 0) {
        ASSERT_LE(s->begin, s->end);
        ++holders[{s->begin, s->end}];
      }
    }
    if (dim < 0) continue;  // replicated: every rank has it whole
    const int64_t extent = dim == 0 ? dims.first : dims.second;
    const bool kv = name.find("k_proj") != std::string::npos || name.find("v_proj") != std::string::npos;
    int64_t at = 0;
    for (const auto& [range, n] : holders) {
      EXPECT_EQ(range.first, at) << "a gap or an overlap before " << range.first;
      EXPECT_EQ(n, kv ? l.kv_replicas : 1) << "range [" << range.first << ", " << range.second << ")";
      at = range.second;
    }
    EXPECT_EQ(at, extent);
  }
}

TEST(TensorParallel, TheQwen3ShapesTileEveryTensorAtEveryDividingSize) {
  for (int tp : {1, 2, 4, 8, 16}) expect_tiling(kQwen3_06b, tp);
  for (int tp : {1, 2, 4, 8, 16, 32}) expect_tiling(kQwen3_8b, tp);
  for (int tp : {1, 2, 4, 8}) expect_tiling(kGroup5, tp);
}

TEST(TensorParallel, KvHeadsAreSplitThenReplicated) {
  auto two = plan_tensor_parallel(kQwen3_06b, 2);
  ASSERT_TRUE(two);
  EXPECT_EQ(two->q_heads, 8);
  EXPECT_EQ(two->kv_heads, 4);
  EXPECT_EQ(two->kv_replicas, 1);
  EXPECT_EQ(two->kv_head_begin(1), 4);
  EXPECT_EQ(two->intermediate, 1536);
  auto sixteen = plan_tensor_parallel(kQwen3_06b, 16);
  ASSERT_TRUE(sixteen);
  EXPECT_EQ(sixteen->q_heads, 1);
  EXPECT_EQ(sixteen->kv_heads, 1);
  EXPECT_EQ(sixteen->kv_replicas, 2);
  EXPECT_EQ(sixteen->kv_head_begin(6), 3);
  EXPECT_EQ(sixteen->kv_head_begin(7), 3);
  // A P TP=2 rank 1 holds KV heads 4..7; a D TP=1 rank holds all 8: the D rank takes both P ranks' heads.
  auto one = plan_tensor_parallel(kQwen3_06b, 1);
  ASSERT_TRUE(one);
  EXPECT_EQ(one->kv_heads, 8);
  EXPECT_EQ(one->kv_head_begin(0), 0);
}

// P/D between TP groups: every D rank gets each KV head it owns exactly once, from a P rank that
// holds it, at that rank's local index, in as few contiguous pieces as the two layouts allow; P's
// replicas of a head are shared out among the D ranks that need it.
TEST(TensorParallel, KvHeadPiecesGiveEachDecodeRankItsHeadsOnceFromAHolder) {
  for (const ModelConfig* cfg : {&kQwen3_06b, &kQwen3_8b, &kGroup5}) {
    std::vector<int> sizes;
    for (int tp = 1; tp <= 32; tp *= 2)
      if (plan_tensor_parallel(*cfg, tp)) sizes.push_back(tp);
    for (int ptp : sizes)
      for (int dtp : sizes) {
        const auto p = *plan_tensor_parallel(*cfg, ptp), d = *plan_tensor_parallel(*cfg, dtp);
        const std::string what = "P TP " + std::to_string(ptp) + ", D TP " + std::to_string(dtp) + ", " +
                                 std::to_string(cfg->num_heads) + " heads";
        std::map<std::pair<int, int>, int> served;  // (P rank, head) -> D ranks served
        for (int r = 0; r < dtp; ++r) {
          const auto pieces = kv_head_pieces(p, d, r);
          std::vector<int> got;
          for (size_t i = 0; i < pieces.size(); ++i) {
            const KvHeadPiece& x = pieces[i];
            ASSERT_GE(x.count, 1) << what;
            ASSERT_GE(x.p_rank, 0) << what;
            ASSERT_LT(x.p_rank, ptp) << what;
            EXPECT_EQ(x.p_local, x.head - p.kv_head_begin(x.p_rank)) << what;
            EXPECT_EQ(x.d_local, x.head - d.kv_head_begin(r)) << what;
            EXPECT_GE(x.p_local, 0) << what;
            EXPECT_LE(x.p_local + x.count, p.kv_heads) << what << ": P rank " << x.p_rank << " does not hold them";
            if (i > 0) {  // maximal: a piece continues the previous one only from another P rank
              const KvHeadPiece& prev = pieces[i - 1];
              EXPECT_FALSE(prev.p_rank == x.p_rank && prev.p_local + prev.count == x.p_local) << what;
            }
            for (int k = 0; k < x.count; ++k) {
              got.push_back(x.head + k);
              ++served[{x.p_rank, x.head + k}];
            }
          }
          std::vector<int> want(d.kv_heads);
          std::iota(want.begin(), want.end(), d.kv_head_begin(r));
          EXPECT_EQ(got, want) << what << ", D rank " << r;
        }
        // A replicated head's copies serve its D ranks in turn: no replica serves two more than another.
        for (int h = 0; h < cfg->num_kv_heads; ++h) {
          int lo = 1 << 30, hi = 0;
          for (int pr = 0; pr < ptp; ++pr) {
            if (h < p.kv_head_begin(pr) || h >= p.kv_head_begin(pr) + p.kv_heads) continue;
            const int n = served.count({pr, h}) ? served[{pr, h}] : 0;
            lo = std::min(lo, n);
            hi = std::max(hi, n);
          }
          EXPECT_LE(hi - lo, 1) << what << ", head " << h;
        }
      }
  }
  // The two cases of the issue: P TP=2 -> D TP=1 (two pieces, one per P rank) and P TP=1 -> D TP=2.
  const auto one = *plan_tensor_parallel(kQwen3_06b, 1), two = *plan_tensor_parallel(kQwen3_06b, 2);
  const auto from_two = kv_head_pieces(two, one, 0);
  ASSERT_EQ(from_two.size(), 2u);
  EXPECT_EQ(from_two[0].p_rank, 0);
  EXPECT_EQ(from_two[0].count, 4);
  EXPECT_EQ(from_two[1].p_rank, 1);
  EXPECT_EQ(from_two[1].head, 4);
  EXPECT_EQ(from_two[1].p_local, 0);
  EXPECT_EQ(from_two[1].d_local, 4);
  const auto to_two = kv_head_pieces(one, two, 1);
  ASSERT_EQ(to_two.size(), 1u);
  EXPECT_EQ(to_two[0].p_rank, 0);
  EXPECT_EQ(to_two[0].head, 4);
  EXPECT_EQ(to_two[0].p_local, 4);
  EXPECT_EQ(to_two[0].d_local, 0);
  EXPECT_EQ(to_two[0].count, 4);
  EXPECT_TRUE(kv_head_pieces(one, two, 2).empty());  // no such D rank
}

TEST(TensorParallel, TheVocabularyIsSplitInEqualSharesButTheLast) {
  const ModelConfig c = shape(6, 3, 256, 768, 10);
  auto l = plan_tensor_parallel(c, 3);
  ASSERT_TRUE(l) << l.error().message;
  EXPECT_EQ(l->vocab, 4);
  std::vector<std::pair<int64_t, int64_t>> got;
  for (int r = 0; r < 3; ++r) {
    auto s = tensor_shard(*l, c, "lm_head.weight", r);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->dim, 0);
    got.push_back({s->begin, s->end});
  }
  EXPECT_EQ(got, (std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 8}, {8, 10}}));
}

TEST(TensorParallel, SizesThatDoNotDivideAreRefusedByName) {
  auto bad_heads = plan_tensor_parallel(kQwen3_06b, 3);
  ASSERT_FALSE(bad_heads);
  EXPECT_NE(bad_heads.error().message.find("16 attention heads"), std::string::npos) << bad_heads.error().message;
  auto bad_group5 = plan_tensor_parallel(kGroup5, 16);
  ASSERT_FALSE(bad_group5);
  EXPECT_NE(bad_group5.error().message.find("40 attention heads"), std::string::npos);
  auto bad_kv = plan_tensor_parallel(shape(12, 6, 256, 768, 100), 4);
  ASSERT_FALSE(bad_kv);
  EXPECT_NE(bad_kv.error().message.find("6 KV heads"), std::string::npos) << bad_kv.error().message;
  auto bad_mlp = plan_tensor_parallel(shape(16, 8, 1024, 3000, 100), 16);
  ASSERT_FALSE(bad_mlp);
  EXPECT_NE(bad_mlp.error().message.find("intermediate size 3000"), std::string::npos) << bad_mlp.error().message;
  EXPECT_FALSE(plan_tensor_parallel(kQwen3_06b, 0));
}

TEST(TensorParallel, UnknownTensorsAndRanksAreErrors) {
  auto l = plan_tensor_parallel(kQwen3_06b, 2);
  ASSERT_TRUE(l);
  EXPECT_FALSE(tensor_shard(*l, kQwen3_06b, "model.layers.0.mlp.experts.0.weight", 0));
  EXPECT_FALSE(tensor_shard(*l, kQwen3_06b, "model.layers.28.mlp.up_proj.weight", 0));  // past the last layer
  EXPECT_FALSE(tensor_shard(*l, kQwen3_06b, "model.layers.x.mlp.up_proj.weight", 0));
  auto far = tensor_shard(*l, kQwen3_06b, "lm_head.weight", 2);
  ASSERT_FALSE(far);
  EXPECT_NE(far.error().message.find("rank 2"), std::string::npos);
}

}  // namespace
}  // namespace siesta
