#include "model/cuda/qwen3_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <compare>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <string>

#include "common/log.h"
#include "model/cuda/cublaslt_gemm.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/ipc_weights.h"
#include "model/cuda/kernels.h"
#include "model/cuda/weight_upload.h"
#include "model/safetensors.h"

namespace siesta {

// step_plan.h mirrors kernels.h's device structs and constants without CUDA headers.
static_assert(sizeof(cuda::SamplingRecord) == sizeof(cuda::SamplingRowParams));
static_assert(offsetof(cuda::SamplingRecord, uniform) == offsetof(cuda::SamplingRowParams, uniform));
static_assert(offsetof(cuda::SamplingRecord, top_k) == offsetof(cuda::SamplingRowParams, top_k));
static_assert(offsetof(cuda::SamplingRecord, banned_end) == offsetof(cuda::SamplingRowParams, banned_end));
static_assert(cuda::kMaxBannedIdsPerRow == cuda::kMaxBannedPerRow);
static_assert(cuda::kKvBlockSizeForPlan == cuda::kKvBlockSize);
static_assert(cuda::kSampleOnHostToken == cuda::kSampleOnHost);
// The step image's sync words (zeroed by every upload): the LM head's argmax
// keys, two words per row, from word 16; the decode attention kernel's
// partition counters from word 32.
constexpr size_t kArgmaxSyncOffset = 16;
constexpr size_t kPartitionSyncOffset = 32;
static_assert(kArgmaxSyncOffset + 2 * cuda::kGemvMaxRows <= kPartitionSyncOffset);

namespace {

using cuda::bf16;

constexpr size_t kAlign = 256;
constexpr size_t kGemmWorkspaceBytes = 32u << 20;
// Padded decode batch sizes: one graph per size (and per partition count).
constexpr int kGraphBatchSizes[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512};

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct LayerWeights {
  bf16* qkv = nullptr;      // [q_dim + 2 kv_dim, hidden]: q_proj, k_proj, v_proj rows
  bf16* o = nullptr;        // [hidden, q_dim]
  bf16* gate_up = nullptr;  // [2 inter, hidden]: gate_proj, up_proj rows
  bf16* down = nullptr;     // [hidden, inter]
  bf16* input_norm = nullptr;
  bf16* post_norm = nullptr;
  bf16* q_norm = nullptr;
  bf16* k_norm = nullptr;
};

struct GraphKey {
  int seqs = 0;
  int partitions = 0;
  bool sample = false;
  const void* kv_base = nullptr;
  auto operator<=>(const GraphKey&) const = default;
};

// Device pointers of one uploaded pass.
struct PassDevice {
  int T = 0, S = 0, D = 0, W = 0, R = 0;
  int max_partitions = 0;
  int partition_tokens = 0;  // decode attention's partition for this pass
  int partial_parts = 0;     // partial-buffer stride per (sequence, head): max_model_len's partitions
  bool rows_are_tokens = false;
  const int32_t *tokens = nullptr, *positions = nullptr, *slots = nullptr;
  const int32_t *q_start = nullptr, *q_len = nullptr, *kv_len = nullptr, *table_start = nullptr;
  const int32_t *block_tables = nullptr, *decode_seqs = nullptr, *prefill_items = nullptr, *logits_rows = nullptr;
  const cuda::SamplingRowParams* sampling = nullptr;
  const int32_t* banned = nullptr;
  uint32_t* sync = nullptr;  // zeroed by the upload (step_plan.h: kStepSyncWords)
  cuda::KvCacheDesc kv;
};

// Where each checkpoint tensor (and the RoPE tables) sits in the one weights
// buffer. Depends only on the config, so a reload writes the same places.
struct WeightSlot {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset;  // bytes from the buffer's start
};
struct LayerOffsets {
  size_t qkv, o, gate_up, down, input_norm, post_norm, q_norm, k_norm;
};
struct WeightsLayout {
  std::vector<WeightSlot> slots;
  std::vector<LayerOffsets> layers;
  size_t embed = 0, final_norm = 0, lm_head = 0, inv_freq = 0, rope = 0, bytes = 0;
};

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

// A checked tensor and where it goes: `offset` bytes into the weights buffer.
struct HostWrite {
  size_t offset;
  TensorView view;
};
struct DeviceWrite {
  size_t offset;
  const std::byte* src;  // device memory (an opened CUDA IPC buffer)
  DType dtype;
  size_t bytes;
};

// Every tensor of the layout from the store (shape and dtype checked), before
// anything is written.
Result<std::vector<TensorView>> checked_tensors(const WeightsLayout& L, const TensorStore& store) {
  std::vector<TensorView> views;
  views.reserve(L.slots.size());
  for (const WeightSlot& slot : L.slots) {
    SIESTA_ASSIGN_OR_RETURN(TensorView v, store.get(slot.name, slot.shape, {DType::kBF16, DType::kF16, DType::kF32}));
    views.push_back(std::move(v));
  }
  return views;
}

}  // namespace

bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

struct CudaQwen3::Impl {
  ModelConfig cfg;
  CudaModelOptions opt;
  // Set when the model owns its allocator: declared before the buffers, so
  // that it is destroyed after them.
  std::unique_ptr<cuda::DeviceAllocator> owned_alloc;
  cuda::DeviceAllocator* alloc = nullptr;
  std::unique_ptr<cuda::WeightUpload> weight_upload;  // pinned staging for checkpoint copies
  cudaStream_t stream = nullptr;
  cudaEvent_t meta_uploaded = nullptr;

  cuda::DeviceBuffer weights;
  bf16* embed = nullptr;
  bf16* final_norm = nullptr;
  bf16* lm_head = nullptr;
  float* inv_freq = nullptr;
  __nv_bfloat162* rope_table = nullptr;  // [max_model_len, head_dim / 2] (cos, sin)
  std::vector<LayerWeights> layers;

  cuda::DeviceBuffer scratch;
  bf16 *x = nullptr, *h = nullptr, *qkv = nullptr, *q = nullptr, *attn = nullptr, *proj = nullptr;
  bf16 *gu = nullptr, *act = nullptr, *hn = nullptr;
  float* logits = nullptr;
  float* partial_out = nullptr;
  float* partial_ml = nullptr;
  void* gemm_ws = nullptr;
  std::byte* meta = nullptr;
  // options.trace: the timelines of a small-batch pass's trace_slots() launches (5 per layer).
  unsigned long long* trace_buf = nullptr;
  int trace_slots() const { return 5 * cfg.num_layers; }
  static constexpr size_t kTraceLaunchWords = static_cast<size_t>(cuda::kTraceCtas) * cuda::kTraceCtaWords;
  unsigned long long* trace_at(int slot) const { return trace_buf ? trace_buf + slot * kTraceLaunchWords : nullptr; }
  size_t meta_capacity = 0;
  int logits_rows_cap = 0;
  int partial_parts = 0;

  std::byte* host_meta = nullptr;     // pinned: the step image
  // Pinned and mapped: the sampled tokens, which the sampling kernel writes
  // there itself (through `sampled`, the device's address of it), so that no
  // copy follows it in the stream (0.6B shape, H200, batch 1: 0.547 -> 0.542
  // ms per token).
  int32_t* host_sampled = nullptr;
  int32_t* sampled = nullptr;

  std::unique_ptr<cuda::CublasLtGemm> gemm;
  bool gemv_ok = false;
  // Decode steps of up to kStagedDecodeBatch sequences stage their partitions
  // (partition_tokens()), where the device's shared memory allows.
  bool staged_ok = false;
  int sm_count = 132;  // of the model's device, read at create
  std::map<GraphKey, cudaGraphExec_t> graphs;

  // Profiling (options.profile): events recorded after each kernel group.
  std::vector<cudaEvent_t> event_pool;
  std::vector<std::pair<const char*, cudaEvent_t>> marks;
  std::vector<std::pair<std::string, double>> profile_ms;
  // options.time_graphs: the events that open and close each decode graph,
  // and the graph steps timed since reset_profile().
  cudaEvent_t graph_events[2] = {};
  bool graph_launched = false;  // the step in flight is a graph replay
  double graph_ms_total = 0;
  int graph_steps = 0;

