#include "common/host_port.h"

namespace siesta {

std::optional<HostPort> split_host_port(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) return std::nullopt;
  return HostPort{std::string(address.substr(0, colon)), std::string(address.substr(colon + 1))};
}

std::string unbracketed(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::string(host);
}

}  // namespace siesta
