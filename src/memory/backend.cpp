#include "memory/backend.h"

namespace siesta::memory {

const char* backend_kind_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kHost: return "host";
    case BackendKind::kCuda: return "cuda";
  }
  return "unknown";
}

}  // namespace siesta::memory
