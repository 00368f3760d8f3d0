// KV blocks as transfer entries. The KV cache is block-major (one block of
// every layer, K and V, is one contiguous range of block_bytes), so copying a
// prompt's blocks is one entry per block; runs of blocks consecutive on both
// sides become one entry. A pure function.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "transfer/xfer.h"

namespace siesta::pd {

// Entries that copy block local_blocks[i] <-> remote_blocks[i] for every i.
// kInvalidArgument when the lists differ in length, are empty, or hold a
// negative id.
Result<std::vector<transfer::XferEntry>> block_entries(transfer::RegionId local_region,
                                                        std::span<const int32_t> local_blocks,
                                                        transfer::RegionId remote_region,
                                                        std::span<const int32_t> remote_blocks,
                                                        uint64_t block_bytes);

}  // namespace siesta::pd
