#include "model/cpu/qwen3_cpu_tp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "common/log.h"
#include "common/thread_pool.h"
#include "memory/host_backend.h"
#include "model/cpu/kernels.h"
#include "model/rope.h"
#include "model/safetensors.h"

namespace siesta {

namespace {

// Rows [begin, end) of a 2-D tensor view, or columns [begin, end) of its row `row`.
TensorView sub_view(const TensorView& v, size_t first_elem, size_t elems, std::vector<int64_t> shape) {
  const size_t elem = dtype_size(v.dtype);
  TensorView s = v;
  s.shape = std::move(shape);
  s.data = v.data + first_elem * elem;
  s.nbytes = elems * elem;
  if (v.file_offset >= 0) s.file_offset = v.file_offset + static_cast<int64_t>(first_elem * elem);
  return s;
}

// Rank r's shard of the whole tensor `view` into dst (the shard's place in
// the rank's arena), as writes.
void shard_writes(const TensorView& view, const TensorShard& shard, float* dst,
                  std::vector<cpu::WeightWrite>& out) {
  if (shard.dim < 0) {
    out.push_back({view, {dst, static_cast<size_t>(view.numel())}});
    return;
  }
  const size_t rows = static_cast<size_t>(view.shape[0]);
  const size_t cols = static_cast<size_t>(view.numel()) / rows;
  const size_t b = static_cast<size_t>(shard.begin), width = static_cast<size_t>(shard.end - shard.begin);
  if (shard.dim == 0) {
    out.push_back({sub_view(view, b * cols, width * cols, {static_cast<int64_t>(width), static_cast<int64_t>(cols)}),
                   {dst, width * cols}});
    return;
  }
  for (size_t i = 0; i < rows; ++i)
    out.push_back({sub_view(view, i * cols + b, width, {static_cast<int64_t>(width)}), {dst + i * width, width}});
}

}  // namespace

Result<std::unique_ptr<CpuQwen3Tp>> CpuQwen3Tp::load(const std::filesystem::path& model_dir, int tp,
                                                     ThreadPool& threads) {
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<memory::MemoryBackend> backend, memory::make_host_backend());
  auto own = std::make_unique<memory::MemoryPool>(std::move(backend));
  memory::MemoryPool& pool = *own;
  SIESTA_ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::load(model_dir));
  SIESTA_ASSIGN_OR_RETURN(TensorParallelLayout layout, plan_tensor_parallel(cfg, tp));
  std::unique_ptr<CpuQwen3Tp> model(new CpuQwen3Tp(std::move(cfg), layout, std::move(own), pool, threads));
  SIESTA_TRY(model->reserve_memory(model_dir, /*scratch_rows=*/0));
  return model;
}

Result<std::unique_ptr<CpuQwen3Tp>> CpuQwen3Tp::load(const std::filesystem::path& model_dir, int tp,
                                                     ThreadPool& threads, memory::MemoryPool& memory,
                                                     int32_t scratch_rows) {
  SIESTA_ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::load(model_dir));
  SIESTA_ASSIGN_OR_RETURN(TensorParallelLayout layout, plan_tensor_parallel(cfg, tp));
  std::unique_ptr<CpuQwen3Tp> model(new CpuQwen3Tp(std::move(cfg), layout, nullptr, memory, threads));
  SIESTA_TRY(model->reserve_memory(model_dir, scratch_rows));
  return model;
}

CpuQwen3Tp::CpuQwen3Tp(ModelConfig cfg, TensorParallelLayout layout, std::unique_ptr<memory::MemoryPool> own_memory,
                       memory::MemoryPool& memory, ThreadPool& threads)
    : cfg_(std::move(cfg)), layout_(layout), own_memory_(std::move(own_memory)), memory_(memory), threads_(threads) {
  inv_freq_ = rope_inv_freq(cfg_);
}

CpuQwen3Tp::~CpuQwen3Tp() {
  std::vector<const std::optional<memory::Allocation>*> allocs = {&chain_alloc_};
  for (const Rank& r : ranks_) {
    allocs.push_back(&r.weights);
    allocs.push_back(&r.scratch);
  }
  for (const std::optional<memory::Allocation>* a : allocs)
    if (*a)
      if (auto ok = memory_.free((*a)->id); !ok)
        SIESTA_LOG_WARN("model: freeing {}: {}", (*a)->name, ok.error().message);
}

