// Tokenizer: exact agreement with Hugging Face tokenizers on the real Qwen3
// tokenizer and the tiny model's tokenizer, special tokens, streaming
// detokenization, and clear errors for tokenizer.json files we cannot serve.
#include "model/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "model/tokenizer_text.h"
#include "test_data.h"

namespace siesta {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;

const fs::path kSource = siesta::testing::test_data_root();

fs::path assets_dir() {
  const char* env = std::getenv("SIESTA_ASSETS");
  if (env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr ? home : "") / ".cache" / "siesta" / "assets";
}

fs::path qwen3_tokenizer_path() { return assets_dir() / "qwen3-tokenizer" / "tokenizer.json"; }
fs::path tiny_tokenizer_path() { return kSource / "models" / "tiny-qwen3" / "tokenizer.json"; }

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json read_json(const fs::path& p) { return json::parse(read_text(p)); }

// The real Qwen3 tokenizer, loaded once. Missing means the test assets were
// never fetched: that is a failure (with the fix), never a skip.
const Tokenizer* qwen3() {
  static const Result<Tokenizer> tok = Tokenizer::load_file(qwen3_tokenizer_path());
  if (!tok) {
    if (!fs::exists(qwen3_tokenizer_path())) {
      ADD_FAILURE() << "The Qwen3 tokenizer is missing at " << qwen3_tokenizer_path()
                    << ": run scripts/setup (it fetches the test assets), or point SIESTA_ASSETS at them";
    } else {
      ADD_FAILURE() << tok.error().message;
    }
    return nullptr;
  }
  return &*tok;
}

const Tokenizer* tiny() {
  static const Result<Tokenizer> tok = Tokenizer::load_file(tiny_tokenizer_path());
  if (!tok) {
    ADD_FAILURE() << tok.error().message;
    return nullptr;
  }
  return &*tok;
}

std::vector<int32_t> ids_of(const json& list) { return list.get<std::vector<int32_t>>(); }

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The id of the token that stands for exactly one byte.
int32_t byte_token(const Tokenizer& tok, uint8_t byte) {
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    if (tok.token_bytes(id) == std::string(1, static_cast<char>(byte))) return id;
  }
  ADD_FAILURE() << "no token for byte " << int{byte};
  return -1;
}

// ---- Agreement with Hugging Face ----------------------------------------------

