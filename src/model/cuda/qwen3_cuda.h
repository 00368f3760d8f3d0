// CudaQwen3: Qwen3 in bf16 on one CUDA GPU, an implementation of Model.
//
//   cuda::CudaMallocAllocator alloc;                       // or cuda::PoolDeviceAllocator(pool)
//   SIESTA_ASSIGN_OR_RETURN(auto model, CudaQwen3::load(model_dir, alloc, options));
//   // or CudaQwen3::load(model_dir, std::make_unique<cuda::PoolDeviceAllocator>(pool), options):
//   // the model owns the allocator (the engine's way)
//   SIESTA_ASSIGN_OR_RETURN(cuda::DeviceBuffer kv, model->allocate_kv_cache(num_blocks));
//   KvCacheView view{kv.data(), num_blocks, model->kv_layout()};   // bf16, elem_bytes 2
//   model->forward(batch, view, out);                      // logits on the host (fp32 holding bf16 values)
//   model->forward_sample(batch, view, rows, sampled);     // tokens chosen on the GPU
//
// Weights and activations are bf16 with fp32 accumulation, rounded where
// Hugging Face's bf16 model rounds (kernels.h) — the logits too: its LM head
// outputs bf16, so equal bf16 logits tie there and here alike (lowest id wins). Projections go through
// cuBLASLt, or through a tensor-core GEMV for batches of up to 8 tokens (with
// the preceding norm or SiLU-mul and the residual add folded in), or — with
// options.batch_invariant — through a fixed-order tensor-core GEMM whose
// per-row arithmetic does not depend on the batch (nor does anything else:
// then a request's logits, tokens and KV are bit-identical whatever it is
// batched with AND however its prompt is cut into chunks — one chunk, n-1
// tokens then 1 as a P/D decode engine computes it, or any other cut — since
// every query row, decode steps included, takes the prefill attention
// kernel's per-row arithmetic; README.md says why and what it costs).
//
// Every device byte comes from the DeviceAllocator given at load, tagged
// weights / kv_cache / scratch, and is held at a fixed address for the
// model's life: decode steps (every sequence with one new token) replay CUDA
// graphs captured per padded batch size, which bake those addresses in.
//
// Sleep (with cuda::PoolDeviceAllocator): the pool may release and re-map the
// weights and the scratch underneath the model between calls, at the same
// addresses; the graphs and the cuBLASLt plans stay valid (nothing is
// re-captured). Weights woken after a release hold zeros until
// reload_weights writes a checkpoint into them again (the RoPE table, which
// lives with the weights, is recomputed then). Scratch holds nothing from one
// call to the next, so it may come back zero-filled. While released, the
// model must not be called.
//
// A batch larger than options.max_batch_tokens or options.max_seqs is run as
// several passes (long prompts in chunks); the result is the same call.
// Thread safety: one thread at a time (the engine loop).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/cuda/device_allocator.h"
#include "model/cuda/step_plan.h"
#include "model/forward.h"
#include "model/weight_update.h"

