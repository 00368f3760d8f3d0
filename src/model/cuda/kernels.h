// Launchers for the CUDA model's kernels: a plain C++ header, so host code
// (compiled by the host compiler, with fmt/spdlog) never includes device code.
// Each launcher checks its arguments' static limits, launches as `launch` says
// and returns the launch's cudaError_t (cudaSuccess, or the error of the
// launch itself; asynchronous faults surface at the next synchronising call).
//
// Rounding follows Hugging Face's bf16 Qwen3: every tensor that is bf16 there
// is rounded to bf16 at the same point here (norm outputs, q/k after norm and
// after RoPE, projections, residual sums, SiLU and its product), and every
// reduction accumulates in fp32. Kernels that reduce do so in an order that
// depends only on the row being computed, never on the batch around it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace siesta::cuda {

using bf16 = __nv_bfloat16;

// Where and how a kernel is launched. With `overlap` (programmatic dependent
// launch, sm_90) a kernel may start while the previous kernel in the stream is
// still running: every kernel here first lets its successor launch, may read
// weights (which nothing writes), and waits for its predecessor
// (griddepcontrol.wait) before it reads activations or writes anything. That
// hides the launch gap and the weight-fetch latency of the many small kernels
// of a decode step. Without `overlap` the wait is a no-op.
struct LaunchConfig {
  LaunchConfig(cudaStream_t s = nullptr, bool overlap_launch = false)  // NOLINT(google-explicit-constructor)
      : stream(s), overlap(overlap_launch) {}
  cudaStream_t stream;
  bool overlap;
};

// A launch's timeline (InstrumentationOptions::trace), %globaltimer readings in ns
// stored without atomics (so that recording does not serialise the CTAs):
// kTraceCtaWords words for each of the first kTraceCtas CTAs. Word 0: the CTA's
// start, 1: it passed griddepcontrol.wait, 2: its SM's id + 1; then for each of kTraceMarks per-warp
// marks (kernel-specific marks 3 to kTraceEnd - 1, then kTraceEnd = the warp's
// end) eight words, one per warp. Zero = not reached.
// The marks are compiled only in builds with SIESTA_CUDA_TRACE (CMake option).
#if defined(SIESTA_CUDA_TRACE)
inline constexpr bool kTraceCompiled = true;
#else
inline constexpr bool kTraceCompiled = false;
#endif
inline constexpr int kTraceCtas = 264;
inline constexpr int kTraceMarks = 4;
inline constexpr int kTraceEnd = 2 + kTraceMarks;
inline constexpr int kTraceCtaWords = 8 + 8 * kTraceMarks;

inline constexpr int kKvBlockSize = 16;
// Decode attention splits a sequence's context into partitions of this many
// tokens (then reduces them in partition order): this default, or what
// InstrumentationOptions::decode_partition_tokens fixes. Compiled: 64, 128, 256.
inline constexpr int kDecodePartitionTokens = 256;
bool decode_partition_supported(int tokens);
// Whether AttentionArgs::staged_partitions fits this device's shared memory per
// block for the shape (the current device; ~200 KB at head_dim 128, group 8).
bool decode_staged_partitions_supported(int num_heads, int num_kv_heads, int head_dim);
// Prefill attention: query rows of a work item, per head of a CTA (key tiles are the same size).
inline constexpr int kPrefillTileRows = 64;

// The paged KV cache in its block-major layout (forward.h): element
// ((((block * L + layer) * 2 + kind) * 16 + slot) * kv_heads + head) * head_dim + d.
struct KvCacheDesc {
  bf16* base = nullptr;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
};

// x[t] = table[tokens[t]] for t < T.
cudaError_t launch_embed(const int32_t* tokens, int T, const bf16* table, int hidden, bf16* x, LaunchConfig launch);

// Residual add and RMSNorm, with HF's rounding:
//   if delta: x[r] = bf16(x[r] + delta[r])                (written back)
//   out[r] = bf16(w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)))
// With row_index (the final norm of the rows that get logits): out[r] is the
// norm of bf16(x + delta) at row row_index[r], and x is not written.
cudaError_t launch_add_rms_norm(bf16* x, const bf16* delta, const bf16* weight, int rows, int hidden, float eps,
                                const int32_t* row_index, bf16* out, LaunchConfig launch);

