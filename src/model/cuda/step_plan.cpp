#include "model/cuda/step_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>

namespace siesta::cuda {

std::vector<std::vector<PassChunk>> split_into_passes(std::span<const SequenceChunk> batch, PassLimits limits) {
  std::vector<std::vector<PassChunk>> passes(1);
  int tokens_in_pass = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceChunk& seq = batch[s];
    size_t done = 0;
    while (done < seq.tokens.size()) {
      if (tokens_in_pass == limits.max_tokens || static_cast<int>(passes.back().size()) == limits.max_seqs) {
        passes.emplace_back();
        tokens_in_pass = 0;
      }
      const size_t room = static_cast<size_t>(limits.max_tokens - tokens_in_pass);
      const size_t take = std::min(room, seq.tokens.size() - done);
      const bool last_piece = done + take == seq.tokens.size();
      PassChunk piece;
      piece.seq = s;
      piece.chunk.tokens = seq.tokens.subspan(done, take);
      piece.chunk.start_pos = seq.start_pos + static_cast<int32_t>(done);
      piece.chunk.block_table = seq.block_table;
      piece.chunk.all_logits = seq.all_logits;
      piece.logits = seq.all_logits ? LogitsWanted::kAll : (last_piece ? LogitsWanted::kLast : LogitsWanted::kNone);
      passes.back().push_back(piece);
      tokens_in_pass += static_cast<int>(take);
      done += take;
    }
  }
  if (passes.back().empty()) passes.pop_back();
  return passes;
}

bool StepPlan::logits_rows_are_all_tokens() const {
  if (static_cast<int>(logits_rows.size()) != num_tokens) return false;
  for (int i = 0; i < num_tokens; ++i)
    if (logits_rows[i] != i) return false;
  return true;
}

Result<StepPlan> plan_pass(std::span<const PassChunk> chunks, int pad_to_seqs, const StepShape& shape) {
  StepPlan p;
  const int real = static_cast<int>(chunks.size());
  const int padded = std::max(real, pad_to_seqs);
  if (padded > real) {
    for (const PassChunk& c : chunks)
      if (c.chunk.tokens.size() != 1 || c.logits == LogitsWanted::kNone)
        return invalid_argument("plan_pass: padding is only for decode passes (one token, logits, per sequence)");
  }
  p.num_seqs = padded;
  p.num_real_seqs = real;
  p.first_row.resize(real);
  p.num_rows.resize(real);
  int row = 0;
  for (int s = 0; s < padded; ++s) {
    if (s >= real) {  // padding: a decode row that reads and writes no cache
      p.q_start.push_back(row);
      p.q_len.push_back(1);
      p.kv_len.push_back(0);
      p.table_start.push_back(0);
      p.tokens.push_back(0);
      p.positions.push_back(0);
      p.slots.push_back(-1);
      if (shape.one_token_as_prefill) {
        p.prefill_items.push_back(s);
        p.prefill_items.push_back(0);
      } else {
        p.decode_seqs.push_back(s);
      }
      p.logits_rows.push_back(row);
      ++row;
      continue;
    }
    const SequenceChunk& c = chunks[s].chunk;
    const int n = static_cast<int>(c.tokens.size());
    const int kv_len = c.start_pos + n;
    const int blocks = (kv_len + kKvBlockSizeForPlan - 1) / kKvBlockSizeForPlan;
    if (n <= 0 || static_cast<int>(c.block_table.size()) < blocks)
      return invalid_argument("plan_pass: sequence " + std::to_string(chunks[s].seq) +
                              " has no tokens or a block table shorter than its " + std::to_string(kv_len) +
                              " positions");
    p.q_start.push_back(row);
    p.q_len.push_back(n);
    p.kv_len.push_back(kv_len);
    p.table_start.push_back(static_cast<int32_t>(p.block_tables.size()));
    p.block_tables.insert(p.block_tables.end(), c.block_table.begin(), c.block_table.begin() + blocks);
    for (int i = 0; i < n; ++i) {
      const int pos = c.start_pos + i;
      p.tokens.push_back(c.tokens[i]);
      p.positions.push_back(pos);
      p.slots.push_back(c.block_table[pos / kKvBlockSizeForPlan] * kKvBlockSizeForPlan + pos % kKvBlockSizeForPlan);
    }
    if (n == 1 && !shape.one_token_as_prefill) {
      p.decode_seqs.push_back(s);
      if (!shape.decode_whole_context)
        p.max_partitions = std::max(p.max_partitions, (kv_len + shape.partition_tokens - 1) / shape.partition_tokens);
    } else {
      for (int t = 0; t * shape.prefill_tile_rows < n; ++t) {
        p.prefill_items.push_back(s);
        p.prefill_items.push_back(t);
      }
    }
    p.max_kv_len = std::max(p.max_kv_len, kv_len);
    p.first_row[s] = p.logits_rows.size();
    switch (chunks[s].logits) {
      case LogitsWanted::kNone: break;
      case LogitsWanted::kLast: p.logits_rows.push_back(row + n - 1); break;
      case LogitsWanted::kAll:
        for (int i = 0; i < n; ++i) p.logits_rows.push_back(row + i);
        break;
    }
    p.num_rows[s] = p.logits_rows.size() - p.first_row[s];
    row += n;
  }
  p.num_tokens = row;
  p.partition_tokens = shape.partition_tokens;
  if (!p.decode_seqs.empty()) p.max_partitions = std::max(p.max_partitions, 1);
  if (shape.decode_whole_context)  // padding (kv_len 0) last
    std::stable_sort(p.decode_seqs.begin(), p.decode_seqs.end(),
                     [&](int32_t a, int32_t b) { return p.kv_len[a] > p.kv_len[b]; });

  // Most work first, so the longest tiles do not start last: a tile's work is
  // the number of positions its last row sees.
  const int items = static_cast<int>(p.prefill_items.size() / 2);
  std::vector<int> order(items);
  std::iota(order.begin(), order.end(), 0);
  auto work = [&](int i) {
    const int s = p.prefill_items[2 * i], t = p.prefill_items[2 * i + 1];
    const int start = p.kv_len[s] - p.q_len[s];
    return start + std::min(p.q_len[s], (t + 1) * shape.prefill_tile_rows);
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return work(a) > work(b); });
  std::vector<int32_t> sorted(p.prefill_items.size());
  for (int i = 0; i < items; ++i) {
    sorted[2 * i] = p.prefill_items[2 * order[i]];
    sorted[2 * i + 1] = p.prefill_items[2 * order[i] + 1];
  }
  p.prefill_items = std::move(sorted);
  return p;
}

