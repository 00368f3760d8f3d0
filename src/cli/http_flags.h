// The flags `siesta serve` and `siesta proxy` share for reading requests
// (common/http_server.h):
//   --max-request-body-bytes N        larger bodies get 413, chunked ones as soon as they pass it (default 32 MiB)
//   --max-json-depth N                bodies nesting JSON arrays and objects deeper get 400 (default 64, at most 1024)
//   --request-header-timeout-s S      a request's head must arrive within S of its first byte (default 10)
//   --request-body-timeout-s S        its body within S of its head (default 30); 408 otherwise
//   --keep-alive-timeout-s S          a connection without a request closes after S (default 5)
//   --max-connections-per-address N   open connections from one client address (default 512)
//   --max-open-connections N          open connections in all (default 4096; at most half the open-file limit)
//
//   HttpFlags flags;  flags.add_to(*cmd);                   // when the command is built
//   SIESTA_ASSIGN_OR_RETURN(HttpServerOptions http, flags.options());  // after parsing
// Also raise_open_file_limit(): the process's soft limit on open files up to
// its hard limit, so that the connection limits, not the file limit, decide.
#pragma once

#include <CLI/CLI.hpp>

#include <cstddef>

#include "common/http_server.h"
#include "common/status.h"

namespace siesta::cli {

struct HttpFlags {
  size_t max_request_body_bytes = 32u << 20;
  size_t max_json_depth = kDefaultMaxJsonDepth;
  double header_timeout_s = 10;
  double body_timeout_s = 30;
  double keep_alive_timeout_s = 5;
  size_t max_connections_per_address = 512;
  size_t max_open_connections = 4096;

  void add_to(CLI::App& cmd);
  // Errors name the flag. worker_threads is left at its default for the caller.
  Result<HttpServerOptions> options() const;
};

void raise_open_file_limit();

}  // namespace siesta::cli