TEST(Qwen3Tokenizer, MatchesHuggingFaceOnEveryGoldenCase) {
  const Tokenizer* tok = qwen3();
  ASSERT_NE(tok, nullptr);
  const json golden = read_json(kSource / "tests/data/golden/qwen3_tokenizer_golden.json");
  ASSERT_EQ(golden["cases"].size(), 83u);
  for (const json& c : golden["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> expected = ids_of(c["ids"]);
    EXPECT_EQ(tok->encode(text), expected) << "text: " << json(text).dump();
    EXPECT_EQ(tok->decode(expected), c["decoded"].get<std::string>()) << "text: " << json(text).dump();
  }
}

TEST(Qwen3Tokenizer, VocabularyAndSpecialTokens) {
  const Tokenizer* tok = qwen3();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 151669);
  EXPECT_EQ(tok->token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(tok->token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok->token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(tok->token_to_id("Hello"), 9707);
  EXPECT_EQ(tok->token_to_id("no such token at all"), std::nullopt);
  EXPECT_TRUE(tok->is_special(151644));
  EXPECT_FALSE(tok->is_special(151668));  // </think> is an added token, not a special one
  EXPECT_FALSE(tok->is_special(9707));
  EXPECT_EQ(tok->token_bytes(tok->token_to_id("Ġworld").value()), " world");
  EXPECT_EQ(tok->token_bytes(-1), "");
  EXPECT_EQ(tok->token_bytes(tok->vocab_size()), "");
}

TEST(Qwen3Tokenizer, CachedAndUncachedEncodingAgree) {
  Result<Tokenizer> uncached = Tokenizer::load_file(qwen3_tokenizer_path(), TokenizerOptions{.word_cache_words = 0});
  ASSERT_TRUE(uncached) << "run scripts/setup: " << uncached.error().message;
  const Tokenizer* cached = qwen3();
  ASSERT_NE(cached, nullptr);
  const json golden = read_json(kSource / "tests/data/golden/qwen3_tokenizer_golden.json");
  for (const json& c : golden["cases"]) {
    const std::string text = c["text"].get<std::string>();
    EXPECT_EQ(uncached->encode(text), cached->encode(text)) << json(text).dump();
  }
}

TEST(Qwen3Tokenizer, EncodesFromManyThreadsAtOnce) {
  const Tokenizer* tok = qwen3();
  ASSERT_NE(tok, nullptr);
  const json golden = read_json(kSource / "tests/data/golden/qwen3_tokenizer_golden.json");
  std::vector<std::pair<std::string, std::vector<int32_t>>> cases;
  for (const json& c : golden["cases"]) cases.emplace_back(c["text"].get<std::string>(), ids_of(c["ids"]));
  // A small cache forces concurrent inserts and shard clears while others read.
  Result<Tokenizer> small_cache = Tokenizer::load_file(qwen3_tokenizer_path(), TokenizerOptions{.word_cache_words = 64});
  ASSERT_TRUE(small_cache);
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < cases.size(); ++i) {
          const auto& [text, ids] = cases[(i + static_cast<size_t>(t) * 7) % cases.size()];
          if (tok->encode(text) != ids) ++mismatches[t];
          if (small_cache->encode(text) != ids) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST(Qwen3Tokenizer, RoundTripsLongAndRepetitiveText) {
  const Tokenizer* tok = qwen3();
  ASSERT_NE(tok, nullptr);
  const std::string long_word(100000, 'z');
  EXPECT_EQ(tok->decode(tok->encode(long_word)), long_word);
  std::string mixed;
  for (int i = 0; i < 200; ++i) mixed += "東京👨‍👩‍👧 café int main() { return 0; }\n";
  EXPECT_EQ(tok->decode(tok->encode(mixed)), mixed);
}

TEST(TinyTokenizer, MatchesHuggingFaceGolden) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 4096);
  const json golden = read_json(kSource / "tests/data/golden/tiny-qwen3_golden.json");
  ASSERT_FALSE(golden["tokenizer_cases"].empty());
  for (const json& c : golden["tokenizer_cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> expected = ids_of(c["input_ids"]);
    EXPECT_EQ(tok->encode(text), expected) << json(text).dump();
    EXPECT_EQ(tok->decode(expected), text) << json(text).dump();
  }
  ASSERT_FALSE(golden["prompts"].empty());
  for (const json& p : golden["prompts"]) {
    const std::string text = p["text"].get<std::string>();
    const std::vector<int32_t> expected = ids_of(p["input_ids"]);
    EXPECT_EQ(tok->encode(text), expected) << json(text).dump();
    EXPECT_EQ(tok->decode(expected), p["decoded"].get<std::string>()) << json(text).dump();
  }
}

// ---- Behaviour --------------------------------------------------------------

TEST(Tokenizer, SpecialTokensInsideTextAreNeverSplit) {
  const Tokenizer* tok = qwen3();
  ASSERT_NE(tok, nullptr);
  const int32_t im_start = tok->token_to_id("<|im_start|>").value();
  const int32_t im_end = tok->token_to_id("<|im_end|>").value();
  const std::vector<int32_t> ids = tok->encode("<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(ids, concat(concat({im_start}, tok->encode("user\nhi")), {im_end}));
  EXPECT_EQ(tok->decode(ids), "<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(tok->decode(ids, /*skip_special_tokens=*/true), "user\nhi");
  // Glued to words on both sides, and back to back.
  EXPECT_EQ(tok->encode("a<|im_end|>b"), concat(concat(tok->encode("a"), {im_end}), tok->encode("b")));
  EXPECT_EQ(tok->encode("<|im_end|><|im_start|>"), (std::vector<int32_t>{im_end, im_start}));
  // Something that only looks like a special token is ordinary text.
  const std::vector<int32_t> almost = tok->encode("<|im_start|");
  EXPECT_EQ(std::count(almost.begin(), almost.end(), im_start), 0);
  EXPECT_EQ(tok->decode(almost), "<|im_start|");
}

TEST(Tokenizer, EmptyInput) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  EXPECT_TRUE(tok->encode("").empty());
  EXPECT_EQ(tok->decode({}), "");
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.finish(), "");
}

TEST(Tokenizer, InvalidUtf8InputIsReadAsReplacementCharacters) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode("a\xff" "b"), tok->encode("a\xEF\xBF\xBD" "b"));
  EXPECT_EQ(tok->encode("\xE6\x97"), tok->encode("\xEF\xBF\xBD"));  // a cut-short character: one U+FFFD
}