// The RoPE table: for pos < max_pos and i < head_dim / 2, (cos, sin) of the
// fp32 angle pos * inv_freq[i], each rounded to bf16 as HF rounds them.
cudaError_t launch_rope_table(const float* inv_freq, int head_dim, int max_pos, __nv_bfloat162* table,
                              LaunchConfig launch);

// dst[i] = src[i] rounded to bf16 (nearest even), for n elements of float16
// (src_bytes_per_element 2) or float32 (4): weights pushed in another dtype
// (weight_convert.cu). src needs only its element alignment.
cudaError_t launch_convert_to_bf16(const void* src, int src_bytes_per_element, bf16* dst, size_t n,
                                   cudaStream_t stream);

// Per token t: q/k heads of qkv[t] = [q | k | v] get RMSNorm (q_norm / k_norm
// weights) and RoPE (rotate-half, with the table above at positions[t]); q
// goes to q_out[t] ([heads, head_dim]); k and v go to the cache at slots[t]
// (= block * 16 + offset; negative: padding, not written).
cudaError_t launch_qk_norm_rope_kv(const bf16* qkv, int T, const int32_t* positions, const int32_t* slots,
                                   const bf16* q_norm, const bf16* k_norm, const __nv_bfloat162* rope_table,
                                   int num_heads, int num_kv_heads, int head_dim, float eps, bf16* q_out,
                                   KvCacheDesc kv, int layer, LaunchConfig launch);

// out[t, i] = bf16(bf16(silu(gate)) * up) with gate_up[t] = [gate (inter) | up (inter)].
cudaError_t launch_silu_mul(const bf16* gate_up, int T, int inter, bf16* out, LaunchConfig launch);

// Everything attention reads about a pass. Sequence s owns query rows
// [q_start[s], q_start[s] + q_len[s]) and attends to cache positions
// [0, kv_len[s]) (its new tokens are the last q_len of them, already written);
// its block table is block_tables[table_start[s] ...]. kv_len 0 marks padding.
struct AttentionArgs {
  const bf16* q = nullptr;  // [T, heads, head_dim]
  bf16* out = nullptr;      // [T, heads * head_dim]
  KvCacheDesc kv;
  int layer = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 0.0f;  // 1 / sqrt(head_dim)
  const int32_t* seq_q_start = nullptr;
  const int32_t* seq_q_len = nullptr;
  const int32_t* seq_kv_len = nullptr;
  const int32_t* seq_table_start = nullptr;
  const int32_t* block_tables = nullptr;
  // Decode: the sequences with one new token, and scratch for split contexts:
  // partial_out [num_decode, heads, partial_parts, head_dim], partial_ml [.., 2].
  const int32_t* decode_seqs = nullptr;
  float* partial_out = nullptr;
  float* partial_ml = nullptr;
  int partial_parts = 0;
  int partition_tokens = kDecodePartitionTokens;  // decode_partition_supported
  // Optional: num_decode * num_kv_heads counters, zero at launch (the step image's sync words).
  // With them the last CTA of a (sequence, kv head) to finish combines its partitions and
  // returns the counter to zero, in place of the reduction kernel (one launch fewer, same bits).
  uint32_t* partition_done = nullptr;
  // Decode with 64-token (or staged 256-token) partitions, 2 to 8 of them: the
  // partitions of a (kv head, sequence) run as one thread-block cluster and
  // combine through distributed shared memory (same bits, no partial outputs
  // in global memory).
  bool cluster_partitions = false;
  // Decode with 256-token partitions: each partition's K/V rows staged in shared
  // memory (the cached ones before the wait for the previous kernel), attended
  // on tensor cores by 16 warps of 16 tokens (one CTA per partition, no
  // cluster for contexts of up to 256 tokens). Other results in the last bits
  // than the fp32 item the partition otherwise takes. The model sets it for
  // passes of up to kGemvMaxRows decode sequences where
  // decode_staged_partitions_supported.
  bool staged_partitions = false;
  // Decode of a pure decode pass: with qkv set, each decode attention CTA applies
  // q/k norm + RoPE to its query heads itself (q above is not read), and the CTA
  // of a sequence's last partition writes the new token's K and V to the cache
  // first: launch_qk_norm_rope_kv's work, with its arithmetic, without its launch.
  const bf16* qkv = nullptr;  // [T, q | k | v]
  const int32_t* positions = nullptr;
  const int32_t* slots = nullptr;
  const bf16* q_norm = nullptr;
  const bf16* k_norm = nullptr;
  const __nv_bfloat162* rope_table = nullptr;
  float eps = 0.0f;
  // Prefill: work items (sequence, query tile of kPrefillTileRows rows), as int32 pairs.
  const int32_t* prefill_items = nullptr;
  // Query heads per prefill CTA (they share a kv head): 1 or 2; 0 = 2 when the GQA group is even.
  int prefill_heads_per_cta = 0;
  // Query rows per prefill warp (prefill_warp_rows_supported): 32, two m16 tiles sharing each K/V
  // fragment; or 16, one tile and twice the warps per CTA (faster for passes of few CTAs). Each
  // keeps a row's result independent of its batch and chunking; at head_dim 128 the two differ
  // by rounding. The model chooses per pass (InstrumentationOptions::prefill_warp_rows).
  int prefill_warp_rows = 32;
  // Decode: optional timeline (kTraceCtas x kTraceCtaWords), recorded with
  // staged partitions; marks: 3 q/k norm done, 4 the partition's output, 5
  // partitions combined (cluster: by partition 0; else counted, or reduced by
  // the last CTA), then the end.
  unsigned long long* trace = nullptr;
};

