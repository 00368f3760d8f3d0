// ProcessIdentity: which host, pid namespace and pid an engine runs in, so a
// peer on the same host can tell (ipc refuses peers on other hosts) and can
// watch the process for exit (ucx without UCX peer error handling).
#pragma once

#include <cstdint>
#include <string>

#include "transfer/wire.h"

namespace siesta::transfer {

struct ProcessIdentity {
  std::string boot_id;        // /proc/sys/kernel/random/boot_id: differs between hosts
  uint64_t pid_namespace = 0; // inode of /proc/self/ns/pid
  uint32_t pid = 0;

  static ProcessIdentity of_this_process();
  bool same_host(const ProcessIdentity& other) const { return !boot_id.empty() && boot_id == other.boot_id; }
  // Whether `pid` names the same process here as there.
  bool same_pid_namespace(const ProcessIdentity& other) const {
    return same_host(other) && pid_namespace != 0 && pid_namespace == other.pid_namespace;
  }

  void encode(WireWriter& w) const;
  static ProcessIdentity decode(WireReader& r);
};

// A pidfd (pidfd_open) for a process in our pid namespace, or -1.
int open_process_watch(uint32_t pid);
// True once the process behind `pidfd` exited; never blocks.
bool process_exited(int pidfd);

}  // namespace siesta::transfer
