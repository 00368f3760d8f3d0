// What every benchmark's JSON records about its run: the machine, the time
// (UTC) and a shell command's output (the git commit). Header-only, for the
// bench/ programs.
#pragma once

#include <sys/utsname.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace siesta::bench {

// stdout of `cmd`, trailing newlines and spaces removed; empty if it cannot run.
inline std::string run_command(const char* cmd) {
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// hostname, kernel, CPU model, CPU count and memory of this machine.
inline nlohmann::json machine() {
  nlohmann::json m;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  m["hostname"] = host;
  utsname u{};
  if (uname(&u) == 0) m["kernel"] = std::string(u.sysname) + " " + u.release;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      m["cpu"] = line.substr(line.find(':') + 2);
      break;
    }
  }
  m["cpus"] = sysconf(_SC_NPROCESSORS_ONLN);
  m["memory_total_bytes"] = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  return m;
}

// "2026-11-29T20:40:37Z"
inline std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace siesta::bench
