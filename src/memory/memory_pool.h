// MemoryPool: all memory an engine owns, by tag, able to give the physical
// memory back (sleep) and take it again at the same virtual addresses (wake),
// so every pointer, block table and CUDA graph that names it stays valid.
//
// Lifecycle, in order:
//   MemoryPool pool(make_host_backend().value());   // or make_cuda_backend({.device = 0})
//   Allocation a = pool.allocate(bytes, Tag::kKvCache, {.single_allocation = true}).value();
//       resident and zero-filled; a.base stays the same until free() or the pool's end
//   Export e = pool.export_fd(a.id).value();        // FDs a peer maps (transfer ipc backend)
//       ... peers map it; before sleep: invalidate peers, deregister regions, then
//   pool.close_export(e.id);
//   pool.sleep({Tag::kWeights});                    // level 1: weights copied to host, then
//       every resident allocation released;         // pool.sleep({}) is level 2
//   pool.wake({Tag::kWeights});                     // partial wake: weights mapped and restored
//   pool.wake(TagSet::all());                       // the rest mapped, zero-filled
//   pool.discard({Tag::kWeights});                  // drop host copies not wanted any more
//   pool.free(a.id);                                // or the pool's destructor frees everything
//
// States of one allocation (AllocationState):
//   resident  --sleep, tag offloaded-->  offloaded  --wake: contents restored-->  resident
//   resident  --sleep------------------>  released  --wake: zero-filled-------->  resident
//   offloaded --discard---------------->  released
// After wake, an allocation that was offloaded holds exactly what it held at
// sleep; every other allocation holds zeros, on both backends.
//
// Exports. A physical allocation is freed only when every mapping and every
// exported handle is gone. The pool keeps a ledger of the exports it handed
// out: their FDs belong to the pool until close_export(), and the caller closes
// an export only when no one holds a copy any more (the transfer engine has
// deregistered the region, and every peer has acknowledged INVALIDATE, which
// unmaps its import). The pool cannot see copies others made of the FDs; the
// ledger is the caller's statement. sleep() refuses (kConflict) to release an
// allocation with an open export, leaving everything as it was; with
// SleepOptions::release_exported it releases anyway and reports the bytes the
// exports keep alive (SleepReport::held_by_exports_bytes, and
// TagUsage::held_by_exports_bytes until the export is closed).
//
// Failures leave a state the next call repairs. sleep() copies every offloaded
// allocation before releasing anything: if a copy fails, nothing is released.
// wake() maps allocation by allocation; an allocation whose mapping or restore
// fails stays as it was (its host copy kept), those woken before it stay
// resident, and the error names what is resident and what to do. Calling
// sleep or wake again with the same arguments continues from there; calls
// that find nothing to do succeed and change nothing.
//
// Thread safety: the owner (the engine thread) makes the calls that change
// state: allocate, free, export_fd, close_export, sleep, wake, discard. They
// are serialised, so a second thread calling one waits. The reads (usage,
// is_resident, resident_tags, state, allocations) are safe from any thread
// (the HTTP thread) at any time: they never wait for a copy or a mapping, and
// see each allocation either before or after its transition.
#pragma once

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "memory/backend.h"
#include "memory/tag.h"

namespace siesta::memory {

struct AllocationId {
  uint64_t value = 0;
  friend auto operator<=>(AllocationId, AllocationId) = default;
};

struct ExportId {
  uint64_t value = 0;
  friend auto operator<=>(ExportId, ExportId) = default;
};

enum class AllocationState : uint8_t {
  kResident = 0,   // mapped, usable
  kOffloaded = 1,  // physical memory released; contents kept in host memory
  kReleased = 2,   // physical memory released; contents dropped
};

const char* allocation_state_name(AllocationState state);

struct AllocationOptions {
  // One physical allocation for the whole range, so that one exported FD (one
  // registration, one dma-buf) covers it: the KV cache.
  bool single_allocation = false;
  // Otherwise the range is made of physical chunks of this many bytes (the
  // last may be shorter), a multiple of the backend's granularity. 0: the
  // pool's default_chunk_bytes.
  size_t chunk_bytes = 0;
  // Shown in messages and, on the host, in /proc/<pid>/maps. Default: the tag.
  std::string name;
};

struct PoolOptions {
  // Chunk size of allocations that set neither single_allocation nor
  // chunk_bytes. Large chunks map and release fast (on an H200, 64 GiB takes
  // 2 ms as one allocation, ~100 ms in 256 MiB chunks, 2 s in 2 MiB chunks).
  size_t default_chunk_bytes = size_t{256} << 20;
  // Keep each offload's host buffer after the wake that restored from it, for
  // the next sleep of that allocation: its pages are touched already (a fresh
  // buffer's first touch bounded the staged offload), and the backend may pin
  // it meanwhile (MemoryBackend::retain_host). The price: host memory the
  // size of the offloaded allocations while awake (TagUsage::kept_host_bytes).
  // discard() drops kept buffers too.
  bool keep_offload_buffers = false;
};

struct Allocation {
  AllocationId id;
  Tag tag = Tag::kScratch;
  std::string name;
  void* base = nullptr;         // stable until free() or the pool's destruction
  size_t bytes = 0;             // the requested size rounded up to the granularity; all usable
  size_t requested_bytes = 0;
  size_t piece_bytes = 0;       // size of each physical allocation (== bytes when single)
  size_t pieces = 0;            // number of physical allocations
};

// Bytes of one tag, by state. resident + offloaded + released is the size of
// every allocation with the tag; held_by_exports is memory the pool released
// but open exports keep alive (returned when they are closed).
struct TagUsage {
  uint64_t allocations = 0;
  uint64_t resident_bytes = 0;
  uint64_t offloaded_bytes = 0;  // also the host memory the copies take
  uint64_t released_bytes = 0;
  uint64_t held_by_exports_bytes = 0;
  // Host memory kept for the next offload of resident allocations
  // (PoolOptions::keep_offload_buffers); not part of total_bytes().
  uint64_t kept_host_bytes = 0;

