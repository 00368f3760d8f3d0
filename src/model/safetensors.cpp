#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

namespace siesta {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; a larger length is
// a corrupt file, not a reason to parse gigabytes of "JSON".
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string errno_str() { return std::strerror(errno); }

// Tensor names come from the file and may hold control characters; messages stay one line.
Status one_line(Status s) {
  for (char& c : s.message)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return s;
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

// numel * elem_size, or nullopt on a negative dim or overflow.
std::optional<size_t> checked_nbytes(const std::vector<int64_t>& shape, size_t elem_size) {
  size_t n = elem_size;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<size_t>::max() / static_cast<size_t>(d)) return std::nullopt;
    n *= static_cast<size_t>(d);
  }
  return n;
}

Result<void> write_all(int fd, const std::byte* p, size_t n, const std::filesystem::path& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, 1u << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return io_error(fmt::format("{}: write failed: {}", path.string(), errno_str()));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return {};
}

}  // namespace

// ---- dtypes and conversions ----

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
  }
  return "?";
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}

Result<DType> parse_dtype(const std::string& name) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64, DType::kU8})
    if (name == dtype_name(d)) return d;
  return invalid_argument(fmt::format("unsupported dtype \"{}\" (supported: BF16, F16, F32, I32, I64, U8)", name));
}

float bf16_to_f32(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

uint16_t f32_to_bf16(float v) {
  uint32_t bits = std::bit_cast<uint32_t>(v);
  // A NaN whose payload sits only in the low 16 bits would round to infinity; keep it quiet NaN.
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // ties go to the even neighbour
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float f16_to_f32(uint16_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
  uint32_t exp = (v >> 10) & 0x1fu;
  uint32_t mant = v & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf or NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal half: value = mant * 2^-24, exact in f32.
    float f = static_cast<float>(mant) * 0x1p-24f;
    bits = sign | std::bit_cast<uint32_t>(f);
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_f16(float v) {
  uint32_t bits = std::bit_cast<uint32_t>(v);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): scale so the integer part is the f16 mantissa, and let
    // the f32 addition round to nearest even.
    float f = std::bit_cast<float>(abs) * 0x1p24f;
    float r = f + 0x1p23f;  // forces rounding at the unit place
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(r) - 0x4b000000u));
  }
  uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  abs += rounding;
  return static_cast<uint16_t>(sign | ((abs - 0x38000000u) >> 13));
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Result<void> convert_to_f32(const TensorView& t, std::span<float> out) {
  const size_t n = static_cast<size_t>(t.numel());
  if (out.size() != n)
    return invalid_argument(
        fmt::format("{}: {} elements in {}, but the destination holds {}", t.name, n, t.file, out.size()));
  if (t.nbytes != n * dtype_size(t.dtype))
    return internal_error(fmt::format("{}: view of {} bytes for {} {} elements", t.name, t.nbytes, n, dtype_name(t.dtype)));
  const std::byte* p = t.data;
  switch (t.dtype) {
    case DType::kBF16:
    case DType::kF16: {
      const bool bf16 = t.dtype == DType::kBF16;
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = bf16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      return {};
    }
    case DType::kF32:
      if (n > 0) std::memcpy(out.data(), p, n * sizeof(float));
      return {};
    default:
      return invalid_argument(
          fmt::format("{}: dtype {} in {} is not a floating-point type", t.name, dtype_name(t.dtype), t.file));
  }
}

// ---- reading ----

// One mapped file and the tensors its header describes. Every view points inside the mapping.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::filesystem::path& path);
  ~SafetensorsFile() {
    if (base_) ::munmap(base_, size_);
  }
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }

 private:
  SafetensorsFile() = default;
  Result<void> parse_header();
  Result<TensorView> parse_entry(const std::string& name, const json& entry, const std::byte* data, size_t data_size) const;

  std::string path_;
  void* base_ = nullptr;
  size_t size_ = 0;
  std::vector<TensorView> tensors_;
};

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::filesystem::path& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path.string();
  int fd = ::open(f->path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return not_found(fmt::format("{}: no such file", f->path_));
    return io_error(fmt::format("{}: cannot open: {}", f->path_, errno_str()));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    auto err = io_error(fmt::format("{}: cannot stat: {}", f->path_, errno_str()));
    ::close(fd);
    return err;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(fmt::format("{}: not a regular file", f->path_));
  }
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return corrupt(fmt::format("{}: truncated: {} bytes, too short for the 8-byte header length", f->path_, f->size_));
  }
  void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int mmap_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    return io_error(fmt::format("{}: mmap of {} bytes failed: {}", f->path_, f->size_, std::strerror(mmap_errno)));
  f->base_ = p;
  SIESTA_TRY(f->parse_header());
  return f;
}

