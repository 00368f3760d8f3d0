#include "model/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <new>
#include <utility>

#include "model/tokenizer_bpe.h"
#include "model/tokenizer_text.h"

namespace siesta {

namespace ti = tokenizer_internal;
using Json = nlohmann::json;

namespace {

// The pre-tokenizer regex of GPT-2, which ByteLevel{use_regex: true} implies.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Ids above this are refused: they would only make the id tables huge.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// Per-id flags.
constexpr uint8_t kKnown = 1;
constexpr uint8_t kSpecial = 2;

// ---- JSON access that reports the field instead of throwing ----------------

const Json* member(const Json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

Result<bool> optional_bool(const Json& object, const char* key, bool fallback, const std::string& where) {
  const Json* v = member(object, key);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_boolean()) return corrupt(where + "." + key + " is not a boolean");
  return v->get<bool>();
}

Result<std::string> required_string(const Json& object, const char* key, const std::string& where) {
  const Json* v = member(object, key);
  if (v == nullptr || !v->is_string()) return corrupt(where + "." + key + " is missing or not a string");
  return v->get<std::string>();
}

std::string type_of(const Json& object) {
  const Json* t = member(object, "type");
  return t != nullptr && t->is_string() ? t->get<std::string>() : std::string();
}

Result<int32_t> token_id(const Json& v, const std::string& where) {
  if (!v.is_number_integer()) return corrupt(where + " is not an integer id");
  const int64_t id = v.get<int64_t>();
  if (id < 0 || id > kMaxTokenId)
    return corrupt(where + " = " + std::to_string(id) + " is outside [0, " + std::to_string(kMaxTokenId) + "]");
  return static_cast<int32_t>(id);
}

// ---- Sections of tokenizer.json ---------------------------------------------

// normalizer: null, NFC, or a Sequence of those. Returns whether NFC applies.
Result<bool> parse_normalizer(const Json* n) {
  if (n == nullptr || n->is_null()) return false;
  const std::string type = type_of(*n);
  if (type == "NFC") return true;
  if (type == "Sequence") {
    const Json* list = member(*n, "normalizers");
    if (list == nullptr || !list->is_array()) return corrupt("normalizer.normalizers is missing or not a list");
    bool nfc = false;
    for (const Json& item : *list) {
      SIESTA_ASSIGN_OR_RETURN(bool item_nfc, parse_normalizer(&item));
      nfc = nfc || item_nfc;
    }
    return nfc;
  }
  return invalid_argument("normalizer '" + type + "' is not supported (only NFC, a Sequence of NFC, or null)");
}

struct PreTokenizer {
  std::vector<ti::SplitRegex> splits;        // applied in order, each on the pieces of the last
  bool add_prefix_space = false;             // ByteLevel: prefix every piece that lacks one
  std::optional<ti::SplitRegex> byte_level;  // ByteLevel{use_regex: true}: the GPT-2 split
};

Result<void> parse_split(const Json& split, const std::string& where, PreTokenizer& out) {
  const Json* pattern = member(split, "pattern");
  const Json* regex = pattern != nullptr ? member(*pattern, "Regex") : nullptr;
  const Json* literal = pattern != nullptr ? member(*pattern, "String") : nullptr;
  const Json* text = regex != nullptr ? regex : literal;
  if (text == nullptr || !text->is_string()) return corrupt(where + ".pattern needs a Regex or String");
  const Json* behavior = member(split, "behavior");
  const std::string behavior_name = behavior != nullptr && behavior->is_string() ? behavior->get<std::string>() : "";
  if (behavior_name != "Isolated")
    return invalid_argument(where + ".behavior '" + behavior_name + "' is not supported (only Isolated)");
  SIESTA_ASSIGN_OR_RETURN(bool invert, optional_bool(split, "invert", false, where));
  if (invert) return invalid_argument(where + ".invert = true is not supported");
  Result<ti::SplitRegex> compiled = ti::SplitRegex::compile(text->get<std::string>(), literal == text);
  if (!compiled) return compiled.error().with_context(where);
  out.splits.push_back(std::move(*compiled));
  return {};
}

Result<void> parse_byte_level(const Json& byte_level, const std::string& where, PreTokenizer& out) {
  SIESTA_ASSIGN_OR_RETURN(out.add_prefix_space, optional_bool(byte_level, "add_prefix_space", false, where));
  SIESTA_ASSIGN_OR_RETURN(bool use_regex, optional_bool(byte_level, "use_regex", true, where));
  if (use_regex) {
    Result<ti::SplitRegex> gpt2 = ti::SplitRegex::compile(kGpt2Pattern, false);
    if (!gpt2) return gpt2.error().with_context(where);
    out.byte_level = std::move(*gpt2);
  }
  return {};
}

// pre_tokenizer: ByteLevel, or a Sequence of Splits that ends in ByteLevel (a
// Split after ByteLevel would see the byte alphabet, not the text).
Result<PreTokenizer> parse_pre_tokenizer(const Json& doc) {
  const Json* p = member(doc, "pre_tokenizer");
  if (p == nullptr || p->is_null())
    return invalid_argument("pre_tokenizer null is not supported (byte-level BPE needs a ByteLevel pre-tokenizer)");
  PreTokenizer out;
  const std::string type = type_of(*p);
  if (type == "ByteLevel") {
    SIESTA_TRY(parse_byte_level(*p, "pre_tokenizer", out));
    return out;
  }
  if (type != "Sequence")
    return invalid_argument("pre_tokenizer '" + type + "' is not supported (only ByteLevel or a Sequence of Split + ByteLevel)");
  const Json* list = member(*p, "pretokenizers");
  if (list == nullptr || !list->is_array() || list->empty())
    return corrupt("pre_tokenizer.pretokenizers is missing or empty");
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& step = (*list)[i];
    const std::string where = "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]";
    const std::string step_type = type_of(step);
    const bool last = i + 1 == list->size();
    if (step_type == "Split" && !last) {
      SIESTA_TRY(parse_split(step, where, out));
    } else if (step_type == "ByteLevel" && last) {
      SIESTA_TRY(parse_byte_level(step, where, out));
    } else {
      return invalid_argument(where + " '" + step_type +
                              "' is not supported here (only Split steps followed by one ByteLevel)");
    }
  }
  return out;
}

Result<void> check_decoder(const Json& doc) {
  const Json* d = member(doc, "decoder");
  const std::string type = d != nullptr ? type_of(*d) : std::string();
  if (type != "ByteLevel")
    return invalid_argument("decoder '" + (type.empty() ? std::string("null") : type) +
                            "' is not supported (only ByteLevel)");
  return {};
}

Result<std::vector<ti::AddedToken>> parse_added_tokens(const Json& doc) {
  std::vector<ti::AddedToken> tokens;
  const Json* list = member(doc, "added_tokens");
  if (list == nullptr || list->is_null()) return tokens;
  if (!list->is_array()) return corrupt("added_tokens is not a list");
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& item = (*list)[i];
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!item.is_object()) return corrupt(where + " is not an object");
    ti::AddedToken t;
    const Json* id = member(item, "id");
    if (id == nullptr) return corrupt(where + ".id is missing");
    SIESTA_ASSIGN_OR_RETURN(t.id, token_id(*id, where + ".id"));
    SIESTA_ASSIGN_OR_RETURN(t.content, required_string(item, "content", where));
    if (t.content.empty()) return corrupt(where + ".content is empty");
    SIESTA_ASSIGN_OR_RETURN(t.special, optional_bool(item, "special", false, where));
    SIESTA_ASSIGN_OR_RETURN(t.lstrip, optional_bool(item, "lstrip", false, where));
    SIESTA_ASSIGN_OR_RETURN(t.rstrip, optional_bool(item, "rstrip", false, where));
    SIESTA_ASSIGN_OR_RETURN(t.single_word, optional_bool(item, "single_word", false, where));
    SIESTA_ASSIGN_OR_RETURN(t.normalized, optional_bool(item, "normalized", !t.special, where));
    tokens.push_back(std::move(t));
  }
  return tokens;
}