// Query heads per kv head that the attention kernels are compiled for: 1 to 8 (Qwen3 uses 2, 4, 5, 8).
inline constexpr int kMaxGqaGroup = 8;
// True when head_dim and the GQA group size have compiled kernels (64 or 128; 1 to kMaxGqaGroup).
bool attention_supported(int num_heads, int num_kv_heads, int head_dim);

// Decode attention for num_decode sequences, each split into up to
// max_partitions partitions of args.partition_tokens (max_partitions <=
// partial_parts); sequences that need more than one are combined by the last of
// their CTAs (args.partition_done set) or else in a second kernel.
cudaError_t launch_decode_attention(const AttentionArgs& args, int num_decode, int max_partitions,
                                    LaunchConfig launch);

bool prefill_warp_rows_supported(int rows);  // 16 or 32
// Query heads per prefill attention CTA for AttentionArgs::prefill_heads_per_cta = `option`:
// 2 when the GQA group is even and the option allows it, else 1.
int prefill_heads_per_cta(int num_heads, int num_kv_heads, int option);

// Causal prefill attention over num_items (sequence, query tile) work items,
// with tensor cores (bf16 inputs, fp32 scores and softmax, bf16 probabilities).
// A row's result depends only on its position and its sequence's cache, not on
// the tile it shares (a 1-row tile, a one-token chunk, gives the same bits as
// that row inside a longer chunk). Padding sequences (kv_len 0) get zeros and
// read no cache.
cudaError_t launch_prefill_attention(const AttentionArgs& args, int num_items, LaunchConfig launch);

// The same contract on Hopper's warpgroup MMA (attention_prefill_wgmma.cu), for head_dim 128 in
// builds for sm_90a (prefill_wgmma_supported); prefill_heads_per_cta applies, prefill_warp_rows
// does not. A row's result depends only on its position and its cache, as with the mma.sync
// kernel; but the two sum in other orders, so they differ by rounding: a model takes one of them
// for every pass.
bool prefill_wgmma_supported(int num_heads, int num_kv_heads, int head_dim);
cudaError_t launch_prefill_attention_wgmma(const AttentionArgs& args, int num_items, LaunchConfig launch);

// Batch-invariant decode attention (attention_decode_invariant.cu): num_decode
// sequences of one query token (args.decode_seqs, as launch_decode_attention
// takes them), each row bit-identical to what the prefill kernel of the pass
// gives the same query at the same position over the same cache (a 1-row tile
// or a row of a longer chunk): launch_prefill_attention_wgmma where `wgmma`
// (prefill_wgmma_supported), else launch_prefill_attention with
// args.prefill_warp_rows. One CTA per (kv head, sequence) walks the whole
// context in that kernel's softmax steps (no split into partitions) with the
// group's query heads as the rows of one MMA tile, so K and V are read once per
// kv head. With args.qkv (a pure decode pass) it does q/k norm + RoPE and the KV
// write itself, as launch_decode_attention does; otherwise q and the new K/V row
// are what launch_qk_norm_rope_kv wrote. Padding sequences (kv_len 0) get zeros.
// warps: per CTA, 4 or 8 (8: head_dim 128 with 64-key softmax steps only); 0 chooses
// (kDecodeInvariantWarps for grids of at most half the SMs, else 4). The same bits
// with either.
inline constexpr int kDecodeInvariantWarps = 8;
cudaError_t launch_decode_attention_invariant(const AttentionArgs& args, int num_decode, bool wgmma,
                                              LaunchConfig launch, int warps = 0);

