#include "model/cuda/qwen3_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
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

#include "common/clock.h"
#include "common/log.h"
#include "model/cuda/activation_scratch.h"
#include "model/cuda/cublaslt_gemm.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/decode_graphs.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/ipc_weights.h"
#include "model/cuda/kernels.h"
#include "model/safetensors.h"

namespace siesta {

// step_plan.h mirrors kernels.h's device structs and constants without CUDA headers.
static_assert(sizeof(cuda::SamplingRecord) == sizeof(cuda::SamplingRowParams));
static_assert(offsetof(cuda::SamplingRecord, uniform) == offsetof(cuda::SamplingRowParams, uniform));
static_assert(offsetof(cuda::SamplingRecord, top_k) == offsetof(cuda::SamplingRowParams, top_k));
static_assert(offsetof(cuda::SamplingRecord, banned_end) == offsetof(cuda::SamplingRowParams, banned_end));
static_assert(cuda::kMaxBannedIdsPerRow == cuda::kMaxBannedPerRow);
static_assert(cuda::kKvBlockSizeForPlan == cuda::kKvBlockSize);
static_assert(kChooseOnHost == cuda::kSampleOnHost);
// The step image's sync words (zeroed by every upload): the LM head's argmax
// keys, two words per row, from word 16; the decode attention kernel's
// partition counters from word 32.
constexpr size_t kArgmaxSyncOffset = 16;
constexpr size_t kPartitionSyncOffset = 32;
static_assert(kArgmaxSyncOffset + 2 * cuda::kGemvMaxRows <= kPartitionSyncOffset);

namespace {

using cuda::bf16;
using cuda::DeviceWrite;
using cuda::HostWrite;
using cuda::WeightsLayout;
using cuda::WeightSlot;

constexpr size_t kGemmWorkspaceBytes = 32u << 20;
// Padded decode batch sizes: one graph per size (and per partition count).
constexpr int kGraphBatchSizes[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512};

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

}  // namespace

bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

// The model's state, by concern: its weights (DeviceWeights), the
// activation scratch a pass works in (ActivationScratch), the decode graph
// cache (DecodeGraphs) and what a benchmark records (Instrumentation); here
// the stream, the cuBLASLt plans and the kernel choices that join them into
// passes.
struct CudaQwen3::Impl {
  ModelConfig cfg;
  CudaModelOptions opt;
  // Set when the model owns its allocator: declared before the buffers, so
  // that it is destroyed after them.
  std::unique_ptr<cuda::DeviceAllocator> owned_alloc;
  cuda::DeviceAllocator* alloc = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t meta_uploaded = nullptr;

  cuda::DeviceWeights weights;
  cuda::ActivationScratch scratch;
  int partial_parts = 0;  // decode attention partitions per (sequence, head) the scratch holds
  cuda::DecodeGraphs graphs;
  bool graph_launched = false;  // the step in flight is a graph replay
  std::unique_ptr<cuda::Instrumentation> instr;

  std::unique_ptr<cuda::CublasLtGemm> gemm;
  // Passes of up to this many tokens take the GEMV for every projection: the
  // most rows whose staged inputs fit its shared memory at every projection's K
  // (kGemvMaxRows for the 0.6B and 1.7B shapes; 3 for the 8B, whose down
  // projection stages rows of 12288); 0 where not even one row fits.
  int gemv_rows = 0;
  // Decode steps of up to kStagedDecodeBatch sequences stage their partitions
  // (partition_tokens()), where the device's shared memory allows.
  bool staged_ok = false;
  int sm_count = 132;  // of the model's device, read at create

  ~Impl() {
    gemm.reset();
    if (meta_uploaded) cudaEventDestroy(meta_uploaded);
    if (stream) cudaStreamDestroy(stream);
  }