// model.vocab and the added tokens: token text -> id, and id -> bytes.
struct Vocabulary {
  ti::TokenIndex ids;                                      // as spelled in tokenizer.json
  std::vector<std::pair<uint32_t, uint32_t>> bytes_span;   // id -> (offset, length) in bytes
  std::string bytes;
  std::vector<uint8_t> flags;                              // kKnown, kSpecial per id

  // `spelled` as in tokenizer.json; its bytes are what the ByteLevel decoder makes of it.
  void set_token(int32_t id, std::string_view spelled, uint8_t id_flags) {
    const auto index = static_cast<size_t>(id);
    if (index >= flags.size()) {
      flags.resize(index + 1, 0);
      bytes_span.resize(index + 1, {0, 0});
    }
    const size_t offset = bytes.size();
    ti::append_token_bytes(spelled, bytes);
    bytes_span[index] = {static_cast<uint32_t>(offset), static_cast<uint32_t>(bytes.size() - offset)};
    flags[index] = id_flags;
  }
};

// One merge rule as read, before the vocabulary resolves it: two spans of a text arena.
struct MergeText {
  uint32_t left_offset, left_length, right_offset, right_length;
};

// Reads tokenizer.json in one pass (nlohmann SAX). model.vocab and
// model.merges, 150k entries each in a real file, go straight into compact
// tables: a DOM of them costs more than all the rest of loading. The other
// sections are small and become a DOM for the section parsers above.
class TokenizerJsonReader final : public nlohmann::json_sax<Json> {
 public:
  Json doc;  // tokenizer.json without model.vocab and model.merges
  Vocabulary vocab;
  bool has_vocab = false;
  bool has_merges = false;
  std::string merge_text;  // arena for the tokens of merges
  std::vector<MergeText> merges;
  std::optional<Status> error;

