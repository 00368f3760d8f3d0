// WeightUpdate: new weights for a loaded model, written in place (same
// addresses), from one of three sources:
//   kDir      a checkpoint directory, as reload_weights reads it;
//   kShm      host shared memory: a /dev/shm file or a memfd (by path, e.g.
//             /proc/PID/fd/N, or an open descriptor) holding packed tensors;
//   kCudaIpc  device memory of another process on the same GPU, one
//             cudaIpcMemHandle_t per buffer (what PyTorch's storage sharing
//             gives), tensors at byte offsets in the buffers.
// A pushed tensor is named as in the Hugging Face checkpoint, with its dtype
// (bf16, f16, f32: converted to the model's own) and shape.
//
//   WeightUpdate u{.source = WeightSource::kShm, .path = "/dev/shm/w", .tensors = {...}};
//   SIESTA_ASSIGN_OR_RETURN(auto prepared, model.prepare_weight_update(u));  // opens, checks everything
//   SIESTA_ASSIGN_OR_RETURN(WeightUpdateReport r, prepared->apply());        // writes
//
// prepare_weight_update checks every name, shape, dtype and byte range (and,
// with `complete`, that every tensor of the model is there) before anything is
// written: a refused update changes nothing, and its kInvalidArgument message
// names each tensor at fault. apply() writes; the prepared update holds the
// sources open (mappings, imported handles) until it is destroyed.
//
// check_pushed_tensors is the model-independent part of that check, and
// SharedWeightFile the host shared-memory source; both are used by every model.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace siesta {

enum class WeightSource : uint8_t { kDir = 0, kShm = 1, kCudaIpc = 2 };

const char* weight_source_name(WeightSource source);  // "dir", "shm", "cuda_ipc"
Result<WeightSource> parse_weight_source(std::string_view name);

// "bfloat16", "float16", "float32" (PyTorch's names, as the HTTP body gives them).
Result<DType> parse_pushed_dtype(std::string_view name);
const char* pushed_dtype_name(DType dtype);

// A CUDA IPC buffer: the 64 bytes of a cudaIpcMemHandle_t, and which part of
// the allocation it names the tensors live in: `offset` bytes from the
// allocation's start (PyTorch's storage offset inside its cached block),
// `bytes` long. Tensor offsets count from `offset`.
inline constexpr size_t kCudaIpcHandleBytes = 64;
struct CudaIpcBuffer {
  std::array<std::byte, kCudaIpcHandleBytes> handle{};
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct PushedTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  size_t buffer = 0;    // kCudaIpc: index into WeightUpdate::buffers
  uint64_t offset = 0;  // bytes from the start of the file (kShm) or the buffer (kCudaIpc)
};

struct WeightUpdate {
  WeightSource source = WeightSource::kDir;
  // kDir: the checkpoint directory (empty: the one the weights hold now);
  // kShm: the file, or with fd given what messages and the report call it
  // (empty: "descriptor N").
  std::filesystem::path path;
  int fd = -1;  // kShm: an open descriptor instead of path; the caller's (not closed)
  std::vector<CudaIpcBuffer> buffers;
  std::vector<PushedTensor> tensors;
  // Every tensor of the model must be among `tensors` (kShm, kCudaIpc; a
  // directory is always complete).
  bool complete = false;
};

struct WeightUpdateReport {
  WeightSource source = WeightSource::kDir;
  std::string from;     // the directory or file read; "cuda_ipc: N buffers"
  int64_t tensors = 0;  // tensors written
  uint64_t bytes = 0;   // bytes read from the source (before any dtype conversion)
  // Named and checked, not written: lm_head.weight of a model whose
  // embeddings are tied (its data is embed_tokens', which PyTorch's
  // state_dict lists under both names).
  std::vector<std::string> skipped;
  // Indices into updatable_tensors(cfg) of the tensors written.
  std::vector<int> written;
  double prepare_seconds = 0;  // opening the source and checking
  double write_seconds = 0;    // copying (and converting) into the weights

  double gb_per_s() const { return write_seconds > 0 ? static_cast<double>(bytes) / 1e9 / write_seconds : 0.0; }
};

// A model's side of an update: sources open and checked, ready to write.
class PreparedWeightUpdate {
 public:
  virtual ~PreparedWeightUpdate() = default;
  // Writes every checked tensor into the weights. A failure here (a device
  // error) may leave some tensors written: the message says so.
  virtual Result<WeightUpdateReport> apply() = 0;
};

// The tensors an update may write for this config, in Hugging Face's
// state-dict order (qwen3_tensor_specs; no lm_head.weight when tied).
std::vector<TensorSpec> updatable_tensors(const ModelConfig& cfg);

// Checks the pushed tensors of `u` against `specs` (updatable_tensors): names
// known and unique, shapes equal, dtypes bf16/f16/f32, offsets aligned to the
// element size, every byte range inside its source (`source_bytes`: the size
// of each buffer, or the one file's size for kShm), and with u.complete every
// spec present. Every problem goes into one kInvalidArgument message, by kind,
// naming the tensors. Returns, per pushed tensor, its index into specs, or -1
// for lm_head.weight of a tied model (skipped).
Result<std::vector<int>> check_pushed_tensors(const ModelConfig& cfg, const std::vector<TensorSpec>& specs,
                                              const WeightUpdate& u, std::span<const uint64_t> source_bytes);

// The host shared-memory source: the file (or descriptor) of a kShm update,
// mapped read-only for the object's life.
class SharedWeightFile {
 public:
  static Result<SharedWeightFile> open(const WeightUpdate& u);
  SharedWeightFile(SharedWeightFile&& other) noexcept;
  SharedWeightFile& operator=(SharedWeightFile&& other) noexcept;
  ~SharedWeightFile();

  uint64_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  // A view of a checked tensor (check_pushed_tensors passed) in the mapping.
  TensorView view(const PushedTensor& t) const;

 private:
  SharedWeightFile() = default;
  std::string name_;
  const std::byte* base_ = nullptr;
  uint64_t bytes_ = 0;
};

// The byte size of a pushed tensor (numel x element size); 0 when its shape
// has a negative dimension or overflows.
uint64_t pushed_tensor_bytes(const PushedTensor& t);

}  // namespace siesta