size_t CpuQwen3Tp::rank_scratch_numel_per_row() const {
  // x, h, normed [hidden]; q, attn [q heads]; k, v [KV heads]; gate, up [intermediate], all of this rank.
  const size_t hd = static_cast<size_t>(cfg_.head_dim);
  return 3 * static_cast<size_t>(cfg_.hidden_size) + 2 * layout_.q_heads * hd + 2 * layout_.kv_heads * hd +
         2 * static_cast<size_t>(layout_.intermediate);
}

Result<void> CpuQwen3Tp::reserve_memory(const std::filesystem::path& model_dir, int32_t scratch_rows) {
  ranks_.resize(static_cast<size_t>(layout_.tp));
  for (int r = 0; r < layout_.tp; ++r) {
    Rank& rank = ranks_[r];
    std::vector<cpu::WeightSlot> slots = cpu::weight_slots(cfg_, rank.w);
    size_t offset = 0;
    for (const cpu::WeightSlot& s : slots) {
      SIESTA_ASSIGN_OR_RETURN(TensorShard shard, tensor_shard(layout_, cfg_, s.name, r));
      size_t n = 1;
      for (int64_t d : s.shape) n *= static_cast<size_t>(d);
      if (shard.dim >= 0) n = n / static_cast<size_t>(s.shape[shard.dim]) * static_cast<size_t>(shard.end - shard.begin);
      rank.places.emplace(s.name, cpu::TensorPlace{offset, n});
      rank.shards.push_back(shard);
      offset += n;
    }
    rank.numel = offset;
    SIESTA_ASSIGN_OR_RETURN(rank.weights,
                            memory_.allocate(offset * sizeof(float), memory::Tag::kWeights,
                                             {.single_allocation = false, .chunk_bytes = 0,
                                              .name = fmt::format("weights (rank {})", r)}));
    float* base = static_cast<float*>(rank.weights->base);
    rank.w.arena = {base, offset};
    for (const cpu::WeightSlot& s : slots) *s.dest = base + rank.places.at(s.name).offset;
    if (cfg_.tie_word_embeddings) rank.w.lm_head = rank.w.embed;
    if (scratch_rows > 0) {
      const size_t bytes = static_cast<size_t>(scratch_rows) * rank_scratch_numel_per_row() * sizeof(float);
      SIESTA_ASSIGN_OR_RETURN(rank.scratch,
                              memory_.allocate(bytes, memory::Tag::kScratch,
                                               {.single_allocation = false, .chunk_bytes = 0,
                                                .name = fmt::format("activations (rank {})", r)}));
    }
  }
  scratch_rows_ = static_cast<size_t>(std::max(0, scratch_rows));
  const size_t chain = cpu::TpCollective::chain_numel(static_cast<size_t>(cfg_.hidden_size));
  SIESTA_ASSIGN_OR_RETURN(chain_alloc_, memory_.allocate(chain * sizeof(float), memory::Tag::kScratch,
                                                         {.single_allocation = false, .chunk_bytes = 0,
                                                          .name = "tensor-parallel chain"}));
  group_.emplace(layout_.tp, threads_, std::span<float>(static_cast<float*>(chain_alloc_->base), chain));
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<PreparedWeightUpdate> prepared,
                          prepare_update({.source = WeightSource::kDir, .path = model_dir}, "loading the weights"));
  SIESTA_TRY(prepared->apply());
  return {};
}

uint64_t CpuQwen3Tp::weights_bytes() const {
  uint64_t total = 0;
  for (const Rank& r : ranks_) total += r.weights ? r.weights->bytes : 0;
  return total;
}

uint64_t CpuQwen3Tp::scratch_bytes() const {
  uint64_t total = chain_alloc_ ? chain_alloc_->bytes : 0;
  for (const Rank& r : ranks_) total += r.scratch ? r.scratch->bytes : 0;
  return total;
}

