#include "model/cuda/device_weights.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "model/cuda/cuda_check.h"

namespace siesta::cuda {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

WeightsLayout weights_layout(const ModelConfig& cfg, int max_model_len) {
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim(), HD = cfg.head_dim;
  WeightsLayout L;
  size_t at = 0;
  // Tensors that are concatenated (q|k|v, gate|up) sit back to back.
  auto place = [&](const std::string& name, std::vector<int64_t> shape, bool pad = true) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    L.slots.push_back({name, std::move(shape), at});
    const size_t off = at;
    at += static_cast<size_t>(n) * sizeof(bf16);
    if (pad) at = align_up(at, kAlign);
    return off;
  };
  L.embed = place("model.embed_tokens.weight", {V, H});
  L.layers.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerOffsets& lo = L.layers[l];
    lo.qkv = place(p + "self_attn.q_proj.weight", {QD, H}, false);
    place(p + "self_attn.k_proj.weight", {KVD, H}, false);
    place(p + "self_attn.v_proj.weight", {KVD, H});
    lo.o = place(p + "self_attn.o_proj.weight", {H, QD});
    lo.gate_up = place(p + "mlp.gate_proj.weight", {I, H}, false);
    place(p + "mlp.up_proj.weight", {I, H});
    lo.down = place(p + "mlp.down_proj.weight", {H, I});
    lo.input_norm = place(p + "input_layernorm.weight", {H});
    lo.post_norm = place(p + "post_attention_layernorm.weight", {H});
    lo.q_norm = place(p + "self_attn.q_norm.weight", {HD});
    lo.k_norm = place(p + "self_attn.k_norm.weight", {HD});
  }
  L.final_norm = place("model.norm.weight", {H});
  L.lm_head = cfg.tie_word_embeddings ? L.embed : place("lm_head.weight", {V, H});
  L.inv_freq = at;
  at = align_up(at + static_cast<size_t>(HD / 2) * sizeof(float), kAlign);
  // cos/sin for every position up to max_model_len, computed once (kernels.h).
  L.rope = at;
  at = align_up(at + static_cast<size_t>(max_model_len) * (HD / 2) * sizeof(__nv_bfloat162), kAlign);
  L.bytes = at;
  return L;
}

Result<std::vector<TensorView>> checked_tensors(const WeightsLayout& L, const TensorStore& store) {
  std::vector<TensorView> views;
  views.reserve(L.slots.size());
  for (const WeightSlot& slot : L.slots) {
    SIESTA_ASSIGN_OR_RETURN(TensorView v, store.get(slot.name, slot.shape, {DType::kBF16, DType::kF16, DType::kF32}));
    views.push_back(std::move(v));
  }
  return views;
}

Result<DeviceWeights> DeviceWeights::load(const ModelConfig& cfg, int max_model_len, const TensorStore& store,
                                          DeviceAllocator& alloc, int device) {
  DeviceWeights w;
  w.cfg_ = cfg;
  w.max_model_len_ = max_model_len;
  w.device_ = device;
  w.layout_ = weights_layout(cfg, max_model_len);
  const WeightsLayout& L = w.layout_;
  // Check every tensor before allocating anything.
  SIESTA_ASSIGN_OR_RETURN(std::vector<TensorView> views, checked_tensors(L, store));
  SIESTA_ASSIGN_OR_RETURN(w.buffer_, DeviceBuffer::allocate(alloc, L.bytes, DeviceMemoryTag::kWeights));
  std::vector<HostWrite> items;
  items.reserve(L.slots.size());
  for (size_t i = 0; i < L.slots.size(); ++i) items.push_back({L.slots[i].offset, views[i]});
  SIESTA_TRY(w.write_host(items));
  SIESTA_TRY(w.write_rope());

  std::byte* base = w.buffer_.as<std::byte>();
  auto ptr = [&](size_t off) { return reinterpret_cast<bf16*>(base + off); };
  w.embed = ptr(L.embed);
  w.final_norm = ptr(L.final_norm);
  w.lm_head = ptr(L.lm_head);
  w.inv_freq = reinterpret_cast<float*>(base + L.inv_freq);
  w.rope_table = reinterpret_cast<__nv_bfloat162*>(base + L.rope);
  w.layers.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    const LayerOffsets& lo = L.layers[l];
    w.layers[l] = {ptr(lo.qkv),        ptr(lo.o),         ptr(lo.gate_up), ptr(lo.down),
                   ptr(lo.input_norm), ptr(lo.post_norm), ptr(lo.q_norm),  ptr(lo.k_norm)};
  }
  return w;
}

