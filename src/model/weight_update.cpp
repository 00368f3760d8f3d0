#include "model/weight_update.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "model/make_model.h"

namespace siesta {
namespace {

// How many names one kind of problem lists before "and N more".
constexpr size_t kNamesPerProblem = 8;

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Names come from the client; messages stay one line.
std::string printable(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  if (s.size() > 200) s = s.substr(0, 200) + "...";
  return s;
}

struct Problems {
  std::vector<std::pair<std::string, std::vector<std::string>>> kinds;

  void add(const std::string& kind, std::string item) {
    for (auto& [k, items] : kinds)
      if (k == kind) {
        items.push_back(std::move(item));
        return;
      }
    kinds.push_back({kind, {std::move(item)}});
  }
  bool empty() const { return kinds.empty(); }
  std::string text() const {
    std::string out;
    for (const auto& [kind, items] : kinds) {
      if (!out.empty()) out += "; ";
      out += fmt::format("{} {}: ", items.size(), kind);
      for (size_t i = 0; i < items.size() && i < kNamesPerProblem; ++i) out += (i ? ", " : "") + items[i];
      if (items.size() > kNamesPerProblem) out += fmt::format(" and {} more", items.size() - kNamesPerProblem);
    }
    return out;
  }
};

}  // namespace

const char* weight_source_name(WeightSource source) {
  switch (source) {
    case WeightSource::kDir:
      return "dir";
    case WeightSource::kShm:
      return "shm";
    case WeightSource::kCudaIpc:
      return "cuda_ipc";
  }
  return "unknown";
}

Result<WeightSource> parse_weight_source(std::string_view name) {
  if (name == "dir") return WeightSource::kDir;
  if (name == "shm") return WeightSource::kShm;
  if (name == "cuda_ipc") return WeightSource::kCudaIpc;
  return invalid_argument(
      fmt::format("weight source '{}' is not one of dir, shm, cuda_ipc", printable(std::string(name))));
}

Result<DType> parse_pushed_dtype(std::string_view name) {
  if (name == "bfloat16" || name == "bf16" || name == "torch.bfloat16") return DType::kBF16;
  if (name == "float16" || name == "half" || name == "torch.float16") return DType::kF16;
  if (name == "float32" || name == "float" || name == "torch.float32") return DType::kF32;
  return invalid_argument(
      fmt::format("dtype '{}' is not one of bfloat16, float16, float32", printable(std::string(name))));
}

const char* pushed_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
      return "float32";
    default:
      return dtype_name(dtype);
  }
}

std::vector<TensorSpec> updatable_tensors(const ModelConfig& cfg) { return qwen3_tensor_specs(cfg, DType::kBF16); }