namespace siesta {

class TensorStore;

struct CudaModelOptions {
  int device = 0;
  int max_batch_tokens = 8192;  // tokens per pass: sizes the activation buffers
  int max_seqs = 256;           // sequences per pass
  int max_model_len = 0;        // longest context; 0: min(config max_position_embeddings, 32768)
  bool batch_invariant = false;
  bool cuda_graphs = true;
  int max_graph_batch = 256;    // decode steps of up to this many sequences replay graphs
  // Let each kernel start while its predecessor finishes (programmatic
  // dependent launch, sm_90; kernels.h: LaunchConfig). Same results either way.
  bool programmatic_launch = true;
  // Query heads per prefill attention CTA (kernels.h); 0 = the default. For benchmarks.
  int prefill_heads_per_cta = 0;
  // Query rows per prefill attention warp (kernels.h): 32 (K/V fragments feed two MMAs; faster
  // where the pass has CTAs to fill the GPU twice over) or 16 (twice the warps per CTA; faster for
  // short prompts). 0: 32 in batch-invariant mode (one kernel for every pass, since the two
  // differ by rounding at head_dim 128), else chosen per pass by its CTA count.
  int prefill_warp_rows = 0;
  // Prefill attention on Hopper's warpgroup MMA (kernels.h: launch_prefill_attention_wgmma)
  // where the build and the shape allow it (sm_90a, head_dim 128), for every pass (in
  // batch-invariant mode too: a row's result does not depend on its tile there either);
  // false: the mma.sync kernel (prefill_warp_rows). The two differ by rounding. For benchmarks.
  bool prefill_wgmma = true;
  // Decode attention partition (kernels.h: 64, 128 or 256 tokens) for every pass; 0: 256 tokens
  // (staged in shared memory, on tensor cores, for passes of up to 8 decode sequences).
  int decode_partition_tokens = 0;
  // Passes of up to this many tokens take the GEMV kernel (kernels.h: launch_gemv, at most
  // kGemvMaxRows) for their projections instead of cuBLASLt; -1: kGemvMaxRows. Results differ
  // between the two by rounding. For benchmarks.
  int gemv_max_rows = -1;
  // Time each kernel group with CUDA events between eager launches (no graphs);
  // read with CudaQwen3::profile(). For finding where time goes, not for speed.
  bool profile = false;
  // Record the timeline of each decode GEMV and decode attention launch of
  // the small-batch path (kernels.h: kTraceCtas), overwritten by every such
  // pass; read with CudaQwen3::trace(). Graphs and programmatic launch stay on:
  // this shows how the dependent kernels of a step overlap. A few stores per
  // warp, and a memset of ~12 MB per pass (0.6B shape). Needs a build with the
  // CMake option SIESTA_CUDA_TRACE (load fails otherwise), whose kernels carry
  // the marks; in other builds they are not compiled.
  bool trace = false;
  // Capture each decode graph between two CUDA event nodes, and keep the mean
  // time between them over forward_sample's graph replays (graph_step_ms):
  // the GPU's part of a step, to set against the host's clock around the call
  // (the rest is the metadata copy, the launch and the synchronisation). For
  // benchmarks; the two nodes cost a little.
  bool time_graphs = false;
};

// One launch of CudaQwen3::trace(): its kernel and layer, and its marks in ns
// from the first launch's start (-1: not reached). marks[0] / [1] the first /
// last CTA's start, [2] / [3] the first / last CTA past the wait for the
// previous kernel, [4] to [kMarks - 2] the last warp at the kernel's own marks
// 3 to kTraceEnd - 1 (kernels.h), [kMarks - 1] the last warp's end.
struct KernelTrace {
  std::string kernel;
  int layer = -1;
  static constexpr int kMarks = 8;  // 4 + cuda::kTraceMarks (kernels.h)
  double marks[kMarks] = {};
  // Per recorded CTA (the first cuda::kTraceCtas): its SM, its start, its
  // passing the wait, then the last of its warps at each kernel mark (3 to
  // the end); ns on the marks' clock, -1 where not reached.
  struct Cta {
    int sm = -1;
    double ns[kMarks - 2] = {};  // start, wait, cuda::kTraceMarks marks
  };
  std::vector<Cta> ctas;
};

// forward_sample's result: one token per sequence of the batch. A row the
// device could not decide (top-p whose nucleus holds more than 1024 tokens)
// is cuda::kSampleOnHostToken; then, or when asked, `logits` holds every
// sequence's logits as forward() would give them, for the host sampler.
struct SampledTokens {
  std::vector<int32_t> tokens;
  bool has_logits = false;
  ForwardOutput logits;
};

namespace cuda {
inline constexpr int32_t kSampleOnHostToken = -1;
}  // namespace cuda

// True when a CUDA device is present and usable (tests skip without one).
bool cuda_device_available();

class CudaQwen3 final : public Model {
 public:
  static Result<std::unique_ptr<CudaQwen3>> load(const std::filesystem::path& model_dir,
                                                 cuda::DeviceAllocator& allocator,
                                                 const CudaModelOptions& options = {});
  // As above, the model owning its allocator (destroyed after the model's buffers).
  static Result<std::unique_ptr<CudaQwen3>> load(const std::filesystem::path& model_dir,
                                                 std::unique_ptr<cuda::DeviceAllocator> allocator,
                                                 const CudaModelOptions& options = {});
  static Result<std::unique_ptr<CudaQwen3>> create(const ModelConfig& cfg, const TensorStore& store,
                                                   cuda::DeviceAllocator& allocator,
                                                   const CudaModelOptions& options = {});
  ~CudaQwen3() override;
  CudaQwen3(const CudaQwen3&) = delete;
  CudaQwen3& operator=(const CudaQwen3&) = delete;

