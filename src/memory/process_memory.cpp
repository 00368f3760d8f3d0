#include "memory/process_memory.h"

#include <unistd.h>

#include <fstream>

namespace siesta::memory {

Result<uint64_t> process_resident_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size_pages = 0, resident_pages = 0;
  if (!(in >> size_pages >> resident_pages)) return io_error("cannot read /proc/self/statm");
  return resident_pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace siesta::memory