Result<void> SafetensorsFile::parse_header() {
  const auto* bytes = static_cast<const std::byte*>(base_);
  const uint64_t header_len = read_le64(bytes);
  if (header_len > size_ - 8)
    return corrupt(fmt::format("{}: header length {} exceeds the {} bytes after it (truncated or not a safetensors file)",
                               path_, header_len, size_ - 8));
  if (header_len > kMaxHeaderBytes)
    return corrupt(fmt::format("{}: header length {} is over the {} byte limit", path_, header_len, kMaxHeaderBytes));
  const auto* header = reinterpret_cast<const char*>(bytes + 8);
  json j;
  try {
    j = json::parse(header, header + header_len);
  } catch (const json::exception& e) {
    return corrupt(fmt::format("{}: header is not valid JSON: {}", path_, e.what()));
  }
  if (!j.is_object()) return corrupt(fmt::format("{}: header is not a JSON object", path_));

  const std::byte* data = bytes + 8 + header_len;
  const size_t data_size = size_ - 8 - header_len;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return corrupt(fmt::format("{}: __metadata__ is not an object", path_));
      continue;
    }
    SIESTA_ASSIGN_OR_RETURN(TensorView view, parse_entry(name, entry, data, data_size));
    tensors_.push_back(std::move(view));
  }
  return {};
}

Result<TensorView> SafetensorsFile::parse_entry(const std::string& name, const json& entry, const std::byte* data,
                                                size_t data_size) const {
  auto bad = [&](std::string_view what) { return corrupt(fmt::format("{}: tensor {}: {}", path_, name, what)); };
  if (!entry.is_object()) return bad("entry is not an object");
  TensorView v;
  v.name = name;
  v.file = path_;

  auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string()) return bad("missing or non-string \"dtype\"");
  auto parsed = parse_dtype(dt->get<std::string>());
  if (!parsed) return bad(parsed.error().message);
  v.dtype = *parsed;

  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) return bad("missing or non-array \"shape\"");
  for (const json& d : *shape) {
    if (!d.is_number_unsigned()) return bad(fmt::format("shape {} has a dimension that is not a non-negative integer", shape->dump()));
    if (d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return bad("shape dimension too large");
    v.shape.push_back(d.get<int64_t>());
  }

  auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned())
    return bad("\"data_offsets\" must be [begin, end] with non-negative integers");
  const uint64_t begin = (*offsets)[0].get<uint64_t>();
  const uint64_t end = (*offsets)[1].get<uint64_t>();
  if (begin > end) return bad(fmt::format("data_offsets [{}, {}] has begin after end", begin, end));
  if (end > data_size)
    return bad(fmt::format("data_offsets [{}, {}] extend past the data section ({} bytes; file truncated?)", begin, end,
                           data_size));
  auto expected = checked_nbytes(v.shape, dtype_size(v.dtype));
  if (!expected) return bad(fmt::format("shape {} overflows", shape_str(v.shape)));
  if (end - begin != *expected)
    return bad(fmt::format("data_offsets [{}, {}] hold {} bytes, but {} {} needs {}", begin, end, end - begin,
                           dtype_name(v.dtype), shape_str(v.shape), *expected));
  v.data = data + begin;
  v.nbytes = static_cast<size_t>(end - begin);
  v.file_offset = static_cast<int64_t>(data - static_cast<const std::byte*>(base_)) + static_cast<int64_t>(begin);
  return v;
}

TensorStore::TensorStore() = default;
TensorStore::TensorStore(TensorStore&&) noexcept = default;
TensorStore& TensorStore::operator=(TensorStore&&) noexcept = default;
TensorStore::~TensorStore() = default;