// Small-batch projection y[m, n] = sum_k a[m, k] * w[n, k] for M <= kGemvMaxRows,
// streaming w once through tensor-core MMAs (fp32 accumulation; a row's values
// do not depend on M). The input can be transformed on the way in, and the
// output added to a residual, so decode needs fewer launches.
inline constexpr int kGemvMaxRows = 8;
enum class GemvInput {
  kPlain,    // a = input [M, K]
  kRmsNorm,  // a = bf16(norm_weight * bf16(x * rsqrt(mean(x^2) + eps))), x = input [M, K]
  kSiluMul,  // a = bf16(bf16(silu(gate)) * up), input [M, 2K] = [gate | up]
};
enum class GemvOutput {
  kBf16,     // out bf16 [M, N] = bf16(acc)
  kAddBf16,  // out bf16 [M, N] = bf16(out + bf16(acc))  (residual add)
  kLogits,   // out fp32 [M, N] = bf16(acc): logits, rounded as HF's bf16 LM head rounds them
  // w = [gate (N/2 rows) | up (N/2 rows)] (the MLP's gate_up; N even): out bf16 [M, N/2] =
  // bf16(bf16(silu(g)) * u), g = bf16(acc[:, :N/2]), u = bf16(acc[:, N/2:]); the same bits
  // as kBf16 followed by launch_silu_mul or by a GemvInput::kSiluMul staging.
  kSiluMul,
};
struct GemvArgs {
  const bf16* input = nullptr;
  const bf16* norm_weight = nullptr;
  float eps = 0.0f;
  const bf16* weight = nullptr;  // [N, K]
  int M = 0;
  int N = 0;
  int K = 0;
  GemvInput input_kind = GemvInput::kPlain;
  GemvOutput output_kind = GemvOutput::kBf16;
  void* out = nullptr;
  // Optional, with kLogits: M words, zero before the launch, that end as each
  // row's largest dev::argmax_key (its first maximum) for launch_sample_tokens.
  unsigned long long* argmax = nullptr;
  // Optional timeline (kTraceCtas x kTraceCtaWords), recorded when M is 1:
  // start, wait; marks 3 the input staged, 4 the products done, 5 the warps'
  // sums in shared memory; the end.
  unsigned long long* trace = nullptr;
  // The projection order below (kProjectionSegments): the bits of
  // launch_fixed_gemm for every row. Otherwise each warp forms its k16 blocks
  // from the k that its 16-byte weight loads hold, which is faster at batch 1
  // and gives other bits.
  bool canonical = false;
};
// M input rows of K and one norm row fit the GEMV's shared memory; K % 256 == 0.
bool gemv_supported(int M, int K);
cudaError_t launch_gemv(const GemvArgs& args, LaunchConfig launch);

// The projection order that no batch size changes, shared by every kernel that
// computes it (the fixed GEMM, the canonical GEMV): K falls in
// kProjectionSegments segments of projection_segment_k(K) (one segment where
// K % 256 != 0); each segment is one fp32 chain, from zero, of bf16 k16 MMAs
// over its natural k16 blocks (k in [16 j, 16 j + 16)) in ascending order; the
// segments' sums are added in order, from zero. An MMA's bits do not depend on
// how its 16 k are laid out in the fragments (the canonical GEMV lays them out
// otherwise than the fixed GEMM: cuda_kernels_test,
// GemvAndFixedGemmGiveEachRowTheSameBits), so kernels of other tilings can
// share the order.
inline constexpr int kProjectionSegments = 8;
constexpr int projection_segment_k(int K) {
  return K % (16 * 2 * kProjectionSegments) == 0 ? K / kProjectionSegments : K;
}

