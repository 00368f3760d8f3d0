// libFuzzer target: the JSON depth check (common/json_depth.h) that every
// HTTP body, side-channel message and configuration passes before it is
// parsed. On any text nlohmann's parser accepts, the scanner must find the
// nesting exactly (as nlohmann's own events count it, without recursion),
// fed whole or in pieces; parse_json must accept exactly the texts within the
// limit (and refuse a raw NUL byte, which nlohmann alone takes for the end);
// and nothing may crash, whatever the bytes.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/json_depth.h"

using namespace siesta;
using nlohmann::json;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

// Nesting as nlohmann's SAX events count it.
struct DepthEvents : nlohmann::json_sax<json> {
  size_t depth = 0;
  size_t deepest = 0;
  bool open() {
    if (++depth > deepest) deepest = depth;
    return true;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(); }
  bool key(string_t&) override { return true; }
  bool end_object() override {
    --depth;
    return true;
  }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override {
    --depth;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t limit = data[0] % 16;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  JsonDepthScanner whole(SIZE_MAX);
  require(whole.feed(text));
  JsonDepthScanner pieces(SIZE_MAX);
  for (size_t i = 0; i < text.size(); i += 7) pieces.feed(text.substr(i, 7));
  require(pieces.deepest() == whole.deepest());
  JsonDepthScanner bounded(limit);
  const bool within = bounded.feed(text);
  require(within == (whole.deepest() <= limit));
  Result<json> parsed = parse_json(text, limit);
  // nlohmann stops at a NUL byte (what follows is ignored); parse_json refuses it.
  if (text.find('\0') != std::string_view::npos) {
    require(!parsed);
    return 0;
  }
  DepthEvents events;
  const bool valid = json::sax_parse(text.begin(), text.end(), &events, nlohmann::detail::input_format_t::json, true);
  if (valid) require(events.deepest == whole.deepest());
  if (parsed) require(valid && within);
  if (valid && within) require(parsed.has_value());
  if (!within) require(!parsed && parsed.error().code == ErrorCode::kInvalidArgument);
  return 0;
}