  ~Impl() {
    for (cudaEvent_t e : event_pool) cudaEventDestroy(e);
    for (cudaEvent_t e : graph_events)
      if (e) cudaEventDestroy(e);
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    gemm.reset();
    if (host_meta) cudaFreeHost(host_meta);
    if (host_sampled) cudaFreeHost(host_sampled);
    if (meta_uploaded) cudaEventDestroy(meta_uploaded);
    if (stream) cudaStreamDestroy(stream);
  }

  int hidden() const { return cfg.hidden_size; }
  int qkv_cols() const { return cfg.q_dim() + 2 * cfg.kv_dim(); }
  float eps() const { return static_cast<float>(cfg.rms_norm_eps); }
  KvCacheLayout layout() const { return KvCacheLayout::for_model(cfg, sizeof(bf16)); }
  // Batch-invariant mode sends one-token chunks through the prefill kernel
  // too, so a row's attention does not depend on how its prompt was chunked.
  cuda::StepShape shape() const { return {partition_tokens(), cuda::kPrefillTileRows, opt.batch_invariant}; }
  // Decode attention's partition: the option where one is set, else 256
  // tokens. A decode step of up to kStagedDecodeBatch sequences stages its
  // partitions in shared memory and attends on tensor cores, 16 warps of 16
  // tokens (AttentionArgs::staged_partitions, where the device's shared memory
  // per block allows): its few CTAs would leave most SMs idle on the fp32
  // item. Against 64-token partitions combined in a cluster (0.6B shape, H200,
  // one A/B call, then with 4 warps of 64 tokens): batch 1 0.631 ms per token both, batch 2 0.675 -> 0.657,
  // batch 4 0.736 -> 0.697, batch 8 0.834 -> 0.792 ms per step. The line is
  // the GEMV's (kGemvMaxRows), where results already change with the batch;
  // batch-invariant mode sends one-token chunks through prefill attention and
  // is not affected.
  int partition_tokens() const {
    return opt.decode_partition_tokens > 0 ? opt.decode_partition_tokens : cuda::kDecodePartitionTokens;
  }
  int parts_for(int partition) const { return (opt.max_model_len + partition - 1) / partition; }
  // Prefill attention's rows per warp for a pass of `items` work items
  // (CudaModelOptions::prefill_warp_rows): 32 where its CTAs fill every SM
  // twice (a 4096-token prompt of the 0.6B shape: 7.8 against 10.4 ms of
  // attention on an H200), 16 below (512 tokens: 64 CTAs, 2.68 against 3.05
  // ms of prefill).
  int prefill_warp_rows(int items) const {
    if (opt.prefill_warp_rows != 0) return opt.prefill_warp_rows;
    if (opt.batch_invariant) return 32;
    const int heads_per_cta = cuda::prefill_heads_per_cta(cfg.num_heads, cfg.num_kv_heads, opt.prefill_heads_per_cta);
    const long ctas = static_cast<long>(items) * (cfg.num_heads / heads_per_cta);
    return ctas >= 2L * sm_count ? 32 : 16;
  }
  bool use_prefill_wgmma() const {
    return opt.prefill_wgmma && cuda::prefill_wgmma_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
  }
  static constexpr int kStagedDecodeBatch = cuda::kGemvMaxRows;
  bool use_gemv(int T) const {
    const int rows = opt.gemv_max_rows < 0 ? cuda::kGemvMaxRows : std::min(opt.gemv_max_rows, cuda::kGemvMaxRows);
    return !opt.batch_invariant && gemv_ok && T <= rows;
  }
  cuda::LaunchConfig launch() const { return {stream, opt.programmatic_launch}; }

  Result<void> load_weights(const TensorStore& store);
  // Writes checked tensors into the weights buffer and computes the RoPE tables.
  Result<void> write_weights(const WeightsLayout& L, const std::vector<TensorView>& views);
  // Host tensors (checkpoint files, shared memory) to their places, converted to bf16.
  Result<void> write_host(const std::vector<HostWrite>& items);
  // Device tensors (CUDA IPC) to their places: copied, or converted on the GPU.
  Result<void> write_device(const std::vector<DeviceWrite>& items);
  // inv_freq and the RoPE table, which live with the weights.
  Result<void> write_rope(const WeightsLayout& L);
  Result<void> init_buffers();
  Result<void> check_cache(const KvCacheView& kv) const;
  Result<PassDevice> upload(const cuda::StepPlan& plan, bool sample, std::span<const cuda::SamplingRow> rows,
                            const KvCacheView& kv);
  Result<void> linear(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K);
  Result<void> enqueue_layers(const PassDevice& p);
  static bool pure_decode(const PassDevice& p) { return p.D > 0 && p.D == p.T && p.W == 0; }
  cuda::AttentionArgs attention_args(const PassDevice& p) const;
  Result<void> enqueue_logits(const PassDevice& p, int r0, int r1);
  // Set by enqueue_logits: each logits row's first maximum (GemvArgs::argmax) when
  // its LM head GEMV computed every row, else null.
  const unsigned long long* logits_argmax = nullptr;
  Result<void> enqueue_step(const PassDevice& p, bool sample);
  Result<void> copy_logits_rows(int device_row, int rows, float* host);
  bool graph_eligible(std::span<const SequenceChunk> batch) const;
  void mark(const char* label);
  void collect_profile();
  Result<void> decode_step(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                           std::span<const cuda::SamplingRow> rows, bool sample);
};

Result<void> CudaQwen3::Impl::load_weights(const TensorStore& store) {
  const WeightsLayout L = weights_layout(cfg, opt.max_model_len);
  // Check every tensor before allocating anything.
  SIESTA_ASSIGN_OR_RETURN(std::vector<TensorView> views, checked_tensors(L, store));
  SIESTA_ASSIGN_OR_RETURN(weights, cuda::DeviceBuffer::allocate(*alloc, L.bytes, cuda::DeviceMemoryTag::kWeights));
  SIESTA_TRY(write_weights(L, views));

  std::byte* base = weights.as<std::byte>();
  auto ptr = [&](size_t off) { return reinterpret_cast<bf16*>(base + off); };
  embed = ptr(L.embed);
  final_norm = ptr(L.final_norm);
  lm_head = ptr(L.lm_head);
  inv_freq = reinterpret_cast<float*>(base + L.inv_freq);
  rope_table = reinterpret_cast<__nv_bfloat162*>(base + L.rope);
  layers.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    const LayerOffsets& lo = L.layers[l];
    layers[l] = {ptr(lo.qkv),        ptr(lo.o),         ptr(lo.gate_up), ptr(lo.down),
                 ptr(lo.input_norm), ptr(lo.post_norm), ptr(lo.q_norm),  ptr(lo.k_norm)};
  }
  return {};
}

Result<void> CudaQwen3::Impl::write_weights(const WeightsLayout& L, const std::vector<TensorView>& views) {
  std::vector<HostWrite> items;
  items.reserve(L.slots.size());
  for (size_t i = 0; i < L.slots.size(); ++i) items.push_back({L.slots[i].offset, views[i]});
  SIESTA_TRY(write_host(items));
  return write_rope(L);
}

Result<void> CudaQwen3::Impl::write_host(const std::vector<HostWrite>& items) {
  if (!weight_upload) {
    SIESTA_ASSIGN_OR_RETURN(weight_upload, cuda::WeightUpload::create(4, size_t{16} << 20, 0, opt.device));
  }
  std::byte* base = weights.as<std::byte>();
  // bf16 tensors of checkpoint files: read in parallel straight into pinned
  // memory (WeightUpload::copy_files); the rest through the staging ring.
  std::vector<cuda::WeightUpload::FilePiece> pieces;
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
    if (auto ok = weight_upload->copy(base + w.offset, src, bytes); !ok)
      return ok.error().with_context("copying " + v.name + " to the GPU");
  }
  if (auto ok = weight_upload->copy_files(pieces); !ok) return ok.error().with_context("copying the checkpoint to the GPU");
  return {};
}

