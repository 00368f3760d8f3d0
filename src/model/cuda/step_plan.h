// StepPlan: a batch of SequenceChunks flattened into the arrays the CUDA
// kernels read, and packed into one byte image for a single host-to-device copy.
// Plain C++ (no CUDA), so it is tested on machines without a GPU.
//
//   auto passes = split_into_passes(batch, {max_tokens, max_seqs});   // each fits the scratch buffers
//   for (auto& pass : passes) {
//     SIESTA_ASSIGN_OR_RETURN(StepPlan plan, plan_pass(pass, pad_to, layout));
//     StepImage image = pack_step(plan, sampling, banned);              // image.bytes -> device
//   }
//
// Padding (for CUDA graphs, whose kernel arguments are fixed at capture):
// plan_pass(..., pad_to_seqs) appends decode rows with no cache (kv_len 0,
// slot -1) up to pad_to_seqs sequences, so a graph captured for that size
// serves every batch up to it. The byte offsets of the image depend only on
// the plan's sizes (tokens, sequences, decode rows, prefill items, logits
// rows, sampling rows), never on the data, so a graph's pointers stay right.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/forward.h"

namespace siesta::cuda {

inline constexpr int kKvBlockSizeForPlan = kBlockSize;  // forward.h's block size

enum class LogitsWanted : uint8_t { kNone, kLast, kAll };

// One sequence's share of a pass.
struct PassChunk {
  size_t seq = 0;  // index in the caller's batch
  SequenceChunk chunk;
  LogitsWanted logits = LogitsWanted::kLast;
};

struct PassLimits {
  int max_tokens = 0;  // tokens per pass (rows of the activation buffers)
  int max_seqs = 0;    // sequences per pass
};

// Splits a batch into passes that fit the limits, keeping order. A sequence
// longer than what is left of a pass is cut: its first piece ends the pass and
// the rest continues in the next ones (each piece sees the KV its earlier
// pieces wrote). Only a sequence's last piece gives logits, unless all_logits.
std::vector<std::vector<PassChunk>> split_into_passes(std::span<const SequenceChunk> batch, PassLimits limits);

// The kernels' work granularity (kernels.h), passed in so that this file needs no CUDA.
struct StepShape {
  int partition_tokens = 256;  // kDecodePartitionTokens
  int prefill_tile_rows = 64;  // kPrefillTileRows
  // One attention kernel for every row (batch-invariant mode's path before its
  // decode kernel, kept to compare): a chunk of one token (and a padding row)
  // becomes a prefill work item (a 1-row tile) instead of a decode sequence, so
  // a row's attention is the prefill kernel's whether its token came alone or
  // inside a longer chunk.
  bool one_token_as_prefill = false;
  // Decode sequences are not split into partitions (max_partitions is 1
  // whatever their context: batch-invariant mode's decode attention walks a
  // row's whole context in the prefill kernel's key steps) and are listed
  // longest context first, so that the longest CTAs do not start last.
  bool decode_whole_context = false;
};

struct StepPlan {
  int num_tokens = 0;  // T: activation rows (incl. padding)
  int num_seqs = 0;    // S (incl. padding)
  int num_real_seqs = 0;
  std::vector<int32_t> tokens, positions, slots;              // [T]; slot = block * 16 + offset, -1: none
  std::vector<int32_t> q_start, q_len, kv_len, table_start;  // [S]
  std::vector<int32_t> block_tables;                         // the blocks each sequence uses, concatenated
  std::vector<int32_t> decode_seqs;                          // sequences with one new token (unless one_token_as_prefill)
                                                             // (decode_whole_context: longest context first)
  std::vector<int32_t> prefill_items;                        // (sequence, query tile) pairs, most work first
  int max_partitions = 0;                                    // decode partitions of the longest decode sequence
  int partition_tokens = 0;                                  // StepShape::partition_tokens of this plan
  std::vector<int32_t> logits_rows;                          // activation rows to project, in output order
  std::vector<size_t> first_row, num_rows;                   // per real chunk: its rows in logits_rows
  int max_kv_len = 0;

  // True when every activation row gets logits, in order (decode): the final
  // norm can then read the residual stream directly.
  bool logits_rows_are_all_tokens() const;
};

// Flattens one pass. pad_to_seqs > num chunks pads with empty decode rows
// (only for passes where every chunk has one token and wants its logits);
// with shape.one_token_as_prefill they are prefill items like every row.
// The image's sizes still depend only on the number of sequences and tokens.
Result<StepPlan> plan_pass(std::span<const PassChunk> chunks, int pad_to_seqs, const StepShape& shape);

// The metadata image: sections of int32 (and SamplingRecord records), each
// 16-byte aligned, at offsets that depend only on the section sizes.
struct StepLayout {
  size_t tokens = 0, positions = 0, slots = 0;
  size_t q_start = 0, q_len = 0, kv_len = 0, table_start = 0;
  size_t decode_seqs = 0, prefill_items = 0, logits_rows = 0;
  size_t sampling = 0;  // SamplingRecord[sampling_rows]
  size_t banned = 0;    // int32[sampling_rows * kMaxBannedPerRow]
  size_t sync = 0;  // kStepSyncWords zeroed int32: counters (LM head argmax keys; decode attention partitions)
  size_t block_tables = 0;
  size_t end = 0;  // bytes used
  size_t sampling_rows = 0;
};

// Zeroed words at the end of every image: the LM head GEMV's argmax keys and
// decode attention's partition counters (qwen3_cuda.cpp), reset by the upload
// itself before each step, so no state carries over between steps or across a
// sleep that unmapped the scratch memory.
inline constexpr int kStepSyncWords = 32 + 8 * 64;

// A sampling request for one logits row, as the device reads it (the layout
// of kernels.h's SamplingRowParams, which the CUDA side static_asserts).
struct SamplingRecord {
  double temperature = 0.0;
  double top_p = 1.0;
  double min_p = 0.0;
  double uniform = 0.0;
  int32_t top_k = 0;
  int32_t banned_begin = 0;
  int32_t banned_end = 0;
  int32_t pad = 0;
};
static_assert(sizeof(SamplingRecord) == 48);
inline constexpr int kMaxBannedIdsPerRow = 32;  // == kMaxBannedPerRow

// sampling_rows: the sampling records (0: the pass samples nothing; at most
// the plan's logits rows). A decode graph samples every logits row; a pass
// whose chunks include rows for the host samples only the device's rows,
// record k for the k-th of them, so the records never outnumber the
// sequences.
StepLayout step_layout(const StepPlan& plan, size_t sampling_rows);

static_assert(kMaxChoiceBannedTokens == kMaxBannedIdsPerRow);

// Builds the image. sampling: at most layout.sampling_rows choices, for the
// first records (the rest, padding rows among them, get greedy).
Result<std::vector<std::byte>> pack_step(const StepPlan& plan, const StepLayout& layout,
                                         std::span<const TokenChoice> sampling);

}  // namespace siesta::cuda