Result<void> TensorStore::add_file(const std::filesystem::path& path) {
  auto opened = SafetensorsFile::open(path);
  if (!opened) return one_line(opened.error());
  std::unique_ptr<SafetensorsFile> file = std::move(opened).value();
  for (const TensorView& t : file->tensors()) {
    auto [it, inserted] = tensors_.emplace(t.name, t);
    if (!inserted)
      return one_line(corrupt(fmt::format("tensor {} appears in both {} and {}", t.name, it->second.file, t.file)));
  }
  files_.push_back(std::move(file));
  return {};
}

Result<TensorStore> TensorStore::open_file(const std::filesystem::path& file) {
  TensorStore store;
  store.source_ = file.string();
  SIESTA_TRY(store.add_file(file));
  return store;
}

Result<TensorStore> TensorStore::open(const std::filesystem::path& model_dir) {
  const auto index_path = model_dir / kIndexFile;
  std::error_code ec;
  if (!std::filesystem::exists(index_path, ec)) {
    const auto single = model_dir / kSingleFile;
    if (!std::filesystem::exists(single, ec))
      return not_found(fmt::format("{}: no {} or {}", model_dir.string(), kSingleFile, kIndexFile));
    return open_file(single);
  }

  std::ifstream in(index_path, std::ios::binary);
  if (!in) return io_error(fmt::format("{}: cannot open", index_path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  json index;
  try {
    index = json::parse(ss.str());
  } catch (const json::exception& e) {
    return corrupt(fmt::format("{}: not valid JSON: {}", index_path.string(), e.what()));
  }
  auto wm = index.is_object() ? index.find("weight_map") : index.end();
  if (!index.is_object() || wm == index.end() || !wm->is_object())
    return corrupt(fmt::format("{}: missing \"weight_map\" object", index_path.string()));

  std::map<std::string, std::string> weight_map;
  std::set<std::string> shards;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string()) return one_line(corrupt(fmt::format("{}: weight_map[\"{}\"] is not a file name", index_path.string(), name)));
    auto f = file.get<std::string>();
    // Shards live next to the index; a path could point anywhere on the machine.
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      return one_line(
          corrupt(fmt::format("{}: weight_map[\"{}\"] = \"{}\" is not a plain file name", index_path.string(), name, f)));
    weight_map.emplace(name, f);
    shards.insert(f);
  }
  if (shards.empty()) return corrupt(fmt::format("{}: weight_map is empty", index_path.string()));

  TensorStore store;
  store.source_ = model_dir.string();
  for (const std::string& shard : shards) SIESTA_TRY(store.add_file(model_dir / shard));
  for (const auto& [name, shard] : weight_map) {
    auto it = store.tensors_.find(name);
    const std::string shard_path = (model_dir / shard).string();
    if (it == store.tensors_.end() || it->second.file != shard_path)
      return one_line(
          corrupt(fmt::format("{}: names {} for {}, but that file does not contain it", index_path.string(), shard, name)));
  }
  return store;
}

bool TensorStore::contains(const std::string& name) const { return tensors_.count(name) != 0; }

const TensorView* TensorStore::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<std::string> TensorStore::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

Result<TensorView> TensorStore::get(const std::string& name, const std::vector<int64_t>& shape,
                                    const std::vector<DType>& dtypes) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return not_found(fmt::format("{}: not found in {}", name, source_));
  const TensorView& t = it->second;
  if (t.shape != shape)
    return invalid_argument(fmt::format("{}: shape {} in {}, expected {}", name, shape_str(t.shape), t.file, shape_str(shape)));
  static const std::vector<DType> kFloat = {DType::kBF16, DType::kF16, DType::kF32};
  const auto& accepted = dtypes.empty() ? kFloat : dtypes;
  if (std::find(accepted.begin(), accepted.end(), t.dtype) == accepted.end()) {
    std::vector<std::string> names;
    for (DType d : accepted) names.emplace_back(dtype_name(d));
    return invalid_argument(
        fmt::format("{}: dtype {} in {}, expected {}", name, dtype_name(t.dtype), t.file, fmt::join(names, " or ")));
  }
  return t;
}

Result<std::vector<float>> TensorStore::get_f32(const std::string& name, const std::vector<int64_t>& shape) const {
  SIESTA_ASSIGN_OR_RETURN(TensorView t, get(name, shape));
  std::vector<float> out(static_cast<size_t>(t.numel()));
  SIESTA_TRY(convert_to_f32(t, out));
  return out;
}

// ---- writing ----

