// EngineMeta: what a peer needs to move bytes to and from this engine. The
// answer to GET_META; a peer caches it as its descriptor of this engine until
// an INVALIDATE (or a failed transfer) makes it fetch again.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "transfer/epoch.h"
#include "transfer/region.h"

namespace siesta::transfer {

// One registered region as a peer sees it.
struct RegionDesc {
  RegionId id;
  uint32_t slot = 0;       // its entry in the engine's RegionTable
  uint64_t base = 0;       // address in the owner's process (what ucx puts/gets name)
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  std::string backend_blob;  // per backend: ucx packs its rkey here; ipc leaves it empty
};

struct EngineMeta {
  std::string engine_id;
  Epoch epoch;
  std::string side_channel_address;  // host:port of the engine's listener
  std::string backend;               // "ipc" or "ucx"
  std::string backend_blob;          // per backend: ipc socket name, ucx worker address
  std::vector<RegionDesc> regions;

  const RegionDesc* find_region(RegionId id) const;
};

std::string encode_engine_meta(const EngineMeta& meta);
// Refuses trailing bytes, unknown memory kinds and counts larger than the input.
Result<EngineMeta> decode_engine_meta(std::string_view bytes);

}  // namespace siesta::transfer