Result<void> CudaQwen3::Impl::write_device(const std::vector<DeviceWrite>& items) {
  std::byte* base = weights.as<std::byte>();
  for (const DeviceWrite& w : items) {
    const size_t n = w.bytes / dtype_size(w.dtype);
    if (w.dtype == DType::kBF16) {
      SIESTA_CUDA_TRY(cudaMemcpyAsync(base + w.offset, w.src, w.bytes, cudaMemcpyDeviceToDevice, stream),
                      "copying pushed weights (CUDA IPC)");
    } else {
      SIESTA_CUDA_TRY(cuda::launch_convert_to_bf16(w.src, static_cast<int>(dtype_size(w.dtype)),
                                                   reinterpret_cast<bf16*>(base + w.offset), n, stream),
                      "converting pushed weights to bf16 (CUDA IPC)");
    }
  }
  SIESTA_CUDA_TRY(cudaStreamSynchronize(stream), "copying pushed weights (CUDA IPC)");
  return {};
}

Result<void> CudaQwen3::Impl::write_rope(const WeightsLayout& L) {
  std::byte* base = weights.as<std::byte>();
  // As the CPU reference: inv_freq = 1 / theta^(2i / head_dim), in fp32.
  const int HD = cfg.head_dim;
  std::vector<float> inv(static_cast<size_t>(HD / 2));
  for (size_t i = 0; i < inv.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(HD);
    inv[i] = static_cast<float>(1.0 / std::pow(cfg.rope_theta, static_cast<double>(exponent)));
  }
  SIESTA_CUDA_TRY(cudaMemcpy(base + L.inv_freq, inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice),
                  "copying RoPE frequencies to the GPU");
  SIESTA_CUDA_TRY(cuda::launch_rope_table(reinterpret_cast<const float*>(base + L.inv_freq), HD, opt.max_model_len,
                                          reinterpret_cast<__nv_bfloat162*>(base + L.rope), cuda::LaunchConfig{}),
                  "computing the RoPE table");
  SIESTA_CUDA_TRY(cudaDeviceSynchronize(), "computing the RoPE table");
  return {};
}

Result<void> CudaQwen3::Impl::init_buffers() {
  const size_t T = opt.max_batch_tokens, S = opt.max_seqs;
  const size_t H = cfg.hidden_size, QD = cfg.q_dim(), I = cfg.intermediate_size, V = cfg.vocab_size;
  logits_rows_cap = std::max<int>(opt.max_seqs, 64);
  partial_parts = parts_for(partition_tokens());
  const size_t max_blocks_per_seq = (opt.max_model_len + kBlockSize - 1) / kBlockSize;
  // Every section of the step image at its largest, plus alignment.
  const size_t ints =
      3 * T + 5 * S + 2 * (T / cuda::kPrefillTileRows + S) + T + S * max_blocks_per_seq + cuda::kStepSyncWords;
  meta_capacity = align_up(ints * 4 + S * (sizeof(cuda::SamplingRecord) + cuda::kMaxBannedPerRow * 4) + 16 * 16, kAlign);

  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t off = at;
    at = align_up(at + bytes, kAlign);
    return off;
  };
  const size_t x_off = take(T * H * 2), h_off = take(T * H * 2), proj_off = take(T * H * 2);
  const size_t qkv_off = take(T * static_cast<size_t>(qkv_cols()) * 2);
  const size_t q_off = take(T * QD * 2), attn_off = take(T * QD * 2);
  const size_t gu_off = take(T * 2 * I * 2), act_off = take(T * I * 2);
  const size_t hn_off = take(static_cast<size_t>(logits_rows_cap) * H * 2);
  const size_t logits_off = take(static_cast<size_t>(logits_rows_cap) * V * 4);
  // Room for S sequences' partitions.
  const size_t part_elems = cfg.num_heads * S * static_cast<size_t>(partial_parts);
  const size_t partial_off = take(part_elems * cfg.head_dim * 4), ml_off = take(part_elems * 2 * 4);
  const size_t ws_off = take(kGemmWorkspaceBytes);
  const size_t meta_off = take(meta_capacity);
  const size_t trace_bytes = opt.trace ? trace_slots() * kTraceLaunchWords * 8 : 0;
  const size_t trace_off = take(trace_bytes);
  SIESTA_ASSIGN_OR_RETURN(scratch, cuda::DeviceBuffer::allocate(*alloc, at, cuda::DeviceMemoryTag::kScratch));
  std::byte* b = scratch.as<std::byte>();
  x = reinterpret_cast<bf16*>(b + x_off);
  h = reinterpret_cast<bf16*>(b + h_off);
  proj = reinterpret_cast<bf16*>(b + proj_off);
  qkv = reinterpret_cast<bf16*>(b + qkv_off);
  q = reinterpret_cast<bf16*>(b + q_off);
  attn = reinterpret_cast<bf16*>(b + attn_off);
  gu = reinterpret_cast<bf16*>(b + gu_off);
  act = reinterpret_cast<bf16*>(b + act_off);
  hn = reinterpret_cast<bf16*>(b + hn_off);
  logits = reinterpret_cast<float*>(b + logits_off);
  partial_out = reinterpret_cast<float*>(b + partial_off);
  partial_ml = reinterpret_cast<float*>(b + ml_off);
  gemm_ws = b + ws_off;
  meta = b + meta_off;
  if (opt.trace) trace_buf = reinterpret_cast<unsigned long long*>(b + trace_off);

  SIESTA_CUDA_TRY(cudaMallocHost(&host_meta, meta_capacity), "allocating pinned host memory for step metadata");
  SIESTA_CUDA_TRY(cudaHostAlloc(&host_sampled, S * 4, cudaHostAllocMapped),
                  "allocating pinned host memory for sampled tokens");
  SIESTA_CUDA_TRY(cudaHostGetDevicePointer(&sampled, host_sampled, 0), "mapping the sampled tokens' host memory");
  SIESTA_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating the model's CUDA stream");
  SIESTA_CUDA_TRY(cudaEventCreateWithFlags(&meta_uploaded, cudaEventDisableTiming), "creating a CUDA event");
  SIESTA_CUDA_TRY(cudaEventRecord(meta_uploaded, stream), "recording a CUDA event");
  SIESTA_ASSIGN_OR_RETURN(gemm, cuda::CublasLtGemm::create(gemm_ws, kGemmWorkspaceBytes));
  return {};
}

Result<void> CudaQwen3::Impl::check_cache(const KvCacheView& kv) const {
  const KvCacheLayout want = layout();
  const KvCacheLayout& got = kv.layout;
  if (got.num_layers != want.num_layers || got.num_kv_heads != want.num_kv_heads || got.head_dim != want.head_dim ||
      got.block_size != want.block_size || got.elem_bytes != want.elem_bytes)
    return invalid_argument("forward: KV cache layout does not match the model (the CUDA model keeps bf16, elem_bytes 2)");
  if (static_cast<int64_t>(kv.num_blocks) * kBlockSize >= (int64_t{1} << 31))
    return invalid_argument("forward: KV cache has more than 2^27 blocks");
  return {};
}

