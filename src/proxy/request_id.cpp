#include "proxy/request_id.h"

#include <fmt/format.h>

#include <algorithm>

namespace siesta::proxy {

RequestIdSource::RequestIdSource() {
  std::random_device seed;
  std::seed_seq seq{seed(), seed(), seed(), seed()};
  gen_.seed(seq);
}

std::string RequestIdSource::next() {
  std::lock_guard lock(mu_);
  const uint64_t a = gen_();
  const uint64_t b = gen_();
  return fmt::format("pd-{:016x}{:016x}", a, b);
}

std::string RequestIdSource::choose(const std::string& from_client) {
  auto usable = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == ':' || c == '-';
  };
  if (!from_client.empty() && from_client.size() <= 128 && std::all_of(from_client.begin(), from_client.end(), usable))
    return from_client;
  return next();
}

}  // namespace siesta::proxy