  bool null() override { return scalar(Json(nullptr)); }
  bool boolean(bool value) override { return scalar(Json(value)); }
  bool number_integer(number_integer_t value) override {
    return section() == Section::kVocab ? vocab_entry(value) : scalar(Json(value));
  }
  bool number_unsigned(number_unsigned_t value) override {
    if (section() != Section::kVocab) return scalar(Json(value));
    return vocab_entry(value > static_cast<uint64_t>(kMaxTokenId) ? kMaxTokenId + 1 : static_cast<int64_t>(value));
  }
  bool number_float(number_float_t value, const string_t&) override { return scalar(Json(value)); }
  bool binary(binary_t&) override { return fail(corrupt("tokenizer.json holds binary data")); }
  bool string(string_t& value) override;
  bool key(string_t& value) override {
    key_ = std::move(value);
    return true;
  }
  bool start_object(std::size_t) override;
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override;
  bool end_array() override;
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return fail(corrupt(std::string("tokenizer.json is not valid JSON: ") + e.what()));
  }

 private:
  enum class Section { kDom, kVocab, kMerges, kMergePair };
  struct Frame {
    Section section;
    Json* container;   // the DOM node being filled; null in the streamed sections
    std::string name;  // key under which it sits in its parent object ("" in an array)
  };

  Section section() const { return frames_.empty() ? Section::kDom : frames_.back().section; }
  bool fail(Status status) {
    if (!error) error = std::move(status);
    return false;
  }
  // The key a new value takes in the current object, "" in an array.
  std::string member_name() const {
    return !frames_.empty() && frames_.back().container->is_object() ? key_ : std::string();
  }
  bool parent_is_model() const { return frames_.size() == 2 && frames_[1].name == "model"; }
  std::string merge_where() const { return "model.merges[" + std::to_string(merges.size()) + "]"; }
  Status not_an_id() const { return corrupt("model.vocab[\"" + key_ + "\"] is not an integer id"); }
  Status not_a_merge() const { return corrupt(merge_where() + " is neither \"a b\" nor [\"a\", \"b\"]"); }

  Json* add_to_dom(Json value);
  bool scalar(Json value);
  bool vocab_entry(int64_t id);
  uint32_t add_merge_token(std::string_view token) {
    merge_text.append(token);
    return static_cast<uint32_t>(merge_text.size() - token.size());
  }

  std::vector<Frame> frames_;
  std::string key_;
  MergeText pair_{};        // the [a, b] merge being read
  size_t pair_strings_ = 0;
};

Json* TokenizerJsonReader::add_to_dom(Json value) {
  if (frames_.empty()) {
    doc = std::move(value);
    return &doc;
  }
  Json& parent = *frames_.back().container;
  if (parent.is_array()) {
    parent.push_back(std::move(value));
    return &parent.back();
  }
  Json& slot = parent[key_];
  slot = std::move(value);
  return &slot;
}

