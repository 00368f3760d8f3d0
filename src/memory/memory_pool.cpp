#include "memory/memory_pool.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "common/clock.h"
#include "common/log.h"

namespace siesta::memory {
namespace {

using Clock = std::chrono::steady_clock;

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

}  // namespace

const char* allocation_state_name(AllocationState state) {
  switch (state) {
    case AllocationState::kResident: return "resident";
    case AllocationState::kOffloaded: return "offloaded";
    case AllocationState::kReleased: return "released";
  }
  return "unknown";
}

TagUsage PoolUsage::total() const {
  TagUsage sum;
  for (const TagUsage& t : tags) {
    sum.allocations += t.allocations;
    sum.resident_bytes += t.resident_bytes;
    sum.offloaded_bytes += t.offloaded_bytes;
    sum.released_bytes += t.released_bytes;
    sum.held_by_exports_bytes += t.held_by_exports_bytes;
    sum.kept_host_bytes += t.kept_host_bytes;
  }
  return sum;
}

struct MemoryPool::Entry {
  Allocation info;  // fixed at allocate()
  // Written by the owner under state_mu_; read by anyone under state_mu_.
  AllocationState state = AllocationState::kResident;
  // Which physical memory is mapped: bumped at every wake, so an export can
  // tell whether it still names the memory the pool maps.
  uint64_t generation = 0;
  // Owner thread only. backing is set exactly while resident, host_copy
  // exactly while offloaded.
  std::unique_ptr<Backing> backing;
  std::unique_ptr<HostBuffer> host_copy;
  // PoolOptions::keep_offload_buffers: the host buffer of the last offload,
  // kept while resident for the next one. kept_bytes is its size, written
  // under state_mu_ (usage() reads it from any thread).
  std::unique_ptr<HostBuffer> kept;
  uint64_t kept_bytes = 0;
};

struct MemoryPool::ExportRecord {
  ExportId id;
  AllocationId allocation;
  uint64_t generation = 0;  // the entry's generation when exported
  std::vector<ExportedPiece> pieces;
};

MemoryPool::MemoryPool(std::unique_ptr<MemoryBackend> backend, PoolOptions options)
    : backend_(std::move(backend)), options_(options) {}

MemoryPool::~MemoryPool() {
  std::lock_guard op(op_mu_);
  if (!exports_.empty()) {
    SIESTA_LOG_WARN("memory pool destroyed with {} export(s) open; closing the pool's copies (memory that peers "
                    "still map stays allocated until they unmap it)",
                    exports_.size());
  }
  for (auto& [id, record] : exports_) {
    for (const ExportedPiece& piece : record.pieces) close(piece.fd);
  }
  exports_.clear();
  Ok synced = backend_->synchronize();
  if (!synced) SIESTA_LOG_ERROR("memory pool teardown: {}", synced.error().message);
  for (auto& [id, entry] : entries_) {
    entry->backing.reset();  // a Backing releases itself when destroyed
    entry->host_copy.reset();
    backend_->unreserve(entry->info.base, entry->info.bytes);
  }
  entries_.clear();
}

MemoryPool::Entry* MemoryPool::find(AllocationId id) {
  auto it = entries_.find(id.value);
  return it == entries_.end() ? nullptr : it->second.get();
}

std::string MemoryPool::describe(const Entry& entry) const {
  return fmt::format("{} allocation '{}' ({} at {})", tag_name(entry.info.tag), entry.info.name,
                     format_bytes(entry.info.bytes), entry.info.base);
}

std::vector<const MemoryPool::ExportRecord*> MemoryPool::exports_of(const Entry& entry) const {
  std::vector<const ExportRecord*> out;
  for (const auto& [id, record] : exports_) {
    if (record.allocation == entry.info.id) out.push_back(&record);
  }
  return out;
}

void MemoryPool::publish(Entry& entry, AllocationState state) {
  std::lock_guard lock(state_mu_);
  entry.state = state;
  if (state == AllocationState::kResident) entry.generation++;
}

Result<Allocation> MemoryPool::allocate(size_t bytes, Tag tag, AllocationOptions options) {
  std::lock_guard op(op_mu_);
  std::string name = options.name.empty() ? tag_name(tag) : options.name;
  const size_t granularity = backend_->granularity();
  if (bytes == 0) {
    return invalid_argument(fmt::format("allocation '{}' ({}) asks for 0 bytes", name, tag_name(tag)));
  }
  if (bytes > SIZE_MAX - granularity) {
    return invalid_argument(fmt::format("allocation '{}' ({}) asks for {} bytes, more than an address space holds",
                                        name, tag_name(tag), bytes));
  }
  const size_t rounded = (bytes + granularity - 1) / granularity * granularity;
  size_t piece = rounded;
  if (!options.single_allocation) {
    size_t chunk = options.chunk_bytes != 0 ? options.chunk_bytes : options_.default_chunk_bytes;
    if (chunk == 0 || chunk % granularity != 0) {
      return invalid_argument(fmt::format(
          "allocation '{}' ({}): chunk size {} B is not a multiple of the {} backend's granularity ({} B); "
          "use a multiple of {} or single_allocation",
          name, tag_name(tag), chunk, backend_kind_name(backend_->kind()), granularity, format_bytes(granularity)));
    }
    piece = std::min(chunk, rounded);
  }

  std::string what = fmt::format("allocating {} for {} '{}'", format_bytes(rounded), tag_name(tag), name);
  Result<void*> base = backend_->reserve(rounded);
  if (!base) return base.error().with_context(what);
  Result<std::unique_ptr<Backing>> backing = backend_->map(*base, rounded, piece, /*zero_fill=*/true, name);
  if (!backing) {
    backend_->unreserve(*base, rounded);
    return backing.error().with_context(what);
  }

  auto entry = std::make_unique<Entry>();
  entry->info = Allocation{AllocationId{0}, tag, name, *base, rounded, bytes, piece, (*backing)->piece_count()};
  entry->backing = std::move(*backing);
  entry->generation = 1;
  Allocation info;
  {
    std::lock_guard lock(state_mu_);
    entry->info.id = AllocationId{next_allocation_id_++};
    info = entry->info;
    entries_.emplace(info.id.value, std::move(entry));
  }
  SIESTA_LOG_DEBUG("memory: allocated {} '{}' {} at {} in {} piece(s)", tag_name(tag), name, format_bytes(rounded),
                   info.base, info.pieces);
  return info;
}

Ok MemoryPool::free(AllocationId id) {
  std::lock_guard op(op_mu_);
  Entry* entry = find(id);
  if (entry == nullptr) return not_found(fmt::format("no allocation {} in this memory pool (already freed?)", id.value));
  if (auto open = exports_of(*entry); !open.empty()) {
    return conflict(fmt::format("cannot free {}: {} export(s) still open; deregister it from the transfer engine, "
                                "close the exports (close_export), then free",
                                describe(*entry), open.size()));
  }
  if (entry->backing) {
    SIESTA_TRY(backend_->synchronize());
    Ok released = entry->backing->release();
    if (!released) return released.error().with_context("freeing " + describe(*entry));
  }
  backend_->unreserve(entry->info.base, entry->info.bytes);
  std::unique_ptr<Entry> gone;
  {
    std::lock_guard lock(state_mu_);
    auto it = entries_.find(id.value);
    gone = std::move(it->second);
    entries_.erase(it);
  }
  return {};  // `gone` (and any host copy) is destroyed outside the lock
}

Result<Export> MemoryPool::export_fd(AllocationId id) {
  std::lock_guard op(op_mu_);
  Entry* entry = find(id);
  if (entry == nullptr) return not_found(fmt::format("no allocation {} in this memory pool (freed?)", id.value));
  if (entry->state != AllocationState::kResident) {
    return conflict(fmt::format("cannot export {}: it is {} (the pool sleeps); wake {} first", describe(*entry),
                                allocation_state_name(entry->state), tag_name(entry->info.tag)));
  }
  Result<std::vector<ExportedPiece>> pieces = entry->backing->export_pieces();
  if (!pieces) return pieces.error().with_context("exporting " + describe(*entry));
  ExportRecord record{ExportId{0}, id, entry->generation, *pieces};
  {
    std::lock_guard lock(state_mu_);
    record.id = ExportId{next_export_id_++};
    exports_.emplace(record.id.value, record);
  }
  return Export{record.id, id, backend_->kind(), std::move(*pieces)};
}

Ok MemoryPool::close_export(ExportId id) {
  std::lock_guard op(op_mu_);
  ExportRecord record;
  {
    std::lock_guard lock(state_mu_);
    auto it = exports_.find(id.value);
    if (it == exports_.end()) return not_found(fmt::format("no open export {} in this memory pool (already closed?)", id.value));
    record = std::move(it->second);
    exports_.erase(it);
  }
  for (const ExportedPiece& piece : record.pieces) close(piece.fd);
  return {};
}

Result<SleepReport> MemoryPool::sleep(TagSet offload_tags, SleepOptions options) {
  std::lock_guard op(op_mu_);
  if (!offload_tags.is_subset_of(options.tags)) {
    return invalid_argument(fmt::format("sleep: offload tags ({}) must be among the tags released ({})",
                                        offload_tags.to_string(), options.tags.to_string()));
  }
  SleepReport report;
  std::vector<Entry*> targets;
  for (auto& [id, entry] : entries_) {
    if (options.tags.contains(entry->info.tag) && entry->state == AllocationState::kResident) {
      targets.push_back(entry.get());
    }
  }
  if (targets.empty()) return report;  // already asleep: nothing to do

  // Memory with an open export would not be freed: peers may still map it.
  std::vector<std::string> exported;
  for (const Entry* entry : targets) {
    auto open = exports_of(*entry);
    if (open.empty()) continue;
    std::string ids;
    for (const ExportRecord* r : open) ids += fmt::format("{}{}", ids.empty() ? "" : ",", r->id.value);
    exported.push_back(fmt::format("{} has {} open export(s) (id {})", describe(*entry), open.size(), ids));
  }
  if (!exported.empty() && !options.release_exported) {
    return conflict(fmt::format(
        "sleep: nothing released, because exported memory would not be freed: {}. Invalidate the peers and "
        "deregister these regions from the transfer engine, close the exports (close_export), then sleep again",
        join(exported, "; ")));
  }

  Ok synced = backend_->synchronize();
  if (!synced) return synced.error().with_context("sleep: waiting for device work (nothing released)");

  // Every copy before any release: if one fails, nothing has been released.
  auto start = Clock::now();
  // A kept buffer (keep_offload_buffers) takes the copy again; it moves to
  // the entry only when everything was copied.
  std::vector<std::unique_ptr<HostBuffer>> copies(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    const Entry& entry = *targets[i];
    if (!offload_tags.contains(entry.info.tag)) continue;
    std::string hint = fmt::format(
        "sleep: offloading {} (nothing released). Free host memory, or sleep without offloading {} "
        "(level 2) and reload it after wake",
        describe(entry), tag_name(entry.info.tag));
    HostBuffer* dst = entry.kept && entry.kept->bytes() >= entry.info.bytes ? entry.kept.get() : nullptr;
    if (dst == nullptr) {
      Result<std::unique_ptr<HostBuffer>> copy = backend_->allocate_host(entry.info.bytes);
      if (!copy) return copy.error().with_context(hint);
      copies[i] = std::move(*copy);
      dst = copies[i].get();
    }
    Ok copied = backend_->copy_to_host(dst->data(), entry.info.base, entry.info.bytes);
    if (!copied) return copied.error().with_context(hint);
  }
  report.offload_seconds = seconds_since(start);

  start = Clock::now();
  std::vector<std::string> failures;
  for (size_t i = 0; i < targets.size(); ++i) {
    Entry& entry = *targets[i];
    const bool has_exports = !exports_of(entry).empty();
    Ok released = entry.backing->release();
    if (!released) {
      failures.push_back(describe(entry) + ": " + released.error().message);
      continue;  // stays resident (its host copy is dropped); the next sleep retries
    }
    entry.backing.reset();
    if (offload_tags.contains(entry.info.tag)) {
      const bool fresh = copies[i] != nullptr;
      entry.host_copy = fresh ? std::move(copies[i]) : std::move(entry.kept);
      entry.kept.reset();
      // A new buffer that will be kept: the backend may prepare it (pin it) meanwhile.
      if (fresh && options_.keep_offload_buffers) backend_->retain_host(*entry.host_copy);
    }
    {
      std::lock_guard lock(state_mu_);
      entry.kept_bytes = 0;
    }
    publish(entry, entry.host_copy ? AllocationState::kOffloaded : AllocationState::kReleased);
    size_t t = tag_index(entry.info.tag);
    report.released_bytes[t] += entry.info.bytes;
    if (entry.host_copy) report.offloaded_bytes[t] += entry.info.bytes;
    if (has_exports) {
      report.held_by_exports_bytes += entry.info.bytes;
      report.held_by.push_back(fmt::format("{} stays allocated while its exports are open; it is returned when "
                                           "they are closed and peers have unmapped it",
                                           describe(entry)));
    }
  }
  report.release_seconds = seconds_since(start);

  SIESTA_LOG_INFO("memory: sleep released {} (offloaded {}) in {:.1f} ms{}", format_bytes(sum(report.released_bytes)),
                  format_bytes(sum(report.offloaded_bytes)), 1e3 * (report.offload_seconds + report.release_seconds),
                  report.held_by_exports_bytes == 0
                      ? std::string()
                      : fmt::format("; {} still held by open exports", format_bytes(report.held_by_exports_bytes)));
  if (!failures.empty()) {
    return internal_error(fmt::format("sleep released {} but could not release: {}; call sleep again to retry",
                                      format_bytes(sum(report.released_bytes)), join(failures, "; ")));
  }
  return report;
}

Result<WakeReport> MemoryPool::wake(TagSet tags) {
  std::lock_guard op(op_mu_);
  WakeReport report;
  std::vector<std::string> woken;
  for (auto& [id, entry_ptr] : entries_) {
    Entry& entry = *entry_ptr;
    if (!tags.contains(entry.info.tag) || entry.state == AllocationState::kResident) continue;
    const bool restore = entry.state == AllocationState::kOffloaded;

    auto fail = [&](const Status& error) -> Status {
      std::string free_now;
      if (Result<DeviceMemoryInfo> info = backend_->memory_info(); info) {
        free_now = fmt::format(" ({} of {} free now)", format_bytes(info->free_bytes), format_bytes(info->total_bytes));
      }
      return Status{error.code,
                    fmt::format("wake: mapping {} failed: {}. It stays {}{}; {}. Free {} memory{} and call wake again",
                                describe(entry), error.message, allocation_state_name(entry.state),
                                restore ? " (its host copy is kept)" : "",
                                woken.empty() ? "nothing else was mapped" : "already resident again: " + join(woken, ", "),
                                backend_kind_name(backend_->kind()), free_now)};
    };

    auto start = Clock::now();
    Result<std::unique_ptr<Backing>> backing =
        backend_->map(entry.info.base, entry.info.bytes, entry.info.piece_bytes, /*zero_fill=*/!restore, entry.info.name);
    if (!backing) return fail(backing.error());
    report.map_seconds += seconds_since(start);
    if (restore) {
      start = Clock::now();
      Ok copied = backend_->copy_from_host(entry.info.base, entry.host_copy->data(), entry.info.bytes);
      if (!copied) {
        Ok undone = (*backing)->release();
        if (!undone) SIESTA_LOG_ERROR("wake: undoing a failed restore: {}", undone.error().message);
        return fail(copied.error());
      }
      report.restore_seconds += seconds_since(start);
      report.restored_bytes[tag_index(entry.info.tag)] += entry.info.bytes;
    }
    entry.backing = std::move(*backing);
    if (restore && options_.keep_offload_buffers) {
      entry.kept = std::move(entry.host_copy);
      std::lock_guard lock(state_mu_);
      entry.kept_bytes = entry.kept->bytes();
    }
    publish(entry, AllocationState::kResident);
    entry.host_copy.reset();
    report.mapped_bytes[tag_index(entry.info.tag)] += entry.info.bytes;
    woken.push_back(fmt::format("{} '{}'", tag_name(entry.info.tag), entry.info.name));
  }
  TagSet resident = resident_tags();
  for (Tag t : kAllTags) {
    if (!resident.contains(t)) report.not_resident.insert(t);
  }
  if (!woken.empty()) {
    SIESTA_LOG_INFO("memory: wake mapped {} (restored {}) in {:.1f} ms (mapping {:.1f}, restoring {:.1f}); "
                    "not resident: {}",
                    format_bytes(sum(report.mapped_bytes)), format_bytes(sum(report.restored_bytes)),
                    1e3 * (report.map_seconds + report.restore_seconds), 1e3 * report.map_seconds,
                    1e3 * report.restore_seconds, report.not_resident.to_string());
  }
  return report;
}

Result<uint64_t> MemoryPool::discard(TagSet tags) {
  std::lock_guard op(op_mu_);
  uint64_t freed = 0;
  for (auto& [id, entry] : entries_) {
    if (!tags.contains(entry->info.tag)) continue;
    if (entry->kept) {
      freed += entry->kept->bytes();
      entry->kept.reset();
      std::lock_guard lock(state_mu_);
      entry->kept_bytes = 0;
    }
    if (entry->state != AllocationState::kOffloaded) continue;
    publish(*entry, AllocationState::kReleased);
    freed += entry->info.bytes;
    entry->host_copy.reset();
  }
  return freed;
}

Result<uint64_t> MemoryPool::prepare_offload_buffers(TagSet tags) {
  std::lock_guard op(op_mu_);
  if (!options_.keep_offload_buffers) return uint64_t{0};
  uint64_t made = 0;
  for (auto& [id, entry] : entries_) {
    if (!tags.contains(entry->info.tag) || entry->state != AllocationState::kResident) continue;
    if (entry->kept && entry->kept->bytes() >= entry->info.bytes) continue;
    Result<std::unique_ptr<HostBuffer>> buffer = backend_->allocate_host(entry->info.bytes);
    if (!buffer) {
      return buffer.error().with_context(
          fmt::format("preparing the host buffer a sleep offloads {} into", describe(*entry)));
    }
    entry->kept = std::move(*buffer);
    backend_->retain_host(*entry->kept);
    made += entry->kept->bytes();
    std::lock_guard lock(state_mu_);
    entry->kept_bytes = entry->kept->bytes();
  }
  if (made > 0) {
    SIESTA_LOG_INFO("memory: {} of host memory prepared for offloads of {}", format_bytes(made), tags.to_string());
  }
  return made;
}

uint64_t MemoryPool::pinned_host_bytes() {
  std::lock_guard op(op_mu_);
  uint64_t pinned = 0;
  for (auto& [id, entry] : entries_) {
    if (entry->host_copy) pinned += entry->host_copy->pinned_bytes();
    if (entry->kept) pinned += entry->kept->pinned_bytes();
  }
  return pinned;
}

PoolUsage MemoryPool::usage() const {
  std::lock_guard lock(state_mu_);
  PoolUsage usage;
  for (const auto& [id, entry] : entries_) {
    TagUsage& t = usage.tags[tag_index(entry->info.tag)];
    t.allocations++;
    switch (entry->state) {
      case AllocationState::kResident: t.resident_bytes += entry->info.bytes; break;
      case AllocationState::kOffloaded: t.offloaded_bytes += entry->info.bytes; break;
      case AllocationState::kReleased: t.released_bytes += entry->info.bytes; break;
    }
    t.kept_host_bytes += entry->kept_bytes;
  }
  // An export no longer names the memory the pool maps once the allocation
  // was released (and perhaps mapped anew): that memory lives on only through
  // the export. Several exports of the same memory count it once.
  std::set<std::pair<uint64_t, uint64_t>> held;
  for (const auto& [id, record] : exports_) {
    const Entry& entry = *entries_.at(record.allocation.value);  // free() refuses while exports are open
    bool stale = entry.state != AllocationState::kResident || entry.generation != record.generation;
    if (stale && held.insert({record.allocation.value, record.generation}).second) {
      usage.tags[tag_index(entry.info.tag)].held_by_exports_bytes += entry.info.bytes;
    }
  }
  usage.open_exports = exports_.size();
  return usage;
}

TagSet MemoryPool::resident_tags_locked() const {
  TagSet not_resident;
  for (const auto& [id, entry] : entries_) {
    if (entry->state != AllocationState::kResident) not_resident.insert(entry->info.tag);
  }
  TagSet resident;
  for (Tag t : kAllTags) {
    if (!not_resident.contains(t)) resident.insert(t);
  }
  return resident;
}

TagSet MemoryPool::resident_tags() const {
  std::lock_guard lock(state_mu_);
  return resident_tags_locked();
}

bool MemoryPool::is_resident(Tag tag) const { return resident_tags().contains(tag); }

Result<AllocationState> MemoryPool::state(AllocationId id) const {
  std::lock_guard lock(state_mu_);
  auto it = entries_.find(id.value);
  if (it == entries_.end()) return not_found(fmt::format("no allocation {} in this memory pool", id.value));
  return it->second->state;
}

std::vector<Allocation> MemoryPool::allocations() const {
  std::lock_guard lock(state_mu_);
  std::vector<Allocation> out;
  for (const auto& [id, entry] : entries_) out.push_back(entry->info);
  return out;
}

}  // namespace siesta::memory
