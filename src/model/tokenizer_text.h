// Text stages of the tokenizer (internal to src/model/tokenizer.cpp): UTF-8
// checks and repair, NFC normalisation (utf8proc), the pre-tokenizer split
// regex (PCRE2) and the matcher that cuts added tokens out of the text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace siesta::tokenizer_internal {

// ---- UTF-8 ------------------------------------------------------------------

bool is_valid_utf8(std::string_view s);
// Appends `s` with each ill-formed sequence replaced by U+FFFD, one per
// maximal subpart (the Unicode-recommended practice that Python's
// errors="replace" and Rust's String::from_utf8_lossy follow).
void append_utf8_lossy(std::string_view s, std::string& out);
// Length (0..3) of a character at the end of `s` that is cut short but valid
// so far, i.e. bytes that more input could still complete.
size_t incomplete_utf8_tail(std::string_view s);
// Decodes the code point at s[i] of valid UTF-8 and advances i past it.
uint32_t next_code_point(std::string_view s, size_t& i);
void append_utf8(uint32_t code_point, std::string& out);

// ---- Normalisation ----------------------------------------------------------

// True when `s` (valid UTF-8) is certainly in NFC already: every code point
// lies in ranges whose characters are unchanged by NFC, have combining class 0
// and never compose with a preceding character (ASCII, Latin, Cyrillic, CJK,
// kana, Hangul syllables, emoji, ...). False means "run the normaliser".
bool is_nfc_quick(std::string_view s);
// NFC of valid UTF-8 `s` into `out` (replaced). False if utf8proc failed.
bool to_nfc(std::string_view s, std::string& out);

// ---- Pre-tokenizer split ----------------------------------------------------

// A compiled PCRE2 pattern (UTF + UCP, JIT when available), shared read-only by
// all threads; per-thread match data lives in the .cpp.
class SplitRegex {
 public:
  // literal: the pattern is a plain string (Split{pattern: {String: ...}}).
  static Result<SplitRegex> compile(std::string_view pattern, bool literal);

  SplitRegex(SplitRegex&&) noexcept;
  SplitRegex& operator=(SplitRegex&&) noexcept;
  ~SplitRegex();

  // Finds the first match in text[from..] (text is valid UTF-8). False when
  // there is none, or when PCRE2 gave up (match limits): the caller then keeps
  // the rest of the text as one piece, which BPE still encodes losslessly.
  bool find(std::string_view text, size_t from, size_t& begin, size_t& end) const;

  // Calls on_piece for every piece of `text` under the "Isolated" behaviour:
  // each match is a piece and so is each stretch between matches.
  template <class OnPiece>
  void split(std::string_view text, OnPiece&& on_piece) const;

 private:
  struct Code;
  explicit SplitRegex(std::unique_ptr<Code> code);
  std::unique_ptr<Code> code_;
};

// ---- Added tokens -----------------------------------------------------------

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;       // the match also takes whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool single_word = false;  // matches only when not inside a word
  bool normalized = false;   // matched on normalised text (else on the input)
};

// Finds added tokens in text, leftmost first and longest at that position
// (the Aho-Corasick LeftmostLongest semantics of Hugging Face tokenizers).
class AddedTokenMatcher {
 public:
  struct Match {
    size_t begin = 0;  // widened by lstrip
    size_t end = 0;    // widened by rstrip
    int32_t id = -1;
  };

  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);
  bool empty() const { return tokens_.empty(); }

  // The next match starting at or after `from`; lstrip never reaches below `floor`.
  std::optional<Match> find(std::string_view text, size_t from, size_t floor) const;

  // Cuts `text` into stretches of plain text (on_text) and added tokens (on_token), in order.
  template <class OnText, class OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const;

 private:
  struct Entry {
    std::string content;
    int32_t id;
    bool lstrip, rstrip, single_word;
  };
  std::vector<Entry> tokens_;                   // longest content first
  std::vector<uint32_t> by_first_byte_[256];  // indices into tokens_, longest first
  bool first_byte_[256] = {};
};

// ---- Template definitions ---------------------------------------------------

template <class OnPiece>
void SplitRegex::split(std::string_view text, OnPiece&& on_piece) const {
  size_t piece_start = 0;  // start of the text not yet given out
  size_t search = 0;
  while (search <= text.size()) {
    size_t begin = 0, end = 0;
    if (!find(text, search, begin, end)) break;
    if (begin > piece_start) on_piece(text.substr(piece_start, begin - piece_start));
    if (end > begin) on_piece(text.substr(begin, end - begin));
    piece_start = end;
    if (end > begin) {
      search = end;
    } else {
      // An empty match: look again one character further on (as find_iter does).
      if (end >= text.size()) break;
      size_t next = end;
      next_code_point(text, next);
      search = next;
    }
  }
  if (piece_start < text.size()) on_piece(text.substr(piece_start));
}

template <class OnText, class OnToken>
void AddedTokenMatcher::split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
  size_t done = 0;
  if (!empty()) {
    while (std::optional<Match> m = find(text, done, done)) {
      if (m->begin > done) on_text(text.substr(done, m->begin - done));
      on_token(m->id);
      done = m->end;
    }
  }
  if (done < text.size()) on_text(text.substr(done));
}

}  // namespace siesta::tokenizer_internal
