// Byte-level BPE core of the tokenizer (internal to src/model/tokenizer.cpp):
// the GPT-2 byte alphabet, the token index, the merge table, the word merge
// loop and a bounded, thread-safe cache of merged words.
//
// BPE here works on raw bytes, never on the byte-level alphabet strings that
// tokenizer.json spells tokens in: the alphabet is a bijection on bytes, so
// merging byte ids gives the same tokens without mapping every input byte to
// a code point first.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace siesta::tokenizer_internal {

// GPT-2's bytes_to_unicode(): printable bytes stand for themselves, the other
// 68 bytes (controls, space, 0x7f-0xa0, 0xad) for U+0100 onwards, in order.
uint32_t byte_to_alphabet(uint8_t byte);
// The byte a code point of the alphabet stands for; nullopt for other code points.
std::optional<uint8_t> alphabet_to_byte(uint32_t code_point);
// Appends the bytes a token written in the alphabet stands for. A token with a
// code point outside the alphabet (an added token such as "<|im_end|>" is
// inside it, but "\n" is not) stands for its own UTF-8 bytes, as in the
// ByteLevel decoder of Hugging Face tokenizers.
void append_token_bytes(std::string_view token, std::string& out);
// Appends the alphabet spelling (UTF-8) of raw bytes.
void append_alphabet(std::string_view bytes, std::string& out);

// Exact-match map from a string to a token id (open addressing over one arena;
// a plain unordered_map costs one allocation per entry, 150k at load time).
class TokenIndex {
 public:
  void reserve(size_t keys);
  // Inserts or replaces (the last insert of a string wins).
  void insert(std::string_view key, int32_t id);
  std::optional<int32_t> find(std::string_view key) const;
  size_t size() const { return count_; }

  // For many lookups in a row: hash, prefetch all, then find with the hash,
  // so that the cache misses overlap instead of queueing.
  static uint32_t hash_of(std::string_view key);
  void prefetch(uint32_t hash) const;
  std::optional<int32_t> find(std::string_view key, uint32_t hash) const;

 private:
  // Keys up to kInlineKey bytes (nearly every token) are stored in the slot
  // itself, so that a lookup touches one cache line: loading a 150k-token
  // vocabulary is bound by memory latency, not by compares.
  static constexpr size_t kInlineKey = 16;
  struct alignas(32) Slot {
    uint32_t hash = 0;  // low bits of the key's hash: most mismatches stop here
    int32_t id = -1;    // -1: empty slot
    uint32_t length = 0;
    uint32_t offset = 0;  // in arena_, for longer keys
    char inline_key[kInlineKey] = {};
  };
  const char* key_of(const Slot& s) const { return s.length <= kInlineKey ? s.inline_key : arena_.data() + s.offset; }
  void grow();
  size_t find_slot(std::string_view key, uint32_t hash) const;

  std::vector<Slot> slots_;
  std::string arena_;  // keys longer than kInlineKey
  size_t count_ = 0;
};

// (left id, right id) -> (rank, merged id), from model.merges.
struct MergeRule {
  int32_t rank = 0;
  int32_t merged = 0;
};

class MergeTable {
 public:
  void reserve(size_t merges);
  // A later rule for the same pair replaces an earlier one, as in Hugging Face
  // tokenizers (merges are collected into a map in file order).
  void insert(int32_t left, int32_t right, MergeRule rule);
  const MergeRule* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pair_key(left, right);
    for (size_t i = slot_of(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.rule;
      if (s.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return count_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Slot {
    uint64_t key = kEmpty;
    MergeRule rule;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (uint64_t{static_cast<uint32_t>(left)} << 32) | static_cast<uint32_t>(right);
  }
  size_t slot_of(uint64_t key) const {
    // Fibonacci hashing: the high bits of key * 2^64/phi spread consecutive ids.
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }
  void rehash(size_t slot_count);

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  unsigned shift_ = 64;
  size_t count_ = 0;
};

// Bounded cache word bytes -> token ids, safe for concurrent readers and
// writers. Sharded by hash; each shard has a reader/writer lock, a fixed slot
// array and arenas for keys and ids. A full shard is cleared as a whole:
// cheaper than LRU bookkeeping on every hit, and words worth caching (common
// ones) come back at once.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 256;  // longer words are not cached

  explicit WordCache(size_t capacity_words);
  ~WordCache();
  WordCache(const WordCache&) = delete;
  WordCache& operator=(const WordCache&) = delete;

  // Appends the ids of `word` to `out` and returns true on a hit.
  bool lookup(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const;
  void insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count);

 private:
  struct Shard;
  std::unique_ptr<Shard[]> shards_;
  size_t words_per_shard_ = 0;
};

struct BpeOptions {
  std::optional<int32_t> unk_id;  // for bytes missing from the vocabulary
  bool fuse_unk = false;
  bool ignore_merges = false;     // a word found whole in the vocabulary is one token
  size_t cache_words = 0;         // 0 disables the word cache
};

class BpeModel {
 public:
  // byte_ids[b]: the token of the single byte b, -1 if the vocabulary lacks it.
  // whole_words: raw bytes -> id, consulted only with ignore_merges.
  BpeModel(std::array<int32_t, 256> byte_ids, MergeTable merges, TokenIndex whole_words, BpeOptions options);

  // Appends the tokens of one pre-tokenized word (raw bytes) to `out`.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::array<int32_t, 256> byte_ids_;
  MergeTable merges_;
  TokenIndex whole_words_;
  BpeOptions options_;
  std::unique_ptr<WordCache> cache_;  // null when disabled
};

}  // namespace siesta::tokenizer_internal
