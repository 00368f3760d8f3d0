#include "model/forward.h"

#include <string>

namespace siesta {

Result<void> validate_batch(const ModelConfig& cfg, std::span<const SequenceChunk> batch, const KvCacheView& kv) {
  if (kv.base == nullptr || kv.num_blocks <= 0) return invalid_argument("forward: no KV cache");
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceChunk& seq = batch[s];
    const std::string where = "forward: sequence " + std::to_string(s) + ": ";
    if (seq.tokens.empty()) return invalid_argument(where + "no new tokens");
    if (seq.start_pos < 0) return invalid_argument(where + "negative start position");
    for (int32_t t : seq.tokens) {
      if (t < 0 || t >= cfg.vocab_size)
        return invalid_argument(where + "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                std::to_string(cfg.vocab_size) + ")");
    }
    const size_t end = static_cast<size_t>(seq.start_pos) + seq.tokens.size();
    const size_t blocks_needed = (end + kv.layout.block_size - 1) / kv.layout.block_size;
    if (seq.block_table.size() < blocks_needed)
      return invalid_argument(where + "block table has " + std::to_string(seq.block_table.size()) +
                              " blocks, " + std::to_string(blocks_needed) + " needed");
    for (size_t i = 0; i < blocks_needed; ++i) {
      int32_t b = seq.block_table[i];
      if (b < 0 || b >= kv.num_blocks)
        return invalid_argument(where + "block id " + std::to_string(b) + " is outside the cache [0, " +
                                std::to_string(kv.num_blocks) + ")");
    }
  }
  return {};
}

}  // namespace siesta
