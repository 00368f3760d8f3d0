// Unix SOCK_SEQPACKET sockets in the Linux abstract namespace (no file to
// clean up), with file descriptors passed as SCM_RIGHTS. The ipc backend's
// exporter and importer talk over these.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace siesta::transfer::ipc {

inline constexpr size_t kMaxFdsPerPacket = 64;

// A non-blocking listening socket bound to the abstract name `name`.
Result<int> listen_abstract(const std::string& name);
// A connected socket to the abstract name `name`.
Result<int> connect_abstract(const std::string& name);

// One message with `bytes` and up to kMaxFdsPerPacket descriptors (the
// receiver gets duplicates; ours stay open).
Ok send_packet(int sock, std::string_view bytes, std::span<const int> fds = {});
// One message of at most max_bytes, and the descriptors it carried
// (close-on-exec), waiting until `deadline`. A peer that closed is kUnavailable.
Result<std::string> recv_packet(int sock, size_t max_bytes, std::vector<int>* fds, Deadline deadline);

// True when the other end closed (or the socket failed); never blocks.
bool peer_hung_up(int sock);

void close_fds(std::vector<int>& fds);

}  // namespace siesta::transfer::ipc
