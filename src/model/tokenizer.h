// Tokenizer: Hugging Face tokenizer.json, byte-level BPE as Qwen2/Qwen3 use it.
//
//   Result<Tokenizer> tok = Tokenizer::load(model_dir);     // reads DIR/tokenizer.json
//   std::vector<int32_t> ids = tok->encode("Hello world");  // added/special tokens recognised
//   std::string text = tok->decode(ids);                    // skip_special_tokens=false by default
//
// Pipeline (encode): added tokens are matched first and split out (leftmost,
// longest; a special token such as <|im_start|> is never split by BPE); each
// remaining segment is NFC-normalised (utf8proc), split with the pre-tokenizer
// regex (PCRE2, UTF + UCP, JIT), and merged by BPE rank over its bytes (a heap
// over adjacent pairs: O(n log n) per word, with a bounded cache of merged
// words shared by all threads).
//
// What tokenizer.json may contain: model BPE (merges as "a b" or ["a", "b"]);
// normalizer NFC, null, or a Sequence of NFC; pre_tokenizer ByteLevel, or a
// Sequence of Split{Regex or String, Isolated} ending in ByteLevel; decoder
// ByteLevel. Anything else is refused at load with a one-line error. The
// post_processor is not applied: encode never adds BOS/EOS or template tokens.
//
// Input that is not valid UTF-8 is read as Python's errors="replace" would:
// each ill-formed sequence becomes U+FFFD before tokenization.
//
// Thread safety: after load, encode/decode/lookups are safe from several
// threads at once. A Tokenizer may be moved, but an IncrementalDetokenizer
// holds its address: keep the Tokenizer in place while one is in use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace siesta {

struct TokenizerOptions {
  // Distinct words whose merge results are kept; 0 turns the cache off (for
  // measuring the merge itself). Memory stays below ~300 bytes per word.
  size_t word_cache_words = 32768;
};

class Tokenizer {
 public:
  static Result<Tokenizer> load(const std::filesystem::path& model_dir, const TokenizerOptions& options = {});
  static Result<Tokenizer> load_file(const std::filesystem::path& tokenizer_json, const TokenizerOptions& options = {});
  static Result<Tokenizer> from_json_string(std::string_view tokenizer_json, const TokenizerOptions& options = {});

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text) const;
  // Unknown ids are skipped; ill-formed UTF-8 in the result becomes U+FFFD.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  int32_t vocab_size() const;                           // largest id + 1, added tokens included
  std::optional<int32_t> token_to_id(std::string_view token) const;  // vocab or added token, as spelled in tokenizer.json
  bool is_special(int32_t id) const;
  // The raw bytes a token stands for (byte-level alphabet undone); empty for unknown ids.
  std::string token_bytes(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Incremental detokenizer for streaming: feed token ids one at a time, get the
// text that is complete so far. Never emits part of a UTF-8 character: bytes of
// an incomplete character are held back until the character completes (or are
// flushed as U+FFFD by finish() if the stream ends mid-character). The pieces
// returned by push() and finish() concatenate to decode() of the same ids.
class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tok, bool skip_special_tokens = false);
  // Returns the newly complete text (possibly empty).
  std::string push(int32_t id);
  // Returns whatever is still held back (invalid trailing bytes as U+FFFD).
  std::string finish();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;  // bytes not yet emitted
};

}  // namespace siesta
