// JSON from outside (HTTP bodies, side-channel messages, configuration) with a
// limit on how deeply arrays and objects nest, checked before any value is
// built: nlohmann's parser does not recurse, but copying, dumping and the
// readers of a parsed value do, so a body of 100,000 '[' would overflow a
// thread's stack after a successful parse.
//
//   SIESTA_ASSIGN_OR_RETURN(nlohmann::json j, parse_json(text));   // limit 64
//   JsonDepthScanner scan(64);  scan.feed(piece) ... scan.exceeded()
//
// Depth counts open arrays and objects: `1` is 0, `{"a": 1}` 1, `[[1]]` 2. The
// scanner tracks strings (and escapes in them), so brackets inside strings do
// not count; on any text that is valid JSON it finds the nesting exactly. It
// is linear, keeps four words of state, and never recurses.
//
// Plain values and functions; thread-safe as values are.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"

namespace siesta {

// The default limit (--max-json-depth of serve and proxy; every other parser).
inline constexpr size_t kDefaultMaxJsonDepth = 64;
// The largest limit a user may configure: deeper values would reach the
// recursion of copies and dumps again.
inline constexpr size_t kMaxJsonDepthLimit = 1024;

// Incremental: feed the text in pieces, in order.
class JsonDepthScanner {
 public:
  explicit JsonDepthScanner(size_t max_depth) : max_depth_(max_depth) {}

  // false once the text so far nests deeper than max_depth (and from then on);
  // the rest of that piece is not looked at.
  bool feed(std::string_view piece);
  bool exceeded() const { return exceeded_; }
  size_t max_depth() const { return max_depth_; }
  // The deepest nesting seen so far (at most max_depth + 1).
  size_t deepest() const { return deepest_; }

 private:
  size_t max_depth_;
  size_t depth_ = 0;
  size_t deepest_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
  bool exceeded_ = false;
};

// "JSON nests arrays and objects deeper than 64 levels (the limit is 64)"
std::string json_too_deep_message(size_t max_depth);

// kInvalidArgument with json_too_deep_message when `text` nests deeper than max_depth.
Result<void> check_json_depth(std::string_view text, size_t max_depth = kDefaultMaxJsonDepth);

// The depth check, then nlohmann's parser (no exceptions escape). Too deep:
// kInvalidArgument naming the limit; not JSON (a raw NUL byte included, which
// nlohmann alone would take for the end of the text): kCorrupt naming the
// reason and where it was found.
Result<nlohmann::json> parse_json(std::string_view text, size_t max_depth = kDefaultMaxJsonDepth);

}  // namespace siesta