TEST(Tokenizer, DecodeSkipsUnknownIdsAndRepairsBrokenUtf8) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> hello = tok->encode("hello");
  EXPECT_EQ(tok->decode(concat(concat({-5}, hello), {tok->vocab_size() + 10})), "hello");
  // The first two bytes of "€" (E2 82 AC), then "x": one U+FFFD for the cut-short character.
  const std::vector<int32_t> broken = {byte_token(*tok, 0xE2), byte_token(*tok, 0x82), tok->encode("x")[0]};
  EXPECT_EQ(tok->decode(broken), "\xEF\xBF\xBD" "x");
  // A lone continuation byte.
  EXPECT_EQ(tok->decode({byte_token(*tok, 0xAC)}), "\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizer, EmitsOnlyWholeCharacters) {
  const Tokenizer* tok = tiny();  // small vocabulary: emoji and CJK split into byte tokens
  ASSERT_NE(tok, nullptr);
  const std::string text = "ok😀🚀 東京 naïve 👨‍👩‍👧 done";
  const std::vector<int32_t> ids = tok->encode(text);
  ASSERT_GT(ids.size(), 10u);
  IncrementalDetokenizer detok(*tok);
  std::string streamed;
  int held_back = 0;
  for (int32_t id : ids) {
    const std::string piece = detok.push(id);
    EXPECT_TRUE(tokenizer_internal::is_valid_utf8(piece)) << json(piece).dump(-1, ' ', false,
                                                                              json::error_handler_t::replace);
    if (piece.empty()) ++held_back;
    streamed += piece;
    // Nothing is ever emitted that is not a prefix of the final text.
    EXPECT_EQ(text.compare(0, streamed.size(), streamed), 0);
  }
  streamed += detok.finish();
  EXPECT_EQ(streamed, tok->decode(ids));
  EXPECT_EQ(streamed, text);
  EXPECT_GT(held_back, 0) << "the test text should split characters across tokens";
}

TEST(IncrementalDetokenizer, HoldsBackAPartialCharacterUntilItCompletes) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.push(byte_token(*tok, 0xE2)), "");
  EXPECT_EQ(detok.push(byte_token(*tok, 0x82)), "");
  EXPECT_EQ(detok.push(byte_token(*tok, 0xAC)), "€");
  EXPECT_EQ(detok.finish(), "");
}

TEST(IncrementalDetokenizer, FinishFlushesACutShortCharacterAsReplacement) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.push(tok->encode("a")[0]), "a");
  EXPECT_EQ(detok.push(byte_token(*tok, 0xF0)), "");
  EXPECT_EQ(detok.push(byte_token(*tok, 0x9F)), "");
  EXPECT_EQ(detok.finish(), "\xEF\xBF\xBD");
  // An invalid byte that no later byte can repair is emitted at once.
  EXPECT_EQ(detok.push(byte_token(*tok, 0xFF)), "\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizer, SkipsSpecialTokensWhenAsked) {
  const Tokenizer* tok = qwen3();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> ids = tok->encode("<|im_start|>assistant\n東京<|im_end|>");
  IncrementalDetokenizer detok(*tok, /*skip_special_tokens=*/true);
  std::string streamed;
  for (int32_t id : ids) streamed += detok.push(id);
  streamed += detok.finish();
  EXPECT_EQ(streamed, "assistant\n東京");
  EXPECT_EQ(streamed, tok->decode(ids, true));
}

// ---- Variants of tokenizer.json -------------------------------------------------

json tiny_json() { return read_json(tiny_tokenizer_path()); }

TEST(TokenizerJson, MergesWrittenAsStringsGiveTheSameTokens) {
  json doc = tiny_json();
  json merges = json::array();
  for (const json& m : doc["model"]["merges"]) merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  doc["model"]["merges"] = merges;
  Result<Tokenizer> tok = Tokenizer::from_json_string(doc.dump());
  ASSERT_TRUE(tok) << tok.error().message;
  const json golden = read_json(kSource / "tests/data/golden/tiny-qwen3_golden.json");
  for (const json& c : golden["tokenizer_cases"])
    EXPECT_EQ(tok->encode(c["text"].get<std::string>()), ids_of(c["input_ids"]));
}