bool TokenizerJsonReader::scalar(Json value) {
  switch (section()) {
    case Section::kDom:
      add_to_dom(std::move(value));
      return true;
    case Section::kVocab:
      return fail(not_an_id());
    case Section::kMerges:
    case Section::kMergePair:
      return fail(not_a_merge());
  }
  return false;
}

bool TokenizerJsonReader::vocab_entry(int64_t id) {
  if (id < 0 || id > kMaxTokenId)
    return fail(corrupt("model.vocab[\"" + key_ + "\"] = " + std::to_string(id) + " is outside [0, " +
                        std::to_string(kMaxTokenId) + "]"));
  vocab.ids.insert(key_, static_cast<int32_t>(id));
  vocab.set_token(static_cast<int32_t>(id), key_, kKnown);
  return true;
}

bool TokenizerJsonReader::string(string_t& value) {
  switch (section()) {
    case Section::kMerges: {
      // The older form "a b": the first space separates the two tokens.
      const size_t space = value.find(' ');
      if (space == std::string::npos)
        return fail(corrupt(merge_where() + " \"" + value + "\" is not two tokens separated by a space"));
      const std::string_view text(value);
      const uint32_t left = add_merge_token(text.substr(0, space));
      const uint32_t right = add_merge_token(text.substr(space + 1));
      merges.push_back(MergeText{left, static_cast<uint32_t>(space), right,
                                 static_cast<uint32_t>(value.size() - space - 1)});
      return true;
    }
    case Section::kMergePair: {
      if (pair_strings_ >= 2) return fail(not_a_merge());
      const uint32_t offset = add_merge_token(value);
      if (pair_strings_++ == 0) {
        pair_.left_offset = offset;
        pair_.left_length = static_cast<uint32_t>(value.size());
      } else {
        pair_.right_offset = offset;
        pair_.right_length = static_cast<uint32_t>(value.size());
      }
      return true;
    }
    default:
      return scalar(Json(std::move(value)));
  }
}

bool TokenizerJsonReader::start_object(std::size_t) {
  switch (section()) {
    case Section::kDom: {
      std::string name = member_name();
      if (parent_is_model() && name == "vocab") {
        has_vocab = true;
        frames_.push_back(Frame{Section::kVocab, nullptr, std::move(name)});
        return true;
      }
      Json* node = add_to_dom(Json::object());
      frames_.push_back(Frame{Section::kDom, node, std::move(name)});
      return true;
    }
    case Section::kVocab:
      return fail(not_an_id());
    default:
      return fail(not_a_merge());
  }
}

bool TokenizerJsonReader::start_array(std::size_t) {
  switch (section()) {
    case Section::kDom: {
      std::string name = member_name();
      if (parent_is_model() && name == "merges") {
        has_merges = true;
        frames_.push_back(Frame{Section::kMerges, nullptr, std::move(name)});
        return true;
      }
      Json* node = add_to_dom(Json::array());
      frames_.push_back(Frame{Section::kDom, node, std::move(name)});
      return true;
    }
    case Section::kMerges:
      pair_strings_ = 0;
      frames_.push_back(Frame{Section::kMergePair, nullptr, std::string()});
      return true;
    case Section::kVocab:
      return fail(not_an_id());
    default:
      return fail(not_a_merge());
  }
}

bool TokenizerJsonReader::end_array() {
  if (section() == Section::kMergePair) {
    if (pair_strings_ != 2) return fail(not_a_merge());
    merges.push_back(pair_);
  }
  frames_.pop_back();
  return true;
}

