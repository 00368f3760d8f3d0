#include "cli/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>
#include <utility>

#include <fmt/format.h>

namespace siesta::cli {

ChildProcess::ChildProcess(std::string name, pid_t pid, std::filesystem::path log)
    : name_(std::move(name)), pid_(pid), log_(std::move(log)) {}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : name_(std::move(other.name_)), pid_(std::exchange(other.pid_, -1)), log_(std::move(other.log_)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    stop(std::chrono::seconds(5));
    name_ = std::move(other.name_);
    pid_ = std::exchange(other.pid_, -1);
    log_ = std::move(other.log_);
  }
  return *this;
}

ChildProcess::~ChildProcess() { stop(std::chrono::seconds(5)); }

Result<ChildProcess> ChildProcess::start(std::string name, const std::filesystem::path& exe,
                                         const std::vector<std::string>& args, const std::filesystem::path& log) {
  int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error(fmt::format("cannot create log file {}: {}", log.string(), std::strerror(errno)));
  std::vector<std::string> argv_storage;
  argv_storage.push_back(exe.string());
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) {
    int err = errno;
    ::close(fd);
    return io_error(fmt::format("cannot start {}: fork: {}", name, std::strerror(err)));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the demo blocks SIGINT/SIGTERM for its waiter thread
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    ::execv(argv[0], argv.data());
    const char msg[] = "exec failed\n";
    (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::close(fd);
  return ChildProcess(std::move(name), pid, log);
}

bool ChildProcess::running() {
  if (pid_ <= 0) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_ || (r < 0 && errno == ECHILD)) {
    pid_ = -1;
    return false;
  }
  return true;
}

void ChildProcess::signal(int sig) {
  const pid_t pid = pid_;
  if (pid > 0) ::kill(pid, sig);
}

void ChildProcess::stop(std::chrono::milliseconds grace) {
  // A local copy: kill() must never see 0 or -1 (the process group, every
  // process), even if another thread reaps the child meanwhile.
  const pid_t pid = pid_;
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  const auto deadline = Clock::now() + grace;
  while (Clock::now() < deadline) {
    if (!running()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  pid_ = -1;
}

std::string ChildProcess::last_log_line() const {
  std::ifstream in(log_);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last.empty() ? "(no output)" : last;
}

Result<std::string> ChildProcess::wait_for_listening(Clock::time_point deadline) {
  static const std::regex kListening(R"(listening on (http://[^\s()]+))");
  for (;;) {
    {
      std::ifstream in(log_);
      std::string line;
      std::smatch m;
      while (std::getline(in, line)) {
        if (std::regex_search(line, m, kListening)) return m[1].str();
      }
    }
    if (!running()) {
      return io_error(fmt::format("{} exited before it listened: {} (log: {})", name_, last_log_line(), log_.string()));
    }
    if (Clock::now() >= deadline) {
      return timeout(
          fmt::format("{} did not start listening in time: {} (log: {})", name_, last_log_line(), log_.string()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace siesta::cli
