#include "bench/transfer/bench_memory.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "transfer/ipc/piece_copy.h"

namespace siesta::transfer {

namespace {

constexpr size_t kStagingBytes = size_t{64} << 20;

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 64-bit words from splitmix64 of (seed, index).
void fill_host(char* p, size_t n, uint64_t seed) {
  size_t words = n / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t v = mix(seed * 0x9E3779B97F4A7C15ull + i);
    std::memcpy(p + i * 8, &v, 8);
  }
  for (size_t i = words * 8; i < n; ++i) p[i] = static_cast<char>(mix(seed + i));
}

uint64_t hash_host(const char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull ^ n;
  size_t words = n / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t v;
    std::memcpy(&v, p + i * 8, 8);
    h = (h ^ v) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (size_t i = words * 8; i < n; ++i) h = (h ^ static_cast<uint8_t>(p[i])) * 0x100000001b3ull;
  return h;
}

}  // namespace

Result<std::unique_ptr<BenchMemory>> BenchMemory::create(MemoryKind kind, size_t bytes, int cuda_device) {
  std::unique_ptr<BenchMemory> m(new BenchMemory());
  m->kind_ = kind;
  m->device_ = cuda_device;
  if (kind == MemoryKind::kHost) {
    m->fd_ = memfd_create("siesta-bench-transfer", MFD_CLOEXEC);
    if (m->fd_ < 0 || ftruncate(m->fd_, static_cast<off_t>(bytes)) != 0)
      return io_error(fmt::format("memfd of {} bytes for the benchmark: {}", bytes, std::strerror(errno)));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m->fd_, 0);
    if (p == MAP_FAILED) return out_of_memory(fmt::format("mapping {} bytes for the benchmark", bytes));
    m->base_ = static_cast<char*>(p);
    m->bytes_ = bytes;
  } else {
    SIESTA_ASSIGN_OR_RETURN(m->cuda_, ipc::cuda_alloc_exportable(bytes, cuda_device));
    m->base_ = static_cast<char*>(m->cuda_.base);
    m->bytes_ = m->cuda_.bytes;
    m->fd_ = m->cuda_.fd;
    m->staging_.resize(std::min(bytes, kStagingBytes));
  }
  return m;
}

BenchMemory::~BenchMemory() {
  if (kind_ == MemoryKind::kHost) {
    if (base_ != nullptr) munmap(base_, bytes_);
    if (fd_ >= 0) close(fd_);
  } else {
    ipc::cuda_free_exportable(cuda_);
  }
}

RegionSpec BenchMemory::spec() const {
  RegionSpec s;
  s.base = base_;
  s.bytes = bytes_;
  s.kind = kind_;
  s.export_fd = fd_;
  s.export_bytes = kind_ == MemoryKind::kCuda ? bytes_ : 0;
  s.cuda_device = device_;
  return s;
}

// CUDA memory goes through host staging piece by piece; the seed advances per
// piece and hashes chain per piece, the same way in expected_hash().
Ok BenchMemory::fill(size_t offset, size_t length, uint64_t seed) {
  if (offset + length > bytes_) return invalid_argument("fill outside the benchmark memory");
  if (kind_ == MemoryKind::kHost) {
    fill_host(base_ + offset, length, seed);
    return {};
  }
  for (size_t done = 0; done < length; done += staging_.size()) {
    size_t n = std::min(staging_.size(), length - done);
    fill_host(staging_.data(), n, seed + done);
    SIESTA_TRY(ipc::cuda_copy({{base_ + offset + done, staging_.data(), n}}, device_));
  }
  return {};
}

Result<uint64_t> BenchMemory::hash(size_t offset, size_t length) {
  if (offset + length > bytes_) return invalid_argument("hash outside the benchmark memory");
  if (kind_ == MemoryKind::kHost) return hash_host(base_ + offset, length);
  uint64_t h = 0;
  for (size_t done = 0; done < length; done += staging_.size()) {
    size_t n = std::min(staging_.size(), length - done);
    SIESTA_TRY(ipc::cuda_copy({{staging_.data(), base_ + offset + done, n}}, device_));
    h = mix(h ^ hash_host(staging_.data(), n));
  }
  return h;
}

uint64_t BenchMemory::expected_hash(size_t length, uint64_t seed) const {
  std::vector<char> tmp;
  if (kind_ == MemoryKind::kHost) {
    tmp.resize(length);
    fill_host(tmp.data(), length, seed);
    return hash_host(tmp.data(), length);
  }
  uint64_t h = 0;
  tmp.resize(std::min(staging_.size(), length));
  for (size_t done = 0; done < length; done += staging_.size()) {
    size_t n = std::min(staging_.size(), length - done);
    fill_host(tmp.data(), n, seed + done);
    h = mix(h ^ hash_host(tmp.data(), n));
  }
  return h;
}

}  // namespace siesta::transfer
