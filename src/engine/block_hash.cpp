#include "engine/block_hash.h"

#include "engine/random.h"

namespace siesta {
namespace {

// Two independent lanes; each absorbs 64-bit words through the splitmix64 mixer.
struct Lanes {
  uint64_t a;
  uint64_t b;
  void absorb(uint64_t w) {
    a = mix64(a ^ (w + kGoldenGamma));
    b = mix64(b + w * 0xC2B2AE3D27D4EB4FULL + 0x165667B19E3779F9ULL);
  }
};

}  // namespace

uint64_t hash_salt(std::string_view salt) {
  Lanes l{0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL};
  l.absorb(salt.size());
  uint64_t word = 0;
  size_t n = 0;
  for (char c : salt) {
    word = (word << 8) | static_cast<unsigned char>(c);
    if (++n % 8 == 0) {
      l.absorb(word);
      word = 0;
    }
  }
  if (n % 8 != 0) l.absorb(word);
  return l.a ^ l.b;
}

BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens, uint64_t salt) {
  Lanes l{parent.hi, parent.lo};
  l.absorb(salt);
  l.absorb(tokens.size());
  for (size_t i = 0; i < tokens.size(); i += 2) {
    const uint64_t lo = static_cast<uint32_t>(tokens[i]);
    const uint64_t hi = i + 1 < tokens.size() ? static_cast<uint32_t>(tokens[i + 1]) : 0xFFFFFFFFULL;
    l.absorb((hi << 32) | lo);
  }
  return BlockHash{mix64(l.a ^ (l.b << 32 | l.b >> 32)), mix64(l.b ^ l.a)};
}

void extend_block_hashes(std::vector<BlockHash>& hashes, std::span<const int32_t> tokens, uint64_t salt,
                         int block_size) {
  const size_t full = tokens.size() / block_size;
  while (hashes.size() < full) {
    const size_t i = hashes.size();
    const BlockHash& parent = i == 0 ? kRootBlockHash : hashes[i - 1];
    hashes.push_back(hash_block(parent, tokens.subspan(i * block_size, block_size), salt));
  }
}

}  // namespace siesta
