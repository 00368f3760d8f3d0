// ConnectionProbe: tells a handler whether its client has gone away.
//
// cpp-httplib 0.11 hands a handler no handle on its connection, and writes
// fail only after the client is gone and something is written. On a worker of
// siesta's HttpServer (common/http_server.h) the probe takes the socket the
// server names; elsewhere it finds the connection's socket among this
// process's file descriptors by its
// address pair (local port, remote address and port: unique among live
// sockets, and the socket stays open while its handler runs), then peeks at it
// without consuming anything: an orderly close or a reset means the client is
// gone.
//
//   ConnectionProbe probe = ConnectionProbe::find(local_port, remote_addr, remote_port);
//   while (waiting) { if (probe.client_gone()) { abort; break; } ... }
//
// A probe that found no socket never reports the client gone. Use it only
// while the handler (or its content provider) runs. Not thread-safe; cheap to
// copy.
#pragma once

#include <string>

namespace siesta::server {

class ConnectionProbe {
 public:
  static ConnectionProbe find(int local_port, const std::string& remote_addr, int remote_port);

  bool found() const { return fd_ >= 0; }
  // The peer closed or reset the connection.
  bool client_gone() const;

 private:
  int fd_ = -1;
};

}  // namespace siesta::server
