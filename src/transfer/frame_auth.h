// Side-channel authentication: engines that share a secret key prove it to
// each other when a connection opens, and every frame after that carries a
// MAC, so that a peer without the key can neither open a session nor inject,
// alter or replay a frame (a spoofed INVALIDATE is refused before anything
// reads it).
//
// The handshake (client: the engine that connects; server: the listener):
//   C -> S  HELLO      {client id, nc}
//   S -> C  CHALLENGE  {server id, ns, HMAC(K, "server" | nc | ns | client id | server id)}
//   C -> S  AUTH       {HMAC(K, "client" | nc | ns | client id | server id)}
// nc and ns are 16 random bytes each. Then each direction has its own key,
// K_cs = HMAC(K, "c2s" | nc | ns) and K_sc = HMAC(K, "s2c" | nc | ns), and
// every frame is followed by HMAC(K_dir, counter | header | payload), the
// counter 0, 1, 2, ... per direction. Fresh nonces make every connection's
// keys new (a frame recorded on one connection means nothing on another);
// the counter makes a frame replayed, dropped or reordered on a connection
// fail. The server's identity is the id it proved; the side channel hands it
// to the request handler, so a request can be checked against who sent it.
// HMAC-SHA256 through OpenSSL; proofs and MACs compared in constant time.
//
//   ClientHandshake c(key, "decode-0");      ServerHandshake s(key, "prefill-0");
//   send(c.hello());                          Result<Frame> ch = s.challenge(hello);
//   Result<Frame> auth = c.answer(challenge); Result<FrameSession> ss = s.verify(auth);
//   FrameSession cs = c.session();
//   send(cs.seal(request));                   SIESTA_TRY(ss->open(received));
//
// Values; not thread-safe (one connection's I/O runs on one thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transfer/frame.h"

namespace siesta::transfer {

inline constexpr size_t kAuthNonceBytes = 16;
inline constexpr size_t kAuthMacBytes = 32;
inline constexpr size_t kMinAuthKeyBytes = 16;

// HMAC-SHA256 of the parts, one after the other.
std::string hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts);
// kAuthNonceBytes from the OS's random source.
std::string random_nonce();
// Equal, in time that depends only on the lengths.
bool same_secret(std::string_view a, std::string_view b);
// kInvalidArgument unless the key is at least kMinAuthKeyBytes long.
Result<void> check_auth_key(std::string_view key);

// One end of an authenticated connection, after its handshake.
class FrameSession {
 public:
  FrameSession(std::string send_key, std::string receive_key)
      : send_key_(std::move(send_key)), receive_key_(std::move(receive_key)) {}

  // The frame's header, payload and MAC, ready to write.
  std::string seal(const Frame& frame);
  // kCorrupt unless frame.mac is the MAC of the next frame this end should receive.
  Result<void> open(const Frame& frame);

 private:
  std::string send_key_;
  std::string receive_key_;
  uint64_t sent_ = 0;
  uint64_t received_ = 0;
};

class ClientHandshake {
 public:
  ClientHandshake(std::string key, std::string engine_id);

  Frame hello() const;
  // Checks the server's proof; the AUTH frame to send. kCorrupt for a
  // malformed challenge, kInvalidArgument for a wrong proof (the server does
  // not hold our key).
  Result<Frame> answer(const Frame& challenge);
  // After answer(): the session, and who the server proved to be.
  FrameSession session() const;
  const std::string& server_engine_id() const { return server_id_; }

 private:
  std::string key_;
  std::string engine_id_;
  std::string nonce_;
  std::string server_id_;
  std::string server_nonce_;
};

class ServerHandshake {
 public:
  ServerHandshake(std::string key, std::string engine_id);

  // The CHALLENGE for a HELLO (kCorrupt when it is not one).
  Result<Frame> challenge(const Frame& hello);
  // Checks the client's proof (kInvalidArgument when wrong); the session.
  Result<FrameSession> verify(const Frame& auth) const;
  const std::string& client_engine_id() const { return client_id_; }

 private:
  std::string key_;
  std::string engine_id_;
  std::string nonce_;
  std::string client_id_;
  std::string client_nonce_;
};

}  // namespace siesta::transfer