Result<PassDevice> CudaQwen3::Impl::upload(const cuda::StepPlan& plan, bool sample,
                                           std::span<const cuda::SamplingRow> rows, const KvCacheView& kv) {
  if (plan.max_kv_len > opt.max_model_len)
    return invalid_argument("forward: a sequence reaches " + std::to_string(plan.max_kv_len) +
                            " positions, past max_model_len " + std::to_string(opt.max_model_len));
  const cuda::StepLayout L = cuda::step_layout(plan, sample);
  if (L.end > meta_capacity) return internal_error("forward: step metadata larger than its buffer");
  SIESTA_ASSIGN_OR_RETURN(std::vector<std::byte> image, cuda::pack_step(plan, L, rows));
  // The previous upload must have left the pinned buffer before it is rewritten.
  SIESTA_CUDA_TRY(cudaEventSynchronize(meta_uploaded), "waiting for the previous metadata upload");
  std::memcpy(host_meta, image.data(), image.size());
  mark("start");
  SIESTA_CUDA_TRY(cudaMemcpyAsync(meta, host_meta, image.size(), cudaMemcpyHostToDevice, stream),
                  "uploading step metadata");
  mark("upload");
  SIESTA_CUDA_TRY(cudaEventRecord(meta_uploaded, stream), "recording the metadata upload");

  PassDevice p;
  p.T = plan.num_tokens;
  p.S = plan.num_seqs;
  p.D = static_cast<int>(plan.decode_seqs.size());
  p.W = static_cast<int>(plan.prefill_items.size() / 2);
  p.R = static_cast<int>(plan.logits_rows.size());
  p.max_partitions = plan.max_partitions;
  p.partition_tokens = plan.partition_tokens > 0 ? plan.partition_tokens : partition_tokens();
  p.partial_parts = parts_for(p.partition_tokens);
  p.rows_are_tokens = plan.logits_rows_are_all_tokens();
  auto at = [&](size_t off) { return reinterpret_cast<const int32_t*>(meta + off); };
  p.tokens = at(L.tokens);
  p.positions = at(L.positions);
  p.slots = at(L.slots);
  p.q_start = at(L.q_start);
  p.q_len = at(L.q_len);
  p.kv_len = at(L.kv_len);
  p.table_start = at(L.table_start);
  p.block_tables = at(L.block_tables);
  p.decode_seqs = at(L.decode_seqs);
  p.prefill_items = at(L.prefill_items);
  p.logits_rows = at(L.logits_rows);
  p.sampling = reinterpret_cast<const cuda::SamplingRowParams*>(meta + L.sampling);
  p.banned = at(L.banned);
  p.sync = reinterpret_cast<uint32_t*>(meta + L.sync);
  p.kv = {static_cast<bf16*>(kv.base), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim};
  return p;
}

Result<void> CudaQwen3::Impl::linear(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K) {
  if (opt.batch_invariant)
    return cuda::cuda_result(cuda::launch_fixed_gemm(a, w, out, out_f32, M, N, K, launch()), "fixed-order GEMM");
  return gemm->run(a, w, out, out_f32, M, N, K, stream);
}

// Everything attention reads about pass p. A pure decode pass also gets the
// q/k norm + RoPE inputs: its decode attention does that
// work and the KV write itself (per layer: q_norm, k_norm, layer).
cuda::AttentionArgs CudaQwen3::Impl::attention_args(const PassDevice& p) const {
  cuda::AttentionArgs aa;
  aa.q = q;
  aa.out = attn;
  aa.kv = p.kv;
  aa.num_heads = cfg.num_heads;
  aa.num_kv_heads = cfg.num_kv_heads;
  aa.head_dim = cfg.head_dim;
  aa.scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
  aa.seq_q_start = p.q_start;
  aa.seq_q_len = p.q_len;
  aa.seq_kv_len = p.kv_len;
  aa.seq_table_start = p.table_start;
  aa.block_tables = p.block_tables;
  aa.decode_seqs = p.decode_seqs;
  aa.partial_out = partial_out;
  aa.partial_ml = partial_ml;
  aa.partial_parts = p.partial_parts;
  aa.partition_tokens = p.partition_tokens;
  // Decode partitions combined by their last CTA, on counters in the step image's
  // sync words (zeroed by every upload).
  if (static_cast<size_t>(p.D) * cfg.num_kv_heads <= cuda::kStepSyncWords - kPartitionSyncOffset)
    aa.partition_done = p.sync + kPartitionSyncOffset;
  aa.cluster_partitions = true;  // contexts of 2 to 8 partitions (kernels.h)
  aa.staged_partitions = staged_ok && p.D <= kStagedDecodeBatch;  // partition_tokens()
  aa.prefill_items = p.prefill_items;
  aa.prefill_heads_per_cta = opt.prefill_heads_per_cta;
  aa.prefill_warp_rows = prefill_warp_rows(p.W);
  if (pure_decode(p)) {
    aa.qkv = qkv;
    aa.positions = p.positions;
    aa.slots = p.slots;
    aa.rope_table = rope_table;
    aa.eps = eps();
  }
  return aa;
}

Result<void> CudaQwen3::Impl::enqueue_layers(const PassDevice& p) {
  const int T = p.T, H = hidden(), QD = cfg.q_dim(), I = cfg.intermediate_size;
  const bool small = use_gemv(T);
  // The first kernel of a pass follows the metadata copy, not a kernel: no overlap.
  SIESTA_CUDA_TRY(cuda::launch_embed(p.tokens, T, embed, H, x, stream), "embedding");
  mark("embed");

  cuda::AttentionArgs aa = attention_args(p);
  // A pure decode pass: decode attention does q/k norm + RoPE and the KV write
  // itself, one launch fewer per layer, same bits. (Combining the partitions in
  // the O projection's GEMV staging as well was measured: no gain at batch 1,
  // 3% slower at batch 8, where every GEMV CTA repeats the combination.)
  const bool decode_only = pure_decode(p);
  const bool traced = small && trace_buf;
  if (traced) {
    SIESTA_CUDA_TRY(cudaMemsetAsync(trace_buf, 0, trace_slots() * kTraceLaunchWords * 8, stream), "clearing the trace");
  }
  auto trace_slot = [&](int slot) { return traced ? trace_at(slot) : nullptr; };

  for (int l = 0; l < cfg.num_layers; ++l) {
    const LayerWeights& w = layers[l];
    if (small) {
      cuda::GemvArgs g{x, w.input_norm, eps(), w.qkv, T, qkv_cols(), H, cuda::GemvInput::kRmsNorm,
                       cuda::GemvOutput::kBf16, qkv};
      g.trace = trace_slot(5 * l);
      SIESTA_CUDA_TRY(cuda::launch_gemv(g, launch()), "QKV projection (GEMV)");
      mark("qkv_gemv");
    } else {
      SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(x, l == 0 ? nullptr : proj, w.input_norm, T, H, eps(), nullptr, h,
                                                launch()),
                      "input RMSNorm");
      mark("norm");
      SIESTA_TRY(linear(h, w.qkv, qkv, false, T, qkv_cols(), H));
      mark("qkv");
    }
    if (!decode_only) {
      SIESTA_CUDA_TRY(cuda::launch_qk_norm_rope_kv(qkv, T, p.positions, p.slots, w.q_norm, w.k_norm, rope_table,
                                                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps(), q, p.kv, l,
                                                   launch()),
                      "q/k norm, RoPE and KV write");
      mark("rope_kv");
    }
    aa.layer = l;
    aa.q_norm = w.q_norm;
    aa.k_norm = w.k_norm;
    aa.trace = trace_slot(5 * l + 1);
    SIESTA_CUDA_TRY(cuda::launch_decode_attention(aa, p.D, p.max_partitions, launch()), "decode attention");
    if (p.D > 0) mark("attention_decode");
    if (use_prefill_wgmma()) {
      SIESTA_CUDA_TRY(cuda::launch_prefill_attention_wgmma(aa, p.W, launch()), "prefill attention (wgmma)");
    } else {
      SIESTA_CUDA_TRY(cuda::launch_prefill_attention(aa, p.W, launch()), "prefill attention");
    }
    if (p.W > 0) mark("attention_prefill");
    if (small) {
      cuda::GemvArgs o{attn, nullptr, 0.0f, w.o, T, H, QD, cuda::GemvInput::kPlain, cuda::GemvOutput::kAddBf16, x};
      o.trace = trace_slot(5 * l + 2);
      SIESTA_CUDA_TRY(cuda::launch_gemv(o, launch()), "output projection (GEMV)");
      mark("o_gemv");
      // The SiLU-mul: in the gate/up GEMV's epilogue (act = bf16(bf16(silu(g)) * u),
      // once per value), or at one row in every down CTA's staging, which measured
      // faster there (0.6B shape, H200: 0.678 against 0.705 ms per token; 2 to 8
      // rows: 0.80-0.98 against 0.86-1.27 ms per step). The same bits either way.
      const bool silu_in_gate_up = T > 1;
      bf16* const mlp = silu_in_gate_up ? act : gu;  // gate/up's output, the down projection's input
      cuda::GemvArgs gup{x, w.post_norm, eps(), w.gate_up, T, 2 * I, H, cuda::GemvInput::kRmsNorm,
                         silu_in_gate_up ? cuda::GemvOutput::kSiluMul : cuda::GemvOutput::kBf16, mlp};
      gup.trace = trace_slot(5 * l + 3);
      SIESTA_CUDA_TRY(cuda::launch_gemv(gup, launch()), "gate/up projection (GEMV)");
      mark("gate_up_gemv");
      cuda::GemvArgs down{mlp, nullptr, 0.0f, w.down, T, H, I,
                          silu_in_gate_up ? cuda::GemvInput::kPlain : cuda::GemvInput::kSiluMul,
                          cuda::GemvOutput::kAddBf16, x};
      down.trace = trace_slot(5 * l + 4);
      SIESTA_CUDA_TRY(cuda::launch_gemv(down, launch()), "down projection (GEMV)");
      mark("down_gemv");
    } else {
      SIESTA_TRY(linear(attn, w.o, proj, false, T, H, QD));
      mark("o_proj");
      SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(x, proj, w.post_norm, T, H, eps(), nullptr, h, launch()),
                      "post-attention RMSNorm");
      mark("norm");
      SIESTA_TRY(linear(h, w.gate_up, gu, false, T, 2 * I, H));
      mark("gate_up");
      SIESTA_CUDA_TRY(cuda::launch_silu_mul(gu, T, I, act, launch()), "SiLU-mul");
      mark("silu_mul");
      SIESTA_TRY(linear(act, w.down, proj, false, T, H, I));
      mark("down");
    }
  }
  return {};
}