// The batch-invariant projection: y[m, n] = sum_k a[m, k] * w[n, k] in the
// projection order above, never split across CTAs. The tile shape chosen for M
// changes which rows share a CTA, never the arithmetic of a row, so a row's
// result is bit-identical for every M, and equal to the canonical GEMV's.
// Needs K % 32 == 0 and N % 8 == 0. out_f32: the output is fp32 holding
// bf16-rounded values (logits, as kLogits above).
// Where the build has sm_90a, K % 512 == 0 runs on warpgroup MMA
// (gemm_fixed_wgmma.cu), which may split K by whole segments across CTAs when
// the output tiles are fewer than the SMs: each segment's sum goes to the
// workspace (kProjectionSegments * M * N floats) and a second kernel adds
// them in order. Every choice below gives the same bits.
struct FixedGemmOptions {
  void* workspace = nullptr;  // for splits; without it (or too small) no split
  size_t workspace_bytes = 0;
  // 0: the fastest the build has (sm_90a: 3, split where its tiles are few; else 1), 1: mma.sync,
  // 2: wgmma with cp.async loads (any tile and split below), 3: wgmma fed by TMA copies from a loading
  // warpgroup, persistent, 128 x 128 or 128 x 64 tiles (any split below); 4: kernel 3 in clusters
  // of two CTAs along M that share each weight tile (TMA multicast: half the weight reads from L2)
  int kernel = 0;
  int splits = 0;  // wgmma: 0 chosen from the tile count, else 1, 2, 4 or 8
  int tile_n = 0;  // wgmma: 0 chosen, else 64 or 128 output columns per CTA (kernels 3, 4: per tile)
  int tile_m = 0;  // wgmma: 0 chosen, else 64 or 128 output rows per CTA (one or two warpgroups)
};
bool fixed_gemm_supported(int N, int K);
cudaError_t launch_fixed_gemm(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K,
                              LaunchConfig launch, const FixedGemmOptions& options = {});
bool fixed_gemm_wgmma_supported(int N, int K);  // false in builds without sm_90a
cudaError_t launch_fixed_gemm_wgmma(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K,
                                    LaunchConfig launch, const FixedGemmOptions& options);

// x[i] = bf16(x[i]) in place (logits from cuBLASLt's fp32 output).
cudaError_t launch_round_to_bf16(float* x, size_t n, LaunchConfig launch);

// Token selection on the device, one row of logits per CTA. Greedy takes the
// largest logit (ties: lowest id, NaN as -inf). Otherwise, in the engine
// sampler's order: temperature, min-p, top-k, top-p, then the draw `uniform`
// inverted through the cumulative distribution of the survivors (sorted by
// logit for top-k/top-p, else in id order), accumulated in fp64.
// banned ids (at most kMaxBannedPerRow per row) are excluded (min_tokens).
inline constexpr int kMaxBannedPerRow = 32;
// top-p needs the survivors sorted; the device sorts up to this many, and
// asks the host to sample a row (status kSampleOnHost) when more survive
// than that and their top part does not already hold top_p of the mass.
inline constexpr int kDeviceSortCapacity = 1024;
inline constexpr int32_t kSampleOnHost = -1;
struct SamplingRowParams {
  double temperature = 0.0;  // < 1e-5: greedy
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off
  double uniform = 0.0;      // the request's draw in [0, 1)
  int32_t top_k = 0;         // <= 0: off
  int32_t banned_begin = 0;  // [begin, end) in the banned id list
  int32_t banned_end = 0;
  int32_t pad = 0;
};
// tokens[r] = the choice for logits row r, or kSampleOnHost (device memory, or
// mapped pinned host memory through its device address). argmax_keys
// (optional: the LM head GEMV's GemvArgs::argmax) give rows without banned ids
// their first maximum without a pass over the row: a greedy row is then done.
cudaError_t launch_sample_tokens(const float* logits, int rows, int vocab, const SamplingRowParams* params,
                                 const int32_t* banned_ids, int32_t* tokens, LaunchConfig launch,
                                 const unsigned long long* argmax_keys = nullptr);

// Fills n bf16 values with a hash of (seed, index) mapped to [-scale, scale):
// benchmark and test inputs that are neither zeros nor constant.
cudaError_t launch_fill_random_bf16(bf16* out, size_t n, uint64_t seed, float scale, LaunchConfig launch);

}  // namespace siesta::cuda
