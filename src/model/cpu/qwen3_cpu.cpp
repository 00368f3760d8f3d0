#include "model/cpu/qwen3_cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>

#include "common/log.h"
#include "common/thread_pool.h"
#include "memory/host_backend.h"
#include "model/cpu/kernels.h"
#include "model/rope.h"
#include "model/safetensors.h"

namespace siesta {
namespace cpu {

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

std::vector<WeightSlot> weight_slots(const ModelConfig& cfg, Weights& w) {
  const int64_t hidden = cfg.hidden_size, inter = cfg.intermediate_size, vocab = cfg.vocab_size;
  const int64_t q_dim = cfg.q_dim(), kv_dim = cfg.kv_dim(), head_dim = cfg.head_dim;
  w.layers.resize(cfg.num_layers);
  std::vector<WeightSlot> specs;
  specs.push_back({"model.embed_tokens.weight", {vocab, hidden}, &w.embed});
  for (int i = 0; i < cfg.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& l = w.layers[i];
    specs.push_back({p + "input_layernorm.weight", {hidden}, &l.input_norm});
    specs.push_back({p + "self_attn.q_proj.weight", {q_dim, hidden}, &l.q_proj});
    specs.push_back({p + "self_attn.k_proj.weight", {kv_dim, hidden}, &l.k_proj});
    specs.push_back({p + "self_attn.v_proj.weight", {kv_dim, hidden}, &l.v_proj});
    specs.push_back({p + "self_attn.o_proj.weight", {hidden, q_dim}, &l.o_proj});
    specs.push_back({p + "self_attn.q_norm.weight", {head_dim}, &l.q_norm});
    specs.push_back({p + "self_attn.k_norm.weight", {head_dim}, &l.k_norm});
    specs.push_back({p + "post_attention_layernorm.weight", {hidden}, &l.post_norm});
    specs.push_back({p + "mlp.gate_proj.weight", {inter, hidden}, &l.gate_proj});
    specs.push_back({p + "mlp.up_proj.weight", {inter, hidden}, &l.up_proj});
    specs.push_back({p + "mlp.down_proj.weight", {hidden, inter}, &l.down_proj});
  }
  specs.push_back({"model.norm.weight", {hidden}, &w.final_norm});
  if (!cfg.tie_word_embeddings) specs.push_back({"lm_head.weight", {vocab, hidden}, &w.lm_head});
  return specs;
}

std::map<std::string, TensorPlace> tensor_places(const ModelConfig& cfg) {
  Weights w;
  std::map<std::string, TensorPlace> out;
  size_t offset = 0;
  for (const WeightSlot& s : weight_slots(cfg, w)) {
    const size_t n = static_cast<size_t>(numel(s.shape));
    out.emplace(s.name, TensorPlace{offset, n});
    offset += n;
  }
  return out;
}

size_t weights_numel(const ModelConfig& cfg) {
  Weights w;
  size_t total = 0;
  for (const WeightSlot& s : weight_slots(cfg, w)) total += static_cast<size_t>(numel(s.shape));
  return total;
}

Result<void> load_weights(const ModelConfig& cfg, const TensorStore& store, std::span<float> arena, Weights& w) {
  std::vector<WeightSlot> specs = weight_slots(cfg, w);
  // Check every tensor first, then convert.
  std::vector<TensorView> views;
  size_t total = 0;
  for (const WeightSlot& s : specs) {
    SIESTA_ASSIGN_OR_RETURN(TensorView v, store.get(s.name, s.shape));
    total += static_cast<size_t>(v.numel());
    views.push_back(std::move(v));
  }
  if (total != arena.size())
    return invalid_argument(fmt::format("the weights take {} floats but the arena has {}", total, arena.size()));
  w.arena = arena;
  size_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    std::span<float> dst(arena.data() + offset, static_cast<size_t>(views[i].numel()));
    SIESTA_TRY(convert_to_f32(views[i], dst));
    *specs[i].dest = dst.data();
    offset += dst.size();
  }
  if (cfg.tie_word_embeddings) w.lm_head = w.embed;
  return {};
}

size_t scratch_numel_per_row(const ModelConfig& cfg) {
  // x, h, proj, normed [hidden]; q, attn [q_dim]; k, v [kv_dim]; gate, up [intermediate]
  return 4 * static_cast<size_t>(cfg.hidden_size) + 2 * static_cast<size_t>(cfg.q_dim()) +
         2 * static_cast<size_t>(cfg.kv_dim()) + 2 * static_cast<size_t>(cfg.intermediate_size);
}

}  // namespace cpu

