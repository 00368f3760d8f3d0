// ChildProcess: another siesta process started by this one (the demo starts
// P, D, the proxy and a colocated reference server), with its stdout and
// stderr in a log file.
//
//   SIESTA_ASSIGN_OR_RETURN(ChildProcess p, ChildProcess::start("P", exe, args, log_path));
//   SIESTA_ASSIGN_OR_RETURN(std::string url, p.wait_for_listening(deadline));
//   p.stop(std::chrono::seconds(5));   // SIGTERM, then SIGKILL after the grace period
//
// The child gets PR_SET_PDEATHSIG(SIGTERM): if this process dies without
// stopping it (SIGKILL), the kernel stops it. Destruction stops the child.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta::cli {

class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  static Result<ChildProcess> start(std::string name, const std::filesystem::path& exe,
                                    const std::vector<std::string>& args, const std::filesystem::path& log);
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  // Reads the log until a line "...listening on http://HOST:PORT..." appears
  // and returns "http://HOST:PORT". Fails if the child exits first (with the
  // log's last line) or the deadline passes.
  Result<std::string> wait_for_listening(Clock::time_point deadline);

  // Whether the child is still running (reaps it when it has exited).
  bool running();

  // Sends `sig` to the child if it has not been reaped (never to any other
  // process: a stopped child's pid is not signalled).
  void signal(int sig);

  // SIGTERM, wait up to `grace`, then SIGKILL. Idempotent.
  void stop(std::chrono::milliseconds grace);

  const std::string& name() const { return name_; }
  const std::filesystem::path& log() const { return log_; }
  pid_t pid() const { return pid_; }

 private:
  ChildProcess(std::string name, pid_t pid, std::filesystem::path log);
  std::string last_log_line() const;

  std::string name_;
  pid_t pid_ = -1;
  std::filesystem::path log_;
};

}  // namespace siesta::cli
