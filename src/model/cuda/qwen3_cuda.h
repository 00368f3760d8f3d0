// CudaQwen3: Qwen3 in bf16 on one CUDA GPU, an implementation of Model.
//
//   cuda::CudaMallocAllocator alloc;                       // or cuda::PoolDeviceAllocator(pool)
//   SIESTA_ASSIGN_OR_RETURN(auto model, CudaQwen3::load(model_dir, alloc, options));
//   // or CudaQwen3::load(model_dir, std::make_unique<cuda::PoolDeviceAllocator>(pool), options):
//   // the model owns the allocator (the engine's way)
//   SIESTA_ASSIGN_OR_RETURN(cuda::DeviceBuffer kv, model->allocate_kv_cache(num_blocks));
//   KvCacheView view{kv.data(), num_blocks, model->kv_layout()};   // bf16, elem_bytes 2
//   model->forward(batch, view, out);                      // logits on the host (fp32 holding bf16 values)
//   model->forward_choose(batch, view, choices, chosen);   // tokens chosen on the GPU
//
// Weights and activations are bf16 with fp32 accumulation, rounded where
// Hugging Face's bf16 model rounds (kernels.h) — the logits too: its LM head
// outputs bf16, so equal bf16 logits tie there and here alike (lowest id wins). Projections go through
// cuBLASLt, or through a tensor-core GEMV for batches of up to 8 tokens (with
// the preceding norm or SiLU-mul and the residual add folded in), or — with
// options.batch_invariant — through a fixed-order tensor-core GEMM and, up to 8
// tokens, the GEMV in the same order, whose per-row arithmetic does not depend
// on the batch (nor does anything else:
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
#include "model/cuda/instrumentation.h"
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
  bool batch_invariant = true;  // false: cuBLASLt and split-KV decode attention (results change with the batch)
  bool cuda_graphs = true;
  int max_graph_batch = 256;    // decode steps of up to this many sequences replay graphs
  // Let each kernel start while its predecessor finishes (programmatic
  // dependent launch, sm_90; kernels.h: LaunchConfig). Same results either way.
  bool programmatic_launch = true;
  // Kernel choices a benchmark compares and what it records (instrumentation.h);
  // serving leaves them at their defaults.
  cuda::InstrumentationOptions instrumentation;
};

// forward_choose's result: one token per sequence of the batch. A sequence
// the host chooses (TokenChoice::on_host) or a row the device could not
// decide (top-p whose nucleus holds more than 1024 tokens) is kChooseOnHost
// (model/forward.h), and `logits` holds its rows as forward() gives them, at
// first_row / num_rows (every row of an on_host all_logits chunk); with
// copy_logits every other sequence's last row comes back too. has_logits:
// some row came back.
struct ChosenTokens {
  std::vector<int32_t> tokens;
  bool has_logits = false;
  ForwardOutput logits;
};

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
  // last row of logits, as `choices[i]` says (one per sequence; all_logits
  // counts only for on_host choices), and only the tokens come back to the
  // host, with the rows of the sequences the host chooses (Model's contract;
  // every sequence's last row too when copy_logits). A decode step replays a
  // graph whatever rows come back; only those rows are copied.
  Result<void> forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                              std::span<const TokenChoice> choices, ChosenTokens& out, bool copy_logits = false);
  // The Model interface's form of the same call (what the engine calls).
  bool chooses_tokens() const override { return true; }
  Result<void> forward_choose(std::span<const SequenceChunk> batch, const KvCacheView& kv,
                              std::span<const TokenChoice> choices, std::vector<int32_t>& tokens,
                              ForwardOutput& logits) override;

  // A KV cache of num_blocks blocks from the model's allocator (tag kv_cache).
  Result<cuda::DeviceBuffer> allocate_kv_cache(int num_blocks);
  // Runs a prompt of prompt_tokens tokens, a short one and a decode step in a
  // KV cache of its own (freed after), so that the kernels, cuBLASLt's plans
  // and modules load now and not in the first request (on the H200 its
  // prefill of 1024 tokens took 208 ms instead of 3.8 ms). The engine calls it
  // at start.
  Result<void> warm_up(int prompt_tokens = 1024);

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
  // What options.instrumentation asked to record: kernel-group times, decode
  // graph times, kernel timelines (instrumentation.h). For benchmarks.
  cuda::Instrumentation& instrumentation();
  const cuda::Instrumentation& instrumentation() const;
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