// Logits of rows [r0, r1) of the pass's logits rows into `logits` (row 0 = r0).
Result<void> CudaQwen3::Impl::enqueue_logits(const PassDevice& p, int r0, int r1) {
  const int rows = r1 - r0, H = hidden(), V = cfg.vocab_size;
  logits_argmax = nullptr;
  if (rows <= 0) return {};
  if (use_gemv(p.T)) {
    // Every row's first maximum as well, for sampling (the keys start at zero).
    unsigned long long* keys = nullptr;
    if (r0 == 0 && r1 == p.R)
      keys = reinterpret_cast<unsigned long long*>(p.sync + kArgmaxSyncOffset);
    logits_argmax = keys;
    // The residual stream x is complete (the down GEMV added into it).
    if (p.rows_are_tokens && r0 == 0 && r1 == p.R) {
      cuda::GemvArgs g{x, final_norm, eps(), lm_head, rows, V, H, cuda::GemvInput::kRmsNorm, cuda::GemvOutput::kLogits,
                       logits, keys};
      SIESTA_CUDA_TRY(cuda::launch_gemv(g, launch()), "LM head (GEMV)");
      mark("lm_head_gemv");
      return {};
    }
    SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(x, nullptr, final_norm, rows, H, eps(), p.logits_rows + r0, hn, launch()),
                    "final RMSNorm");
    cuda::GemvArgs g{hn, nullptr, 0.0f, lm_head, rows, V, H, cuda::GemvInput::kPlain, cuda::GemvOutput::kLogits, logits,
                     keys};
    return cuda::cuda_result(cuda::launch_gemv(g, launch()), "LM head (GEMV)");
  }
  // The last layer's down projection is still in proj: add it for these rows only.
  SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(x, proj, final_norm, rows, H, eps(), p.logits_rows + r0, hn, launch()),
                  "final RMSNorm");
  mark("final_norm");
  SIESTA_TRY(linear(hn, lm_head, logits, true, rows, V, H));
  mark("lm_head");
  if (opt.batch_invariant) return {};  // the fixed GEMM rounds as it stores
  SIESTA_CUDA_TRY(cuda::launch_round_to_bf16(logits, static_cast<size_t>(rows) * V, launch()), "rounding logits");
  mark("round_logits");
  return {};
}

Result<void> CudaQwen3::Impl::enqueue_step(const PassDevice& p, bool sample) {
  SIESTA_TRY(enqueue_layers(p));
  SIESTA_TRY(enqueue_logits(p, 0, p.R));
  if (sample) {
    SIESTA_CUDA_TRY(cuda::launch_sample_tokens(logits, p.R, cfg.vocab_size, p.sampling, p.banned, sampled, launch(),
                                               logits_argmax),
                    "token sampling");
    mark("sampling");
  }
  return {};
}

Result<void> CudaQwen3::Impl::copy_logits_rows(int device_row, int rows, float* host) {
  if (rows <= 0) return {};
  const size_t V = cfg.vocab_size;
  return cuda::cuda_result(cudaMemcpyAsync(host, logits + static_cast<size_t>(device_row) * V, rows * V * sizeof(float),
                                           cudaMemcpyDeviceToHost, stream),
                           "copying logits to the host");
}

bool CudaQwen3::Impl::graph_eligible(std::span<const SequenceChunk> batch) const {
  if (!opt.cuda_graphs || batch.empty() || static_cast<int>(batch.size()) > std::min(opt.max_graph_batch, opt.max_seqs) ||
      static_cast<int>(batch.size()) > opt.max_batch_tokens)
    return false;
  for (const SequenceChunk& c : batch)
    if (c.tokens.size() != 1) return false;
  return true;
}

void CudaQwen3::Impl::mark(const char* label) {
  if (!opt.profile) return;
  if (marks.size() == event_pool.size()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return;
    event_pool.push_back(e);
  }
  cudaEvent_t e = event_pool[marks.size()];
  cudaEventRecord(e, stream);
  marks.emplace_back(label, e);
}

// Adds the time between consecutive marks to each mark's label; call after a sync.
void CudaQwen3::Impl::collect_profile() {
  if (!opt.profile) return;
  for (size_t i = 1; i < marks.size(); ++i) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second) != cudaSuccess) continue;
    auto it = std::find_if(profile_ms.begin(), profile_ms.end(), [&](const auto& p) { return p.first == marks[i].first; });
    if (it == profile_ms.end()) profile_ms.emplace_back(marks[i].first, ms);
    else it->second += ms;
  }
  marks.clear();
}

// One decode step (every sequence one token) through a CUDA graph captured for
// its padded batch size and partition count. The first step of a shape runs
// eagerly (which also sets kernel attributes and cuBLASLt plans), then the
// same launches are captured for the next steps.
Result<void> CudaQwen3::Impl::decode_step(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                          std::span<const cuda::SamplingRow> rows, bool sample) {
  int padded = static_cast<int>(batch.size());
  for (int b : kGraphBatchSizes)
    if (b >= padded) {
      padded = std::min(b, std::min(opt.max_seqs, opt.max_batch_tokens));
      break;
    }
  std::vector<cuda::PassChunk> chunks(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) chunks[i] = {i, batch[i], cuda::LogitsWanted::kLast};
  SIESTA_ASSIGN_OR_RETURN(cuda::StepPlan plan, cuda::plan_pass(chunks, padded, shape()));
  int parts = 1;
  while (parts < plan.max_partitions) parts *= 2;
  parts = std::min(parts, parts_for(plan.partition_tokens));
  if (plan.max_partitions > parts)
    return invalid_argument("forward: context longer than max_model_len " + std::to_string(opt.max_model_len));
  plan.max_partitions = parts;
  SIESTA_ASSIGN_OR_RETURN(PassDevice p, upload(plan, sample, rows, kv));

  const GraphKey key{padded, parts, sample, kv.base};
  auto it = graphs.find(key);
  graph_launched = false;
  if (it != graphs.end()) {
    SIESTA_CUDA_TRY(cudaGraphLaunch(it->second, stream), "launching a decode graph");
    graph_launched = true;
    return {};
  }
  SIESTA_TRY(enqueue_step(p, sample));  // this step's result
  // Capture the same launches for the next steps of this shape. A capture
  // that fails costs speed, not correctness: graphs are switched off.
  Result<void> captured = cuda::cuda_result(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                                            "beginning graph capture");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (captured && opt.time_graphs && !graph_events[0])
    for (cudaEvent_t& e : graph_events)
      if (captured) captured = cuda::cuda_result(cudaEventCreate(&e), "creating the graph timing events");
  if (captured) {
    // External records: nodes of the graph that take the time when it runs.
    if (opt.time_graphs)
      captured = cuda::cuda_result(cudaEventRecordWithFlags(graph_events[0], stream, cudaEventRecordExternal),
                                   "recording the graph's first event");
    if (captured) captured = enqueue_step(p, sample);
    if (captured && opt.time_graphs)
      captured = cuda::cuda_result(cudaEventRecordWithFlags(graph_events[1], stream, cudaEventRecordExternal),
                                   "recording the graph's last event");
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (captured) captured = cuda::cuda_result(end, "ending graph capture");
  }
  if (captured) captured = cuda::cuda_result(cudaGraphInstantiate(&exec, graph, 0), "instantiating a decode graph");
  if (graph) cudaGraphDestroy(graph);
  if (!captured) {
    (void)cudaGetLastError();
    opt.cuda_graphs = false;
    SIESTA_LOG_WARN("cuda: decode graphs switched off: {}", captured.error().message);
    return {};
  }
  graphs.emplace(key, exec);
  SIESTA_LOG_DEBUG("cuda: captured decode graph for {} sequences, {} partitions{}", padded, parts,
                   sample ? ", sampling" : "");
  return {};
}