  int hidden() const { return cfg.hidden_size; }
  int qkv_cols() const { return cfg.q_dim() + 2 * cfg.kv_dim(); }
  float eps() const { return static_cast<float>(cfg.rms_norm_eps); }
  KvCacheLayout layout() const { return KvCacheLayout::for_model(cfg, sizeof(bf16)); }
  // Batch-invariant mode gives one-token chunks the prefill kernel's row
  // arithmetic, so a row's attention does not depend on how its prompt was
  // chunked: through launch_decode_attention_invariant (each decode row's whole
  // context in one CTA), or, with InstrumentationOptions::invariant_decode_as_prefill,
  // as 1-row tiles of the prefill kernel itself.
  cuda::StepShape shape() const {
    cuda::StepShape s{partition_tokens(), cuda::kPrefillTileRows};
    s.one_token_as_prefill = opt.batch_invariant && opt.instrumentation.invariant_decode_as_prefill;
    s.decode_whole_context = opt.batch_invariant && !opt.instrumentation.invariant_decode_as_prefill;
    return s;
  }
  // Decode attention's partition: the option where one is set, else 256
  // tokens. A decode step of up to kStagedDecodeBatch sequences stages its
  // partitions in shared memory and attends on tensor cores, 16 warps of 16
  // tokens (AttentionArgs::staged_partitions, where the device's shared memory
  // per block allows): its few CTAs would leave most SMs idle on the fp32
  // item (against 64-token partitions combined in a cluster:
  // bench/results/cuda_choices.md). The line is
  // the GEMV's (kGemvMaxRows), where results already change with the batch;
  // batch-invariant mode's decode attention takes no partitions and is not
  // affected.
  int partition_tokens() const {
    return opt.instrumentation.decode_partition_tokens > 0 ? opt.instrumentation.decode_partition_tokens
                                                           : cuda::kDecodePartitionTokens;
  }
  int parts_for(int partition) const { return (opt.max_model_len + partition - 1) / partition; }
  // Prefill attention's rows per warp for a pass of `items` work items
  // (InstrumentationOptions::prefill_warp_rows): 32 where its CTAs fill every
  // SM twice, 16 below (timings: bench/results/cuda_choices.md).
  int prefill_warp_rows(int items) const {
    if (opt.instrumentation.prefill_warp_rows != 0) return opt.instrumentation.prefill_warp_rows;
    if (opt.batch_invariant) return 32;
    const int heads_per_cta =
        cuda::prefill_heads_per_cta(cfg.num_heads, cfg.num_kv_heads, opt.instrumentation.prefill_heads_per_cta);
    const long ctas = static_cast<long>(items) * (cfg.num_heads / heads_per_cta);
    return ctas >= 2L * sm_count ? 32 : 16;
  }
  bool use_prefill_wgmma() const {
    return opt.instrumentation.prefill_wgmma &&
           cuda::prefill_wgmma_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
  }
  static constexpr int kStagedDecodeBatch = cuda::kGemvMaxRows;
  bool use_gemv(int T) const {
    const int rows = opt.instrumentation.gemv_max_rows < 0 ? gemv_rows
                                                           : std::min(opt.instrumentation.gemv_max_rows, gemv_rows);
    return T <= rows;
  }
  // Batch-invariant mode takes the canonical GEMV: the fixed GEMM's bits.
  cuda::GemvArgs gemv_args(cuda::GemvArgs g) const {
    g.canonical = opt.batch_invariant;
    return g;
  }
  cuda::LaunchConfig launch() const { return {stream, opt.programmatic_launch}; }

