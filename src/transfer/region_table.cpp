#include "transfer/region_table.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace siesta::transfer {

namespace {
uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
}  // namespace

Result<std::unique_ptr<RegionTable>> RegionTable::create(uint32_t slots, std::string_view name) {
  if (slots == 0) return invalid_argument("region table needs at least one slot");
  size_t bytes = region_table_bytes(slots);
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  bytes = (bytes + page - 1) / page * page;
  int fd = memfd_create(std::string(name).c_str(), MFD_CLOEXEC);
  if (fd < 0) return io_error(fmt::format("memfd_create for the region table: {}", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    return io_error(fmt::format("sizing the region table memfd: {}", std::strerror(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    return io_error(fmt::format("mapping the region table: {}", std::strerror(err)));
  }
  auto* words = static_cast<uint64_t*>(p);
  words[0] = kRegionTableMagic;
  words[2] = slots;
  store(&words[1], 0);
  return std::unique_ptr<RegionTable>(new RegionTable(fd, words, bytes, slots));
}

RegionTable::RegionTable(int fd, uint64_t* words, size_t bytes, uint32_t slots)
    : fd_(fd), words_(words), bytes_(bytes), slots_(slots) {
  free_.reserve(slots);
  for (uint32_t i = slots; i > 0; --i) free_.push_back(i - 1);
}

RegionTable::~RegionTable() {
  munmap(words_, bytes_);
  close(fd_);
}

Result<uint32_t> RegionTable::claim_slot(RegionId id) {
  if (free_.empty())
    return out_of_memory(fmt::format("all {} region slots are in use; deregister regions or raise max_regions", slots_));
  uint32_t slot = free_.back();
  free_.pop_back();
  store(&words_[kRegionTableHeaderWords + slot], id.value);
  return slot;
}

void RegionTable::release_slot(uint32_t slot) {
  if (slot >= slots_) return;
  store(&words_[kRegionTableHeaderWords + slot], 0);
  free_.push_back(slot);
}

void RegionTable::set_epoch(Epoch e) { store(&words_[1], e.value); }
Epoch RegionTable::epoch() const { return Epoch{load(&words_[1])}; }

Ok check_region_live(const uint64_t* words, size_t nwords, uint32_t slot, RegionId id, Epoch epoch) {
  if (nwords < kRegionTableHeaderWords || load(&words[0]) != kRegionTableMagic)
    return corrupt("the peer's region table is not a siesta region table");
  uint64_t now = load(&words[1]);
  size_t index = kRegionTableHeaderWords + slot;
  if (slot >= load(&words[2]) || index >= nwords || load(&words[index]) != id.value)
    return conflict(fmt::format("region {} was deregistered by the peer without invalidating us", id.value));
  if (now != epoch.value)
    return conflict(fmt::format("the peer's regions changed (epoch {} -> {}) without invalidating us", epoch.value, now));
  return {};
}

}  // namespace siesta::transfer
