#include "server/weight_update_request.h"

#include <cstring>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "server/json_fields.h"

namespace siesta::server {
namespace {

using nlohmann::json;

// PyTorch's shared CUDA handle (CUDACachingAllocator::shareIpcHandle): a
// version byte, a kind ('c': cudaMalloc memory, 'e': an expandable segment),
// then the cudaIpcMemHandle_t.
constexpr size_t kTorchHandleBytes = 2 + kCudaIpcHandleBytes;

Result<void> only_fields(const json& obj, const std::set<std::string>& allowed, const std::string& where) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (allowed.count(it.key())) continue;
    std::string list;
    for (const std::string& a : allowed) list += (list.empty() ? "" : ", ") + a;
    return invalid_argument(where + "unknown field '" + it.key() + "' (update_weights takes " + list + ")");
  }
  return {};
}

Result<uint64_t> non_negative(const json& v, const std::string& what) {
  if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
    return invalid_argument("'" + what + "' must be an integer >= 0, got " +
                            (v.is_number() ? v.dump() : json_type_name(v)));
  const uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return invalid_argument("'" + what + "' is too large: " + v.dump());
  return u;
}

Result<PushedTensor> parse_tensor(const json& t, size_t i, bool ipc) {
  const std::string at = "tensors[" + std::to_string(i) + "]";
  if (!t.is_object()) return invalid_argument("'" + at + "' must be an object, got " + json_type_name(t));
  std::set<std::string> fields = {"name", "dtype", "shape", "offset"};
  if (ipc) fields.insert("buffer");
  SIESTA_TRY(only_fields(t, fields, at + ": "));
  PushedTensor out;
  auto name = t.find("name");
  if (name == t.end() || !name->is_string() || name->get<std::string>().empty())
    return invalid_argument("'" + at + ".name' must be a tensor name (a non-empty string)");
  out.name = name->get<std::string>();
  auto dtype = t.find("dtype");
  if (dtype == t.end() || !dtype->is_string())
    return invalid_argument("'" + at + ".dtype' must be one of bfloat16, float16, float32");
  auto parsed = parse_pushed_dtype(dtype->get<std::string>());
  if (!parsed) return parsed.error().with_context(at + " (" + out.name + ")");
  out.dtype = *parsed;
  auto shape = t.find("shape");
  if (shape == t.end() || !shape->is_array())
    return invalid_argument("'" + at + ".shape' must be an array of dimensions");
  for (size_t d = 0; d < shape->size(); ++d) {
    SIESTA_ASSIGN_OR_RETURN(uint64_t dim, non_negative((*shape)[d], at + ".shape[" + std::to_string(d) + "]"));
    out.shape.push_back(static_cast<int64_t>(dim));
  }
  auto offset = t.find("offset");
  if (offset == t.end())
    return invalid_argument("'" + at + ".offset' is required (bytes from the start of its source)");
  SIESTA_ASSIGN_OR_RETURN(out.offset, non_negative(*offset, at + ".offset"));
  if (ipc) {
    auto buffer = t.find("buffer");
    if (buffer != t.end()) {
      SIESTA_ASSIGN_OR_RETURN(uint64_t b, non_negative(*buffer, at + ".buffer"));
      out.buffer = static_cast<size_t>(b);
    }
  }
  return out;
}

Result<CudaIpcBuffer> parse_buffer(const json& b, size_t i) {
  const std::string at = "buffers[" + std::to_string(i) + "]";
  if (!b.is_object()) return invalid_argument("'" + at + "' must be an object, got " + json_type_name(b));
  SIESTA_TRY(only_fields(b, {"handle", "bytes", "offset"}, at + ": "));
  CudaIpcBuffer out;
  auto handle = b.find("handle");
  if (handle == b.end() || !handle->is_string())
    return invalid_argument("'" + at + ".handle' must be the base64 of a cudaIpcMemHandle_t");
  auto raw = decode_base64(handle->get<std::string>());
  if (!raw) return raw.error().with_context("'" + at + ".handle'");
  std::string h = std::move(*raw);
  if (h.size() == kTorchHandleBytes && h[1] == 'c') {
    h = h.substr(2);  // PyTorch's form: the cudaIpcMemHandle_t follows its two bytes
  } else if (h.size() == kTorchHandleBytes && h[1] == 'e') {
    return invalid_argument(
        "'" + at +
        ".handle' is PyTorch's handle of an expandable segment, which is no "
        "cudaIpcMemHandle_t; run the trainer without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
  }
  if (h.size() != kCudaIpcHandleBytes)
    return invalid_argument("'" + at + ".handle' decodes to " + std::to_string(h.size()) + " bytes; a " +
                            "cudaIpcMemHandle_t has " + std::to_string(kCudaIpcHandleBytes) +
                            " (PyTorch's shared handle " + std::to_string(kTorchHandleBytes) + ")");
  std::memcpy(out.handle.data(), h.data(), kCudaIpcHandleBytes);
  auto bytes = b.find("bytes");
  if (bytes == b.end()) return invalid_argument("'" + at + ".bytes' is required (the buffer's size in bytes)");
  SIESTA_ASSIGN_OR_RETURN(out.bytes, non_negative(*bytes, at + ".bytes"));
  if (auto offset = b.find("offset"); offset != b.end()) {
    SIESTA_ASSIGN_OR_RETURN(out.offset, non_negative(*offset, at + ".offset"));
  }
  return out;
}

// A body that names no descriptor came with none.
Ok no_descriptors_unnamed(const WeightUpdate& u, PassedDescriptors passed) {
  if (u.fd >= 0 || passed.fds.empty()) return {};
  return invalid_argument("the packet carried " + std::to_string(passed.fds.size()) + " descriptor" +
                          (passed.fds.size() == 1 ? "" : "s") +
                          ", but the body names none (\"source\": \"shm\" with \"fd\": 0 names one); send "
                          "exactly the descriptors it names");
}

}  // namespace

