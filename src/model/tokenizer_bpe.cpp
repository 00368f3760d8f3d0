#include "model/tokenizer_bpe.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <mutex>
#include <shared_mutex>

#include "model/tokenizer_text.h"

namespace siesta::tokenizer_internal {

// ---- Byte alphabet ----------------------------------------------------------

namespace {

constexpr uint32_t kAlphabetEnd = 256 + 68;  // code points above the last byte stand-in

struct Alphabet {
  std::array<uint32_t, 256> code_point{};
  std::array<int16_t, kAlphabetEnd> byte{};  // -1: not in the alphabet

  Alphabet() {
    byte.fill(-1);
    uint32_t next_stand_in = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      code_point[b] = printable ? b : next_stand_in++;
      byte[code_point[b]] = static_cast<int16_t>(b);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet table;  // immutable after construction; built once, thread-safely
  return table;
}

}  // namespace

uint32_t byte_to_alphabet(uint8_t byte) { return alphabet().code_point[byte]; }

std::optional<uint8_t> alphabet_to_byte(uint32_t code_point) {
  if (code_point >= kAlphabetEnd) return std::nullopt;
  const int16_t b = alphabet().byte[code_point];
  if (b < 0) return std::nullopt;
  return static_cast<uint8_t>(b);
}

void append_token_bytes(std::string_view token, std::string& out) {
  const size_t start = out.size();
  for (size_t i = 0; i < token.size();) {
    const std::optional<uint8_t> b = alphabet_to_byte(next_code_point(token, i));
    if (!b) {
      out.resize(start);
      out.append(token);
      return;
    }
    out.push_back(static_cast<char>(*b));
  }
}

void append_alphabet(std::string_view bytes, std::string& out) {
  for (char c : bytes) append_utf8(byte_to_alphabet(static_cast<uint8_t>(c)), out);
}

// ---- TokenIndex -------------------------------------------------------------

uint32_t TokenIndex::hash_of(std::string_view key) {
  return static_cast<uint32_t>(std::hash<std::string_view>{}(key));
}

void TokenIndex::prefetch(uint32_t hash) const {
  if (!slots_.empty()) __builtin_prefetch(&slots_[hash & (slots_.size() - 1)]);
}

size_t TokenIndex::find_slot(std::string_view key, uint32_t hash) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.id < 0) return i;
    if (s.hash == hash && s.length == key.size() && std::memcmp(key_of(s), key.data(), key.size()) == 0)
      return i;
  }
}

void TokenIndex::reserve(size_t keys) {
  const size_t wanted = std::bit_ceil(std::max<size_t>(1024, keys * 2));
  while (slots_.size() < wanted) grow();
}