  uint64_t total_bytes() const { return resident_bytes + offloaded_bytes + released_bytes; }
  friend bool operator==(const TagUsage&, const TagUsage&) = default;
};

struct PoolUsage {
  std::array<TagUsage, kNumTags> tags{};
  uint64_t open_exports = 0;

  const TagUsage& operator[](Tag tag) const { return tags[tag_index(tag)]; }
  TagUsage total() const;
  friend bool operator==(const PoolUsage&, const PoolUsage&) = default;
};

// An allocation's physical pieces exported as FDs (memfd on the host, cuMem
// POSIX FDs on CUDA). The FDs are the pool's: valid until close_export(id),
// not to be closed by the caller. Whoever keeps them longer dup()s them (the
// transfer engine does at register_region) and must be done before the export
// is closed.
struct Export {
  ExportId id;
  AllocationId allocation;
  BackendKind kind = BackendKind::kHost;
  std::vector<ExportedPiece> pieces;
};

struct SleepOptions {
  // The tags to release; release_kv_cache_memory passes {kKvCache}.
  TagSet tags = TagSet::all();
  // Release allocations that have open exports anyway (see Exports above);
  // the report says how much memory stays alive.
  bool release_exported = false;
};

struct SleepReport {
  TagBytes released_bytes{};   // physical memory released by this call, per tag
  TagBytes offloaded_bytes{};  // of which copied to host memory first
  // Released by the pool but still alive: open exports (and peers mapping
  // them) hold it until the exports are closed.
  uint64_t held_by_exports_bytes = 0;
  std::vector<std::string> held_by;  // one line per such allocation
  double offload_seconds = 0;
  double release_seconds = 0;
};

struct WakeReport {
  TagBytes mapped_bytes{};    // physical memory mapped by this call, per tag
  TagBytes restored_bytes{};  // of which filled from host copies
  TagSet not_resident;        // tags (of all, not only those asked for) not fully resident after the call
  double map_seconds = 0;
  double restore_seconds = 0;
};

class MemoryPool {
 public:
  explicit MemoryPool(std::unique_ptr<MemoryBackend> backend, PoolOptions options = {});
  ~MemoryPool();  // frees every allocation; closes exports still open (logged)
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // --- owner thread ---

  // Reserves and maps `bytes` (rounded up to the granularity), zero-filled.
  // Allowed in any state; the new allocation is resident.
  Result<Allocation> allocate(size_t bytes, Tag tag, AllocationOptions options = {});
  // Releases the memory and the addresses. Refused while exports are open.
  Ok free(AllocationId id);

  // Exports a resident allocation. Each call makes new FDs (a new Export).
  Result<Export> export_fd(AllocationId id);
  Ok close_export(ExportId id);

  // Releases every resident allocation whose tag is in options.tags; those
  // whose tag is in offload_tags (a subset of options.tags) are copied to host
  // memory first (pinned on CUDA).
  Result<SleepReport> sleep(TagSet offload_tags, SleepOptions options = {});
  // Maps every allocation of `tags` that is not resident, at its old address;
  // restores offloaded contents, zero-fills the rest.
  Result<WakeReport> wake(TagSet tags);
  // Drops the host copies of offloaded allocations of `tags` (they become
  // released) and the host buffers kept for them; returns the bytes of host
  // memory freed.
  Result<uint64_t> discard(TagSet tags);
  // With keep_offload_buffers: makes now the host buffer that a sleep
  // offloading `tags` would make, for every resident allocation of them that
  // has none, and hands it to the backend to prepare (pin) in the background,
  // so that even the first such sleep copies into prepared memory. Host memory
  // the size of those allocations is held from now on (kept_host_bytes), as
  // after a first sleep. Returns the bytes of the buffers made; nothing
  // without keep_offload_buffers.
  Result<uint64_t> prepare_offload_buffers(TagSet tags);
  // Host memory of offloads (copies and kept buffers) that copies reach by
  // direct DMA (HostBuffer::pinned_bytes).
  uint64_t pinned_host_bytes();

  MemoryBackend& backend() { return *backend_; }

  // --- any thread ---

  PoolUsage usage() const;
  // Every allocation with this tag is resident (true when there are none).
  bool is_resident(Tag tag) const;
  TagSet resident_tags() const;
  Result<AllocationState> state(AllocationId id) const;
  std::vector<Allocation> allocations() const;

 private:
  struct Entry;
  struct ExportRecord;

  Entry* find(AllocationId id);
  std::string describe(const Entry& entry) const;
  std::vector<const ExportRecord*> exports_of(const Entry& entry) const;
  // Sets an entry's state under state_mu_ (readers see it change atomically).
  void publish(Entry& entry, AllocationState state);
  TagSet resident_tags_locked() const;

  std::unique_ptr<MemoryBackend> backend_;
  PoolOptions options_;

  // Held for the whole of each state-changing call.
  std::mutex op_mu_;
  // Guards the maps below and each entry's state (not its memory), held only
  // for short updates and reads.
  mutable std::mutex state_mu_;
  std::map<uint64_t, std::unique_ptr<Entry>> entries_;
  std::map<uint64_t, ExportRecord> exports_;
  uint64_t next_allocation_id_ = 1;
  uint64_t next_export_id_ = 1;
};

}  // namespace siesta::memory
