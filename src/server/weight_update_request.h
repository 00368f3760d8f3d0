// The body of POST /update_weights as a WeightUpdate (model/weight_update.h).
// No sockets; unit-tested (server_weight_update_test).
//
//   {"source": "shm", "path": "/dev/shm/NAME",
//    "tensors": [{"name": "model.layers.0.mlp.up_proj.weight", "dtype": "bfloat16",
//                 "shape": [3072, 1024], "offset": 0}, ...],
//    "complete": false}
//   {"source": "cuda_ipc",
//    "buffers": [{"handle": "<base64 of a cudaIpcMemHandle_t>", "bytes": N, "offset": 0}],
//    "tensors": [{"name": ..., "dtype": ..., "shape": [...], "buffer": 0, "offset": 0}, ...]}
//   {"source": "dir", "path": DIR}      (also {"model": DIR} or vLLM's {"weights_path": DIR})
//
// `offset` is in bytes (from the file's start, or from the buffer's: a
// buffer's own `offset` is where it starts in the allocation its handle
// names, PyTorch's storage offset from _share_cuda_; default 0). dtypes:
// bfloat16, float16, float32. A handle is the 64 bytes of a
// cudaIpcMemHandle_t, or the 66 of PyTorch's shared handle ("\x01c" and
// those 64). A memfd is named by "path": "/proc/<pid>/fd/<n>", or, over the
// weight socket (weight_socket.h, docs/weight-socket.md), passed with the body
// and named by its index among the packet's descriptors:
//   {"source": "shm", "fd": 0, "tensors": [...], "complete": ...}
// A packet carries exactly the descriptors its body names (one for "fd", none
// for any other body); over HTTP, which passes none, "fd" is refused. Every
// field not listed here is refused (400), as are missing and mistyped ones,
// with the field's place ("tensors[3].shape").
#pragma once

#include <nlohmann/json.hpp>

#include <span>
#include <string>

#include "common/status.h"
#include "model/weight_update.h"

namespace siesta::server {

// The descriptors that came with a body: none over HTTP (can_pass false:
// "fd" is refused, pointing at the weight socket); over the weight socket the
// packet's, which "fd" indexes. They stay the caller's (not closed here); the
// WeightUpdate's fd is one of them.
struct PassedDescriptors {
  bool can_pass = false;
  std::span<const int> fds;
};

Result<WeightUpdate> parse_weight_update(const nlohmann::json& body, PassedDescriptors passed = {});

// Standard base64 (RFC 4648, padding optional); kInvalidArgument on anything else.
Result<std::string> decode_base64(const std::string& text);

}  // namespace siesta::server
