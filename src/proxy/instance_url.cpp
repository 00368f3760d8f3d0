#include "proxy/instance_url.h"

#include <charconv>
#include <optional>

#include "common/host_port.h"

namespace siesta::proxy {

Result<InstanceUrl> parse_instance_url(std::string_view text) {
  const std::string given(text);
  auto bad = [&](const std::string& why) {
    return invalid_argument("instance URL \"" + given + "\": " + why + " (expected http://host:port)");
  };
  std::string_view rest = text;
  if (const size_t scheme_end = rest.find("://"); scheme_end != std::string_view::npos) {
    if (rest.substr(0, scheme_end) != "http") return bad("only http is supported");
    rest.remove_prefix(scheme_end + 3);
  }
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  if (rest.find('/') != std::string_view::npos) return bad("a path is not allowed");

  std::string host;
  std::string port;
  if (!rest.empty() && rest.front() == '[') {
    const size_t close = rest.find(']');
    if (close == std::string_view::npos) return bad("unclosed '['");
    host = std::string(rest.substr(1, close - 1));
    std::string_view after = rest.substr(close + 1);
    if (after.empty() || after.front() != ':') return bad("missing port");
    port = std::string(after.substr(1));
  } else {
    const std::optional<HostPort> split = split_host_port(rest);
    if (!split) return bad("missing port");
    host = split->host;
    port = split->port;
    if (host.find(':') != std::string::npos) return bad("an IPv6 host needs brackets");
  }
  if (host.empty()) return bad("missing host");
  int value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value < 1 || value > 65535)
    return bad("bad port \"" + std::string(port) + "\"");

  InstanceUrl url;
  url.host = std::string(host);
  url.port = value;
  const bool v6 = url.host.find(':') != std::string::npos;
  url.text = "http://" + (v6 ? "[" + url.host + "]" : url.host) + ":" + std::to_string(value);
  return url;
}

}  // namespace siesta::proxy
