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
// those 64). A memfd is named by "path": "/proc/<pid>/fd/<n>". Every field
// not listed here is refused (400), as are missing and mistyped ones, with
// the field's place ("tensors[3].shape").
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "common/status.h"
#include "model/weight_update.h"

namespace siesta::server {

Result<WeightUpdate> parse_weight_update(const nlohmann::json& body);

// Standard base64 (RFC 4648, padding optional); kInvalidArgument on anything else.
Result<std::string> decode_base64(const std::string& text);

}  // namespace siesta::server
