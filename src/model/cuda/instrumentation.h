// cuda::Instrumentation: what a benchmark asks of CudaQwen3 beyond serving —
// kernel choices to compare (InstrumentationOptions) and what the model
// records while it runs (kernel-group times, decode graph times, kernel
// timelines) — in one object, so that the serving options and the model's
// interface carry none of it.
//
//   CudaModelOptions opt;
//   opt.instrumentation.time_graphs = true;              // before load
//   auto model = CudaQwen3::load(dir, alloc, opt);
//   ... decode steps ...
//   model->instrumentation().graph_step_ms();            // then reset() between runs
//
// The model records through the recording calls below (its stream, its
// scratch); a benchmark reads through the reading calls. One thread at a
// time, as the model.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

struct CUevent_st;
struct CUstream_st;

namespace siesta::cuda {

struct InstrumentationOptions {
  // Query heads per prefill attention CTA (kernels.h); 0 = the default.
  int prefill_heads_per_cta = 0;
  // Query rows per prefill attention warp (kernels.h): 32 (K/V fragments feed two MMAs; faster
  // where the pass has CTAs to fill the GPU twice over) or 16 (twice the warps per CTA; faster for
  // short prompts). 0: 32 in batch-invariant mode (one kernel for every pass, since the two
  // differ by rounding at head_dim 128), else chosen per pass by its CTA count.
  int prefill_warp_rows = 0;
  // Prefill attention on Hopper's warpgroup MMA (kernels.h: launch_prefill_attention_wgmma)
  // where the build and the shape allow it (sm_90a, head_dim 128), for every pass (in
  // batch-invariant mode too: a row's result does not depend on its tile there either);
  // false: the mma.sync kernel (prefill_warp_rows). The two differ by rounding.
  bool prefill_wgmma = true;
  // Batch-invariant mode: decode rows through the prefill attention kernel as 1-row tiles
  // (StepShape::one_token_as_prefill, after a q/k norm + RoPE + KV write launch), instead of
  // launch_decode_attention_invariant. The same bits; kept to compare the two.
  bool invariant_decode_as_prefill = false;
  // Decode attention partition (kernels.h: 64, 128 or 256 tokens) for every pass; 0: 256 tokens
  // (staged in shared memory, on tensor cores, for passes of up to 8 decode sequences).
  int decode_partition_tokens = 0;
  // Passes of up to this many tokens take the GEMV kernel (kernels.h: launch_gemv, at most
  // kGemvMaxRows) for their projections instead of cuBLASLt; -1: as many as the GEMV's shared
  // memory takes at every projection's K (8 for the 0.6B shape, 3 for the 8B). Results differ
  // between the two by rounding (not in batch-invariant mode: the canonical GEMV).
  int gemv_max_rows = -1;
  // Batch-invariant mode: the fixed-order GEMM kernel of the projections (kernels.h:
  // FixedGemmOptions::kernel; 0 chosen per shape, 4 the TMA kernel in clusters of two sharing
  // each weight tile). The same bits with every kernel.
  int fixed_gemm_kernel = 0;
  // Batch-invariant mode: warps per CTA of the decode attention kernel (kernels.h:
  // launch_decode_attention_invariant; 4 or 8, 0 chooses). The same bits with either.
  int invariant_decode_warps = 0;
  // Time each kernel group with CUDA events between eager launches (no graphs);
  // read with profile(). For finding where time goes, not for speed.
  bool profile = false;
  // Record the timeline of each decode GEMV and decode attention launch of
  // the small-batch path (kernels.h: kTraceCtas), overwritten by every such
  // pass; read with trace(). Graphs and programmatic launch stay on: this
  // shows how the dependent kernels of a step overlap. A few stores per warp,
  // and a memset of ~12 MB per pass (0.6B shape). Needs a build with the CMake
  // option SIESTA_CUDA_TRACE (load fails otherwise), whose kernels carry the
  // marks; in other builds they are not compiled.
  bool trace = false;
  // Capture each decode graph between two CUDA event nodes, and keep the mean
  // time between them over the graph replays that choose tokens
  // (graph_step_ms): the GPU's part of a step, to set against the host's
  // clock around the call (the rest is the metadata copy, the launch and the
  // synchronisation). The two nodes cost a little.
  bool time_graphs = false;
};

// One launch of trace(): its kernel and layer, and its marks in ns from the
// first launch's start (-1: not reached). marks[0] / [1] the first / last
// CTA's start, [2] / [3] the first / last CTA past the wait for the previous
// kernel, [4] to [kMarks - 2] the last warp at the kernel's own marks 3 to
// kTraceEnd - 1 (kernels.h), [kMarks - 1] the last warp's end.
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

class Instrumentation {
 public:
  Instrumentation(const InstrumentationOptions& options, int num_layers);
  ~Instrumentation();
  Instrumentation(const Instrumentation&) = delete;
  Instrumentation& operator=(const Instrumentation&) = delete;

  const InstrumentationOptions& options() const { return opt_; }

  // Reading. With options().profile: milliseconds per kernel group since the
  // last reset, in order of first appearance ("qkv", "attention_decode",
  // "lm_head", ...).
  std::vector<std::pair<std::string, double>> profile() const { return profile_ms_; }
  // Forgets the kernel-group times and the graph times.
  void reset();
  // With options().time_graphs: the mean milliseconds from a decode graph's
  // first node to its last over the replays since reset(); 0 before any.
  double graph_step_ms() const { return graph_steps_ > 0 ? graph_ms_total_ / graph_steps_ : 0.0; }
  // With options().trace: the last small-batch pass's launches, in order
  // (waits for the model's stream).
  std::vector<KernelTrace> trace() const;

  // Recording (the model). The stream every mark and node goes to.
  void set_stream(CUstream_st* stream) { stream_ = stream; }
  // An event after the kernel group `label` (options().profile).
  void mark(const char* label);
  // Adds the time between consecutive marks to each mark's label; call after a sync.
  void collect_profile();
  // The trace's scratch: trace_bytes() of it, given with bind_trace.
  size_t trace_bytes() const;
  void bind_trace(unsigned long long* buffer) { trace_buf_ = buffer; }
  bool tracing() const { return trace_buf_ != nullptr; }
  // Clears the timelines before a traced pass.
  Result<void> clear_trace();
  // The timeline words of launch `slot` (5 per layer: qkv, attention, o,
  // gate_up, down), or null when not tracing.
  unsigned long long* trace_slot(int slot) const;
  // options().time_graphs: the event nodes that open and close a graph being
  // captured, and the time of a replay once the stream has synchronised.
  Result<void> open_graph();
  Result<void> close_graph();
  Result<void> time_graph_replay();

 private:
  int trace_slots() const { return 5 * num_layers_; }

  InstrumentationOptions opt_;
  int num_layers_ = 0;
  CUstream_st* stream_ = nullptr;
  // Profiling: events recorded after each kernel group.
  std::vector<CUevent_st*> event_pool_;
  std::vector<std::pair<const char*, CUevent_st*>> marks_;
  std::vector<std::pair<std::string, double>> profile_ms_;
  // Graph timing: the events that open and close each decode graph, and the
  // graph steps timed since reset().
  CUevent_st* graph_events_[2] = {};
  double graph_ms_total_ = 0;
  int graph_steps_ = 0;
  // The timelines of a small-batch pass's trace_slots() launches.
  unsigned long long* trace_buf_ = nullptr;
};

}  // namespace siesta::cuda
