// "host:port" and "[v6]:port", as the side channel's addresses and the
// proxy's instance URLs write them.
//
//   auto hp = split_host_port("[::1]:5600");   // host "[::1]", port "5600"
//   unbracketed(hp->host);                     // "::1"
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace siesta {

struct HostPort {
  std::string host;  // as written: an IPv6 literal keeps its brackets
  std::string port;  // the text after the last colon (may be empty)
};

// Splits at the last colon; nullopt when there is none.
std::optional<HostPort> split_host_port(std::string_view address);

// The host without the brackets of an IPv6 literal ("[::1]" -> "::1").
std::string unbracketed(std::string_view host);

}  // namespace siesta
