// ClientAwareServer: an httplib::Server whose handlers can ask whether the
// client of the request they serve has hung up, so that the proxy closes its
// legs to the instances instead of letting them generate for nobody.
//
// httplib serves each client connection on one worker thread, from reading
// the request to writing the last chunk of the response. This class takes
// over that per-connection loop (httplib's process_and_close_socket: wait for
// the next request up to the keep-alive timeout, serve it with httplib's own
// process_request, at most keep_alive_max_count requests, then close) so that
// it can record the connection's socket for the thread. client_hung_up()
// looks at that socket without reading (poll for POLLRDHUP/POLLHUP/POLLERR),
// so a client still sending or pipelining is not mistaken for one that left.
// Written against cpp-httplib 0.11 (Debian's libcpp-httplib-dev).
//
// Threads: client_hung_up() only from a handler or a content provider of
// this server (elsewhere it answers false).
#pragma once

#include <httplib.h>

namespace siesta::proxy {

class ClientAwareServer : public httplib::Server {
 public:
  static bool client_hung_up();

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Waits (in short slices, so that stop() is noticed) until the client sends
  // its next request; false on hang-up, error, keep-alive timeout or stop.
  bool next_request_arrives(socket_t sock) const;
};

}  // namespace siesta::proxy