  Result<void> init_buffers();
  Result<void> check_cache(const KvCacheView& kv) const;
  // sampling_rows: sampling records in the image, choices[r] for record r
  // (greedy past choices.size()); 0: the pass samples nothing.
  Result<PassDevice> upload(const cuda::StepPlan& plan, size_t sampling_rows, std::span<const TokenChoice> choices,
                            const KvCacheView& kv);
  Result<void> linear(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K);
  Result<void> enqueue_layers(const PassDevice& p);
  static bool pure_decode(const PassDevice& p) { return p.D > 0 && p.D == p.T && p.W == 0; }
  cuda::AttentionArgs attention_args(const PassDevice& p) const;
  Result<void> enqueue_logits(const PassDevice& p, int r0, int r1);
  // Set by enqueue_logits: each logits row's first maximum (GemvArgs::argmax) when
  // its LM head GEMV computed every row, else null.
  const unsigned long long* logits_argmax = nullptr;
  Result<void> enqueue_step(const PassDevice& p, bool choose);
  Result<void> copy_logits_rows(int device_row, int rows, float* host);
  bool graph_eligible(std::span<const SequenceChunk> batch) const;
  Result<void> decode_step(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                           std::span<const TokenChoice> choices, bool choose);
  Result<void> choose_tokens(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                             std::span<const TokenChoice> choices, bool copy_logits, std::vector<int32_t>& tokens,
                             ForwardOutput& out);
};

Result<void> CudaQwen3::Impl::init_buffers() {
  partial_parts = parts_for(partition_tokens());
  cuda::ScratchSizes sizes;
  sizes.max_batch_tokens = opt.max_batch_tokens;
  sizes.max_seqs = opt.max_seqs;
  sizes.max_model_len = opt.max_model_len;
  sizes.partial_parts = partial_parts;
  sizes.trace_bytes = instr->trace_bytes();
  sizes.gemm_workspace_bytes = kGemmWorkspaceBytes;
  SIESTA_ASSIGN_OR_RETURN(scratch, cuda::ActivationScratch::allocate(cfg, sizes, *alloc));
  instr->bind_trace(scratch.trace);
  SIESTA_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating the model's CUDA stream");
  instr->set_stream(stream);
  SIESTA_CUDA_TRY(cudaEventCreateWithFlags(&meta_uploaded, cudaEventDisableTiming), "creating a CUDA event");
  SIESTA_CUDA_TRY(cudaEventRecord(meta_uploaded, stream), "recording a CUDA event");
  SIESTA_ASSIGN_OR_RETURN(gemm, cuda::CublasLtGemm::create(scratch.gemm_ws, kGemmWorkspaceBytes));
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

Result<PassDevice> CudaQwen3::Impl::upload(const cuda::StepPlan& plan, size_t sampling_rows,
                                           std::span<const TokenChoice> choices, const KvCacheView& kv) {
  if (plan.max_kv_len > opt.max_model_len)
    return invalid_argument("forward: a sequence reaches " + std::to_string(plan.max_kv_len) +
                            " positions, past max_model_len " + std::to_string(opt.max_model_len));
  const cuda::StepLayout L = cuda::step_layout(plan, sampling_rows);
  if (L.end > scratch.meta_capacity) return internal_error("forward: step metadata larger than its buffer");
  SIESTA_ASSIGN_OR_RETURN(std::vector<std::byte> image, cuda::pack_step(plan, L, choices));
  // The previous upload must have left the pinned buffer before it is rewritten.
  SIESTA_CUDA_TRY(cudaEventSynchronize(meta_uploaded), "waiting for the previous metadata upload");
  std::memcpy(scratch.host_meta, image.data(), image.size());
  instr->mark("start");
  SIESTA_CUDA_TRY(cudaMemcpyAsync(scratch.meta, scratch.host_meta, image.size(), cudaMemcpyHostToDevice, stream),
                  "uploading step metadata");
  instr->mark("upload");
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
  auto at = [&](size_t off) { return reinterpret_cast<const int32_t*>(scratch.meta + off); };
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
  p.sampling = reinterpret_cast<const cuda::SamplingRowParams*>(scratch.meta + L.sampling);
  p.banned = at(L.banned);
  p.sync = reinterpret_cast<uint32_t*>(scratch.meta + L.sync);
  p.kv = {static_cast<bf16*>(kv.base), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim};
  return p;
}

Result<void> CudaQwen3::Impl::linear(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K) {
  if (opt.batch_invariant)
    return cuda::cuda_result(cuda::launch_fixed_gemm(a, w, out, out_f32, M, N, K, launch(),
                                                     {.workspace = scratch.gemm_ws,
                                                      .workspace_bytes = kGemmWorkspaceBytes,
                                                      .kernel = opt.instrumentation.fixed_gemm_kernel}),
                             "fixed-order GEMM");
  return gemm->run(a, w, out, out_f32, M, N, K, stream);
}

// Everything attention reads about pass p. A pure decode pass also gets the
// q/k norm + RoPE inputs: its decode attention does that
// work and the KV write itself (per layer: q_norm, k_norm, layer).
cuda::AttentionArgs CudaQwen3::Impl::attention_args(const PassDevice& p) const {
  cuda::AttentionArgs aa;
  aa.q = scratch.q;
  aa.out = scratch.attn;
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
  aa.partial_out = scratch.partial_out;
  aa.partial_ml = scratch.partial_ml;
  aa.partial_parts = p.partial_parts;
  aa.partition_tokens = p.partition_tokens;
  // Decode partitions combined by their last CTA, on counters in the step image's
  // sync words (zeroed by every upload).
  if (static_cast<size_t>(p.D) * cfg.num_kv_heads <= cuda::kStepSyncWords - kPartitionSyncOffset)
    aa.partition_done = p.sync + kPartitionSyncOffset;
  aa.cluster_partitions = true;  // contexts of 2 to 8 partitions (kernels.h)
  aa.staged_partitions = staged_ok && p.D <= kStagedDecodeBatch;  // partition_tokens()
  aa.prefill_items = p.prefill_items;
  aa.prefill_heads_per_cta = opt.instrumentation.prefill_heads_per_cta;
  aa.prefill_warp_rows = prefill_warp_rows(p.W);
  if (pure_decode(p)) {
    aa.qkv = scratch.qkv;
    aa.positions = p.positions;
    aa.slots = p.slots;
    aa.rope_table = weights.rope_table;
    aa.eps = eps();
  }
  return aa;
}

Result<void> CudaQwen3::Impl::enqueue_layers(const PassDevice& p) {
  const int T = p.T, H = hidden(), QD = cfg.q_dim(), I = cfg.intermediate_size;
  const bool small = use_gemv(T);
  // The first kernel of a pass follows the metadata copy, not a kernel: no overlap.
  SIESTA_CUDA_TRY(cuda::launch_embed(p.tokens, T, weights.embed, H, scratch.x, stream), "embedding");
  instr->mark("embed");

  cuda::AttentionArgs aa = attention_args(p);
  // A pure decode pass: decode attention does q/k norm + RoPE and the KV write
  // itself, one launch fewer per layer, same bits (in batch-invariant mode too).
  // (The partitions are combined there too, not in the O projection's GEMV
  // staging, where every CTA would repeat the combination:
  // bench/results/cuda_choices.md.)
  const bool decode_only = pure_decode(p);
  const bool traced = small && instr->tracing();
  if (traced) SIESTA_TRY(instr->clear_trace());
  auto trace_slot = [&](int slot) { return traced ? instr->trace_slot(slot) : nullptr; };

  for (int l = 0; l < cfg.num_layers; ++l) {
    const cuda::LayerWeights& w = weights.layers[l];
    if (small) {
      cuda::GemvArgs g{scratch.x, w.input_norm, eps(), w.qkv, T, qkv_cols(), H, cuda::GemvInput::kRmsNorm,
                       cuda::GemvOutput::kBf16, scratch.qkv};
      g.trace = trace_slot(5 * l);
      SIESTA_CUDA_TRY(cuda::launch_gemv(gemv_args(g), launch()), "QKV projection (GEMV)");
      instr->mark("qkv_gemv");
    } else {
      SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(scratch.x, l == 0 ? nullptr : scratch.proj, w.input_norm, T, H, eps(),
                                                nullptr, scratch.h, launch()),
                      "input RMSNorm");
      instr->mark("norm");
      SIESTA_TRY(linear(scratch.h, w.qkv, scratch.qkv, false, T, qkv_cols(), H));
      instr->mark("qkv");
    }
    if (!decode_only) {
      SIESTA_CUDA_TRY(cuda::launch_qk_norm_rope_kv(scratch.qkv, T, p.positions, p.slots, w.q_norm, w.k_norm,
                                                   weights.rope_table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                   eps(), scratch.q, p.kv, l, launch()),
                      "q/k norm, RoPE and KV write");
      instr->mark("rope_kv");
    }
    aa.layer = l;
    aa.q_norm = w.q_norm;
    aa.k_norm = w.k_norm;
    aa.trace = trace_slot(5 * l + 1);
    if (opt.batch_invariant) {
      // Each row as the pass's prefill kernel computes it (kernels.h).
      SIESTA_CUDA_TRY(cuda::launch_decode_attention_invariant(aa, p.D, use_prefill_wgmma(), launch(),
                                                              opt.instrumentation.invariant_decode_warps),
                      "decode attention (batch-invariant)");
      if (p.D > 0) instr->mark("attention_decode_invariant");
    } else {
      SIESTA_CUDA_TRY(cuda::launch_decode_attention(aa, p.D, p.max_partitions, launch()), "decode attention");
      if (p.D > 0) instr->mark("attention_decode");
    }
    if (use_prefill_wgmma()) {
      SIESTA_CUDA_TRY(cuda::launch_prefill_attention_wgmma(aa, p.W, launch()), "prefill attention (wgmma)");
    } else {
      SIESTA_CUDA_TRY(cuda::launch_prefill_attention(aa, p.W, launch()), "prefill attention");
    }
    if (p.W > 0) instr->mark("attention_prefill");
    if (small) {
      cuda::GemvArgs o{scratch.attn, nullptr, 0.0f, w.o, T, H, QD, cuda::GemvInput::kPlain, cuda::GemvOutput::kAddBf16,
                       scratch.x};
      o.trace = trace_slot(5 * l + 2);
      SIESTA_CUDA_TRY(cuda::launch_gemv(gemv_args(o), launch()), "output projection (GEMV)");
      instr->mark("o_gemv");
      // The SiLU-mul: in the gate/up GEMV's epilogue (act = bf16(bf16(silu(g)) * u),
      // once per value), or at one row in every down CTA's staging, which measured
      // faster there (bench/results/cuda_choices.md). The same bits either way.
      const bool silu_in_gate_up = T > 1;
      bf16* const mlp = silu_in_gate_up ? scratch.act : scratch.gu;  // gate/up's output, the down projection's input
      cuda::GemvArgs gup{scratch.x, w.post_norm, eps(), w.gate_up, T, 2 * I, H, cuda::GemvInput::kRmsNorm,
                         silu_in_gate_up ? cuda::GemvOutput::kSiluMul : cuda::GemvOutput::kBf16, mlp};
      gup.trace = trace_slot(5 * l + 3);
      SIESTA_CUDA_TRY(cuda::launch_gemv(gemv_args(gup), launch()), "gate/up projection (GEMV)");
      instr->mark("gate_up_gemv");
      cuda::GemvArgs down{mlp, nullptr, 0.0f, w.down, T, H, I,
                          silu_in_gate_up ? cuda::GemvInput::kPlain : cuda::GemvInput::kSiluMul,
                          cuda::GemvOutput::kAddBf16, scratch.x};
      down.trace = trace_slot(5 * l + 4);
      SIESTA_CUDA_TRY(cuda::launch_gemv(gemv_args(down), launch()), "down projection (GEMV)");
      instr->mark("down_gemv");
    } else {
      SIESTA_TRY(linear(scratch.attn, w.o, scratch.proj, false, T, H, QD));
      instr->mark("o_proj");
      SIESTA_CUDA_TRY(
          cuda::launch_add_rms_norm(scratch.x, scratch.proj, w.post_norm, T, H, eps(), nullptr, scratch.h, launch()),
          "post-attention RMSNorm");
      instr->mark("norm");
      SIESTA_TRY(linear(scratch.h, w.gate_up, scratch.gu, false, T, 2 * I, H));
      instr->mark("gate_up");
      SIESTA_CUDA_TRY(cuda::launch_silu_mul(scratch.gu, T, I, scratch.act, launch()), "SiLU-mul");
      instr->mark("silu_mul");
      SIESTA_TRY(linear(scratch.act, w.down, scratch.proj, false, T, H, I));
      instr->mark("down");
    }
  }
  return {};
}

// Logits of rows [r0, r1) of the pass's logits rows into scratch.logits (row 0 = r0).
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
      cuda::GemvArgs g{scratch.x, weights.final_norm, eps(), weights.lm_head, rows, V, H, cuda::GemvInput::kRmsNorm,
                       cuda::GemvOutput::kLogits, scratch.logits, keys};
      SIESTA_CUDA_TRY(cuda::launch_gemv(gemv_args(g), launch()), "LM head (GEMV)");
      instr->mark("lm_head_gemv");
      return {};
    }
    SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(scratch.x, nullptr, weights.final_norm, rows, H, eps(),
                                              p.logits_rows + r0, scratch.hn, launch()),
                    "final RMSNorm");
    cuda::GemvArgs g{scratch.hn, nullptr, 0.0f, weights.lm_head, rows, V, H, cuda::GemvInput::kPlain,
                     cuda::GemvOutput::kLogits, scratch.logits, keys};
    return cuda::cuda_result(cuda::launch_gemv(gemv_args(g), launch()), "LM head (GEMV)");
  }
  // The last layer's down projection is still in proj: add it for these rows only.
  SIESTA_CUDA_TRY(cuda::launch_add_rms_norm(scratch.x, scratch.proj, weights.final_norm, rows, H, eps(),
                                            p.logits_rows + r0, scratch.hn, launch()),
                  "final RMSNorm");
  instr->mark("final_norm");
  SIESTA_TRY(linear(scratch.hn, weights.lm_head, scratch.logits, true, rows, V, H));
  instr->mark("lm_head");
  if (opt.batch_invariant) return {};  // the fixed GEMM rounds as it stores
  SIESTA_CUDA_TRY(cuda::launch_round_to_bf16(scratch.logits, static_cast<size_t>(rows) * V, launch()),
                  "rounding logits");
  instr->mark("round_logits");
  return {};
}

