// Safetensors reading (mmap, zero-copy) and writing.
//
// Reading:
//   Result<TensorStore> store = TensorStore::open(model_dir);
//     opens DIR/model.safetensors, or every shard named by
//     DIR/model.safetensors.index.json ("weight_map": tensor -> file).
//   Result<TensorView> t = store->get("model.norm.weight", {hidden}, {DType::kBF16, DType::kF32});
//     checks presence, shape and dtype; errors name the tensor and the file.
//   Result<std::vector<float>> v = store->get_f32(name, shape);   // any float dtype -> fp32
//   convert_to_f32(view, out) copies into caller memory (e.g. a memory-pool region).
// The mapped files stay mapped while the TensorStore lives; views point into them.
//
// Writing:
//   write_safetensors(path, {TensorData{name, dtype, shape, bytes}...}, metadata)
// or, for data that does not fit in memory at once (make-model's 16 GB checkpoints):
//   SIESTA_ASSIGN_OR_RETURN(auto w, SafetensorsWriter::create(path, specs, metadata));
//   w.append(bytes) ... (the tensors' data in the order of specs, in any pieces)
//   w.finish();   // checks every byte arrived, then renames PATH.partial to PATH
// A writer destroyed before finish() removes its partial file.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the data. Every offset is checked against the file size before use: a
// truncated or malformed file is an error, never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta {

enum class DType { kBF16, kF16, kF32, kI32, kI64, kU8 };

const char* dtype_name(DType d);        // "BF16", "F16", ...
size_t dtype_size(DType d);
Result<DType> parse_dtype(const std::string& name);

// Data pointers of a TensorView are not necessarily aligned to the element size
// (the format does not require it); read through memcpy or convert_to_f32.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  std::string file;  // which file it came from, for error messages
  // Where data starts in `file` (bytes), for readers that pread instead of
  // touching the mapping; -1 for views of memory that is no file's.
  int64_t file_offset = -1;

  int64_t numel() const;
};

// Converts a bf16/f16/f32 tensor to fp32 into out (out.size() == numel()).
Result<void> convert_to_f32(const TensorView& t, std::span<float> out);

// One mapped .safetensors file.
class SafetensorsFile;

class TensorStore {
 public:
  static Result<TensorStore> open(const std::filesystem::path& model_dir);
  // Opens a single file (tests, --dump-logits readers).
  static Result<TensorStore> open_file(const std::filesystem::path& file);

  TensorStore(TensorStore&&) noexcept;
  TensorStore& operator=(TensorStore&&) noexcept;
  ~TensorStore();

  bool contains(const std::string& name) const;
  // The tensor as its file describes it, unchecked; nullptr when absent. For tools that
  // inspect a checkpoint; loaders use get(), which checks what they expect.
  const TensorView* find(const std::string& name) const;
  std::vector<std::string> names() const;
  // shape: the expected shape; dtypes: the accepted dtypes (empty = any float dtype).
  Result<TensorView> get(const std::string& name, const std::vector<int64_t>& shape,
                         const std::vector<DType>& dtypes = {}) const;
  Result<std::vector<float>> get_f32(const std::string& name, const std::vector<int64_t>& shape) const;

 private:
  TensorStore();
  Result<void> add_file(const std::filesystem::path& path);

  std::string source_;  // the directory or file opened, for "not found" messages
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  Result<size_t> nbytes() const;  // numel * dtype size; an error if it overflows or a dim is negative
};

class SafetensorsWriter {
 public:
  static Result<SafetensorsWriter> create(const std::filesystem::path& path, const std::vector<TensorSpec>& tensors,
                                          const std::map<std::string, std::string>& metadata = {});
  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  ~SafetensorsWriter();

  Result<void> append(std::span<const std::byte> bytes);
  Result<void> finish();
  size_t data_bytes() const { return data_bytes_; }  // the size of the data section

 private:
  SafetensorsWriter() = default;
  void discard();

  std::filesystem::path path_;
  std::filesystem::path partial_path_;
  int fd_ = -1;
  size_t data_bytes_ = 0;
  size_t written_ = 0;
};

struct TensorData {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

Result<void> write_safetensors(const std::filesystem::path& path, const std::vector<TensorData>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

// bf16/f16 <-> f32. f32 -> bf16/f16 round to nearest even; NaN stays NaN, infinities stay.
float bf16_to_f32(uint16_t v);
uint16_t f32_to_bf16(float v);
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float v);

}  // namespace siesta