Result<std::unique_ptr<CpuQwen3>> CpuQwen3::load(const std::filesystem::path& model_dir, ThreadPool& threads) {
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<memory::MemoryBackend> backend, memory::make_host_backend());
  auto own = std::make_unique<memory::MemoryPool>(std::move(backend));
  memory::MemoryPool& pool = *own;
  SIESTA_ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::load(model_dir));
  std::unique_ptr<CpuQwen3> model(new CpuQwen3(std::move(cfg), std::move(own), pool, threads));
  SIESTA_TRY(model->reserve_memory(model_dir, /*scratch_rows=*/0));
  return model;
}

Result<std::unique_ptr<CpuQwen3>> CpuQwen3::load(const std::filesystem::path& model_dir, ThreadPool& threads,
                                                 memory::MemoryPool& memory, int32_t scratch_rows) {
  SIESTA_ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::load(model_dir));
  std::unique_ptr<CpuQwen3> model(new CpuQwen3(std::move(cfg), nullptr, memory, threads));
  SIESTA_TRY(model->reserve_memory(model_dir, scratch_rows));
  return model;
}

CpuQwen3::CpuQwen3(ModelConfig cfg, std::unique_ptr<memory::MemoryPool> own_memory, memory::MemoryPool& memory,
                   ThreadPool& threads)
    : cfg_(std::move(cfg)), own_memory_(std::move(own_memory)), memory_(memory), threads_(threads) {
  inv_freq_ = rope_inv_freq(cfg_);
}

CpuQwen3::~CpuQwen3() {
  for (const std::optional<memory::Allocation>* a : {&weights_alloc_, &scratch_alloc_})
    if (*a)
      if (auto ok = memory_.free((*a)->id); !ok)
        SIESTA_LOG_WARN("model: freeing {}: {}", (*a)->name, ok.error().message);
}

Result<void> CpuQwen3::reserve_memory(const std::filesystem::path& model_dir, int32_t scratch_rows) {
  SIESTA_ASSIGN_OR_RETURN(TensorStore store, TensorStore::open(model_dir));
  const size_t floats = cpu::weights_numel(cfg_);
  SIESTA_ASSIGN_OR_RETURN(weights_alloc_, memory_.allocate(floats * sizeof(float), memory::Tag::kWeights,
                                                           {.single_allocation = false, .chunk_bytes = 0,
                                                            .name = "weights"}));
  SIESTA_TRY(cpu::load_weights(cfg_, store, {static_cast<float*>(weights_alloc_->base), floats}, w_));
  if (scratch_rows > 0) {
    const size_t bytes = static_cast<size_t>(scratch_rows) * cpu::scratch_numel_per_row(cfg_) * sizeof(float);
    SIESTA_ASSIGN_OR_RETURN(scratch_alloc_, memory_.allocate(bytes, memory::Tag::kScratch,
                                                             {.single_allocation = false, .chunk_bytes = 0,
                                                              .name = "activations"}));
    scratch_rows_ = static_cast<size_t>(scratch_rows);
  }
  return {};
}

Result<void> CpuQwen3::require_resident_weights(const std::string& where) const {
  auto state = memory_.state(weights_alloc_->id);
  if (!state) return state.error().with_context(where);
  if (*state != memory::AllocationState::kResident)
    return conflict(where + ": the weights memory is " + memory::allocation_state_name(*state) +
                    "; wake it up (wake_up?tags=weights) first");
  return {};
}