// ---------------------------------------------------------------------------

CudaQwen3::CudaQwen3(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaQwen3::~CudaQwen3() = default;

Result<std::unique_ptr<CudaQwen3>> CudaQwen3::load(const std::filesystem::path& model_dir,
                                                   cuda::DeviceAllocator& allocator, const CudaModelOptions& options) {
  SIESTA_ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::load(model_dir));
  SIESTA_ASSIGN_OR_RETURN(TensorStore store, TensorStore::open(model_dir));
  return create(cfg, store, allocator, options);
}

Result<std::unique_ptr<CudaQwen3>> CudaQwen3::load(const std::filesystem::path& model_dir,
                                                   std::unique_ptr<cuda::DeviceAllocator> allocator,
                                                   const CudaModelOptions& options) {
  if (!allocator) return invalid_argument("CUDA model: no device allocator given");
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<CudaQwen3> model, load(model_dir, *allocator, options));
  // The allocator moves into the model; every buffer it handed out is freed
  // before it (Impl declares owned_alloc before the buffers).
  model->impl_->owned_alloc = std::move(allocator);
  return model;
}

Result<std::unique_ptr<CudaQwen3>> CudaQwen3::create(const ModelConfig& cfg, const TensorStore& store,
                                                     cuda::DeviceAllocator& allocator,
                                                     const CudaModelOptions& options) {
  if (!cuda::attention_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    return invalid_argument("CUDA model: head_dim " + std::to_string(cfg.head_dim) + " with " +
                            std::to_string(cfg.num_heads) + " query / " + std::to_string(cfg.num_kv_heads) +
                            " kv heads has no attention kernel (head_dim 64 or 128, 1 to " +
                            std::to_string(cuda::kMaxGqaGroup) + " query heads per kv head)");
  const int H = cfg.hidden_size, I = cfg.intermediate_size;
  if (H % 32 != 0 || I % 32 != 0 || cfg.q_dim() % 32 != 0 || H > 8192)
    return invalid_argument("CUDA model: hidden_size, intermediate_size and q_dim must be multiples of 32 "
                            "(and hidden_size at most 8192)");
  if (options.max_batch_tokens < 1 || options.max_seqs < 1 || options.max_seqs > 65535)
    return invalid_argument("CUDA model: max_batch_tokens and max_seqs must be positive (max_seqs <= 65535)");
  if (options.decode_partition_tokens != 0 && !cuda::decode_partition_supported(options.decode_partition_tokens))
    return invalid_argument("CUDA model: decode_partition_tokens " + std::to_string(options.decode_partition_tokens) +
                            " is not compiled (64, 128 or 256)");
  if (options.prefill_warp_rows != 0 && !cuda::prefill_warp_rows_supported(options.prefill_warp_rows))
    return invalid_argument("CUDA model: prefill_warp_rows " + std::to_string(options.prefill_warp_rows) +
                            " is not compiled (16 or 32; 0 chooses)");

  int devices = 0;
  SIESTA_CUDA_TRY(cudaGetDeviceCount(&devices), "looking for a CUDA device");
  if (options.device < 0 || options.device >= devices)
    return invalid_argument("CUDA model: device " + std::to_string(options.device) + " does not exist (" +
                            std::to_string(devices) + " present)");
  SIESTA_CUDA_TRY(cudaSetDevice(options.device), "selecting the CUDA device");

  auto impl = std::make_unique<Impl>();
  impl->cfg = cfg;
  impl->opt = options;
  SIESTA_CUDA_TRY(cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, options.device),
                  "reading the device's SM count");
  impl->alloc = &allocator;
  if (impl->opt.profile) impl->opt.cuda_graphs = false;  // events between launches
  if (options.trace && !cuda::kTraceCompiled)
    return invalid_argument("CUDA model: trace needs a build with -DSIESTA_CUDA_TRACE=ON (its kernels carry the marks)");
  if (impl->opt.max_model_len <= 0)
    impl->opt.max_model_len = std::min(cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768, 32768);
  impl->staged_ok = cuda::decode_staged_partitions_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
  impl->gemv_ok = cuda::gemv_supported(1, H) && cuda::gemv_supported(1, cfg.q_dim()) &&
                  cuda::gemv_supported(cuda::kGemvMaxRows, I) && cuda::gemv_supported(cuda::kGemvMaxRows, H) &&
                  cuda::gemv_supported(cuda::kGemvMaxRows, cfg.q_dim());
  if (options.batch_invariant &&
      !(cuda::fixed_gemm_supported(impl->qkv_cols(), H) && cuda::fixed_gemm_supported(cfg.vocab_size, H)))
    return invalid_argument("CUDA model: batch-invariant mode needs vocab_size and q/k/v widths divisible by 8");
  SIESTA_TRY(impl->load_weights(store));
  SIESTA_TRY(impl->init_buffers());
  SIESTA_LOG_INFO("cuda: Qwen3 loaded ({} layers, hidden {}), weights {:.1f} MiB, scratch {:.1f} MiB{}",
                  cfg.num_layers, H, impl->weights.bytes() / 1048576.0, impl->scratch.bytes() / 1048576.0,
                  options.batch_invariant ? ", batch-invariant" : "");
  return std::unique_ptr<CudaQwen3>(new CudaQwen3(std::move(impl)));
}

const ModelConfig& CudaQwen3::config() const { return impl_->cfg; }
KvCacheLayout CudaQwen3::kv_layout() const { return impl_->layout(); }
const CudaModelOptions& CudaQwen3::options() const { return impl_->opt; }
size_t CudaQwen3::num_graphs() const { return impl_->graphs.size(); }
size_t CudaQwen3::weight_bytes() const { return impl_->weights.bytes(); }
size_t CudaQwen3::scratch_bytes() const { return impl_->scratch.bytes(); }

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

// A checked update of the CUDA model: host tensors (a checkpoint's files,
// shared memory) or device tensors (CUDA IPC), and the sources they point
// into, open until the object goes.
class CudaWeightWrite final : public PreparedWeightUpdate {
 public:
  CudaWeightWrite(CudaQwen3::Impl& m, WeightsLayout layout) : m_(m), layout_(std::move(layout)) {}

  Result<WeightUpdateReport> apply() override;

  WeightUpdateReport report;
  std::vector<HostWrite> host;
  std::vector<DeviceWrite> device;
  std::optional<TensorStore> store;
  std::optional<SharedWeightFile> file;
  std::optional<cuda::IpcWeightBuffers> ipc;

 private:
  CudaQwen3::Impl& m_;
  WeightsLayout layout_;
};

Result<WeightUpdateReport> CudaWeightWrite::apply() {
  const auto start = std::chrono::steady_clock::now();
  SIESTA_CUDA_TRY(cudaSetDevice(m_.opt.device), "selecting the CUDA device");
  // Nothing of the previous call may still read the weights.
  SIESTA_CUDA_TRY(cudaStreamSynchronize(m_.stream), "waiting for the model's stream before a weight update");
  auto written = [&](Result<void> r) -> Result<void> {
    if (!r) return r.error().with_context("update_weights: writing the weights (some tensors may be written)");
    return {};
  };
  SIESTA_TRY(written(m_.write_host(host)));
  SIESTA_TRY(written(m_.write_device(device)));
  // The RoPE table lives with the weights: after a sleep that released them it is zero too.
  SIESTA_TRY(written(m_.write_rope(layout_)));
  report.write_seconds = seconds_since(start);
  return report;
}