namespace {
size_t align16(size_t v) { return (v + 15) & ~size_t{15}; }
}  // namespace

StepLayout step_layout(const StepPlan& plan, size_t sampling_rows) {
  StepLayout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t off = at;
    at = align16(at + bytes);
    return off;
  };
  const size_t T = static_cast<size_t>(plan.num_tokens), S = static_cast<size_t>(plan.num_seqs);
  const size_t R = plan.logits_rows.size();
  l.tokens = take(T * 4);
  l.positions = take(T * 4);
  l.slots = take(T * 4);
  l.q_start = take(S * 4);
  l.q_len = take(S * 4);
  l.kv_len = take(S * 4);
  l.table_start = take(S * 4);
  l.decode_seqs = take(plan.decode_seqs.size() * 4);
  l.prefill_items = take(plan.prefill_items.size() * 4);
  l.logits_rows = take(R * 4);
  l.sampling = take(sampling_rows * sizeof(SamplingRecord));
  l.banned = take(sampling_rows * kMaxBannedIdsPerRow * 4);
  l.sync = take(kStepSyncWords * 4);
  l.block_tables = take(plan.block_tables.size() * 4);  // last: its size varies from step to step
  l.end = at;
  l.sampling_rows = sampling_rows;
  return l;
}

Result<std::vector<std::byte>> pack_step(const StepPlan& plan, const StepLayout& layout,
                                         std::span<const TokenChoice> sampling) {
  const size_t R = plan.logits_rows.size();
  if (layout.sampling_rows > R || sampling.size() > layout.sampling_rows)
    return invalid_argument("pack_step: " + std::to_string(sampling.size()) + " sampling choices for " +
                            std::to_string(layout.sampling_rows) + " sampling records and " + std::to_string(R) +
                            " logits rows");
  std::vector<std::byte> img(layout.end);
  auto put = [&](size_t off, const std::vector<int32_t>& v) {
    if (!v.empty()) std::memcpy(img.data() + off, v.data(), v.size() * 4);
  };
  put(layout.tokens, plan.tokens);
  put(layout.positions, plan.positions);
  put(layout.slots, plan.slots);
  put(layout.q_start, plan.q_start);
  put(layout.q_len, plan.q_len);
  put(layout.kv_len, plan.kv_len);
  put(layout.table_start, plan.table_start);
  put(layout.decode_seqs, plan.decode_seqs);
  put(layout.prefill_items, plan.prefill_items);
  put(layout.logits_rows, plan.logits_rows);
  put(layout.block_tables, plan.block_tables);
  for (size_t r = 0; r < layout.sampling_rows; ++r) {
    SamplingRecord rec;  // padding rows: greedy
    if (r < sampling.size()) {
      const TokenChoice& s = sampling[r];
      if (s.banned.size() > static_cast<size_t>(kMaxBannedIdsPerRow))
        return invalid_argument("pack_step: " + std::to_string(s.banned.size()) +
                                " banned token ids in one row; the device sampler takes at most " +
                                std::to_string(kMaxBannedIdsPerRow));
      rec.temperature = s.temperature;
      rec.top_p = s.top_p;
      rec.min_p = s.min_p;
      rec.uniform = s.uniform;
      rec.top_k = s.top_k;
      rec.banned_begin = static_cast<int32_t>(r * kMaxBannedIdsPerRow);
      rec.banned_end = rec.banned_begin + static_cast<int32_t>(s.banned.size());
      if (!s.banned.empty())
        std::memcpy(img.data() + layout.banned + r * kMaxBannedIdsPerRow * 4, s.banned.data(), s.banned.size() * 4);
    }
    std::memcpy(img.data() + layout.sampling + r * sizeof(SamplingRecord), &rec, sizeof(rec));
  }
  return img;
}

}  // namespace siesta::cuda