namespace cpu {
namespace {

// Checked tensors and where they go in the arena; apply() converts them
// there, split over the model's threads. Keeps its source (the checkpoint's
// mapped files, or the shared memory) open until destroyed.
class CpuWeightWrite final : public PreparedWeightUpdate {
 public:
  CpuWeightWrite(ThreadPool& threads, WeightUpdateReport report, std::vector<WeightWrite> writes,
                 std::optional<TensorStore> store, std::optional<SharedWeightFile> file)
      : threads_(threads),
        report_(std::move(report)),
        writes_(std::move(writes)),
        store_(std::move(store)),
        file_(std::move(file)) {}

  Result<WeightUpdateReport> apply() override {
    const auto start = std::chrono::steady_clock::now();
    std::mutex mu;
    std::optional<Status> failed;
    threads_.parallel_for(writes_.size(), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i)
        if (auto ok = convert_to_f32(writes_[i].view, writes_[i].dst); !ok) {
          std::lock_guard<std::mutex> lock(mu);
          if (!failed) failed = ok.error();
        }
    });
    report_.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (failed) return failed->with_context("update_weights: writing the weights (some tensors may be written)");
    return report_;
  }

 private:
  ThreadPool& threads_;
  WeightUpdateReport report_;
  std::vector<WeightWrite> writes_;
  std::optional<TensorStore> store_;
  std::optional<SharedWeightFile> file_;
};

}  // namespace

Result<std::unique_ptr<PreparedWeightUpdate>> prepare_weight_writes(const ModelConfig& cfg,
                                                                     const WeightUpdate& update,
                                                                     const std::string& call, ThreadPool& threads,
                                                                     const ResidentCheck& resident,
                                                                     const WeightTargets& targets) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<TensorSpec> specs = updatable_tensors(cfg);
  WeightUpdateReport report;
  report.source = update.source;
  std::vector<WeightWrite> writes;
  int64_t tensors = 0;
  std::optional<TensorStore> kept_store;
  std::optional<SharedWeightFile> kept_file;
  switch (update.source) {
    case WeightSource::kDir: {
      const std::string where = call + " from " + update.path.string();
      SIESTA_TRY(resident(where));
      auto next = ModelConfig::load(update.path);
      if (!next) return next.error().with_context(where);
      if (const std::string diff = architecture_differences(cfg, *next); !diff.empty())
        return invalid_argument(where + ": the checkpoint has a different architecture (" + diff +
                                "); an in-place weight update needs the same shapes. Serve that model from a new "
                                "siesta serve instead");
      auto store = TensorStore::open(update.path);
      if (!store) return store.error().with_context(where);
      for (size_t i = 0; i < specs.size(); ++i) {
        auto v = store->get(specs[i].name, specs[i].shape);
        if (!v) return v.error().with_context(where);
        report.bytes += v->nbytes;
        report.written.push_back(static_cast<int>(i));
        targets(specs[i].name, *v, writes);
        ++tensors;
      }
      report.from = update.path.string();
      kept_store = std::move(*store);
      break;
    }
    case WeightSource::kShm: {
      SIESTA_TRY(resident(call + " (shm)"));
      SIESTA_ASSIGN_OR_RETURN(SharedWeightFile file, SharedWeightFile::open(update));
      const uint64_t size = file.bytes();
      SIESTA_ASSIGN_OR_RETURN(std::vector<int> index,
                              check_pushed_tensors(cfg, specs, update, std::span<const uint64_t>(&size, 1)));
      for (size_t i = 0; i < update.tensors.size(); ++i) {
        const PushedTensor& t = update.tensors[i];
        if (index[i] < 0) {
          report.skipped.push_back(t.name);
          continue;
        }
        report.bytes += pushed_tensor_bytes(t);
        report.written.push_back(index[i]);
        targets(t.name, file.view(t), writes);
        ++tensors;
      }
      report.from = file.name();
      kept_file = std::move(file);
      break;
    }
    case WeightSource::kCudaIpc:
      return invalid_argument("update_weights: the CPU model takes weights from \"shm\" (host shared memory) or "
                              "\"dir\" (a checkpoint); \"cuda_ipc\" needs siesta serve --device cuda");
  }
  report.tensors = tensors;
  report.prepare_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::unique_ptr<PreparedWeightUpdate>(std::make_unique<CpuWeightWrite>(
      threads, std::move(report), std::move(writes), std::move(kept_store), std::move(kept_file)));
}

}  // namespace cpu