Result<size_t> TensorSpec::nbytes() const {
  auto n = checked_nbytes(shape, dtype_size(dtype));
  if (!n) return invalid_argument(fmt::format("{}: shape {} is negative or overflows", name, shape_str(shape)));
  return *n;
}

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& o) noexcept
    : path_(std::move(o.path_)),
      partial_path_(std::move(o.partial_path_)),
      fd_(std::exchange(o.fd_, -1)),
      data_bytes_(o.data_bytes_),
      written_(o.written_) {}

SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&& o) noexcept {
  if (this != &o) {
    discard();
    path_ = std::move(o.path_);
    partial_path_ = std::move(o.partial_path_);
    fd_ = std::exchange(o.fd_, -1);
    data_bytes_ = o.data_bytes_;
    written_ = o.written_;
  }
  return *this;
}

SafetensorsWriter::~SafetensorsWriter() { discard(); }

void SafetensorsWriter::discard() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  std::filesystem::remove(partial_path_, ec);
}

Result<SafetensorsWriter> SafetensorsWriter::create(const std::filesystem::path& path, const std::vector<TensorSpec>& tensors,
                                                    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      return invalid_argument(fmt::format("{}: invalid tensor name \"{}\"", path.string(), t.name));
    if (header.contains(t.name)) return invalid_argument(fmt::format("{}: tensor {} given twice", path.string(), t.name));
    SIESTA_ASSIGN_OR_RETURN(size_t n, t.nbytes());
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');

  SafetensorsWriter w;
  w.path_ = path;
  w.partial_path_ = path;
  w.partial_path_ += ".partial";
  w.data_bytes_ = offset;
  w.fd_ = ::open(w.partial_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd_ < 0) return io_error(fmt::format("{}: cannot create: {}", w.partial_path_.string(), errno_str()));
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::byte>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  SIESTA_TRY(write_all(w.fd_, len, 8, w.partial_path_));
  SIESTA_TRY(write_all(w.fd_, reinterpret_cast<const std::byte*>(text.data()), text.size(), w.partial_path_));
  return w;
}

Result<void> SafetensorsWriter::append(std::span<const std::byte> bytes) {
  if (fd_ < 0) return conflict(fmt::format("{}: writer already finished or failed", path_.string()));
  if (bytes.size() > data_bytes_ - written_)
    return invalid_argument(fmt::format("{}: {} more bytes than the {} the header describes", path_.string(),
                                        written_ + bytes.size() - data_bytes_, data_bytes_));
  auto r = write_all(fd_, bytes.data(), bytes.size(), partial_path_);
  if (!r) {
    discard();
    return r;
  }
  written_ += bytes.size();
  return {};
}

Result<void> SafetensorsWriter::finish() {
  if (fd_ < 0) return conflict(fmt::format("{}: writer already finished or failed", path_.string()));
  if (written_ != data_bytes_) {
    discard();
    return invalid_argument(
        fmt::format("{}: {} data bytes written, the header describes {}", path_.string(), written_, data_bytes_));
  }
  int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    auto err = io_error(fmt::format("{}: close failed: {}", partial_path_.string(), errno_str()));
    std::error_code ec;
    std::filesystem::remove(partial_path_, ec);
    return err;
  }
  std::error_code ec;
  std::filesystem::rename(partial_path_, path_, ec);
  if (ec) {
    auto err = io_error(fmt::format("{}: rename failed: {}", path_.string(), ec.message()));
    std::filesystem::remove(partial_path_, ec);
    return err;
  }
  return {};
}

Result<void> write_safetensors(const std::filesystem::path& path, const std::vector<TensorData>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorData& t : tensors) {
    TensorSpec spec{t.name, t.dtype, t.shape};
    SIESTA_ASSIGN_OR_RETURN(size_t n, spec.nbytes());
    if (n != t.bytes.size())
      return invalid_argument(fmt::format("{}: tensor {}: {} bytes given, {} {} needs {}", path.string(), t.name,
                                          t.bytes.size(), dtype_name(t.dtype), shape_str(t.shape), n));
    specs.push_back(std::move(spec));
  }
  SIESTA_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::create(path, specs, metadata));
  for (const TensorData& t : tensors) SIESTA_TRY(writer.append(t.bytes));
  return writer.finish();
}

}  // namespace siesta