// Turns the merges as read into (left id, right id) -> (rank, merged id).
// Three lookups per merge in a table far larger than the caches: they go in
// batches whose slots are prefetched together, so the misses overlap.
Result<ti::MergeTable> resolve_merges(const std::vector<MergeText>& merges, std::string_view text,
                                      const ti::TokenIndex& vocab) {
  constexpr size_t kBatch = 16;
  ti::MergeTable table;
  table.reserve(merges.size());
  std::array<std::string, kBatch> merged;
  std::array<uint32_t, kBatch * 3> hashes;
  for (size_t first = 0; first < merges.size(); first += kBatch) {
    const size_t count = std::min(kBatch, merges.size() - first);
    auto left = [&](size_t k) { return text.substr(merges[first + k].left_offset, merges[first + k].left_length); };
    auto right = [&](size_t k) { return text.substr(merges[first + k].right_offset, merges[first + k].right_length); };
    for (size_t k = 0; k < count; ++k) {
      merged[k].assign(left(k)).append(right(k));
      hashes[3 * k] = ti::TokenIndex::hash_of(left(k));
      hashes[3 * k + 1] = ti::TokenIndex::hash_of(right(k));
      hashes[3 * k + 2] = ti::TokenIndex::hash_of(merged[k]);
    }
    for (size_t h = 0; h < 3 * count; ++h) vocab.prefetch(hashes[h]);
    for (size_t k = 0; k < count; ++k) {
      const std::optional<int32_t> left_id = vocab.find(left(k), hashes[3 * k]);
      const std::optional<int32_t> right_id = vocab.find(right(k), hashes[3 * k + 1]);
      const std::optional<int32_t> merged_id = vocab.find(merged[k], hashes[3 * k + 2]);
      const std::string where = "model.merges[" + std::to_string(first + k) + "]";
      if (!left_id || !right_id)
        return corrupt(where + ": token \"" + std::string(left_id ? right(k) : left(k)) + "\" is not in model.vocab");
      if (!merged_id) return corrupt(where + ": merged token \"" + merged[k] + "\" is not in model.vocab");
      table.insert(*left_id, *right_id, ti::MergeRule{static_cast<int32_t>(first + k), *merged_id});
    }
  }
  return table;
}

Result<void> check_model_type(const Json& model) {
  const std::string type = type_of(model);
  if (!type.empty() && type != "BPE") return invalid_argument("model.type '" + type + "' is not supported (only BPE)");
  return {};
}

// The options of model (type BPE) that change results; refuses the ones we do not implement.
Result<ti::BpeOptions> parse_bpe_options(const Json& model, const ti::TokenIndex& vocab) {
  ti::BpeOptions options;
  const Json* dropout = member(model, "dropout");
  if (dropout != nullptr && !dropout->is_null() && !(dropout->is_number() && dropout->get<double>() == 0.0))
    return invalid_argument("model.dropout is not supported (it makes encoding random)");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const Json* v = member(model, affix);
    if (v != nullptr && !v->is_null() && !(v->is_string() && v->get_ref<const std::string&>().empty()))
      return invalid_argument(std::string("model.") + affix + " is not supported (byte-level BPE has none)");
  }
  SIESTA_ASSIGN_OR_RETURN(bool byte_fallback, optional_bool(model, "byte_fallback", false, "model"));
  if (byte_fallback) return invalid_argument("model.byte_fallback is not supported (byte-level BPE needs none)");
  SIESTA_ASSIGN_OR_RETURN(options.fuse_unk, optional_bool(model, "fuse_unk", false, "model"));
  SIESTA_ASSIGN_OR_RETURN(options.ignore_merges, optional_bool(model, "ignore_merges", false, "model"));
  const Json* unk = member(model, "unk_token");
  if (unk != nullptr && !unk->is_null()) {
    if (!unk->is_string()) return corrupt("model.unk_token is not a string");
    options.unk_id = vocab.find(unk->get_ref<const std::string&>());
    if (!options.unk_id) return corrupt("model.unk_token \"" + unk->get<std::string>() + "\" is not in model.vocab");
  }
  return options;
}

// The token of each single byte, as the model's vocabulary spells it (-1: none).
std::array<int32_t, 256> single_byte_ids(const ti::TokenIndex& vocab) {
  std::array<int32_t, 256> ids;
  std::string spelled;
  for (size_t b = 0; b < 256; ++b) {
    spelled.clear();
    ti::append_utf8(ti::byte_to_alphabet(static_cast<uint8_t>(b)), spelled);
    ids[b] = vocab.find(spelled).value_or(-1);
  }
  return ids;
}

// Raw bytes -> id over the model's vocabulary (for ignore_merges).
ti::TokenIndex index_by_bytes(const Vocabulary& vocab) {
  ti::TokenIndex index;
  for (size_t id = 0; id < vocab.flags.size(); ++id) {
    if (!(vocab.flags[id] & kKnown)) continue;
    const auto [offset, length] = vocab.bytes_span[id];
    index.insert(std::string_view(vocab.bytes).substr(offset, length), static_cast<int32_t>(id));
  }
  return index;
}

}  // namespace

// ---- Tokenizer ----------------------------------------------------------------

