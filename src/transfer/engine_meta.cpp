#include "transfer/engine_meta.h"

#include "transfer/wire.h"

namespace siesta::transfer {

const RegionDesc* EngineMeta::find_region(RegionId id) const {
  for (const RegionDesc& r : regions)
    if (r.id == id) return &r;
  return nullptr;
}

std::string encode_engine_meta(const EngineMeta& meta) {
  WireWriter w;
  w.bytes(meta.engine_id);
  w.u64(meta.epoch.value);
  w.bytes(meta.side_channel_address);
  w.bytes(meta.backend);
  w.bytes(meta.backend_blob);
  w.u32(static_cast<uint32_t>(meta.regions.size()));
  for (const RegionDesc& r : meta.regions) {
    w.u64(r.id.value);
    w.u32(r.slot);
    w.u64(r.base);
    w.u64(r.bytes);
    w.u8(static_cast<uint8_t>(r.kind));
    w.bytes(r.backend_blob);
  }
  return w.take();
}

Result<EngineMeta> decode_engine_meta(std::string_view bytes) {
  WireReader r(bytes);
  EngineMeta meta;
  meta.engine_id = r.bytes(1024);
  meta.epoch.value = r.u64();
  meta.side_channel_address = r.bytes(1024);
  meta.backend = r.bytes(64);
  meta.backend_blob = r.bytes();
  constexpr size_t kMinRegionBytes = 8 + 4 + 8 + 8 + 1 + 4;
  uint32_t n = r.count(kMinRegionBytes);
  meta.regions.reserve(n);
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    RegionDesc d;
    d.id.value = r.u64();
    d.slot = r.u32();
    d.base = r.u64();
    d.bytes = r.u64();
    uint8_t kind = r.u8();
    if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) return corrupt("metadata names an unknown memory kind");
    d.kind = static_cast<MemoryKind>(kind);
    d.backend_blob = r.bytes();
    meta.regions.push_back(std::move(d));
  }
  if (!r.done()) return corrupt("truncated or oversized engine metadata");
  if (meta.engine_id.empty()) return corrupt("engine metadata without an engine id");
  return meta;
}

}  // namespace siesta::transfer