Result<void> CpuQwen3Tp::require_resident_weights(const std::string& where) const {
  for (const Rank& r : ranks_) {
    auto state = memory_.state(r.weights->id);
    if (!state) return state.error().with_context(where);
    if (*state != memory::AllocationState::kResident)
      return conflict(where + ": the weights memory is " + memory::allocation_state_name(*state) +
                      "; wake it up (wake_up?tags=weights) first");
  }
  return {};
}

Result<std::unique_ptr<PreparedWeightUpdate>> CpuQwen3Tp::prepare_weight_update(const WeightUpdate& update) {
  return prepare_update(update, "update_weights");
}

Result<std::unique_ptr<PreparedWeightUpdate>> CpuQwen3Tp::prepare_update(const WeightUpdate& update,
                                                                        const std::string& call) {
  // Each full tensor read (or pushed) is cut into every rank's shard.
  auto targets = [&](const std::string& name, const TensorView& view, std::vector<cpu::WeightWrite>& out) {
    for (int r = 0; r < layout_.tp; ++r) {
      const Rank& rank = ranks_[r];
      const cpu::TensorPlace& place = rank.places.at(name);
      auto shard = tensor_shard(layout_, cfg_, name, r);  // known: the arena was laid out from it
      shard_writes(view, *shard, rank.w.arena.data() + place.offset, out);
    }
  };
  auto resident = [this](const std::string& where) { return require_resident_weights(where); };
  return cpu::prepare_weight_writes(cfg_, update, call, threads_, resident, targets);
}

Result<void> CpuQwen3Tp::reload_weights(const std::filesystem::path& model_dir) {
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<PreparedWeightUpdate> prepared,
                          prepare_update({.source = WeightSource::kDir, .path = model_dir}, "reload_weights"));
  SIESTA_TRY(prepared->apply());
  return {};
}

