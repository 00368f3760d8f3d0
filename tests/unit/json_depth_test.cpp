// JSON with a nesting limit (common/json_depth.h): what a client, a peer or a
// configuration may send is refused before nesting can exhaust a stack.
#include "common/json_depth.h"

#include <gtest/gtest.h>

#include <string>

namespace siesta {
namespace {

std::string nested_arrays(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(JsonDepthTest, CountsArraysAndObjectsNotBracketsInStrings) {
  JsonDepthScanner scan(10);
  EXPECT_TRUE(scan.feed(R"({"a": [1, {"b": "[[[[[[[[[[[[ \"{{{{{{{{{{{{{{{\" ]]]"}], "c": {}})"));
  EXPECT_EQ(scan.deepest(), 3u);
  JsonDepthScanner plain(1);
  EXPECT_TRUE(plain.feed("17"));
  EXPECT_EQ(plain.deepest(), 0u);
}

TEST(JsonDepthTest, LimitIsInclusive) {
  EXPECT_TRUE(check_json_depth(nested_arrays(64), 64));
  Result<void> deeper = check_json_depth(nested_arrays(65), 64);
  ASSERT_FALSE(deeper);
  EXPECT_EQ(deeper.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(deeper.error().message.find("64"), std::string::npos) << deeper.error().message;
}

TEST(JsonDepthTest, FedInPiecesAsWhole) {
  const std::string text = R"({"x": "\\\"[", "y": [[[1]]]})";
  for (size_t split = 0; split <= text.size(); ++split) {
    JsonDepthScanner scan(4);  // the object and three arrays; the '[' is in a string after escapes
    scan.feed(text.substr(0, split));
    scan.feed(text.substr(split));
    EXPECT_FALSE(scan.exceeded()) << split;
    EXPECT_EQ(scan.deepest(), 4u) << split;
    JsonDepthScanner tight(3);
    tight.feed(text.substr(0, split));
    tight.feed(text.substr(split));
    EXPECT_TRUE(tight.exceeded()) << split;
  }
}

TEST(JsonDepthTest, ParseRefusesDeepBodiesThatWouldCrashCopies) {
  // The shapes that overflowed a stack: 100,000 levels of arrays and objects.
  const std::string arrays = R"({"prompt": "hi", "x": )" + nested_arrays(100000) + "}";
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += R"({"a":)";
  objects += "1" + std::string(100000, '}');
  for (const std::string& text : {arrays, objects}) {
    Result<nlohmann::json> j = parse_json(text);
    ASSERT_FALSE(j);
    EXPECT_EQ(j.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(j.error().message.find("deeper than 64"), std::string::npos) << j.error().message;
  }
}

TEST(JsonDepthTest, ParseNamesMalformedJson) {
  Result<nlohmann::json> j = parse_json(R"({"a": )");
  ASSERT_FALSE(j);
  EXPECT_EQ(j.error().code, ErrorCode::kCorrupt);
  EXPECT_EQ(j.error().message.rfind("not valid JSON: ", 0), 0u) << j.error().message;
  Result<nlohmann::json> ok = parse_json(R"({"a": [1, 2]})");
  ASSERT_TRUE(ok);
  EXPECT_EQ((*ok)["a"][1], 2);
}

}  // namespace
}  // namespace siesta