void TokenIndex::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.empty() ? 1024 : old.size() * 2, Slot{});
  const size_t mask = slots_.size() - 1;
  for (const Slot& s : old) {
    if (s.id < 0) continue;
    size_t i = s.hash & mask;
    while (slots_[i].id >= 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

void TokenIndex::insert(std::string_view key, int32_t id) {
  if ((count_ + 1) * 2 > slots_.size()) grow();  // load factor at most 1/2
  const uint32_t hash = hash_of(key);
  Slot& s = slots_[find_slot(key, hash)];
  if (s.id < 0) {
    s.hash = hash;
    s.length = static_cast<uint32_t>(key.size());
    if (key.size() <= kInlineKey) {
      std::memcpy(s.inline_key, key.data(), key.size());
    } else {
      s.offset = static_cast<uint32_t>(arena_.size());
      arena_.append(key);
    }
    ++count_;
  }
  s.id = id;
}

std::optional<int32_t> TokenIndex::find(std::string_view key) const { return find(key, hash_of(key)); }

std::optional<int32_t> TokenIndex::find(std::string_view key, uint32_t hash) const {
  if (slots_.empty()) return std::nullopt;
  const Slot& s = slots_[find_slot(key, hash)];
  if (s.id < 0) return std::nullopt;
  return s.id;
}

// ---- MergeTable -------------------------------------------------------------

void MergeTable::rehash(size_t slot_count) {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(slot_count, Slot{});
  mask_ = slot_count - 1;
  shift_ = 64 - static_cast<unsigned>(std::countr_zero(slot_count));
  for (const Slot& s : old) {
    if (s.key == kEmpty) continue;
    size_t i = slot_of(s.key);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void MergeTable::reserve(size_t merges) {
  const size_t wanted = std::bit_ceil(std::max<size_t>(16, merges * 2));
  if (wanted > slots_.size()) rehash(wanted);
}

void MergeTable::insert(int32_t left, int32_t right, MergeRule rule) {
  if ((count_ + 1) * 2 > slots_.size()) rehash(std::max<size_t>(16, slots_.size() * 2));
  const uint64_t key = pair_key(left, right);
  size_t i = slot_of(key);
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
  if (slots_[i].key == kEmpty) ++count_;
  slots_[i] = Slot{key, rule};
}

// ---- WordCache --------------------------------------------------------------

namespace {
constexpr size_t kCacheShards = 16;  // a power of two; the top hash bits pick the shard
}  // namespace

struct WordCache::Shard {
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_offset = 0;
    uint32_t ids_offset = 0;
    uint16_t key_length = 0;  // 0: empty (words are never empty)
    uint16_t id_count = 0;
  };
  mutable std::shared_mutex mutex;
  std::vector<Slot> slots;  // a power of two, at least twice the words held
  std::string keys;
  std::vector<int32_t> ids;
  size_t words = 0;

  // Index of the slot holding `word`, or of the empty slot where it would go.
  size_t find(std::string_view word, uint64_t hash) const {
    const size_t mask = slots.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (s.key_length == 0) return i;
      if (s.hash == hash && s.key_length == word.size() &&
          std::memcmp(keys.data() + s.key_offset, word.data(), word.size()) == 0)
        return i;
    }
  }

  void clear() {
    std::fill(slots.begin(), slots.end(), Slot{});
    keys.clear();
    ids.clear();
    words = 0;
  }
};

WordCache::WordCache(size_t capacity_words)
    : shards_(std::make_unique<Shard[]>(kCacheShards)),
      words_per_shard_(std::max<size_t>(1, (capacity_words + kCacheShards - 1) / kCacheShards)) {
  for (size_t i = 0; i < kCacheShards; ++i) shards_[i].slots.resize(std::bit_ceil(words_per_shard_ * 2));
}

WordCache::~WordCache() = default;

bool WordCache::lookup(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const {
  const Shard& shard = shards_[hash >> 60];
  std::shared_lock lock(shard.mutex);
  const Shard::Slot& slot = shard.slots[shard.find(word, hash)];
  if (slot.key_length == 0) return false;
  const int32_t* ids = shard.ids.data() + slot.ids_offset;
  out.insert(out.end(), ids, ids + slot.id_count);
  return true;
}

void WordCache::insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count) {
  if (word.empty() || word.size() > kMaxWordBytes || count > UINT16_MAX) return;
  Shard& shard = shards_[hash >> 60];
  std::unique_lock lock(shard.mutex);
  if (shard.words >= words_per_shard_) shard.clear();
  Shard::Slot& slot = shard.slots[shard.find(word, hash)];
  if (slot.key_length != 0) return;  // another thread cached it first
  slot.hash = hash;
  slot.key_offset = static_cast<uint32_t>(shard.keys.size());
  slot.ids_offset = static_cast<uint32_t>(shard.ids.size());
  slot.key_length = static_cast<uint16_t>(word.size());
  slot.id_count = static_cast<uint16_t>(count);
  shard.keys.append(word);
  shard.ids.insert(shard.ids.end(), ids, ids + count);
  ++shard.words;
}

// ---- BpeModel ---------------------------------------------------------------

BpeModel::BpeModel(std::array<int32_t, 256> byte_ids, MergeTable merges, TokenIndex whole_words, BpeOptions options)
    : byte_ids_(byte_ids),
      merges_(std::move(merges)),
      whole_words_(std::move(whole_words)),
      options_(options),
      cache_(options.cache_words > 0 ? std::make_unique<WordCache>(options.cache_words) : nullptr) {}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (word.size() == 1) {
    // No merge applies to a single symbol; skip hashing and locking.
    const int32_t id = byte_ids_[static_cast<uint8_t>(word[0])];
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  if (options_.ignore_merges) {
    if (std::optional<int32_t> id = whole_words_.find(word)) {
      out.push_back(*id);
      return;
    }
  }
  if (!cache_ || word.size() > WordCache::kMaxWordBytes) {
    merge_word(word, out);
    return;
  }
  const uint64_t hash = std::hash<std::string_view>{}(word);
  if (cache_->lookup(word, hash, out)) return;
  const size_t first = out.size();
  merge_word(word, out);
  cache_->insert(word, hash, out.data() + first, out.size() - first);
}

namespace {

// A symbol of a word being merged: a token id in a doubly linked list over
// the word's byte positions. A merge keeps the left symbol and empties the right.
struct Symbol {
  int32_t id;
  int32_t prev;  // -1: first
  int32_t next;  // -1: last
  uint32_t length;  // bytes covered; 0: merged into its left neighbour
};

// A candidate merge of the symbol at `pos` with its right neighbour, queued
// when that pair was (left, right).
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t merged;
  int32_t left;
  int32_t right;
};

// Heap order: lowest rank first, then leftmost (the order of HF's Word::merge_all).
struct LaterCandidate {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

struct MergeScratch {
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
};

}  // namespace

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  thread_local MergeScratch scratch;  // reused: no allocation per word once warm
  std::vector<Symbol>& symbols = scratch.symbols;
  std::vector<Candidate>& heap = scratch.heap;
  symbols.clear();
  heap.clear();

  for (char c : word) {
    int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id < 0) {
      if (!options_.unk_id) continue;  // no unk token: the byte is dropped, as in HF
      id = *options_.unk_id;
      if (options_.fuse_unk && !symbols.empty() && symbols.back().id == id) {
        symbols.back().length += 1;
        continue;
      }
    }
    const auto pos = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, pos - 1, pos + 1, 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeRule* rule = merges_.find(symbols[i].id, symbols[i + 1].id))
      heap.push_back(Candidate{rule->rank, static_cast<int32_t>(i), rule->merged, symbols[i].id, symbols[i + 1].id});
  }
  std::make_heap(heap.begin(), heap.end(), LaterCandidate{});

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), LaterCandidate{});
    const Candidate top = heap.back();
    heap.pop_back();

    Symbol& left = symbols[top.pos];
    if (left.length == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    // Stale candidate: one side has merged since it was queued. (HF looks the
    // pair up again and compares merged ids; a changed pair always spells a
    // longer string, hence another merged id, so comparing the ids queued
    // decides the same without a table lookup.)
    if (left.id != top.left || right.id != top.right) continue;

    left.id = top.merged;
    left.length += right.length;
    left.next = right.next;
    right.length = 0;
    if (left.next >= 0) symbols[left.next].prev = top.pos;

    if (left.prev >= 0) {
      if (const MergeRule* r = merges_.find(symbols[left.prev].id, left.id)) {
        heap.push_back(Candidate{r->rank, left.prev, r->merged, symbols[left.prev].id, left.id});
        std::push_heap(heap.begin(), heap.end(), LaterCandidate{});
      }
    }
    if (left.next >= 0) {
      if (const MergeRule* r = merges_.find(left.id, symbols[left.next].id)) {
        heap.push_back(Candidate{r->rank, top.pos, r->merged, left.id, symbols[left.next].id});
        std::push_heap(heap.begin(), heap.end(), LaterCandidate{});
      }
    }
  }

  // Surviving symbols in position order are the word's tokens.
  for (const Symbol& s : symbols) {
    if (s.length != 0) out.push_back(s.id);
  }
}

}  // namespace siesta::tokenizer_internal
