#include "memory/tag.h"

#include <fmt/format.h>

namespace siesta::memory {

const char* tag_name(Tag tag) {
  switch (tag) {
    case Tag::kWeights: return "weights";
    case Tag::kKvCache: return "kv_cache";
    case Tag::kScratch: return "scratch";
  }
  return "unknown";
}

Result<Tag> parse_tag(std::string_view name) {
  for (Tag t : kAllTags) {
    if (name == tag_name(t)) return t;
  }
  return invalid_argument(
      fmt::format("unknown memory tag '{}'; the tags are weights, kv_cache and scratch", name));
}

std::string TagSet::to_string() const {
  std::string out;
  for (Tag t : kAllTags) {
    if (!contains(t)) continue;
    if (!out.empty()) out += ',';
    out += tag_name(t);
  }
  return out.empty() ? "none" : out;
}

Result<TagSet> parse_tags(const std::vector<std::string>& names) {
  TagSet set;
  for (const std::string& name : names) {
    SIESTA_ASSIGN_OR_RETURN(Tag tag, parse_tag(name));
    set.insert(tag);
  }
  return set;
}

std::string format_bytes(uint64_t bytes) {
  constexpr uint64_t kKiB = 1024, kMiB = kKiB << 10, kGiB = kMiB << 10;
  if (bytes >= kGiB) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / kGiB);
  if (bytes >= kMiB) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / kMiB);
  if (bytes >= kKiB) return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / kKiB);
  return fmt::format("{} B", bytes);
}

}  // namespace siesta::memory
