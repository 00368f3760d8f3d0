#include "common/json_depth.h"

namespace siesta {

bool JsonDepthScanner::feed(std::string_view piece) {
  if (exceeded_) return false;
  for (const char c : piece) {
    if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (c == '\\') {
        escaped_ = true;
      } else if (c == '"') {
        in_string_ = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string_ = true;
        break;
      case '[':
      case '{':
        ++depth_;
        if (depth_ > deepest_) deepest_ = depth_;
        if (depth_ > max_depth_) {
          exceeded_ = true;
          return false;
        }
        break;
      case ']':
      case '}':
        if (depth_ > 0) --depth_;
        break;
      default:
        break;
    }
  }
  return true;
}

std::string json_too_deep_message(size_t max_depth) {
  return "JSON nests arrays and objects deeper than " + std::to_string(max_depth) + " levels (the limit is " +
         std::to_string(max_depth) + ")";
}

Result<void> check_json_depth(std::string_view text, size_t max_depth) {
  JsonDepthScanner scan(max_depth);
  if (!scan.feed(text)) return invalid_argument(json_too_deep_message(max_depth));
  return {};
}

Result<nlohmann::json> parse_json(std::string_view text, size_t max_depth) {
  SIESTA_TRY(check_json_depth(text, max_depth));
  // nlohmann's parser ends the text at a NUL byte and ignores what follows;
  // JSON has none outside escapes, so a text with one is not JSON.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    return corrupt("not valid JSON: a NUL byte at offset " + std::to_string(nul));
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    // e.what(): "[json.exception.parse_error.101] parse error at line 1, column 2: ..."
    std::string what = e.what();
    const size_t bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    return corrupt("not valid JSON: " + what);
  }
}

}  // namespace siesta