  const ModelConfig& config() const override;
  KvCacheLayout kv_layout() const override;  // bf16: elem_bytes 2
  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override;

  // Like forward, but each sequence's next token is chosen on the GPU from its
  // last row of logits, as `rows[i]` says (one per sequence; all_logits is
  // ignored), and only the tokens come back to the host.
  Result<void> forward_sample(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                              std::span<const cuda::SamplingRow> rows, SampledTokens& out,
                              bool copy_logits = false);
  // The Model interface's name for forward_sample (what the engine calls).
  bool chooses_tokens() const override { return true; }
  Result<void> forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                              std::span<const TokenChoice> choices, std::vector<int32_t>& tokens,
                              ForwardOutput& logits) override;

  // A KV cache of num_blocks blocks from the model's allocator (tag kv_cache).
  Result<cuda::DeviceBuffer> allocate_kv_cache(int num_blocks);

  // Reads the tensors of `model_dir` into the weights in place (same
  // addresses, so graphs stay valid) and recomputes the RoPE table: after a
  // sleep that released the weights, or for an in-place weight update. The
  // checkpoint must have this model's architecture (kInvalidArgument listing
  // what differs) and every tensor is checked before anything is written; the
  // weights memory must be mapped (the caller's pool is awake for `weights`).
  Result<void> reload_weights(const std::filesystem::path& model_dir);
  // An in-place update (model/weight_update.h) from a directory (as
  // reload_weights; bf16 tensors read from the files in parallel straight
  // into pinned memory), host shared memory, or CUDA IPC buffers of another
  // process on this GPU (copied device to device; float16/float32 converted
  // to bf16 by a kernel). Checks everything, opens the IPC handles; apply()
  // writes and recomputes the RoPE table. The weights memory must be mapped.
  Result<std::unique_ptr<PreparedWeightUpdate>> prepare_weight_update(const WeightUpdate& update);

  const CudaModelOptions& options() const;
  // With options.profile: milliseconds per kernel group since the last reset,
  // in order of first appearance ("qkv", "attention_decode", "lm_head", ...).
  std::vector<std::pair<std::string, double>> profile() const;
  void reset_profile();
  // With options.time_graphs: the mean milliseconds from a decode graph's
  // first node to its last over the forward_sample replays since
  // reset_profile(); 0 before any.
  double graph_step_ms() const;
  // With options.trace: the last small-batch pass's launches, in order.
  std::vector<KernelTrace> trace() const;
  size_t num_graphs() const;  // decode graphs captured so far
  size_t weight_bytes() const;
  size_t scratch_bytes() const;

  struct Impl;

 private:
  explicit CudaQwen3(std::unique_ptr<Impl> impl);
  // prepare_weight_update, with `call` opening its messages.
  Result<std::unique_ptr<PreparedWeightUpdate>> prepare_update(const WeightUpdate& update, const std::string& call);
  std::unique_ptr<Impl> impl_;
};

}  // namespace siesta