struct Tokenizer::Impl {
  Impl(ti::BpeModel model, Vocabulary vocabulary) : bpe(std::move(model)), vocab(std::move(vocabulary)) {}
  static Result<std::unique_ptr<Impl>> build(std::string_view tokenizer_json, const TokenizerOptions& options);

  ti::BpeModel bpe;
  Vocabulary vocab;  // token_to_id and the id -> bytes table, added tokens included
  ti::AddedTokenMatcher input_added;       // normalized=false: matched on the input text
  ti::AddedTokenMatcher normalized_added;  // normalized=true: matched on the normalised text
  bool nfc = false;
  PreTokenizer pre;

  std::string_view bytes_of(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= vocab.flags.size() || !(vocab.flags[id] & kKnown)) return {};
    const auto [offset, length] = vocab.bytes_span[static_cast<size_t>(id)];
    return std::string_view(vocab.bytes).substr(offset, length);
  }

  // Text between input-level added tokens: normalise, then cut out the
  // added tokens that match normalised text, then pre-tokenize the rest.
  void encode_segment(std::string_view text, std::vector<int32_t>& ids) const {
    std::string normalized;  // stays empty (no allocation) for text already in NFC
    if (nfc && !ti::is_nfc_quick(text) && ti::to_nfc(text, normalized)) text = normalized;
    normalized_added.split(
        text, [&](std::string_view plain) { pre_tokenize(plain, 0, ids); },
        [&](int32_t id) { ids.push_back(id); });
  }

  // Applies Split step `step` and the ones after it, then the ByteLevel step.
  void pre_tokenize(std::string_view text, size_t step, std::vector<int32_t>& ids) const {
    if (step < pre.splits.size()) {
      pre.splits[step].split(text, [&](std::string_view piece) { pre_tokenize(piece, step + 1, ids); });
      return;
    }
    if (pre.add_prefix_space && text.front() != ' ') {
      std::string spaced;
      spaced.reserve(text.size() + 1);
      spaced.push_back(' ');
      spaced.append(text);
      byte_level(spaced, ids);
      return;
    }
    byte_level(text, ids);
  }

  void byte_level(std::string_view text, std::vector<int32_t>& ids) const {
    if (pre.byte_level) {
      pre.byte_level->split(text, [&](std::string_view word) { bpe.encode_word(word, ids); });
    } else {
      bpe.encode_word(text, ids);
    }
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer::Impl>> Tokenizer::Impl::build(std::string_view tokenizer_json,
                                                                 const TokenizerOptions& options) {
  TokenizerJsonReader reader;
  // Vocabulary and merges take ~70 bytes of JSON per token: sizing the index
  // up front saves rehashing it while 150k tokens stream in.
  reader.vocab.ids.reserve(tokenizer_json.size() / 70);
  if (!Json::sax_parse(tokenizer_json, &reader))
    return reader.error.value_or(corrupt("tokenizer.json could not be parsed"));
  const Json& doc = reader.doc;
  if (!doc.is_object()) return corrupt("tokenizer.json is not a JSON object");
  const Json* model = member(doc, "model");
  if (model == nullptr || !model->is_object()) return corrupt("model is missing or not an object");
  SIESTA_TRY(check_model_type(*model));
  if (!reader.has_vocab || reader.vocab.ids.size() == 0) return corrupt("model.vocab is missing, empty or not an object");
  if (!reader.has_merges) return corrupt("model.merges is missing or not a list");

  Vocabulary& vocab = reader.vocab;
  SIESTA_ASSIGN_OR_RETURN(ti::BpeOptions bpe_options, parse_bpe_options(*model, vocab.ids));
  bpe_options.cache_words = options.word_cache_words;
  SIESTA_ASSIGN_OR_RETURN(ti::MergeTable merges, resolve_merges(reader.merges, reader.merge_text, vocab.ids));
  const std::array<int32_t, 256> byte_ids = single_byte_ids(vocab.ids);
  ti::TokenIndex whole_words = bpe_options.ignore_merges ? index_by_bytes(vocab) : ti::TokenIndex();

  SIESTA_ASSIGN_OR_RETURN(std::vector<ti::AddedToken> added, parse_added_tokens(doc));
  SIESTA_ASSIGN_OR_RETURN(bool nfc, parse_normalizer(member(doc, "normalizer")));
  SIESTA_ASSIGN_OR_RETURN(PreTokenizer pre, parse_pre_tokenizer(doc));
  SIESTA_TRY(check_decoder(doc));

  // Added tokens are looked up before the model's vocabulary, and decode
  // through the ByteLevel decoder like any token: both as in HF tokenizers.
  // (So an added token spelled with alphabet stand-ins such as "Ö" decodes
  // to their bytes, as HF does; ASCII ones like "<|im_end|>" are unchanged.)
  std::vector<ti::AddedToken> input_level, normalized_level;
  for (const ti::AddedToken& t : added) {
    vocab.ids.insert(t.content, t.id);
    vocab.set_token(t.id, t.content, static_cast<uint8_t>(kKnown | (t.special ? kSpecial : 0)));
    (t.normalized && nfc ? normalized_level : input_level).push_back(t);
  }

  auto impl = std::make_unique<Impl>(ti::BpeModel(byte_ids, std::move(merges), std::move(whole_words), bpe_options),
                                     std::move(vocab));
  impl->input_added = ti::AddedTokenMatcher(input_level);
  impl->normalized_added = ti::AddedTokenMatcher(normalized_level);
  impl->nfc = nfc;
  impl->pre = std::move(pre);
  return impl;
}

Result<Tokenizer> Tokenizer::from_json_string(std::string_view tokenizer_json, const TokenizerOptions& options) {
  // nlohmann::json may still throw (allocation, DOM edits); nothing of it leaves here.
  try {
    SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl, Impl::build(tokenizer_json, options));
    return Tokenizer(std::move(impl));
  } catch (const Json::exception& e) {
    return corrupt(std::string("tokenizer.json: ") + e.what());
  } catch (const std::bad_alloc&) {
    return out_of_memory("out of memory while loading tokenizer.json");
  }
}