Result<void> CudaQwen3::Impl::enqueue_step(const PassDevice& p, bool choose) {
  SIESTA_TRY(enqueue_layers(p));
  SIESTA_TRY(enqueue_logits(p, 0, p.R));
  if (choose) {
    SIESTA_CUDA_TRY(cuda::launch_sample_tokens(scratch.logits, p.R, cfg.vocab_size, p.sampling, p.banned,
                                               scratch.chosen, launch(), logits_argmax),
                    "token sampling");
    instr->mark("sampling");
  }
  return {};
}

Result<void> CudaQwen3::Impl::copy_logits_rows(int device_row, int rows, float* host) {
  if (rows <= 0) return {};
  const size_t V = cfg.vocab_size;
  return cuda::cuda_result(cudaMemcpyAsync(host, scratch.logits + static_cast<size_t>(device_row) * V,
                                           rows * V * sizeof(float), cudaMemcpyDeviceToHost, stream),
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

// One decode step (every sequence one token) through a CUDA graph captured for
// its padded batch size and partition count. The first step of a shape runs
// eagerly (which also sets kernel attributes and cuBLASLt plans), then the
// same launches are captured for the next steps.
Result<void> CudaQwen3::Impl::decode_step(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                          std::span<const TokenChoice> choices, bool choose) {
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
  SIESTA_ASSIGN_OR_RETURN(PassDevice p, upload(plan, choose ? plan.logits_rows.size() : 0, choices, kv));

  const cuda::GraphKey key{padded, parts, choose, kv.base};
  graph_launched = false;
  if (cudaGraphExec_t exec = graphs.find(key)) {
    SIESTA_CUDA_TRY(cudaGraphLaunch(exec, stream), "launching a decode graph");
    graph_launched = true;
    return {};
  }
  SIESTA_TRY(enqueue_step(p, choose));  // this step's result
  // Capture the same launches for the next steps of this shape. A capture
  // that fails costs speed, not correctness: graphs are switched off.
  Result<void> captured = cuda::cuda_result(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                                            "beginning graph capture");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (captured) {
    // With time_graphs, event nodes open and close the graph (Instrumentation).
    captured = instr->open_graph();
    if (captured) captured = enqueue_step(p, choose);
    if (captured) captured = instr->close_graph();
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
  graphs.add(key, exec);
  SIESTA_LOG_DEBUG("cuda: captured decode graph for {} sequences, {} partitions{}", padded, parts,
                   choose ? ", choosing tokens" : "");
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
  if (options.instrumentation.decode_partition_tokens != 0 &&
      !cuda::decode_partition_supported(options.instrumentation.decode_partition_tokens))
    return invalid_argument("CUDA model: decode_partition_tokens " +
                            std::to_string(options.instrumentation.decode_partition_tokens) +
                            " is not compiled (64, 128 or 256)");
  if (options.instrumentation.prefill_warp_rows != 0 &&
      !cuda::prefill_warp_rows_supported(options.instrumentation.prefill_warp_rows))
    return invalid_argument("CUDA model: prefill_warp_rows " +
                            std::to_string(options.instrumentation.prefill_warp_rows) +
                            " is not compiled (16 or 32; 0 chooses)");
  if (options.instrumentation.invariant_decode_warps != 0 && options.instrumentation.invariant_decode_warps != 4 &&
      options.instrumentation.invariant_decode_warps != 8)
    return invalid_argument("CUDA model: invariant_decode_warps " +
                            std::to_string(options.instrumentation.invariant_decode_warps) +
                            " is not compiled (4 or 8; 0 chooses)");
  if (options.instrumentation.fixed_gemm_kernel < 0 || options.instrumentation.fixed_gemm_kernel > 4)
    return invalid_argument("CUDA model: fixed_gemm_kernel " +
                            std::to_string(options.instrumentation.fixed_gemm_kernel) +
                            " is not a kernel (0 chooses; 1 to 4)");

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
  if (impl->opt.instrumentation.profile) impl->opt.cuda_graphs = false;  // events between launches
  impl->instr = std::make_unique<cuda::Instrumentation>(options.instrumentation, cfg.num_layers);
  if (options.instrumentation.trace && !cuda::kTraceCompiled)
    return invalid_argument("CUDA model: trace needs a build with -DSIESTA_CUDA_TRACE=ON (its kernels carry the marks)");
  if (impl->opt.max_model_len <= 0)
    impl->opt.max_model_len = std::min(cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768, 32768);
  impl->staged_ok = cuda::decode_staged_partitions_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
  for (int rows = 1; rows <= cuda::kGemvMaxRows; ++rows)
    if (cuda::gemv_supported(rows, H) && cuda::gemv_supported(rows, cfg.q_dim()) && cuda::gemv_supported(rows, I))
      impl->gemv_rows = rows;
    else
      break;
  if (options.batch_invariant &&
      !(cuda::fixed_gemm_supported(impl->qkv_cols(), H) && cuda::fixed_gemm_supported(cfg.vocab_size, H)))
    return invalid_argument("CUDA model: batch-invariant mode needs vocab_size and q/k/v widths divisible by 8");
  SIESTA_ASSIGN_OR_RETURN(impl->weights,
                          cuda::DeviceWeights::load(cfg, impl->opt.max_model_len, store, allocator, options.device));
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

// A checked update of the CUDA model: host tensors (a checkpoint's files,
// shared memory) or device tensors (CUDA IPC), and the sources they point
// into, open until the object goes.
class CudaWeightWrite final : public PreparedWeightUpdate {
 public:
  explicit CudaWeightWrite(CudaQwen3::Impl& m) : m_(m) {}

  Result<WeightUpdateReport> apply() override;

  WeightUpdateReport report;
  std::vector<HostWrite> host;
  std::vector<DeviceWrite> device;
  std::optional<TensorStore> store;
  std::optional<SharedWeightFile> file;
  std::optional<cuda::IpcWeightBuffers> ipc;

 private:
  CudaQwen3::Impl& m_;
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
  SIESTA_TRY(written(m_.weights.write_host(host)));
  SIESTA_TRY(written(m_.weights.write_device(device, m_.stream)));
  // The RoPE table lives with the weights: after a sleep that released them it is zero too.
  SIESTA_TRY(written(m_.weights.write_rope()));
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
  const WeightsLayout& L = m.weights.layout();
  std::map<std::string, size_t> offset_of;
  for (const WeightSlot& slot : L.slots) offset_of.emplace(slot.name, slot.offset);
  const std::vector<TensorSpec> specs = updatable_tensors(m.cfg);
  auto w = std::make_unique<CudaWeightWrite>(m);
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
      auto views = cuda::checked_tensors(L, *store);
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
cuda::Instrumentation& CudaQwen3::instrumentation() { return *impl_->instr; }
const cuda::Instrumentation& CudaQwen3::instrumentation() const { return *impl_->instr; }

Result<cuda::DeviceBuffer> CudaQwen3::allocate_kv_cache(int num_blocks) {
  if (num_blocks <= 0) return invalid_argument("allocate_kv_cache: num_blocks must be positive");
  return cuda::DeviceBuffer::allocate(*impl_->alloc, static_cast<size_t>(num_blocks) * impl_->layout().block_bytes(),
                                      cuda::DeviceMemoryTag::kKvCache);
}

Result<void> CudaQwen3::warm_up(int prompt_tokens) {
  Impl& m = *impl_;
  const int n = std::max(1, std::min({prompt_tokens, m.opt.max_batch_tokens, m.opt.max_model_len - 1}));
  const int blocks = (n + 1 + cuda::kKvBlockSize - 1) / cuda::kKvBlockSize;
  SIESTA_ASSIGN_OR_RETURN(cuda::DeviceBuffer kv_buf, allocate_kv_cache(blocks));
  const KvCacheView kv{kv_buf.data(), blocks, kv_layout()};
  std::vector<int32_t> table(blocks), tokens(n);
  std::iota(table.begin(), table.end(), 0);
  for (int i = 0; i < n; ++i) tokens[i] = i % m.cfg.vocab_size;
  const TokenChoice greedy;
  ChosenTokens out;
  // A prompt of n tokens, a short one (another GEMM shape), then one decode step
  // of the first (eager: a decode graph is captured on a batch size's second step).
  for (const int len : {n, std::min(n, 16)}) {
    const SequenceChunk chunk{std::span<const int32_t>(tokens.data(), static_cast<size_t>(len)), 0, table, false};
    SIESTA_TRY(forward_choose(std::span<const SequenceChunk>(&chunk, 1), kv, std::span<const TokenChoice>(&greedy, 1),
                              out));
  }
  const int32_t next = out.tokens.empty() || out.tokens[0] < 0 ? 0 : out.tokens[0];
  const SequenceChunk step{std::span<const int32_t>(&next, 1), std::min(n, 16), table, false};
  return forward_choose(std::span<const SequenceChunk>(&step, 1), kv, std::span<const TokenChoice>(&greedy, 1), out);
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
    m.instr->collect_profile();
    return {};
  }

  std::vector<size_t> cursor(out.first_row);  // next output row per sequence
  for (const auto& pass : cuda::split_into_passes(batch, {m.opt.max_batch_tokens, m.opt.max_seqs})) {
    SIESTA_ASSIGN_OR_RETURN(cuda::StepPlan plan, cuda::plan_pass(pass, 0, m.shape()));
    SIESTA_ASSIGN_OR_RETURN(PassDevice p, m.upload(plan, 0, {}, kv));
    SIESTA_TRY(m.enqueue_layers(p));
    for (int r0 = 0; r0 < p.R; r0 += m.scratch.logits_rows_cap) {
      const int r1 = std::min(p.R, r0 + m.scratch.logits_rows_cap);
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
  m.instr->collect_profile();
  return {};
}

// forward_choose for both of its forms. The rows known up front (the host's
// sequences, and every sequence's last row with copy_logits) are laid out in
// `out` before the passes, in sequence order; a row the device could not
// decide is appended once its window has synchronised, since `out.logits`
// may only grow while no copy into it is in flight.
Result<void> CudaQwen3::Impl::choose_tokens(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                            std::span<const TokenChoice> choices, bool copy_logits,
                                            std::vector<int32_t>& tokens, ForwardOutput& out) {
  if (choices.size() != batch.size())
    return invalid_argument("forward_choose: " + std::to_string(choices.size()) + " token choices for " +
                            std::to_string(batch.size()) + " sequences");
  SIESTA_TRY(validate_batch(cfg, batch, kv));
  SIESTA_TRY(check_cache(kv));
  SIESTA_CUDA_TRY(cudaSetDevice(opt.device), "selecting the CUDA device");
  const size_t n = batch.size(), V = cfg.vocab_size;
  tokens.assign(n, kChooseOnHost);
  out.vocab_size = static_cast<int>(V);
  out.first_row.assign(n, 0);
  out.num_rows.assign(n, 0);
  size_t host_rows = 0;
  auto bring_back = [&](size_t s, size_t rows) {
    out.first_row[s] = host_rows;
    out.num_rows[s] = rows;
    host_rows += rows;
  };
  std::vector<bool> planned(n, false);  // rows laid out before the pass
  for (size_t s = 0; s < n; ++s) {
    if (choices[s].on_host) {
      bring_back(s, batch[s].all_logits ? batch[s].tokens.size() : 1);
    } else if (copy_logits) {
      bring_back(s, 1);
    }
    planned[s] = out.num_rows[s] > 0;
  }
  out.logits.resize(host_rows * V);
  if (n == 0) return {};

  if (graph_eligible(batch)) {
    // Every sequence has one row: the graph samples them all, the host's
    // sequences greedily (their tokens are dropped), and only the rows that
    // come back are copied, consecutive ones in one copy.
    std::vector<TokenChoice> rows(choices.begin(), choices.end());
    for (TokenChoice& c : rows)
      if (c.on_host) c = TokenChoice{};
    SIESTA_TRY(decode_step(batch, kv, rows, true));
    SIESTA_CUDA_TRY(cudaStreamSynchronize(stream), "decode step");
    instr->collect_profile();
    if (graph_launched) SIESTA_TRY(instr->time_graph_replay());
    for (size_t s = 0; s < n; ++s) {
      if (choices[s].on_host) continue;
      tokens[s] = scratch.host_chosen[s];
      if (tokens[s] == kChooseOnHost && !planned[s]) bring_back(s, 1);
    }
    out.logits.resize(host_rows * V);
    for (size_t s = 0; s < n;) {
      if (out.num_rows[s] == 0) {
        ++s;
        continue;
      }
      size_t e = s + 1;
      while (e < n && out.num_rows[e] == 1 && out.first_row[e] == out.first_row[e - 1] + 1) ++e;
      SIESTA_TRY(
          copy_logits_rows(static_cast<int>(s), static_cast<int>(e - s), out.logits.data() + out.first_row[s] * V));
      s = e;
    }
    if (host_rows > 0) SIESTA_CUDA_TRY(cudaStreamSynchronize(stream), "copying logits to the host");
    return {};
  }

  // Passes: a sequence the host chooses keeps all_logits; the others give
  // their last row, which the device samples.
  std::vector<SequenceChunk> chunks(batch.begin(), batch.end());
  for (size_t s = 0; s < n; ++s) chunks[s].all_logits = batch[s].all_logits && choices[s].on_host;
  std::vector<size_t> cursor(out.first_row);  // next host row per sequence
  for (const auto& pass : cuda::split_into_passes(chunks, {opt.max_batch_tokens, opt.max_seqs})) {
    SIESTA_ASSIGN_OR_RETURN(cuda::StepPlan plan, cuda::plan_pass(pass, 0, shape()));
    // The device's rows, in logits-row order: record k samples row sampled_row[k].
    std::vector<TokenChoice> sampled;
    std::vector<int> sampled_row;
    std::vector<size_t> sampled_seq;
    for (size_t c = 0; c < pass.size(); ++c)
      if (plan.num_rows[c] > 0 && !choices[pass[c].seq].on_host) {
        sampled.push_back(choices[pass[c].seq]);
        sampled_row.push_back(static_cast<int>(plan.first_row[c]));
        sampled_seq.push_back(pass[c].seq);
      }
    SIESTA_ASSIGN_OR_RETURN(PassDevice p, upload(plan, sampled.size(), sampled, kv));
    SIESTA_TRY(enqueue_layers(p));
    size_t k0 = 0;
    // The logits in windows of the scratch's rows (all_logits chunks can
    // have more rows than one window holds).
    for (int r0 = 0; r0 < p.R; r0 += scratch.logits_rows_cap) {
      const int r1 = std::min(p.R, r0 + scratch.logits_rows_cap);
      SIESTA_TRY(enqueue_logits(p, r0, r1));
      size_t k1 = k0;
      while (k1 < sampled.size() && sampled_row[k1] < r1) ++k1;
      // One sampling launch per run of consecutive device rows.
      for (size_t a = k0; a < k1;) {
        size_t b = a + 1;
        while (b < k1 && sampled_row[b] == sampled_row[b - 1] + 1) ++b;
        const int row = sampled_row[a];
        SIESTA_CUDA_TRY(
            cuda::launch_sample_tokens(scratch.logits + static_cast<size_t>(row - r0) * V, static_cast<int>(b - a),
                                       cfg.vocab_size, p.sampling + a, p.banned, scratch.chosen + a, launch(),
                                       logits_argmax ? logits_argmax + row : nullptr),
            "token sampling");
        a = b;
      }
      if (k1 > k0) instr->mark("sampling");
      // This window's share of the rows laid out before the pass.
      for (size_t c = 0; c < pass.size(); ++c) {
        const size_t seq = pass[c].seq;
        if (!planned[seq]) continue;
        const int a = std::max<int>(r0, static_cast<int>(plan.first_row[c]));
        const int b = std::min<int>(r1, static_cast<int>(plan.first_row[c] + plan.num_rows[c]));
        if (a >= b) continue;
        const size_t host_row = cursor[seq] + (a - plan.first_row[c]);
        SIESTA_TRY(copy_logits_rows(a - r0, b - a, out.logits.data() + host_row * V));
      }
      if (k1 > k0) {
        // The window's tokens; a row the device could not decide comes back
        // while its logits are still in the scratch.
        SIESTA_CUDA_TRY(cudaStreamSynchronize(stream), "forward pass");
        std::vector<size_t> undecided;
        for (size_t k = k0; k < k1; ++k) {
          tokens[sampled_seq[k]] = scratch.host_chosen[k];
          if (scratch.host_chosen[k] == kChooseOnHost && !planned[sampled_seq[k]]) undecided.push_back(k);
        }
        if (!undecided.empty()) {
          for (size_t k : undecided) bring_back(sampled_seq[k], 1);
          out.logits.resize(host_rows * V);  // nothing in flight
          for (size_t k : undecided)
            SIESTA_TRY(copy_logits_rows(sampled_row[k] - r0, 1, out.logits.data() + out.first_row[sampled_seq[k]] * V));
        }
      }
      k0 = k1;
    }
    for (size_t c = 0; c < pass.size(); ++c) cursor[pass[c].seq] += plan.num_rows[c];
  }
  SIESTA_CUDA_TRY(cudaStreamSynchronize(stream), "forward pass");
  instr->collect_profile();
  return {};
}

Result<void> CudaQwen3::forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                       std::span<const TokenChoice> choices, ChosenTokens& out, bool copy_logits) {
  SIESTA_TRY(impl_->choose_tokens(batch, kv, choices, copy_logits, out.tokens, out.logits));
  out.has_logits = !out.logits.logits.empty();
  return {};
}

Result<void> CudaQwen3::forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                                       std::span<const TokenChoice> choices, std::vector<int32_t>& tokens,
                                       ForwardOutput& logits) {
  return impl_->choose_tokens(batch, kv, choices, false, tokens, logits);
}

}  // namespace siesta
