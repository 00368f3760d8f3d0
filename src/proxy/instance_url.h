// InstanceUrl: where one serving instance (a `siesta serve`, or any
// vLLM-compatible server) answers HTTP. Parsed once from the command line;
// a value, safe to copy and share between threads.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace siesta::proxy {

struct InstanceUrl {
  std::string host;  // as given: "127.0.0.1", "gpu-3", "::1" (no brackets)
  int port = 0;
  std::string text;  // normalised "http://host:port", the instance's name everywhere

  bool operator==(const InstanceUrl&) const = default;
};

// Accepts "http://host:port", "host:port", "http://[::1]:port", with or without
// a trailing "/". Refuses other schemes, paths, and missing or bad ports.
Result<InstanceUrl> parse_instance_url(std::string_view text);

}  // namespace siesta::proxy