Result<void> DeviceWeights::write_host(const std::vector<HostWrite>& items) {
  if (!upload_) {
    SIESTA_ASSIGN_OR_RETURN(upload_, WeightUpload::create(4, size_t{16} << 20, 0, device_));
  }
  std::byte* base = buffer_.as<std::byte>();
  // bf16 tensors of checkpoint files: read in parallel straight into pinned
  // memory (WeightUpload::copy_files); the rest through the staging ring.
  std::vector<WeightUpload::FilePiece> pieces;
  std::vector<uint16_t> converted;
  for (const HostWrite& w : items) {
    const TensorView& v = w.view;
    if (v.dtype == DType::kBF16 && v.file_offset >= 0 && !v.file.empty()) {
      pieces.push_back({v.file, static_cast<uint64_t>(v.file_offset), base + w.offset, v.nbytes});
      continue;
    }
    const void* src = v.data;
    size_t bytes = v.nbytes;
    if (v.dtype != DType::kBF16) {
      std::vector<float> f(static_cast<size_t>(v.numel()));
      SIESTA_TRY(convert_to_f32(v, f));
      converted.resize(f.size());
      for (size_t k = 0; k < f.size(); ++k) converted[k] = f32_to_bf16(f[k]);
      src = converted.data();
      bytes = converted.size() * sizeof(uint16_t);
    }
    if (auto ok = upload_->copy(base + w.offset, src, bytes); !ok)
      return ok.error().with_context("copying " + v.name + " to the GPU");
  }
  if (auto ok = upload_->copy_files(pieces); !ok) return ok.error().with_context("copying the checkpoint to the GPU");
  return {};
}

Result<void> DeviceWeights::write_device(const std::vector<DeviceWrite>& items, cudaStream_t stream) {
  std::byte* base = buffer_.as<std::byte>();
  for (const DeviceWrite& w : items) {
    const size_t n = w.bytes / dtype_size(w.dtype);
    if (w.dtype == DType::kBF16) {
      SIESTA_CUDA_TRY(cudaMemcpyAsync(base + w.offset, w.src, w.bytes, cudaMemcpyDeviceToDevice, stream),
                      "copying pushed weights (CUDA IPC)");
    } else {
      SIESTA_CUDA_TRY(launch_convert_to_bf16(w.src, static_cast<int>(dtype_size(w.dtype)),
                                             reinterpret_cast<bf16*>(base + w.offset), n, stream),
                      "converting pushed weights to bf16 (CUDA IPC)");
    }
  }
  SIESTA_CUDA_TRY(cudaStreamSynchronize(stream), "copying pushed weights (CUDA IPC)");
  return {};
}

Result<void> DeviceWeights::write_rope() {
  const WeightsLayout& L = layout_;
  std::byte* base = buffer_.as<std::byte>();
  // As the CPU reference: inv_freq = 1 / theta^(2i / head_dim), in fp32.
  const int HD = cfg_.head_dim;
  std::vector<float> inv(static_cast<size_t>(HD / 2));
  for (size_t i = 0; i < inv.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(HD);
    inv[i] = static_cast<float>(1.0 / std::pow(cfg_.rope_theta, static_cast<double>(exponent)));
  }
  SIESTA_CUDA_TRY(cudaMemcpy(base + L.inv_freq, inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice),
                  "copying RoPE frequencies to the GPU");
  SIESTA_CUDA_TRY(launch_rope_table(reinterpret_cast<const float*>(base + L.inv_freq), HD, max_model_len_,
                                    reinterpret_cast<__nv_bfloat162*>(base + L.rope), LaunchConfig{}),
                  "computing the RoPE table");
  SIESTA_CUDA_TRY(cudaDeviceSynchronize(), "computing the RoPE table");
  return {};
}

}  // namespace siesta::cuda
