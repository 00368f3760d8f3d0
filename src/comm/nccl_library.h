// NCCL, loaded at run time (dlopen of libnccl.so.2, as the CUDA memory
// backend loads the driver), for what spans GPUs: tensor parallelism and
// weights broadcast by a trainer. A binary linked with siesta still starts
// where NCCL is not installed; only a caller that asks for it gets the
// error, which names what is missing.
#pragma once

#include <nccl.h>

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace siesta::comm {

#define SIESTA_NCCL_FUNCTIONS(X) \
  X(ncclGetVersion)              \
  X(ncclGetErrorString)          \
  X(ncclGetLastError)            \
  X(ncclGetUniqueId)             \
  X(ncclCommInitRank)            \
  X(ncclCommInitRankConfig)      \
  X(ncclCommFinalize)            \
  X(ncclCommDestroy)             \
  X(ncclCommAbort)               \
  X(ncclCommGetAsyncError)       \
  X(ncclCommCount)               \
  X(ncclCommUserRank)            \
  X(ncclAllReduce)               \
  X(ncclBroadcast)               \
  X(ncclAllGather)               \
  X(ncclSend)                    \
  X(ncclRecv)                    \
  X(ncclGroupStart)              \
  X(ncclGroupEnd)

struct NcclLibrary {
  // `path`: the library to open (the dynamic loader's search applies).
  static Result<std::unique_ptr<NcclLibrary>> load(const std::string& path = "libnccl.so.2");

#define SIESTA_NCCL_MEMBER_(name) decltype(&::name) name = nullptr;
  SIESTA_NCCL_FUNCTIONS(SIESTA_NCCL_MEMBER_)
#undef SIESTA_NCCL_MEMBER_

  int version = 0;  // as NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch
  std::string path;
  // Whether the library has ncclCommSuspend/ncclCommResume (a communicator
  // giving back its buffers while kept); without them a sleeping engine
  // destroys its communicators and makes them again at wake.
  bool has_comm_suspend = false;

  std::string version_text() const;  // "2.28.9"
  // OK, or the error naming `what`, NCCL's text for `result` and its last error.
  Ok check(ncclResult_t result, std::string_view what) const;
};

// NVLink SHARP stays off: NCCL_NVLS_ENABLE=0 in this process's environment,
// set before any communicator exists (NCCL would create multicast objects for
// it, which the GPUs siesta runs on must not be given). Returns what was there
// before ("" when unset).
std::string disable_nvls();

}  // namespace siesta::comm
