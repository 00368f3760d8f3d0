#include "memory/host_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "common/log.h"
#include "memory/tag.h"

namespace siesta::memory {
namespace {

std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

// Replaces [base, base + bytes) with an inaccessible reservation, atomically
// (MAP_FIXED over the old mapping), so no other mapping can land in between.
bool remap_reserved(void* base, size_t bytes) {
  void* p = mmap(base, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return p != MAP_FAILED;
}

// Puts the (already allocated) pages of a fresh mapping into the page table,
// so the memory is committed the way a GPU allocation is and RSS shows it.
// MADV_POPULATE_WRITE (Linux 5.14) reports failure, unlike MAP_POPULATE, and
// was the fastest way on the development VM; older kernels touch each page.
Ok populate(void* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return {};
  if (errno != EINVAL) {
    int err = errno;
    if (err == ENOMEM) {
      return out_of_memory(fmt::format("committing {} of host memory failed: {}", format_bytes(bytes), errno_text(err)));
    }
    return io_error(fmt::format("populating {} of host memory failed: {}", format_bytes(bytes), errno_text(err)));
  }
#endif
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto* bytes_at = static_cast<volatile char*>(p);
  for (size_t i = 0; i < bytes; i += page) bytes_at[i] = bytes_at[i];
  return {};
}

class HostBacking final : public Backing {
 public:
  HostBacking(int fd, void* base, size_t bytes, size_t piece_bytes,
              std::shared_ptr<std::atomic<uint64_t>> committed)
      : fd_(fd), base_(base), bytes_(bytes), piece_bytes_(piece_bytes), committed_(std::move(committed)) {}

  ~HostBacking() override {
    Ok ok = release();
    if (!ok) SIESTA_LOG_ERROR("host memory at {}: {}", base_, ok.error().message);
  }

  Ok release() override {
    if (fd_ < 0) return {};
    if (!remap_reserved(base_, bytes_)) {
      // The memory stays mapped and the fd open: the next release can retry.
      return io_error(fmt::format("unmapping {} at {} failed: {}", format_bytes(bytes_), base_, errno_text(errno)));
    }
    close(fd_);
    fd_ = -1;
    committed_->fetch_sub(committed_bytes_);
    committed_bytes_ = 0;
    return {};
  }

  Result<std::vector<ExportedPiece>> export_pieces() override {
    if (fd_ < 0) return internal_error("export of released host memory");
    int dup_fd = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0) {
      return io_error(fmt::format("duplicating the memfd for export failed: {}; raise the open-file limit (ulimit -n)",
                                  errno_text(errno)));
    }
    return std::vector<ExportedPiece>{ExportedPiece{dup_fd, 0, bytes_}};
  }

  size_t piece_count() const override { return (bytes_ + piece_bytes_ - 1) / piece_bytes_; }

  // Called by HostBackend::map while it commits the pieces.
  void add_committed(uint64_t bytes) {
    committed_->fetch_add(bytes);
    committed_bytes_ += bytes;
  }
  int fd() const { return fd_; }

 private:
  int fd_;
  void* base_;
  size_t bytes_;
  size_t piece_bytes_;
  std::shared_ptr<std::atomic<uint64_t>> committed_;
  uint64_t committed_bytes_ = 0;
};

class AnonymousBuffer final : public HostBuffer {
 public:
  AnonymousBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  ~AnonymousBuffer() override { munmap(data_, bytes_); }
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_;
  size_t bytes_;
};

class HostImport final : public ImportedMapping {
 public:
  HostImport(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  ~HostImport() override { munmap(base_, bytes_); }
  void* base() const override { return base_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* base_;
  size_t bytes_;
};

Result<uint64_t> meminfo_field(const std::string& name) {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == name + ":") return kib * 1024;
  }
  return io_error("/proc/meminfo has no " + name);
}

}  // namespace

HostBackend::HostBackend(HostBackendOptions options)
    : options_(options),
      page_bytes_(static_cast<size_t>(sysconf(_SC_PAGESIZE))),
      committed_(std::make_shared<std::atomic<uint64_t>>(0)) {}

std::string HostBackend::description() const {
  if (options_.capacity_bytes == 0) return "host (memfd)";
  return fmt::format("host (memfd, capacity {})", format_bytes(options_.capacity_bytes));
}

Result<void*> HostBackend::reserve(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return out_of_memory(fmt::format("reserving {} of address space failed: {}", format_bytes(bytes), errno_text(errno)));
  }
  return p;
}

void HostBackend::unreserve(void* base, size_t bytes) { munmap(base, bytes); }