Result<Tokenizer> Tokenizer::load_file(const std::filesystem::path& tokenizer_json, const TokenizerOptions& options) {
  const std::string where = "tokenizer " + tokenizer_json.string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(tokenizer_json, ec)) return not_found(where + " does not exist");
  // One read into a buffer of the file's size (an istreambuf_iterator loop
  // costs tens of milliseconds on an 11 MB file).
  std::ifstream in(tokenizer_json, std::ios::binary);
  const std::uintmax_t size = std::filesystem::file_size(tokenizer_json, ec);
  if (!in || ec) return io_error(where + " could not be opened");
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) return io_error(where + " could not be read");
  Result<Tokenizer> tok = from_json_string(text, options);
  if (!tok) return tok.error().with_context(where);
  return tok;
}

Result<Tokenizer> Tokenizer::load(const std::filesystem::path& model_dir, const TokenizerOptions& options) {
  return load_file(model_dir / "tokenizer.json", options);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  ids.reserve(text.size() / 4 + 4);
  std::string repaired;
  if (!ti::is_valid_utf8(text)) {
    ti::append_utf8_lossy(text, repaired);
    text = repaired;
  }
  impl_->input_added.split(
      text, [&](std::string_view segment) { impl_->encode_segment(segment, ids); },
      [&](int32_t id) { ids.push_back(id); });
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (skip_special_tokens && is_special(id)) continue;
    bytes.append(impl_->bytes_of(id));
  }
  if (ti::is_valid_utf8(bytes)) return bytes;
  std::string text;
  text.reserve(bytes.size() + 8);
  ti::append_utf8_lossy(bytes, text);
  return text;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->vocab.flags.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const { return impl_->vocab.ids.find(token); }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->vocab.flags.size() && (impl_->vocab.flags[id] & kSpecial);
}

std::string Tokenizer::token_bytes(int32_t id) const { return std::string(impl_->bytes_of(id)); }

// ---- IncrementalDetokenizer -------------------------------------------------

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tok, bool skip_special_tokens)
    : tok_(&tok), skip_special_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += tok_->token_bytes(id);
  // Everything up to a cut-short final character is settled: a later byte
  // can complete that character but never change how earlier bytes decode.
  const size_t settled = pending_.size() - ti::incomplete_utf8_tail(pending_);
  std::string text;
  ti::append_utf8_lossy(std::string_view(pending_).substr(0, settled), text);
  pending_.erase(0, settled);
  return text;
}

std::string IncrementalDetokenizer::finish() {
  std::string text;
  ti::append_utf8_lossy(pending_, text);
  pending_.clear();
  return text;
}

}  // namespace siesta