uint64_t pushed_tensor_bytes(const PushedTensor& t) {
  uint64_t n = dtype_size(t.dtype);
  for (int64_t d : t.shape) {
    if (d < 0) return 0;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) return 0;
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

Result<std::vector<int>> check_pushed_tensors(const ModelConfig& cfg, const std::vector<TensorSpec>& specs,
                                              const WeightUpdate& u, std::span<const uint64_t> source_bytes) {
  std::map<std::string, int> index;
  for (size_t i = 0; i < specs.size(); ++i) index.emplace(specs[i].name, static_cast<int>(i));
  const std::vector<int64_t> lm_head_shape = {cfg.vocab_size, cfg.hidden_size};

  Problems problems;
  std::vector<int> out;
  out.reserve(u.tensors.size());
  std::vector<bool> seen(specs.size(), false);
  bool seen_lm_head = false;
  if (u.tensors.empty()) problems.add("tensors given", "none (the update names no tensor)");
  for (const PushedTensor& t : u.tensors) {
    const std::string name = printable(t.name);
    const std::vector<int64_t>* expected = nullptr;
    int spec = -1;
    if (auto it = index.find(t.name); it != index.end()) {
      spec = it->second;
      expected = &specs[static_cast<size_t>(spec)].shape;
      if (seen[static_cast<size_t>(spec)]) problems.add("named twice", name);
      seen[static_cast<size_t>(spec)] = true;
    } else if (cfg.tie_word_embeddings && t.name == "lm_head.weight") {
      expected = &lm_head_shape;  // tied: the embeddings' data under another name
      if (seen_lm_head) problems.add("named twice", name);
      seen_lm_head = true;
    } else {
      problems.add("unknown to this model", name);
      out.push_back(-1);
      continue;
    }
    out.push_back(spec);
    if (t.shape != *expected)
      problems.add("mis-shaped",
                   fmt::format("{} ({} given, {} expected)", name, shape_str(t.shape), shape_str(*expected)));
    if (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32) {
      problems.add("of a dtype other than bfloat16, float16, float32",
                   fmt::format("{} ({})", name, dtype_name(t.dtype)));
      continue;
    }
    const uint64_t nbytes = pushed_tensor_bytes(t);
    if (nbytes == 0 && t.shape == *expected) {
      problems.add("of no bytes", name);
      continue;
    }
    if (t.offset % dtype_size(t.dtype) != 0)
      problems.add("at an offset that is not a multiple of the element size",
                   fmt::format("{} (offset {}, {} bytes per element)", name, t.offset, dtype_size(t.dtype)));
    const size_t source = u.source == WeightSource::kCudaIpc ? t.buffer : 0;
    if (source >= source_bytes.size()) {
      problems.add("in a buffer that does not exist",
                   fmt::format("{} (buffer {}; {} given)", name, t.buffer, source_bytes.size()));
      continue;
    }
    const uint64_t size = source_bytes[source];
    if (t.offset > size || nbytes > size - t.offset) {
      const std::string where = u.source == WeightSource::kCudaIpc ? fmt::format("buffer {}", source) : "the file";
      problems.add("past the end of their source",
                   fmt::format("{} (bytes [{}, {}) of {}, which holds {})", name, t.offset,
                               static_cast<unsigned long long>(t.offset) + nbytes, where, size));
    }
  }
  if (u.complete) {
    for (size_t i = 0; i < specs.size(); ++i)
      if (!seen[i]) problems.add("missing (\"complete\": true)", specs[i].name);
  }
  if (!problems.empty())
    return invalid_argument(fmt::format("update_weights ({}): {}; the weights are unchanged",
                                        weight_source_name(u.source), problems.text()));
  return out;
}

// ---- SharedWeightFile ----

Result<SharedWeightFile> SharedWeightFile::open(const WeightUpdate& u) {
  SharedWeightFile f;
  int fd = u.fd;
  bool own = false;
  if (fd >= 0) {
    f.name_ = u.path.empty() ? fmt::format("descriptor {}", fd) : u.path.string();
  } else {
    if (u.path.empty())
      return invalid_argument(
          "update_weights (shm): no file: give \"path\" (/dev/shm/NAME, or /proc/PID/fd/N for a memfd)");
    f.name_ = u.path.string();
    fd = ::open(u.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return invalid_argument(
          fmt::format("update_weights (shm): cannot open {}: {}", printable(f.name_), std::strerror(errno)));
    own = true;
  }
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  if (!stated || !S_ISREG(st.st_mode)) {
    const std::string why = stated ? "not a regular file (shared memory or a file)" : std::strerror(errno);
    if (own) ::close(fd);
    return invalid_argument(fmt::format("update_weights (shm): {}: {}", printable(f.name_), why));
  }
  if (st.st_size <= 0) {
    if (own) ::close(fd);
    return invalid_argument(fmt::format("update_weights (shm): {} is empty", printable(f.name_)));
  }
  f.bytes_ = static_cast<uint64_t>(st.st_size);
  void* p = ::mmap(nullptr, f.bytes_, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  if (own) ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED)
    return invalid_argument(fmt::format("update_weights (shm): cannot map {} ({} bytes): {}", printable(f.name_),
                                        f.bytes_, std::strerror(err)));
  f.base_ = static_cast<const std::byte*>(p);
  return f;
}

SharedWeightFile::SharedWeightFile(SharedWeightFile&& other) noexcept
    : name_(std::move(other.name_)),
      base_(std::exchange(other.base_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

SharedWeightFile& SharedWeightFile::operator=(SharedWeightFile&& other) noexcept {
  if (this != &other) {
    if (base_) ::munmap(const_cast<std::byte*>(base_), bytes_);
    name_ = std::move(other.name_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

SharedWeightFile::~SharedWeightFile() {
  if (base_) ::munmap(const_cast<std::byte*>(base_), bytes_);
}

TensorView SharedWeightFile::view(const PushedTensor& t) const {
  TensorView v;
  v.name = t.name;
  v.dtype = t.dtype;
  v.shape = t.shape;
  v.data = base_ + t.offset;
  v.nbytes = pushed_tensor_bytes(t);
  v.file = name_;
  return v;
}

}  // namespace siesta