Result<std::unique_ptr<Backing>> HostBackend::map(void* base, size_t bytes, size_t piece_bytes, bool /*zero_fill*/,
                                                  std::string_view label) {
  // zero_fill needs no work: pages of a new memfd read as zero.
  if (bytes == 0 || piece_bytes == 0 || bytes % page_bytes_ != 0 || piece_bytes % page_bytes_ != 0) {
    return internal_error(fmt::format("host map of {} B in pieces of {} B: not page multiples", bytes, piece_bytes));
  }
  // memfd names show up in /proc/<pid>/maps as "/memfd:siesta:<label>".
  std::string name = fmt::format("siesta:{}", label.substr(0, 200));
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return io_error(fmt::format("memfd_create failed: {}", errno_text(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    return io_error(fmt::format("sizing a memfd to {} failed: {}", format_bytes(bytes), errno_text(err)));
  }
  // Peers get this fd; sealed, none of them can shrink it (which would turn
  // our accesses into SIGBUS) or grow it.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = errno;
    close(fd);
    return io_error(fmt::format("sealing a memfd failed: {}", errno_text(err)));
  }
  auto backing = std::make_unique<HostBacking>(fd, base, bytes, piece_bytes, committed_);
  auto* at = static_cast<std::byte*>(base);
  for (size_t off = 0; off < bytes; off += piece_bytes) {
    size_t len = std::min(piece_bytes, bytes - off);
    uint64_t committed = committed_->load();
    if (options_.capacity_bytes != 0 && committed + len > options_.capacity_bytes) {
      // The backing's destructor unmaps and closes what was done so far.
      return out_of_memory(fmt::format("{} does not fit in the host backend's capacity of {} ({} in use by others)",
                                       format_bytes(bytes), format_bytes(options_.capacity_bytes),
                                       format_bytes(committed - off)));
    }
    if (fallocate(fd, 0, static_cast<off_t>(off), static_cast<off_t>(len)) != 0) {
      int err = errno;
      if (err == ENOSPC || err == ENOMEM) {
        return out_of_memory(fmt::format("committing {} of host memory failed: {}", format_bytes(bytes - off),
                                         errno_text(err)));
      }
      return io_error(fmt::format("fallocate on a memfd failed: {}", errno_text(err)));
    }
    backing->add_committed(len);
    void* p = mmap(at + off, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, static_cast<off_t>(off));
    if (p == MAP_FAILED) {
      return io_error(fmt::format("mapping {} of a memfd at {} failed: {}", format_bytes(len),
                                  static_cast<void*>(at + off), errno_text(errno)));
    }
    SIESTA_TRY(populate(p, len));
  }
  return std::unique_ptr<Backing>(std::move(backing));
}

Result<std::unique_ptr<HostBuffer>> HostBackend::allocate_host(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return out_of_memory(fmt::format("allocating {} of host memory failed: {}", format_bytes(bytes), errno_text(errno)));
  }
  return std::unique_ptr<HostBuffer>(std::make_unique<AnonymousBuffer>(p, bytes));
}

Ok HostBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  std::memcpy(host_dst, src, bytes);
  return {};
}

Ok HostBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  std::memcpy(dst, host_src, bytes);
  return {};
}

Result<DeviceMemoryInfo> HostBackend::memory_info() {
  if (options_.capacity_bytes != 0) {
    uint64_t used = std::min<uint64_t>(committed_->load(), options_.capacity_bytes);
    return DeviceMemoryInfo{options_.capacity_bytes - used, options_.capacity_bytes};
  }
  SIESTA_ASSIGN_OR_RETURN(uint64_t available, meminfo_field("MemAvailable"));
  SIESTA_ASSIGN_OR_RETURN(uint64_t total, meminfo_field("MemTotal"));
  return DeviceMemoryInfo{available, total};
}

Result<std::unique_ptr<ImportedMapping>> HostBackend::map_import(const std::vector<ExportedPiece>& pieces) {
  if (pieces.empty()) return invalid_argument("nothing to import: no exported pieces");
  size_t total = 0;
  for (const ExportedPiece& piece : pieces) {
    if (piece.fd < 0 || piece.bytes == 0 || piece.offset % page_bytes_ != 0) {
      return invalid_argument(fmt::format("exported piece (fd {}, offset {}, {} B) cannot be mapped", piece.fd,
                                          piece.offset, piece.bytes));
    }
    total = std::max<size_t>(total, piece.offset + piece.bytes);
  }
  total = (total + page_bytes_ - 1) / page_bytes_ * page_bytes_;
  SIESTA_ASSIGN_OR_RETURN(void* base, reserve(total));
  auto import = std::make_unique<HostImport>(base, total);
  for (const ExportedPiece& piece : pieces) {
    void* p = mmap(static_cast<std::byte*>(base) + piece.offset, piece.bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED | MAP_POPULATE, piece.fd, 0);
    if (p == MAP_FAILED) {
      return io_error(fmt::format("mapping exported fd {} ({}) failed: {}", piece.fd, format_bytes(piece.bytes),
                                  errno_text(errno)));
    }
  }
  return std::unique_ptr<ImportedMapping>(std::move(import));
}

Result<std::unique_ptr<MemoryBackend>> make_host_backend(HostBackendOptions options) {
  return std::unique_ptr<MemoryBackend>(std::make_unique<HostBackend>(options));
}

}  // namespace siesta::memory