Result<std::unique_ptr<PreparedWeightUpdate>> CudaQwen3::prepare_weight_update(const WeightUpdate& update) {
  return prepare_update(update, "update_weights");
}

Result<std::unique_ptr<PreparedWeightUpdate>> CudaQwen3::prepare_update(const WeightUpdate& update,
                                                                       const std::string& call) {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  const WeightsLayout L = weights_layout(m.cfg, m.opt.max_model_len);
  std::map<std::string, size_t> offset_of;
  for (const WeightSlot& slot : L.slots) offset_of.emplace(slot.name, slot.offset);
  const std::vector<TensorSpec> specs = updatable_tensors(m.cfg);
  auto w = std::make_unique<CudaWeightWrite>(m, L);
  WeightUpdateReport& report = w->report;
  report.source = update.source;
  switch (update.source) {
    case WeightSource::kDir: {
      const std::string where = call + " from " + update.path.string();
      auto next = ModelConfig::load(update.path);
      if (!next) return next.error().with_context(where);
      if (const std::string diff = architecture_differences(m.cfg, *next); !diff.empty())
        return invalid_argument(where + ": the checkpoint has a different architecture (" + diff +
                                "); an in-place weight update needs the same shapes. Serve that model from a new "
                                "siesta serve instead");
      auto store = TensorStore::open(update.path);
      if (!store) return store.error().with_context(where);
      auto views = checked_tensors(L, *store);
      if (!views) return views.error().with_context(where);
      for (size_t i = 0; i < L.slots.size(); ++i) {
        report.bytes += (*views)[i].nbytes;
        w->host.push_back({L.slots[i].offset, std::move((*views)[i])});
      }
      for (size_t i = 0; i < specs.size(); ++i) report.written.push_back(static_cast<int>(i));
      report.from = update.path.string();
      w->store = std::move(*store);
      break;
    }
    case WeightSource::kShm: {
      SIESTA_ASSIGN_OR_RETURN(SharedWeightFile file, SharedWeightFile::open(update));
      const uint64_t size = file.bytes();
      SIESTA_ASSIGN_OR_RETURN(std::vector<int> index,
                              check_pushed_tensors(m.cfg, specs, update, std::span<const uint64_t>(&size, 1)));
      for (size_t i = 0; i < update.tensors.size(); ++i) {
        const PushedTensor& t = update.tensors[i];
        if (index[i] < 0) {
          report.skipped.push_back(t.name);
          continue;
        }
        report.bytes += pushed_tensor_bytes(t);
        report.written.push_back(index[i]);
        w->host.push_back({offset_of.at(t.name), file.view(t)});
      }
      report.from = file.name();
      w->file = std::move(file);
      break;
    }
    case WeightSource::kCudaIpc: {
      SIESTA_ASSIGN_OR_RETURN(cuda::IpcWeightBuffers ipc, cuda::IpcWeightBuffers::open(update.buffers, m.opt.device));
      SIESTA_ASSIGN_OR_RETURN(std::vector<int> index, check_pushed_tensors(m.cfg, specs, update, ipc.sizes()));
      for (size_t i = 0; i < update.tensors.size(); ++i) {
        const PushedTensor& t = update.tensors[i];
        if (index[i] < 0) {
          report.skipped.push_back(t.name);
          continue;
        }
        const uint64_t bytes = pushed_tensor_bytes(t);
        report.bytes += bytes;
        report.written.push_back(index[i]);
        w->device.push_back({offset_of.at(t.name), ipc.data(t.buffer) + t.offset, t.dtype, static_cast<size_t>(bytes)});
      }
      report.from = "cuda_ipc: " + std::to_string(update.buffers.size()) + " buffers (" +
                    std::to_string(ipc.handles_opened()) + " handles)";
      w->ipc = std::move(ipc);
      break;
    }
  }
  report.tensors = static_cast<int64_t>(report.written.size());
  report.prepare_seconds = seconds_since(start);
  return std::unique_ptr<PreparedWeightUpdate>(std::move(w));
}

Result<void> CudaQwen3::reload_weights(const std::filesystem::path& model_dir) {
  WeightUpdate u;
  u.source = WeightSource::kDir;
  u.path = model_dir;
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<PreparedWeightUpdate> prepared, prepare_update(u, "reload_weights"));
  SIESTA_TRY(prepared->apply());
  return {};
}
std::vector<std::pair<std::string, double>> CudaQwen3::profile() const { return impl_->profile_ms; }
void CudaQwen3::reset_profile() {
  impl_->profile_ms.clear();
  impl_->graph_ms_total = 0;
  impl_->graph_steps = 0;
}
double CudaQwen3::graph_step_ms() const {
  return impl_->graph_steps > 0 ? impl_->graph_ms_total / impl_->graph_steps : 0.0;
}

std::vector<KernelTrace> CudaQwen3::trace() const {
  const Impl& m = *impl_;
  std::vector<KernelTrace> out;
  if (!m.trace_buf || cudaStreamSynchronize(m.stream) != cudaSuccess) return out;
  std::vector<unsigned long long> w(m.trace_slots() * Impl::kTraceLaunchWords);
  if (cudaMemcpy(w.data(), m.trace_buf, w.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) return out;
  static const char* const kKernels[] = {"qkv", "attention", "o", "gate_up", "down"};
  // Per launch: first and last start, first and last wait, and the last warp at each mark.
  constexpr int kWords = 4 + cuda::kTraceMarks;
  static_assert(kWords == KernelTrace::kMarks);
  using CtaWords = std::array<unsigned long long, 2 + cuda::kTraceMarks>;  // start, wait, last warp at each mark
  static_assert(std::tuple_size_v<CtaWords> == std::size(KernelTrace::Cta{}.ns));
  std::vector<std::array<unsigned long long, kWords>> r(m.trace_slots());
  std::vector<std::vector<std::pair<int, CtaWords>>> ctas(m.trace_slots());
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < m.trace_slots(); ++i) {
    std::array<unsigned long long, kWords> v{};
    v[0] = v[2] = ~0ull;
    for (int c = 0; c < cuda::kTraceCtas; ++c) {
      const unsigned long long* cw = &w[i * Impl::kTraceLaunchWords + static_cast<size_t>(c) * cuda::kTraceCtaWords];
      if (!cw[0]) continue;  // no such CTA
      CtaWords cta{cw[0], cw[1]};
      v[0] = std::min(v[0], cw[0]);
      v[1] = std::max(v[1], cw[0]);
      if (cw[1]) {
        v[2] = std::min(v[2], cw[1]);
        v[3] = std::max(v[3], cw[1]);
      }
      for (int k = 0; k < cuda::kTraceMarks; ++k)
        for (int warp = 0; warp < 8; ++warp) cta[2 + k] = std::max(cta[2 + k], cw[8 + 8 * k + warp]);
      for (int k = 0; k < cuda::kTraceMarks; ++k) v[4 + k] = std::max(v[4 + k], cta[2 + k]);
      ctas[i].emplace_back(static_cast<int>(cw[2]) - 1, cta);
    }
    if (v[0] != ~0ull) t0 = std::min(t0, v[0]);
    r[i] = v;
  }
  auto rel = [&](unsigned long long v) {
    return v != 0 && v != ~0ull ? static_cast<double>(static_cast<long long>(v - t0)) : -1.0;
  };
  for (int i = 0; i < m.trace_slots(); ++i) {
    KernelTrace k;
    k.kernel = kKernels[i % 5];
    k.layer = i / 5;
    for (int j = 0; j < kWords; ++j) k.marks[j] = rel(r[i][j]);
    for (const auto& [sm, words] : ctas[i]) {
      KernelTrace::Cta c;
      c.sm = sm;
      for (size_t j = 0; j < words.size(); ++j) c.ns[j] = rel(words[j]);
      k.ctas.push_back(c);
    }
    out.push_back(std::move(k));
  }
  return out;
}

