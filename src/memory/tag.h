// Tag: what a piece of pool memory holds. Sleep, wake and the byte accounting
// work per tag, because the three kinds of memory are treated differently:
// weights can be copied to host memory and restored (sleep level 1) or
// reloaded; the KV cache and scratch are dropped and come back zero-filled.
//
// TagSet is a small value set of tags, as the admin API passes them
// (`wake_up?tags=weights&tags=kv_cache`); parse_tag turns such a name into a
// Tag or an error that lists the valid names.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace siesta::memory {

enum class Tag : uint8_t {
  kWeights = 0,  // model parameters
  kKvCache = 1,  // the paged KV cache (exported to peers for KV transfer)
  kScratch = 2,  // activations, workspaces, graph pools
};

inline constexpr size_t kNumTags = 3;
inline constexpr std::array<Tag, kNumTags> kAllTags{Tag::kWeights, Tag::kKvCache, Tag::kScratch};

inline constexpr size_t tag_index(Tag tag) { return static_cast<size_t>(tag); }

// "weights", "kv_cache", "scratch" (the names vLLM's admin API uses).
const char* tag_name(Tag tag);

// The inverse of tag_name. An unknown name is kInvalidArgument with a message
// that lists the valid names.
Result<Tag> parse_tag(std::string_view name);

class TagSet {
 public:
  constexpr TagSet() = default;
  constexpr TagSet(std::initializer_list<Tag> tags) {
    for (Tag t : tags) insert(t);
  }
  static constexpr TagSet all() { return TagSet{Tag::kWeights, Tag::kKvCache, Tag::kScratch}; }

  constexpr bool contains(Tag tag) const { return (bits_ >> tag_index(tag)) & 1u; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr TagSet& insert(Tag tag) {
    bits_ = static_cast<uint8_t>(bits_ | (1u << tag_index(tag)));
    return *this;
  }
  constexpr bool is_subset_of(TagSet other) const { return (bits_ & ~other.bits_) == 0; }
  friend constexpr bool operator==(TagSet, TagSet) = default;

  // "weights,kv_cache"; "none" when empty.
  std::string to_string() const;

 private:
  uint8_t bits_ = 0;
};

// Every name parsed with parse_tag; the first unknown name is the error.
Result<TagSet> parse_tags(const std::vector<std::string>& names);

// Bytes per tag, indexed by tag_index.
using TagBytes = std::array<uint64_t, kNumTags>;

inline uint64_t sum(const TagBytes& bytes) {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  return total;
}

// "512 B", "3.0 MiB", "8.00 GiB": sizes in messages an operator reads.
std::string format_bytes(uint64_t bytes);

}  // namespace siesta::memory