TEST(TokenizerJson, AcceptsPlainByteLevelAndNormalizerVariants) {
  json doc = tiny_json();
  doc["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  for (const json& normalizer :
       {json(nullptr), json{{"type", "NFC"}}, json{{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}}}) {
    doc["normalizer"] = normalizer;
    Result<Tokenizer> tok = Tokenizer::from_json_string(doc.dump());
    ASSERT_TRUE(tok) << tok.error().message;
    const std::string text = "Hello world, it's 2024!\n\tok";
    EXPECT_EQ(tok->decode(tok->encode(text)), text);
    // GPT-2's split keeps the space with the word: " world" is one piece.
    EXPECT_EQ(tok->encode("a world"), concat(tok->encode("a"), tok->encode(" world")));
  }
}

TEST(TokenizerJson, NormalizesBeforeSplitting) {
  const Tokenizer* tok = tiny();
  ASSERT_NE(tok, nullptr);
  // "e" + combining acute is NFC "é".
  EXPECT_EQ(tok->encode("caf" "e\xCC\x81"), tok->encode("café"));
}

TEST(TokenizerJson, AddedTokenStripAndSingleWordOptions) {
  json doc = tiny_json();
  doc["added_tokens"].push_back({{"id", 4096}, {"content", "<mask>"}, {"special", true}, {"lstrip", true},
                                 {"rstrip", false}, {"single_word", false}, {"normalized", false}});
  doc["added_tokens"].push_back({{"id", 4097}, {"content", "dog"}, {"special", false}, {"lstrip", false},
                                 {"rstrip", true}, {"single_word", true}, {"normalized", false}});
  doc["added_tokens"].push_back({{"id", 4098}, {"content", "é"}, {"special", false}, {"lstrip", false},
                                 {"rstrip", false}, {"single_word", false}, {"normalized", true}});
  Result<Tokenizer> tok = Tokenizer::from_json_string(doc.dump());
  ASSERT_TRUE(tok) << tok.error().message;
  EXPECT_EQ(tok->vocab_size(), 4099);
  // lstrip: the spaces before <mask> belong to it.
  EXPECT_EQ(tok->encode("a  <mask> b"), concat(concat(tok->encode("a"), {4096}), tok->encode(" b")));
  // single_word: "dog" inside "hotdog" is not the added token; standing alone it is, rstrip takes the space.
  const std::vector<int32_t> hotdog = tok->encode("hotdog");
  EXPECT_EQ(std::count(hotdog.begin(), hotdog.end(), 4097), 0);
  EXPECT_EQ(tok->encode("a dog ran"), concat(concat(tok->encode("a "), {4097}), tok->encode("ran")));
  // normalized: matched after NFC, so the decomposed spelling finds it too.
  EXPECT_EQ(tok->encode("xe\xCC\x81y"), concat(concat(tok->encode("x"), {4098}), tok->encode("y")));
  EXPECT_EQ(tok->decode({4096}, /*skip_special_tokens=*/true), "");
  EXPECT_EQ(tok->decode({4096}), "<mask>");
  // As in HF tokenizers, added tokens go through the ByteLevel decoder too:
  // "é" is the alphabet's stand-in for byte 0xE9, a lone lead byte, so U+FFFD.
  EXPECT_EQ(tok->decode({4098}), "\xEF\xBF\xBD");
}