Result<cuda::DeviceBuffer> CudaQwen3::allocate_kv_cache(int num_blocks) {
  if (num_blocks <= 0) return invalid_argument("allocate_kv_cache: num_blocks must be positive");
  return cuda::DeviceBuffer::allocate(*impl_->alloc, static_cast<size_t>(num_blocks) * impl_->layout().block_bytes(),
                                      cuda::DeviceMemoryTag::kKvCache);
}

Result<void> CudaQwen3::forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) {
  Impl& m = *impl_;
  SIESTA_TRY(validate_batch(m.cfg, batch, kv));
  SIESTA_TRY(m.check_cache(kv));
  SIESTA_CUDA_TRY(cudaSetDevice(m.opt.device), "selecting the CUDA device");
  const size_t V = m.cfg.vocab_size;
  out.vocab_size = static_cast<int>(V);
  out.first_row.assign(batch.size(), 0);
  out.num_rows.assign(batch.size(), 0);
  size_t total = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    out.first_row[s] = total;
    out.num_rows[s] = batch[s].all_logits ? batch[s].tokens.size() : 1;
    total += out.num_rows[s];
  }
  out.logits.resize(total * V);
  if (batch.empty()) return {};

  if (m.graph_eligible(batch)) {
    SIESTA_TRY(m.decode_step(batch, kv, {}, false));
    SIESTA_TRY(m.copy_logits_rows(0, static_cast<int>(batch.size()), out.logits.data()));
    SIESTA_CUDA_TRY(cudaStreamSynchronize(m.stream), "decode step");
    m.collect_profile();
    return {};
  }

  std::vector<size_t> cursor(out.first_row);  // next output row per sequence
  for (const auto& pass : cuda::split_into_passes(batch, {m.opt.max_batch_tokens, m.opt.max_seqs})) {
    SIESTA_ASSIGN_OR_RETURN(cuda::StepPlan plan, cuda::plan_pass(pass, 0, m.shape()));
    SIESTA_ASSIGN_OR_RETURN(PassDevice p, m.upload(plan, false, {}, kv));
    SIESTA_TRY(m.enqueue_layers(p));
    for (int r0 = 0; r0 < p.R; r0 += m.logits_rows_cap) {
      const int r1 = std::min(p.R, r0 + m.logits_rows_cap);
      SIESTA_TRY(m.enqueue_logits(p, r0, r1));
      // Copy each chunk's share of [r0, r1) to its sequence's output rows.
      for (size_t c = 0; c < pass.size(); ++c) {
        const int a = std::max<int>(r0, static_cast<int>(plan.first_row[c]));
        const int b = std::min<int>(r1, static_cast<int>(plan.first_row[c] + plan.num_rows[c]));
        if (a >= b) continue;
        const size_t host_row = cursor[pass[c].seq] + (a - plan.first_row[c]);
        SIESTA_TRY(m.copy_logits_rows(a - r0, b - a, out.logits.data() + host_row * V));
      }
    }
    for (size_t c = 0; c < pass.size(); ++c) cursor[pass[c].seq] += plan.num_rows[c];
  }
  SIESTA_CUDA_TRY(cudaStreamSynchronize(m.stream), "forward pass");
  m.collect_profile();
  return {};
}

Result<void> CudaQwen3::forward_sample(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                       std::span<const cuda::SamplingRow> rows, SampledTokens& out,
                                       bool copy_logits) {
  Impl& m = *impl_;
  if (rows.size() != batch.size())
    return invalid_argument("forward_sample: " + std::to_string(rows.size()) + " sampling rows for " +
                            std::to_string(batch.size()) + " sequences");
  SIESTA_TRY(validate_batch(m.cfg, batch, kv));
  SIESTA_TRY(m.check_cache(kv));
  SIESTA_CUDA_TRY(cudaSetDevice(m.opt.device), "selecting the CUDA device");
  const size_t V = m.cfg.vocab_size;
  out.tokens.assign(batch.size(), cuda::kSampleOnHostToken);
  out.has_logits = false;
  if (batch.empty()) return {};
  // One row of logits per sequence: its last.
  std::vector<SequenceChunk> last_only(batch.begin(), batch.end());
  for (SequenceChunk& c : last_only) c.all_logits = false;
  auto prepare_logits = [&] {
    out.has_logits = true;
    out.logits.vocab_size = static_cast<int>(V);
    out.logits.first_row.resize(batch.size());
    out.logits.num_rows.assign(batch.size(), 1);
    for (size_t s = 0; s < batch.size(); ++s) out.logits.first_row[s] = s;
    out.logits.logits.resize(batch.size() * V);
  };

  if (m.graph_eligible(last_only)) {
    SIESTA_TRY(m.decode_step(last_only, kv, rows, true));
    const int n = static_cast<int>(batch.size());
    SIESTA_CUDA_TRY(cudaStreamSynchronize(m.stream), "decode step");
    m.collect_profile();
    if (m.opt.time_graphs && m.graph_launched) {
      float ms = 0;
      SIESTA_CUDA_TRY(cudaEventElapsedTime(&ms, m.graph_events[0], m.graph_events[1]), "timing a decode graph");
      m.graph_ms_total += ms;
      ++m.graph_steps;
    }
    std::copy(m.host_sampled, m.host_sampled + n, out.tokens.begin());
    const bool fallback = std::find(out.tokens.begin(), out.tokens.end(), cuda::kSampleOnHostToken) != out.tokens.end();
    if (copy_logits || fallback) {
      prepare_logits();
      SIESTA_TRY(m.copy_logits_rows(0, n, out.logits.logits.data()));
      SIESTA_CUDA_TRY(cudaStreamSynchronize(m.stream), "copying logits to the host");
    }
    return {};
  }

  for (const auto& pass : cuda::split_into_passes(last_only, {m.opt.max_batch_tokens, m.opt.max_seqs})) {
    SIESTA_ASSIGN_OR_RETURN(cuda::StepPlan plan, cuda::plan_pass(pass, 0, m.shape()));
    std::vector<cuda::SamplingRow> pass_rows;
    std::vector<size_t> pass_seqs;  // the sequence of each logits row
    for (size_t c = 0; c < pass.size(); ++c)
      if (plan.num_rows[c] > 0) {
        pass_rows.push_back(rows[pass[c].seq]);
        pass_seqs.push_back(pass[c].seq);
      }
    SIESTA_ASSIGN_OR_RETURN(PassDevice p, m.upload(plan, true, pass_rows, kv));
    SIESTA_TRY(m.enqueue_layers(p));
    if (p.R == 0) continue;
    SIESTA_TRY(m.enqueue_logits(p, 0, p.R));  // R <= max_seqs <= logits_rows_cap
    SIESTA_CUDA_TRY(cuda::launch_sample_tokens(m.logits, p.R, m.cfg.vocab_size, p.sampling, p.banned, m.sampled,
                                               m.launch(), m.logits_argmax),
                    "token sampling");
    m.mark("sampling");
    SIESTA_CUDA_TRY(cudaStreamSynchronize(m.stream), "forward pass");
    m.collect_profile();
    bool fallback = false;
    for (int r = 0; r < p.R; ++r) {
      out.tokens[pass_seqs[r]] = m.host_sampled[r];
      fallback |= m.host_sampled[r] == cuda::kSampleOnHostToken;
    }
    if (copy_logits || fallback) {
      if (!out.has_logits) prepare_logits();
      for (int r = 0; r < p.R; ++r)
        SIESTA_TRY(m.copy_logits_rows(r, 1, out.logits.logits.data() + pass_seqs[r] * V));
      SIESTA_CUDA_TRY(cudaStreamSynchronize(m.stream), "copying logits to the host");
    }
  }
  return {};
}

Result<void> CudaQwen3::forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                       std::span<const TokenChoice> choices, std::vector<int32_t>& tokens,
                                       ForwardOutput& logits) {
  SampledTokens out;
  SIESTA_TRY(forward_sample(batch, kv, choices, out));
  tokens = std::move(out.tokens);
  if (out.has_logits) logits = std::move(out.logits);
  return {};
}

}  // namespace siesta
