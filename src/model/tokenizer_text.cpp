#include "model/tokenizer_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace siesta::tokenizer_internal {

// ---- UTF-8 ------------------------------------------------------------------

namespace {

// One step of a UTF-8 decoder over bytes p[0..n), n >= 1. `length` is the
// well-formed sequence, or the maximal subpart to replace by one U+FFFD;
// `truncated` means the subpart is ill-formed only because the bytes ran out.
struct Utf8Step {
  size_t length;
  bool valid;
  bool truncated;
};

Utf8Step utf8_step(const unsigned char* p, size_t n) {
  const unsigned char lead = p[0];
  if (lead < 0x80) return {1, true, false};
  size_t continuation = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    continuation = 1;
  } else if (lead == 0xE0) {
    continuation = 2;
    lo = 0xA0;  // no overlong forms
  } else if (lead == 0xED) {
    continuation = 2;
    hi = 0x9F;  // no surrogates
  } else if (lead >= 0xE1 && lead <= 0xEF) {
    continuation = 2;
  } else if (lead == 0xF0) {
    continuation = 3;
    lo = 0x90;  // no overlong forms
  } else if (lead == 0xF4) {
    continuation = 3;
    hi = 0x8F;  // nothing above U+10FFFF
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    continuation = 3;
  } else {
    return {1, false, false};  // a stray continuation byte, C0, C1 or F5..FF
  }
  for (size_t k = 1; k <= continuation; ++k) {
    if (k >= n) return {k, false, true};
    if (p[k] < lo || p[k] > hi) return {k, false, false};
    lo = 0x80;
    hi = 0xBF;
  }
  return {continuation + 1, true, false};
}

// Index of the first non-ASCII byte at or after i (8 bytes at a time).
size_t skip_ascii(const unsigned char* p, size_t n, size_t i) {
  while (i + 8 <= n) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    if (word & 0x8080808080808080ull) break;
    i += 8;
  }
  while (i < n && p[i] < 0x80) ++i;
  return i;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = skip_ascii(p, n, 0);
  while (i < n) {
    const Utf8Step step = utf8_step(p + i, n - i);
    if (!step.valid) return false;
    i = skip_ascii(p, n, i + step.length);
  }
  return true;
}

void append_utf8_lossy(std::string_view s, std::string& out) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const size_t ascii_end = skip_ascii(p, n, i);
    out.append(s.data() + i, ascii_end - i);
    i = ascii_end;
    if (i >= n) break;
    const Utf8Step step = utf8_step(p + i, n - i);
    if (step.valid) {
      out.append(s.data() + i, step.length);
    } else {
      out.append(kReplacement);
    }
    i += step.length;
  }
}

size_t incomplete_utf8_tail(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  // The last lead byte is at most 3 bytes from the end for a cut-short character.
  size_t i = n;
  for (size_t back = 0; back < 4 && i > 0; ++back) {
    --i;
    if ((p[i] & 0xC0) != 0x80) {
      const Utf8Step step = utf8_step(p + i, n - i);
      return step.truncated ? n - i : 0;
    }
  }
  return 0;
}

