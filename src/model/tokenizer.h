// Tokenizer: Hugging Face tokenizer.json, byte-level BPE as Qwen2/Qwen3 use it.
//
//   Result<Tokenizer> tok = Tokenizer::load(model_dir);     // DIR/tokenizer.json (+ tokenizer_config.json)
//   std::vector<int32_t> ids = tok->encode("Hello world");  // added/special tokens recognised
//   std::string text = tok->decode(ids);                    // skip_special_tokens=false by default
//
// Pipeline (encode): added tokens are matched first and split out; each
// remaining segment is NFC-normalised (utf8proc), split with the pre-tokenizer
// regex (PCRE2, UTF + UCP), mapped byte-by-byte to the GPT-2 byte alphabet,
// and merged by BPE rank (a heap over adjacent pairs: O(n log n) per word, with
// a per-tokenizer cache of merged words).
//
// Thread safety: encode/decode are safe from several threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace siesta {

class Tokenizer {
 public:
  static Result<Tokenizer> load(const std::filesystem::path& model_dir);
  static Result<Tokenizer> load_file(const std::filesystem::path& tokenizer_json);
  static Result<Tokenizer> from_json_string(std::string_view tokenizer_json);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  int32_t vocab_size() const;                           // largest id + 1, added tokens included
  std::optional<int32_t> token_to_id(std::string_view token) const;  // vocab or added token
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
// flushed as U+FFFD by finish() if the stream ends mid-character).
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
