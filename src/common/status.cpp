#include "common/status.h"

namespace siesta {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kCorrupt: return "corrupt";
    case ErrorCode::kIo: return "io_error";
    case ErrorCode::kConflict: return "conflict";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kOutOfMemory: return "out_of_memory";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

}  // namespace siesta