uint32_t next_code_point(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const uint32_t b0 = p[i];
  if (b0 < 0x80) {
    i += 1;
    return b0;
  }
  if (b0 < 0xE0) {
    const uint32_t cp = ((b0 & 0x1F) << 6) | (p[i + 1] & 0x3F);
    i += 2;
    return cp;
  }
  if (b0 < 0xF0) {
    const uint32_t cp = ((b0 & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F);
    i += 3;
    return cp;
  }
  const uint32_t cp = ((b0 & 0x07) << 18) | ((p[i + 1] & 0x3F) << 12) | ((p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F);
  i += 4;
  return cp;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// ---- Normalisation ----------------------------------------------------------

namespace {

// Ranges where every code point has combining class 0, is its own NFC, and is
// never the second half of a canonical composition (nor a Hangul V/T jamo), so
// a string made only of them is in NFC. Derived from the Unicode 14 character
// database; each range stays well inside a block whose status is settled.
struct CodePointRange {
  uint32_t first, last;
};
constexpr CodePointRange kNfcStableRanges[] = {
    {0x0000, 0x02FF},    // ASCII, Latin-1, Latin Extended-A/B, IPA, spacing modifiers
    {0x0388, 0x0482},    // Greek (past the singleton-decomposing U+0374..U+0387), Cyrillic letters
    {0x061B, 0x064A},    // Arabic punctuation and letters (before the harakat)
    {0x2002, 0x20CF},    // punctuation, super/subscripts, currency (after U+2000/2001)
    {0x2190, 0x2328},    // arrows, mathematical operators, technical
    {0x2500, 0x27FF},    // box drawing, shapes, dingbats
    {0x3000, 0x3029},    // CJK punctuation (before the tone marks)
    {0x3030, 0x3098},    // hiragana (before the voicing marks U+3099/309A)
    {0x309B, 0x9FFF},    // katakana, CJK unified ideographs
    {0xAC00, 0xD7A3},    // Hangul syllables
    {0xFE00, 0xFE0F},    // variation selectors
    {0xFF00, 0xFFEF},    // halfwidth and fullwidth forms (compatibility only)
    {0x1F000, 0x1FAFF},  // emoji and pictographs
    {0x20000, 0x2A6DF},  // CJK extension B
};

bool in_nfc_stable_range(uint32_t cp) {
  for (const CodePointRange& r : kNfcStableRanges) {
    if (cp < r.first) return false;  // ranges are sorted
    if (cp <= r.last) return true;
  }
  return false;
}

}  // namespace

bool is_nfc_quick(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = skip_ascii(p, s.size(), 0);
  while (i < s.size()) {
    if (!in_nfc_stable_range(next_code_point(s, i))) return false;
    i = skip_ascii(p, s.size(), i);
  }
  return true;
}

bool to_nfc(std::string_view s, std::string& out) {
  utf8proc_uint8_t* normalized = nullptr;
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                   &normalized, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (length < 0) return false;
  out.assign(reinterpret_cast<const char*>(normalized), static_cast<size_t>(length));
  std::free(normalized);
  return true;
}

// ---- Pre-tokenizer split ----------------------------------------------------

struct SplitRegex::Code {
  pcre2_code* pattern = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(pattern); }
};

namespace {

// Match data for one ovector pair (the whole match is all a split needs),
// created once per thread and shared by every pattern.
pcre2_match_data* thread_match_data() {
  struct Holder {
    pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
    ~Holder() { pcre2_match_data_free(data); }
  };
  thread_local Holder holder;
  return holder.data;
}

}  // namespace

SplitRegex::SplitRegex(std::unique_ptr<Code> code) : code_(std::move(code)) {}
SplitRegex::SplitRegex(SplitRegex&&) noexcept = default;
SplitRegex& SplitRegex::operator=(SplitRegex&&) noexcept = default;
SplitRegex::~SplitRegex() = default;

// Patterns are written for Oniguruma (what HF tokenizers use). With UTF + UCP,
// PCRE2 agrees on \p{L}, \p{N}, (?i:...) and lookahead; its \s also takes
// U+180E (MONGOLIAN VOWEL SEPARATOR, no longer White_Space since Unicode 6.3),
// which Oniguruma does not: the one known difference, on a character that
// practically never occurs.
Result<SplitRegex> SplitRegex::compile(std::string_view pattern, bool literal) {
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
  if (literal) options |= PCRE2_LITERAL;
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  auto code = std::make_unique<Code>();
  code->pattern = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error_code,
                                &error_offset, nullptr);
  if (code->pattern == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return invalid_argument("pre-tokenizer pattern does not compile at offset " + std::to_string(error_offset) +
                            ": " + reinterpret_cast<const char*>(message));
  }
  // JIT is an optimisation only: without it (a PCRE2 built without JIT) the
  // interpreter gives the same matches.
  code->jit = pcre2_jit_compile(code->pattern, PCRE2_JIT_COMPLETE) == 0;
  return SplitRegex(std::move(code));
}

bool SplitRegex::find(std::string_view text, size_t from, size_t& begin, size_t& end) const {
  if (text.empty()) return false;
  pcre2_match_data* match = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // The text was checked for valid UTF-8 once by the tokenizer; PCRE2 need not
  // check it again on every call (the JIT path never does).
  const int rc = code_->jit ? pcre2_jit_match(code_->pattern, subject, text.size(), from, 0, match, nullptr)
                            : pcre2_match(code_->pattern, subject, text.size(), from, PCRE2_NO_UTF_CHECK, match, nullptr);
  if (rc < 0) return false;  // no match, or a match limit (see the header)
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
  begin = ovector[0];
  end = ovector[1];
  return begin >= from && end >= begin && end <= text.size();
}

// ---- Added tokens -----------------------------------------------------------

namespace {

// Rust's char::is_whitespace (the White_Space property).
bool is_white_space(uint32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85) return true;
  if (cp < 0xA0) return false;
  const utf8proc_category_t category = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return category == UTF8PROC_CATEGORY_ZS || category == UTF8PROC_CATEGORY_ZL || category == UTF8PROC_CATEGORY_ZP;
}

// Hugging Face's word character for single_word tokens: alphanumeric or '_'.
bool is_word_char(uint32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  const utf8proc_category_t category = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (category >= UTF8PROC_CATEGORY_LU && category <= UTF8PROC_CATEGORY_LO) ||
         (category >= UTF8PROC_CATEGORY_ND && category <= UTF8PROC_CATEGORY_NO);
}

// Start of the character that ends at byte `end` (end > 0, text valid UTF-8).
size_t previous_char_start(std::string_view text, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}

uint32_t char_before(std::string_view text, size_t end) {
  size_t i = previous_char_start(text, end);
  return next_code_point(text, i);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) {
  for (const AddedToken& t : tokens) {
    if (t.content.empty()) continue;
    tokens_.push_back(Entry{t.content, t.id, t.lstrip, t.rstrip, t.single_word});
  }
  // Longest first, so the first candidate that matches at a position is the longest.
  std::stable_sort(tokens_.begin(), tokens_.end(),
                   [](const Entry& a, const Entry& b) { return a.content.size() > b.content.size(); });
  for (uint32_t i = 0; i < tokens_.size(); ++i) {
    const auto first = static_cast<unsigned char>(tokens_[i].content[0]);
    by_first_byte_[first].push_back(i);
    first_byte_[first] = true;
  }
}

std::optional<AddedTokenMatcher::Match> AddedTokenMatcher::find(std::string_view text, size_t from,
                                                                size_t floor) const {
  const size_t n = text.size();
  for (size_t pos = from; pos < n; ++pos) {
    const auto first = static_cast<unsigned char>(text[pos]);
    if (!first_byte_[first]) continue;
    const Entry* hit = nullptr;
    for (uint32_t index : by_first_byte_[first]) {
      const Entry& e = tokens_[index];
      if (e.content.size() <= n - pos && std::memcmp(text.data() + pos, e.content.data(), e.content.size()) == 0) {
        hit = &e;
        break;
      }
    }
    if (hit == nullptr) continue;
    size_t begin = pos;
    size_t end = pos + hit->content.size();
    if (hit->single_word) {
      size_t after = end;
      const bool word_before = begin > 0 && is_word_char(char_before(text, begin));
      const bool word_after = end < n && is_word_char(next_code_point(text, after));
      if (word_before || word_after) {
        pos = end - 1;  // a refused match still consumes its text, as find_iter does
        continue;
      }
    }
    if (hit->lstrip) {
      while (begin > floor && is_white_space(char_before(text, begin))) begin = previous_char_start(text, begin);
    }
    if (hit->rstrip) {
      while (end < n) {
        size_t next = end;
        if (!is_white_space(next_code_point(text, next))) break;
        end = next;
      }
    }
    return Match{begin, end, hit->id};
  }
  return std::nullopt;
}

}  // namespace siesta::tokenizer_internal
