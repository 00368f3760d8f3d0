#include "transfer/region.h"

namespace siesta::transfer {

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kCuda: return "cuda";
  }
  return "unknown";
}

}  // namespace siesta::transfer