Result<void> CpuQwen3Tp::forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) {
  SIESTA_TRY(validate_batch(cfg_, batch, kv));
  const KvCacheLayout& layout = kv.layout;
  const KvCacheLayout expected = kv_layout();
  if (layout.num_layers != expected.num_layers || layout.num_kv_heads != expected.num_kv_heads ||
      layout.head_dim != expected.head_dim || layout.elem_bytes != expected.elem_bytes ||
      layout.block_size != expected.block_size)
    return invalid_argument("forward: KV cache layout does not match the model");

  const int tp = layout_.tp;
  const size_t hidden = cfg_.hidden_size, vocab = cfg_.vocab_size, head_dim = cfg_.head_dim;
  const size_t group = static_cast<size_t>(cfg_.num_heads / cfg_.num_kv_heads);
  const size_t kv_dim = cfg_.kv_dim();  // a cache slot: every KV head
  const size_t q_heads = layout_.q_heads, q_local = q_heads * head_dim;
  const size_t kv_heads = layout_.kv_heads, kv_local = kv_heads * head_dim;
  const size_t inter = layout_.intermediate;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  float* cache = static_cast<float*>(kv.base);

  struct Row {
    size_t seq;
    int pos;
    int32_t token;
  };
  std::vector<Row> rows;
  for (size_t s = 0; s < batch.size(); ++s)
    for (size_t i = 0; i < batch[s].tokens.size(); ++i)
      rows.push_back({s, batch[s].start_pos + static_cast<int>(i), batch[s].tokens[i]});
  const size_t n = rows.size();
  auto slot_ptr = [&](size_t r, int layer, int kind) {
    const SequenceChunk& seq = batch[rows[r].seq];
    const int pos = rows[r].pos;
    const size_t block = static_cast<size_t>(seq.block_table[pos / layout.block_size]);
    return cache + layout.offset(block, layer, kind) + static_cast<size_t>(pos % layout.block_size) * kv_dim;
  };

  // Each rank's activations: its scratch allocation, or heap memory for a
  // batch larger than it was sized for.
  struct Activations {
    float *x, *h, *normed, *q, *attn, *k, *v, *gate, *up;
  };
  std::vector<Activations> act(static_cast<size_t>(tp));
  std::vector<float*> residuals(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    Rank& rank = ranks_[r];
    float* next = nullptr;
    if (n <= scratch_rows_ && rank.scratch) {
      next = static_cast<float*>(rank.scratch->base);
    } else {
      rank.heap.resize(n * rank_scratch_numel_per_row());
      next = rank.heap.data();
    }
    auto take = [&](size_t floats) {
      float* p = next;
      next += floats;
      return p;
    };
    Activations& a = act[r];
    a.x = take(n * hidden);
    a.h = take(n * hidden);
    a.normed = take(n * hidden);
    a.q = take(n * q_local);
    a.attn = take(n * q_local);
    a.k = take(n * kv_local);
    a.v = take(n * kv_local);
    a.gate = take(n * inter);
    a.up = take(n * inter);
    residuals[r] = a.x;
  }

  // Vocab-parallel embedding: each token's row from the rank holding it.
  std::vector<cpu::EmbeddingRow> embedding(n);
  for (size_t i = 0; i < n; ++i) {
    const int owner = rows[i].token / layout_.vocab;
    const size_t local = static_cast<size_t>(rows[i].token - layout_.vocab_begin(owner, cfg_.vocab_size));
    embedding[i] = {owner, ranks_[owner].w.embed + local * hidden};
  }
  group_->embed(embedding, hidden, residuals);

  std::vector<cpu::RowParallelPart> parts(static_cast<size_t>(tp));
  for (int layer = 0; layer < cfg_.num_layers; ++layer) {
    // Column-parallel QKV; each KV head goes into the cache from its first replica.
    for (int r = 0; r < tp; ++r) {
      const cpu::LayerWeights& lw = ranks_[r].w.layers[layer];
      const Activations& a = act[r];
      const bool writes_kv = r % layout_.kv_replicas == 0;
      const size_t kv_offset = static_cast<size_t>(layout_.kv_head_begin(r)) * head_dim;
      cpu::rms_norm(a.x, lw.input_norm, n, hidden, eps, a.h);
      cpu::linear(a.h, n, hidden, lw.q_proj, q_local, a.q, threads_);
      if (writes_kv) {
        cpu::linear(a.h, n, hidden, lw.k_proj, kv_local, a.k, threads_);
        cpu::linear(a.h, n, hidden, lw.v_proj, kv_local, a.v, threads_);
      }
      for (size_t i = 0; i < n; ++i) {
        for (size_t hh = 0; hh < q_heads; ++hh) {
          float* qh = &a.q[i * q_local + hh * head_dim];
          cpu::rms_norm(qh, lw.q_norm, 1, head_dim, eps, qh);
          cpu::apply_rope(qh, head_dim, inv_freq_.data(), rows[i].pos);
        }
        if (!writes_kv) continue;
        for (size_t hh = 0; hh < kv_heads; ++hh) {
          float* kh = &a.k[i * kv_local + hh * head_dim];
          cpu::rms_norm(kh, lw.k_norm, 1, head_dim, eps, kh);
          cpu::apply_rope(kh, head_dim, inv_freq_.data(), rows[i].pos);
        }
        std::memcpy(slot_ptr(i, layer, 0) + kv_offset, &a.k[i * kv_local], kv_local * sizeof(float));
        std::memcpy(slot_ptr(i, layer, 1) + kv_offset, &a.v[i * kv_local], kv_local * sizeof(float));
      }
    }
    // Attention with each rank's query heads over the KV heads it holds
    // (read from the shared cache), as CpuQwen3 computes it per head.
    for (int r = 0; r < tp; ++r) {
      const Activations& a = act[r];
      const size_t head0 = static_cast<size_t>(layout_.q_head_begin(r));
      threads_.parallel_for(n * q_heads, [&](size_t begin, size_t end) {
        std::vector<float> scores;
        for (size_t t = begin; t < end; ++t) {
          const size_t i = t / q_heads, hh = t % q_heads, kvh = (head0 + hh) / group;
          const SequenceChunk& seq = batch[rows[i].seq];
          const size_t len = static_cast<size_t>(rows[i].pos) + 1;
          const float* qh = &a.q[i * q_local + hh * head_dim];
          scores.resize(len);
          float max_score = -std::numeric_limits<float>::infinity();
          for (size_t p = 0; p < len; ++p) {
            const size_t block = static_cast<size_t>(seq.block_table[p / layout.block_size]);
            const float* kp =
                cache + layout.offset(block, layer, 0) + (p % layout.block_size) * kv_dim + kvh * head_dim;
            scores[p] = cpu::dot(qh, kp, head_dim) * scale;
            max_score = std::max(max_score, scores[p]);
          }
          float sum = 0.0f;
          for (size_t p = 0; p < len; ++p) {
            scores[p] = std::exp(scores[p] - max_score);
            sum += scores[p];
          }
          const float inv_sum = 1.0f / sum;
          float* o = &a.attn[i * q_local + hh * head_dim];
          std::fill(o, o + head_dim, 0.0f);
          for (size_t p = 0; p < len; ++p) {
            const size_t block = static_cast<size_t>(seq.block_table[p / layout.block_size]);
            const float* vp =
                cache + layout.offset(block, layer, 1) + (p % layout.block_size) * kv_dim + kvh * head_dim;
            const float wgt = scores[p] * inv_sum;
            for (size_t d = 0; d < head_dim; ++d) o[d] += wgt * vp[d];
          }
        }
      });
    }
    // Row-parallel O: the ordered chain over the ranks' query-head columns.
    for (int r = 0; r < tp; ++r)
      parts[r] = {act[r].attn, ranks_[r].w.layers[layer].o_proj, q_local,
                  static_cast<size_t>(layout_.q_head_begin(r)) * head_dim};
    group_->row_parallel_add(parts, n, hidden, residuals);

    // Column-parallel gate/up, row-parallel down.
    for (int r = 0; r < tp; ++r) {
      const cpu::LayerWeights& lw = ranks_[r].w.layers[layer];
      const Activations& a = act[r];
      cpu::rms_norm(a.x, lw.post_norm, n, hidden, eps, a.h);
      cpu::linear(a.h, n, hidden, lw.gate_proj, inter, a.gate, threads_);
      cpu::linear(a.h, n, hidden, lw.up_proj, inter, a.up, threads_);
      cpu::silu_mul(a.gate, a.up, n * inter, a.gate);
      parts[r] = {a.gate, lw.down_proj, inter, static_cast<size_t>(r) * inter};
    }
    group_->row_parallel_add(parts, n, hidden, residuals);
  }

  // Final norm and each rank's vocabulary slice of the LM head, for the rows
  // whose logits are wanted; the slices gathered into full rows.
  out.vocab_size = static_cast<int>(vocab);
  out.first_row.assign(batch.size(), 0);
  out.num_rows.assign(batch.size(), 0);
  std::vector<size_t> wanted;
  size_t r0 = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const size_t len = batch[s].tokens.size();
    out.first_row[s] = wanted.size();
    out.num_rows[s] = batch[s].all_logits ? len : 1;
    for (size_t i = batch[s].all_logits ? 0 : len - 1; i < len; ++i) wanted.push_back(r0 + i);
    r0 += len;
  }
  std::vector<cpu::TpCollective::Slice> slices(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    Rank& rank = ranks_[r];
    const Activations& a = act[r];
    const size_t v0 = static_cast<size_t>(layout_.vocab_begin(r, cfg_.vocab_size));
    const size_t width = static_cast<size_t>(layout_.vocab_end(r, cfg_.vocab_size)) - v0;
    for (size_t i = 0; i < wanted.size(); ++i)
      cpu::rms_norm(&a.x[wanted[i] * hidden], rank.w.final_norm, 1, hidden, eps, &a.normed[i * hidden]);
    rank.logits.resize(wanted.size() * width);
    cpu::linear(a.normed, wanted.size(), hidden, rank.w.lm_head, width, rank.logits.data(), threads_);
    slices[r] = {rank.logits.data(), v0, width};
  }
  out.logits.resize(wanted.size() * vocab);
  cpu::TpCollective::gather_columns(slices, wanted.size(), vocab, out.logits.data());
  return {};
}

}  // namespace siesta