Result<std::string> decode_base64(const std::string& text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t end = text.size();
  while (end > 0 && text[end - 1] == '=') --end;
  if (text.size() - end > 2 || end % 4 == 1) return invalid_argument("is not base64 (wrong length or padding)");
  std::string out;
  out.reserve(end * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < end; ++i) {
    const int v = value(text[i]);
    if (v < 0) return invalid_argument("is not base64 (character " + std::to_string(i) + ")");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

Result<WeightUpdate> parse_weight_update(const json& body, PassedDescriptors passed) {
  if (!body.is_object())
    return invalid_argument("the request body must be a JSON object (\"source\": shm, cuda_ipc or dir), got " +
                            json_type_name(body));
  WeightUpdate u;
  auto source = body.find("source");
  if (source == body.end() || source->is_null()) {
    // vLLM's forms of a directory: {"weights_path": DIR} / {"model": DIR}.
    if (!body.contains("model") && !body.contains("weights_path"))
      return invalid_argument(
          "'source' is required: \"shm\" (host shared memory), \"cuda_ipc\" (CUDA IPC handles) or "
          "\"dir\" (a checkpoint directory)");
    u.source = WeightSource::kDir;
  } else {
    if (!source->is_string()) return invalid_argument("'source' must be a string: shm, cuda_ipc or dir");
    SIESTA_ASSIGN_OR_RETURN(u.source, parse_weight_source(source->get<std::string>()));
  }
  switch (u.source) {
    case WeightSource::kDir: {
      SIESTA_TRY(only_fields(body, {"source", "path", "model", "weights_path"}, ""));
      std::optional<std::string> dir;
      for (const char* key : {"path", "model", "weights_path"}) {
        SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> v, read_string(body, key));
        if (!v) continue;
        if (dir) return invalid_argument("give the directory once: one of 'path', 'model', 'weights_path'");
        if (v->empty()) return invalid_argument(std::string("'") + key + "' must name a checkpoint directory");
        dir = std::move(v);
      }
      if (dir) u.path = *dir;  // none: the checkpoint the weights hold
      SIESTA_TRY(no_descriptors_unnamed(u, passed));
      u.complete = true;
      return u;
    }
    case WeightSource::kShm: {
      SIESTA_TRY(only_fields(body, {"source", "path", "fd", "tensors", "complete"}, ""));
      SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> path, read_string(body, "path"));
      auto fd = body.find("fd");
      if (fd != body.end() && !fd->is_null()) {
        if (!passed.can_pass)
          return invalid_argument(
              "'fd' indexes the descriptors passed with the body, which HTTP cannot carry; pass the memfd over the "
              "weight socket (siesta serve --weight-socket PATH, docs/weight-socket.md), or name it by its path: "
              "\"path\": \"/proc/<pid>/fd/<n>\"");
        if (path) return invalid_argument("give the shared memory once: 'path' or 'fd', not both");
        SIESTA_ASSIGN_OR_RETURN(uint64_t index, non_negative(*fd, "fd"));
        if (passed.fds.empty())
          return invalid_argument("'fd' is " + std::to_string(index) +
                                  ", but the packet carried no descriptor: send the memfd with the body (SCM_RIGHTS, "
                                  "e.g. socket.send_fds)");
        if (index >= passed.fds.size())
          return invalid_argument("'fd' is " + std::to_string(index) + ", but the packet carried " +
                                  std::to_string(passed.fds.size()) + " descriptor" +
                                  (passed.fds.size() == 1 ? "" : "s") + " (indices from 0)");
        if (passed.fds.size() != 1)
          return invalid_argument("the packet carried " + std::to_string(passed.fds.size()) +
                                  " descriptors, but the body names one ('fd'); send exactly the descriptors it names");
        u.fd = passed.fds[index];
        u.path = "fd " + std::to_string(index) + " of the weight socket";
        break;
      }
      if (!path || path->empty())
        return invalid_argument(
            std::string("'path' is required: the shared memory file (/dev/shm/NAME, or /proc/<pid>/fd/<n> for a "
                        "memfd)") +
            (passed.can_pass ? ", or 'fd': the index of a descriptor passed with the body" : ""));
      u.path = *path;
      break;
    }
    case WeightSource::kCudaIpc: {
      SIESTA_TRY(only_fields(body, {"source", "buffers", "tensors", "complete"}, ""));
      auto buffers = body.find("buffers");
      if (buffers == body.end() || !buffers->is_array() || buffers->empty())
        return invalid_argument("'buffers' is required: an array of {\"handle\", \"bytes\"[, \"offset\"]}");
      for (size_t i = 0; i < buffers->size(); ++i) {
        SIESTA_ASSIGN_OR_RETURN(CudaIpcBuffer b, parse_buffer((*buffers)[i], i));
        u.buffers.push_back(b);
      }
      break;
    }
  }
  SIESTA_TRY(no_descriptors_unnamed(u, passed));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> complete, read_bool(body, "complete"));
  u.complete = complete.value_or(false);
  auto tensors = body.find("tensors");
  if (tensors == body.end() || !tensors->is_array() || tensors->empty())
    return invalid_argument("'tensors' is required: an array of {\"name\", \"dtype\", \"shape\", \"offset\"" +
                            std::string(u.source == WeightSource::kCudaIpc ? ", \"buffer\"" : "") + "}");
  u.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    SIESTA_ASSIGN_OR_RETURN(PushedTensor t, parse_tensor((*tensors)[i], i, u.source == WeightSource::kCudaIpc));
    u.tensors.push_back(std::move(t));
  }
  return u;
}

}  // namespace siesta::server