Result<std::unique_ptr<PreparedWeightUpdate>> CpuQwen3::prepare_weight_update(const WeightUpdate& update) {
  return prepare_update(update, "update_weights");
}

Result<std::unique_ptr<PreparedWeightUpdate>> CpuQwen3::prepare_update(const WeightUpdate& update,
                                                                      const std::string& call) {
  const std::map<std::string, cpu::TensorPlace> places = cpu::tensor_places(cfg_);
  auto targets = [&](const std::string& name, const TensorView& view, std::vector<cpu::WeightWrite>& out) {
    const cpu::TensorPlace& p = places.at(name);
    out.push_back({view, std::span<float>(w_.arena.data() + p.offset, p.numel)});
  };
  auto resident = [this](const std::string& where) { return require_resident_weights(where); };
  return cpu::prepare_weight_writes(cfg_, update, call, threads_, resident, targets);
}

Result<void> CpuQwen3::reload_weights(const std::filesystem::path& model_dir) {
  WeightUpdate u;
  u.source = WeightSource::kDir;
  u.path = model_dir;
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<PreparedWeightUpdate> prepared, prepare_update(u, "reload_weights"));
  SIESTA_TRY(prepared->apply());
  return {};
}

Result<void> CpuQwen3::forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) {
  SIESTA_TRY(validate_batch(cfg_, batch, kv));
  const KvCacheLayout& layout = kv.layout;
  const KvCacheLayout expected = kv_layout();
  if (layout.num_layers != expected.num_layers || layout.num_kv_heads != expected.num_kv_heads ||
      layout.head_dim != expected.head_dim || layout.elem_bytes != expected.elem_bytes ||
      layout.block_size != expected.block_size)
    return invalid_argument("forward: KV cache layout does not match the model");

  const size_t hidden = cfg_.hidden_size, inter = cfg_.intermediate_size, vocab = cfg_.vocab_size;
  const size_t heads = cfg_.num_heads, kv_heads = cfg_.num_kv_heads, head_dim = cfg_.head_dim;
  const size_t q_dim = cfg_.q_dim(), kv_dim = cfg_.kv_dim(), group = heads / kv_heads;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  float* cache = static_cast<float*>(kv.base);

  // Flatten the batch into rows: row -> (sequence, position).
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

  // Activations: the scratch allocation, or heap memory for a batch larger
  // than it was sized for.
  std::vector<float> heap;
  float* next = nullptr;
  if (n <= scratch_rows_) {
    next = static_cast<float*>(scratch_alloc_->base);
  } else {
    heap.resize(n * cpu::scratch_numel_per_row(cfg_));
    next = heap.data();
  }
  auto take = [&](size_t floats) {
    float* p = next;
    next += floats;
    return p;
  };
  float* x = take(n * hidden);
  float* h = take(n * hidden);
  float* proj = take(n * hidden);
  float* normed = take(n * hidden);
  float* q = take(n * q_dim);
  float* attn = take(n * q_dim);
  float* k = take(n * kv_dim);
  float* v = take(n * kv_dim);
  float* gate = take(n * inter);
  float* up = take(n * inter);
  for (size_t r = 0; r < n; ++r)
    std::memcpy(&x[r * hidden], w_.embed + static_cast<size_t>(rows[r].token) * hidden, hidden * sizeof(float));

  for (int layer = 0; layer < cfg_.num_layers; ++layer) {
    const cpu::LayerWeights& lw = w_.layers[layer];
    cpu::rms_norm(x, lw.input_norm, n, hidden, eps, h);
    cpu::linear(h, n, hidden, lw.q_proj, q_dim, q, threads_);
    cpu::linear(h, n, hidden, lw.k_proj, kv_dim, k, threads_);
    cpu::linear(h, n, hidden, lw.v_proj, kv_dim, v, threads_);
    // Per-head q/k RMSNorm, then RoPE; K and V go into the paged cache.
    for (size_t r = 0; r < n; ++r) {
      for (size_t hh = 0; hh < heads; ++hh) {
        float* qh = &q[r * q_dim + hh * head_dim];
        cpu::rms_norm(qh, lw.q_norm, 1, head_dim, eps, qh);
        cpu::apply_rope(qh, head_dim, inv_freq_.data(), rows[r].pos);
      }
      for (size_t hh = 0; hh < kv_heads; ++hh) {
        float* kh = &k[r * kv_dim + hh * head_dim];
        cpu::rms_norm(kh, lw.k_norm, 1, head_dim, eps, kh);
        cpu::apply_rope(kh, head_dim, inv_freq_.data(), rows[r].pos);
      }
      std::memcpy(slot_ptr(r, layer, 0), &k[r * kv_dim], kv_dim * sizeof(float));
      std::memcpy(slot_ptr(r, layer, 1), &v[r * kv_dim], kv_dim * sizeof(float));
    }
    // Causal attention over the cache: row r sees positions [0, pos]. One task
    // per (row, head); scores, softmax and the weighted sum run in position order.
    threads_.parallel_for(n * heads, [&](size_t begin, size_t end) {
      std::vector<float> scores;
      for (size_t t = begin; t < end; ++t) {
        const size_t r = t / heads, hh = t % heads, kvh = hh / group;
        const SequenceChunk& seq = batch[rows[r].seq];
        const size_t len = static_cast<size_t>(rows[r].pos) + 1;
        const float* qh = &q[r * q_dim + hh * head_dim];
        scores.resize(len);
        float max_score = -std::numeric_limits<float>::infinity();
        for (size_t p = 0; p < len; ++p) {
          const size_t block = static_cast<size_t>(seq.block_table[p / layout.block_size]);
          const float* kp = cache + layout.offset(block, layer, 0) + (p % layout.block_size) * kv_dim + kvh * head_dim;
          scores[p] = cpu::dot(qh, kp, head_dim) * scale;
          max_score = std::max(max_score, scores[p]);
        }
        float sum = 0.0f;
        for (size_t p = 0; p < len; ++p) {
          scores[p] = std::exp(scores[p] - max_score);
          sum += scores[p];
        }
        const float inv_sum = 1.0f / sum;
        float* o = &attn[r * q_dim + hh * head_dim];
        std::fill(o, o + head_dim, 0.0f);
        for (size_t p = 0; p < len; ++p) {
          const size_t block = static_cast<size_t>(seq.block_table[p / layout.block_size]);
          const float* vp = cache + layout.offset(block, layer, 1) + (p % layout.block_size) * kv_dim + kvh * head_dim;
          const float wgt = scores[p] * inv_sum;
          for (size_t d = 0; d < head_dim; ++d) o[d] += wgt * vp[d];
        }
      }
    });
    cpu::linear(attn, n, q_dim, lw.o_proj, hidden, proj, threads_);
    for (size_t i = 0; i < n * hidden; ++i) x[i] += proj[i];

    cpu::rms_norm(x, lw.post_norm, n, hidden, eps, h);
    cpu::linear(h, n, hidden, lw.gate_proj, inter, gate, threads_);
    cpu::linear(h, n, hidden, lw.up_proj, inter, up, threads_);
    cpu::silu_mul(gate, up, n * inter, gate);
    cpu::linear(gate, n, inter, lw.down_proj, hidden, proj, threads_);
    for (size_t i = 0; i < n * hidden; ++i) x[i] += proj[i];
  }

  // Final norm and LM head, only for the rows whose logits are wanted.
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
  for (size_t i = 0; i < wanted.size(); ++i)
    cpu::rms_norm(&x[wanted[i] * hidden], w_.final_norm, 1, hidden, eps, &normed[i * hidden]);
  out.logits.resize(wanted.size() * vocab);
  cpu::linear(normed, wanted.size(), hidden, w_.lm_head, vocab, out.logits.data(), threads_);
  return {};
}

}  // namespace siesta
