// RegionTable: a small shared page that tells peers which of this engine's
// regions are live, and at which epoch, without a round trip to the engine.
//
// Peers check it before and after every transfer: ipc maps it read-only (it
// is a memfd exported with the regions), ucx fetches it with a GET (one-sided
// transfers), or the owner checks it itself as it serves a peer's guarded or
// staged request. A descriptor whose region was deregistered, or which was
// made under an older epoch, fails the check, so a transfer never touches
// memory the owner has given back, and a READ that raced with a
// deregistration is not trusted.
//
// Layout (u64 words, little-endian, what peers read):
//   word 0  kRegionTableMagic
//   word 1  epoch
//   word 2  slot count
//   word 8+i  id of the region in slot i (0: free)
// The owner writes a slot, then the epoch (release); readers load the epoch,
// then the slot (acquire).
//
// Thread safety: claim_slot/release_slot/set_epoch from one thread at a time
// (the engine holds its lock); readers anywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "transfer/epoch.h"
#include "transfer/region.h"

namespace siesta::transfer {

inline constexpr uint64_t kRegionTableMagic = 0x3162617452534953ull;  // "SISRtab1"
inline constexpr size_t kRegionTableHeaderWords = 8;

inline constexpr size_t region_table_bytes(uint32_t slots) { return (kRegionTableHeaderWords + slots) * 8; }

class RegionTable {
 public:
  // A memfd named `name` holding the table, mapped read-write here.
  static Result<std::unique_ptr<RegionTable>> create(uint32_t slots, std::string_view name);
  ~RegionTable();
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  int fd() const { return fd_; }
  void* base() const { return words_; }
  size_t bytes() const { return bytes_; }
  uint32_t slot_count() const { return slots_; }

  // A free slot now holding `id`; kOutOfMemory when all are taken.
  Result<uint32_t> claim_slot(RegionId id);
  void release_slot(uint32_t slot);
  void set_epoch(Epoch e);
  Epoch epoch() const;

 private:
  RegionTable(int fd, uint64_t* words, size_t bytes, uint32_t slots);
  int fd_;
  uint64_t* words_;
  size_t bytes_;
  uint32_t slots_;
  std::vector<uint32_t> free_;
};

// Ok when `words` (a mapped or fetched table, nwords long) is at `epoch` and
// `slot` still holds `id`; otherwise a kConflict Status that says which.
Ok check_region_live(const uint64_t* words, size_t nwords, uint32_t slot, RegionId id, Epoch epoch);

}  // namespace siesta::transfer