TEST(TokenizerJson, MalformedFilesGiveOneLineErrors) {
  const json good = tiny_json();
  struct Case {
    std::string name;
    std::string text;
    std::string message;  // a part of the expected error
  };
  auto with = [&](const std::function<void(json&)>& edit) {
    json doc = good;
    edit(doc);
    return doc.dump();
  };
  const std::vector<Case> cases = {
      {"empty", "", "tokenizer.json"},
      {"not json", "{\"model\": ", "tokenizer.json"},
      {"not an object", "[1, 2]", "not a JSON object"},
      {"no model", with([](json& d) { d.erase("model"); }), "model is missing"},
      {"word piece", with([](json& d) { d["model"]["type"] = "WordPiece"; }), "model.type 'WordPiece' is not supported"},
      {"vocab list", with([](json& d) { d["model"]["vocab"] = json::array({1, 2}); }), "model.vocab"},
      {"bad id", with([](json& d) { d["model"]["vocab"]["hello"] = "x"; }), "not an integer id"},
      {"negative id", with([](json& d) { d["model"]["vocab"]["hello"] = -3; }), "outside"},
      {"merges missing", with([](json& d) { d["model"].erase("merges"); }), "model.merges is missing"},
      {"merge unknown", with([](json& d) { d["model"]["merges"][0] = {"Ġ", "nosuchtoken"}; }), "not in model.vocab"},
      {"merge no space", with([](json& d) { d["model"]["merges"][0] = "ab"; }), "two tokens separated by a space"},
      {"merge shape", with([](json& d) { d["model"]["merges"][0] = 7; }), "model.merges[0]"},
      {"dropout", with([](json& d) { d["model"]["dropout"] = 0.1; }), "dropout"},
      {"normalizer", with([](json& d) { d["normalizer"] = {{"type", "NFKC"}}; }), "normalizer 'NFKC' is not supported"},
      {"pre-tokenizer", with([](json& d) { d["pre_tokenizer"] = {{"type", "Whitespace"}}; }), "pre_tokenizer 'Whitespace'"},
      {"split behaviour",
       with([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext"; }), "Isolated"},
      {"bad regex", with([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
       "does not compile"},
      {"decoder", with([](json& d) { d["decoder"] = {{"type", "WordPiece"}}; }), "decoder 'WordPiece'"},
      {"added tokens", with([](json& d) { d["added_tokens"] = 5; }), "added_tokens is not a list"},
      {"added token id", with([](json& d) { d["added_tokens"][0].erase("id"); }), "added_tokens[0].id"},
      {"added content", with([](json& d) { d["added_tokens"][0]["content"] = ""; }), "added_tokens[0].content"},
  };
  for (const Case& c : cases) {
    Result<Tokenizer> tok = Tokenizer::from_json_string(c.text);
    ASSERT_FALSE(tok) << c.name << " was accepted";
    EXPECT_THAT(tok.error().message, HasSubstr(c.message)) << c.name;
    EXPECT_EQ(tok.error().message.find('\n'), std::string::npos) << c.name << ": " << tok.error().message;
  }
}

TEST(TokenizerJson, MissingFileNamesThePath) {
  Result<Tokenizer> tok = Tokenizer::load("/nonexistent/model");
  ASSERT_FALSE(tok);
  EXPECT_EQ(tok.error().code, ErrorCode::kNotFound);
  EXPECT_THAT(tok.error().message, HasSubstr("/nonexistent/model/tokenizer.json"));
}

// ---- Text stages ----------------------------------------------------------------

TEST(TokenizerText, NfcQuickCheckNeverSkipsRealNormalization) {
  // Every code point the quick check lets through must be left alone by NFC,
  // alone and after a letter it could otherwise compose with.
  int checked = 0;
  for (uint32_t cp = 0x80; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string s;
    tokenizer_internal::append_utf8(cp, s);
    if (!tokenizer_internal::is_nfc_quick(s)) continue;
    ++checked;
    for (const std::string& prefix : {std::string(), std::string("a"), std::string("\xEA\xB0\x80")}) {  // "가"
      std::string nfc;
      ASSERT_TRUE(tokenizer_internal::to_nfc(prefix + s, nfc));
      ASSERT_EQ(nfc, prefix + s) << "U+" << std::hex << cp;
    }
  }
  EXPECT_GT(checked, 80000);
  EXPECT_FALSE(tokenizer_internal::is_nfc_quick("e\xCC\x81"));   // combining acute
  EXPECT_FALSE(tokenizer_internal::is_nfc_quick("\xE2\x84\xAB"));  // U+212B ANGSTROM SIGN
}

TEST(TokenizerText, LossyUtf8ReplacesMaximalSubparts) {
  auto lossy = [](std::string_view s) {
    std::string out;
    tokenizer_internal::append_utf8_lossy(s, out);
    return out;
  };
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(lossy("abc"), "abc");
  EXPECT_EQ(lossy("\xE2\x82"), r);                // cut short: one replacement
  EXPECT_EQ(lossy("\xC0\xAF"), r + r);            // overlong: each byte
  EXPECT_EQ(lossy("\xED\xA0\x80"), r + r + r);    // surrogate: each byte
  EXPECT_EQ(lossy("\xF0\x9F\x98" "a"), r + "a");  // cut-short emoji then ASCII
  EXPECT_EQ(tokenizer_internal::incomplete_utf8_tail("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(tokenizer_internal::incomplete_utf8_tail("ab\xE2"), 1u);
  EXPECT_EQ(tokenizer_internal::incomplete_utf8_tail("ab\xFF"), 0u);
  EXPECT_EQ(tokenizer_internal::incomplete_utf8_tail("\xE2\x82\xAC"), 0u);
}

}  // namespace
}  // namespace siesta
