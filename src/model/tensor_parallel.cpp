#include "model/tensor_parallel.h"

#include <algorithm>
#include <charconv>
#include <string>

#include <fmt/format.h>

namespace siesta {

int64_t TensorParallelLayout::vocab_begin(int rank, int vocab_size) const {
  return std::min<int64_t>(static_cast<int64_t>(rank) * vocab, vocab_size);
}
int64_t TensorParallelLayout::vocab_end(int rank, int vocab_size) const {
  return std::min<int64_t>(static_cast<int64_t>(rank + 1) * vocab, vocab_size);
}

Result<TensorParallelLayout> plan_tensor_parallel(const ModelConfig& cfg, int tp) {
  if (tp < 1) return invalid_argument(fmt::format("tensor parallel size must be at least 1, got {}", tp));
  if (cfg.num_heads <= 0 || cfg.num_kv_heads <= 0 || cfg.num_heads % cfg.num_kv_heads != 0)
    return invalid_argument(fmt::format("tensor parallelism: {} attention heads over {} KV heads is not a GQA shape",
                                        cfg.num_heads, cfg.num_kv_heads));
  if (cfg.num_heads % tp != 0)
    return invalid_argument(fmt::format("tensor parallel size {} does not divide the {} attention heads", tp,
                                        cfg.num_heads));
  if (cfg.num_kv_heads % tp != 0 && tp % cfg.num_kv_heads != 0)
    return invalid_argument(fmt::format("tensor parallel size {} neither divides nor is a multiple of the {} KV heads",
                                        tp, cfg.num_kv_heads));
  if (cfg.intermediate_size % tp != 0)
    return invalid_argument(fmt::format("tensor parallel size {} does not divide the intermediate size {}", tp,
                                        cfg.intermediate_size));
  TensorParallelLayout l;
  l.tp = tp;
  l.q_heads = cfg.num_heads / tp;
  l.kv_replicas = tp > cfg.num_kv_heads ? tp / cfg.num_kv_heads : 1;
  l.kv_heads = tp > cfg.num_kv_heads ? 1 : cfg.num_kv_heads / tp;
  l.intermediate = cfg.intermediate_size / tp;
  l.vocab = static_cast<int>((static_cast<int64_t>(cfg.vocab_size) + tp - 1) / tp);
  return l;
}

namespace {

// "model.layers.<n>.<rest>": n and rest, or false.
bool layer_tensor(std::string_view name, int& layer, std::string_view& rest) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (name.substr(0, kPrefix.size()) != kPrefix) return false;
  name.remove_prefix(kPrefix.size());
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  const auto [p, ec] = std::from_chars(name.data(), name.data() + dot, layer);
  if (ec != std::errc() || p != name.data() + dot) return false;
  rest = name.substr(dot + 1);
  return true;
}

}  // namespace

Result<TensorShard> tensor_shard(const TensorParallelLayout& l, const ModelConfig& cfg, std::string_view name,
                                 int rank) {
  if (rank < 0 || rank >= l.tp)
    return invalid_argument(fmt::format("rank {} is outside the tensor parallel group of {}", rank, l.tp));
  const int64_t hd = cfg.head_dim;
  const int64_t q0 = l.q_head_begin(rank) * hd, q1 = q0 + l.q_heads * hd;
  const int64_t kv0 = l.kv_head_begin(rank) * hd, kv1 = kv0 + l.kv_heads * hd;
  const int64_t i0 = static_cast<int64_t>(rank) * l.intermediate, i1 = i0 + l.intermediate;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight")
    return TensorShard{0, l.vocab_begin(rank, cfg.vocab_size), l.vocab_end(rank, cfg.vocab_size)};
  if (name == "model.norm.weight") return TensorShard{};
  int layer = 0;
  std::string_view rest;
  if (layer_tensor(name, layer, rest) && layer >= 0 && layer < cfg.num_layers) {
    if (rest == "self_attn.q_proj.weight") return TensorShard{0, q0, q1};
    if (rest == "self_attn.k_proj.weight" || rest == "self_attn.v_proj.weight") return TensorShard{0, kv0, kv1};
    if (rest == "self_attn.o_proj.weight") return TensorShard{1, q0, q1};
    if (rest == "mlp.gate_proj.weight" || rest == "mlp.up_proj.weight") return TensorShard{0, i0, i1};
    if (rest == "mlp.down_proj.weight") return TensorShard{1, i0, i1};
    if (rest == "self_attn.q_norm.weight" || rest == "self_attn.k_norm.weight" || rest == "input_layernorm.weight" ||
        rest == "post_attention_layernorm.weight")
      return TensorShard{};
  }
  return invalid_argument(fmt::format("tensor parallelism: '{}' is not a tensor of this Qwen3 model", name));
}

std::vector<KvHeadPiece> kv_head_pieces(const TensorParallelLayout& p, const TensorParallelLayout& d, int d_rank) {
  std::vector<KvHeadPiece> pieces;
  if (d_rank < 0 || d_rank >= d.tp) return pieces;
  const int first = d.kv_head_begin(d_rank);
  for (int h = first; h < first + d.kv_heads; ++h) {
    // The P ranks that hold head h: replica group h / p.kv_heads, p.kv_replicas ranks from its first.
    const int group = h / p.kv_heads;
    const int p_rank = group * p.kv_replicas + d_rank % p.kv_replicas;
    const int p_local = h - p.kv_head_begin(p_rank), d_local = h - first;
    KvHeadPiece* last = pieces.empty() ? nullptr : &pieces.back();
    if (last != nullptr && last->p_rank == p_rank && last->p_local + last->count == p_local &&
        last->d_local + last->count == d_local)
      ++last->count;
    else
      pieces.push_back({p_rank, h, 1, p_local, d_local});
  }
  return pieces;
}

}  // namespace siesta
