// WeightSocket: POST /update_weights over a Unix SOCK_SEQPACKET socket at a
// filesystem path (`siesta serve --weight-socket PATH`), for a trainer that
// holds its weights in a memfd and passes the descriptor (SCM_RIGHTS) rather
// than naming a path. The protocol (docs/weight-socket.md):
//   client -> server  one packet: the JSON body of /update_weights, with
//                     "source": "shm", "fd": 0 (an index into the packet's
//                     descriptors) instead of "path"
//   server -> client  one packet: {"status": <HTTP status>, "body": <what
//                     the HTTP route answers, success or OpenAI error JSON>}
// A connection may send several requests in turn; each is answered before
// the next is read.
//
// Lifecycle
//   SIESTA_ASSIGN_OR_RETURN(auto ws, WeightSocket::listen(path, handler));  // the file (mode 0600)
//   ws->start();     // one thread accepts connections and answers packets
//   ws->stop();      // from any thread (also the destructor): the thread ends
//                    // after the request it runs; the file is removed
//
// The handler (the server's: admin_handlers.h, update_weights_answer) runs on
// that thread, one request at a time; the descriptors it gets are closed
// once it returns, and on every refusal before it: a packet over
// max_packet_bytes (413), one with more descriptors than a packet may carry
// (400; those the kernel could not give are closed by it). A connection
// beyond max_connections is answered 503 and closed. A client that hangs up
// loses its answer and nothing else; an answer it does not read within
// send_packet's deadline closes its connection. No transport knowledge leaks
// into the handler: unit-tested with a fake one (server_weight_socket_test).
#pragma once

#include <atomic>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "server/admin_answer.h"
#include "transfer/ipc/unix_socket.h"

namespace siesta::server {

struct WeightSocketOptions {
  // A packet's JSON body at most (the kernel's socket buffers, about 208 KiB
  // by default on the sender's side, bound it before this does).
  size_t max_packet_bytes = 1u << 20;
  size_t max_connections = 16;
};

// The answer to one packet's body and the descriptors it carried (the
// socket's: closed after the call).
using WeightSocketHandler = std::function<AdminAnswer(const std::string& body, std::span<const int> fds)>;

class WeightSocket {
 public:
  // Listens at `path` (transfer/ipc/unix_socket.h: listen_path; a stale
  // socket file is replaced, anything else there refused).
  static Result<std::unique_ptr<WeightSocket>> listen(const std::filesystem::path& path, WeightSocketHandler handler,
                                                      WeightSocketOptions options = {});
  ~WeightSocket();
  WeightSocket(const WeightSocket&) = delete;
  WeightSocket& operator=(const WeightSocket&) = delete;

  void start();
  void stop();
  const std::filesystem::path& path() const { return listener_.path; }

 private:
  WeightSocket(transfer::ipc::PathListener listener, int wake, WeightSocketHandler handler,
               WeightSocketOptions options);
  void run();
  void accept_all(std::vector<int>& conns);
  // Receives one packet on `conn` and answers it; false when the connection
  // is done (closed by the client, failed, or its answer not taken).
  bool answer_one(int conn);

  transfer::ipc::PathListener listener_;
  int wake_ = -1;  // eventfd: stop() wakes the thread's poll
  WeightSocketHandler handler_;
  WeightSocketOptions options_;
  std::atomic<bool> stopping_{false};
  std::mutex stop_mu_;  // stop() from several threads: one joins, the others wait for it
  std::thread thread_;
};

}  // namespace siesta::server
