// What the OS says about this process's memory: the resident set, which the
// host backend's committed pages are part of. Read for GET /memory, by the
// tests (sleep must make RSS fall) and by the benchmark.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta::memory {

// Resident set size in bytes (/proc/self/statm), shared memfd pages included.
Result<uint64_t> process_resident_bytes();

}  // namespace siesta::memory
