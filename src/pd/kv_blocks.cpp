#include "pd/kv_blocks.h"

#include <string>

namespace siesta::pd {

Result<std::vector<transfer::XferEntry>> block_entries(transfer::RegionId local_region,
                                                        std::span<const int32_t> local_blocks,
                                                        transfer::RegionId remote_region,
                                                        std::span<const int32_t> remote_blocks,
                                                        uint64_t block_bytes) {
  if (local_blocks.size() != remote_blocks.size())
    return invalid_argument("block lists differ in length: " + std::to_string(local_blocks.size()) + " local, " +
                            std::to_string(remote_blocks.size()) + " remote");
  if (local_blocks.empty()) return invalid_argument("no blocks to transfer");
  if (block_bytes == 0) return invalid_argument("a block of 0 bytes");
  std::vector<transfer::XferEntry> out;
  for (size_t i = 0; i < local_blocks.size(); ++i) {
    const int32_t l = local_blocks[i];
    const int32_t r = remote_blocks[i];
    if (l < 0 || r < 0) return invalid_argument("negative block id in a transfer");
    if (!out.empty()) {
      transfer::XferEntry& last = out.back();
      if (last.local_offset + last.bytes == static_cast<uint64_t>(l) * block_bytes &&
          last.remote_offset + last.bytes == static_cast<uint64_t>(r) * block_bytes) {
        last.bytes += block_bytes;
        continue;
      }
    }
    out.push_back(transfer::XferEntry{local_region, static_cast<uint64_t>(l) * block_bytes, remote_region,
                                      static_cast<uint64_t>(r) * block_bytes, block_bytes});
  }
  return out;
}

}  // namespace siesta::pd
