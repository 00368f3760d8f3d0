#include "cli/http_flags.h"

#include <sys/resource.h>

#include <cmath>
#include <string>

namespace siesta::cli {
namespace {

Result<std::chrono::milliseconds> seconds(double s, const char* flag) {
  if (!std::isfinite(s) || s <= 0 || s > 86400)
    return invalid_argument(std::string(flag) + ": expected a number of seconds in (0, 86400]");
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(s * 1000)));
}

}  // namespace

void HttpFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--max-request-body-bytes", max_request_body_bytes,
                 "Larger request bodies get 413 (chunked ones as soon as they pass the limit)")
      ->capture_default_str();
  cmd.add_option("--max-json-depth", max_json_depth,
                 "Request bodies nesting JSON arrays and objects deeper get 400 (1 to 1024)")
      ->capture_default_str();
  cmd.add_option("--request-header-timeout-s", header_timeout_s,
                 "A request's head must arrive within this many seconds of its first byte (else 408)")
      ->capture_default_str();
  cmd.add_option("--request-body-timeout-s", body_timeout_s,
                 "A request's body must arrive within this many seconds of its head (else 408)")
      ->capture_default_str();
  cmd.add_option("--keep-alive-timeout-s", keep_alive_timeout_s,
                 "A connection that sends no request for this many seconds is closed")
      ->capture_default_str();
  cmd.add_option("--max-connections-per-address", max_connections_per_address,
                 "Open connections from one client address; beyond, the oldest waiting one is closed (503 when "
                 "all are in use)")
      ->capture_default_str();
  cmd.add_option("--max-open-connections", max_open_connections,
                 "Open client connections in all (at most half the open-file limit)")
      ->capture_default_str();
}

Result<HttpServerOptions> HttpFlags::options() const {
  HttpServerOptions o;
  if (max_request_body_bytes == 0) return invalid_argument("--max-request-body-bytes: must be positive");
  o.limits.max_body_bytes = max_request_body_bytes;
  if (max_json_depth == 0 || max_json_depth > kMaxJsonDepthLimit)
    return invalid_argument("--max-json-depth: expected 1 to " + std::to_string(kMaxJsonDepthLimit) + ", got " +
                            std::to_string(max_json_depth));
  o.limits.max_json_depth = max_json_depth;
  SIESTA_ASSIGN_OR_RETURN(o.head_timeout, seconds(header_timeout_s, "--request-header-timeout-s"));
  SIESTA_ASSIGN_OR_RETURN(o.body_timeout, seconds(body_timeout_s, "--request-body-timeout-s"));
  SIESTA_ASSIGN_OR_RETURN(o.idle_timeout, seconds(keep_alive_timeout_s, "--keep-alive-timeout-s"));
  if (max_connections_per_address == 0) return invalid_argument("--max-connections-per-address: must be positive");
  if (max_open_connections == 0) return invalid_argument("--max-open-connections: must be positive");
  o.max_connections_per_address = max_connections_per_address;
  o.max_connections = max_open_connections;
  // Bodies being received, in all: room for a few at the limit.
  o.max_buffered_bytes = std::max<size_t>(o.max_buffered_bytes, 4 * max_request_body_bytes);
  return o;
}

void raise_open_file_limit() {
  rlimit fds{};
  if (::getrlimit(RLIMIT_NOFILE, &fds) != 0 || fds.rlim_cur >= fds.rlim_max) return;
  fds.rlim_cur = fds.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &fds);
}

}  // namespace siesta::cli
