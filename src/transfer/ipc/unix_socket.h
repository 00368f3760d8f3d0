// Unix SOCK_SEQPACKET sockets with file descriptors passed as SCM_RIGHTS:
// in the Linux abstract namespace (no file to clean up), where the ipc
// backend's exporter and importer talk, or at a filesystem path (the server's
// weight socket, server/weight_socket.h), whose file's mode says who may connect.
#pragma once

#include <cstdint>
#include <filesystem>
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

// A non-blocking listening socket bound to a filesystem path, its file
// created with mode 0600 (only this user may connect). A socket file that no
// process listens on (left by one that died) is replaced; a path that exists
// and is no socket is kInvalidArgument, a socket another process listens on
// kConflict, each naming the path. `dev` and `ino` are the file's, so that
// remove_socket_file removes this socket's file and no other.
struct PathListener {
  int fd = -1;
  std::filesystem::path path;
  uint64_t dev = 0;
  uint64_t ino = 0;
};
Result<PathListener> listen_path(const std::filesystem::path& path);
// Removes the listener's file if it is still the one its bind made; the
// descriptor is the caller's to close.
void remove_socket_file(const PathListener& listener);
// A connected (blocking) socket to the filesystem path `path`.
Result<int> connect_path(const std::filesystem::path& path);

// One message with `bytes` and up to kMaxFdsPerPacket descriptors (the
// receiver gets duplicates; ours stay open).
Ok send_packet(int sock, std::string_view bytes, std::span<const int> fds = {});
// One message of at most max_bytes, and the descriptors it carried
// (close-on-exec), waiting until `deadline`. A peer that closed is kUnavailable;
// a longer message, or one with more than kMaxFdsPerPacket descriptors, kCorrupt
// (its descriptors closed).
Result<std::string> recv_packet(int sock, size_t max_bytes, std::vector<int>* fds, Deadline deadline);

// One message as it came, for a receiver that answers an oversized one
// rather than failing: its first max_bytes, the descriptors received
// (close-on-exec; the caller closes them), and whether bytes or descriptors
// (beyond kMaxFdsPerPacket: the kernel closes those) were cut off.
struct ReceivedPacket {
  std::string bytes;
  std::vector<int> fds;
  bool bytes_cut = false;
  bool fds_cut = false;
};
Result<ReceivedPacket> recv_whole_packet(int sock, size_t max_bytes, Deadline deadline);

// True when the other end closed (or the socket failed); never blocks.
bool peer_hung_up(int sock);

void close_fds(std::vector<int>& fds);

}  // namespace siesta::transfer::ipc
