#include "transfer/process_identity.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>

namespace siesta::transfer {

ProcessIdentity ProcessIdentity::of_this_process() {
  ProcessIdentity id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, id.boot_id);
  struct stat st{};
  if (stat("/proc/self/ns/pid", &st) == 0) id.pid_namespace = static_cast<uint64_t>(st.st_ino);
  id.pid = static_cast<uint32_t>(getpid());
  return id;
}

void ProcessIdentity::encode(WireWriter& w) const {
  w.bytes(boot_id);
  w.u64(pid_namespace);
  w.u32(pid);
}

ProcessIdentity ProcessIdentity::decode(WireReader& r) {
  ProcessIdentity id;
  id.boot_id = r.bytes(256);
  id.pid_namespace = r.u64();
  id.pid = r.u32();
  return id;
}

int open_process_watch(uint32_t pid) {
#ifdef SYS_pidfd_open
  long fd = syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0);
  return fd < 0 ? -1 : static_cast<int>(fd);
#else
  (void)pid;
  return -1;
#endif
}

bool process_exited(int pidfd) {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

}  // namespace siesta::transfer
