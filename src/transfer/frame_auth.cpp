#include "transfer/frame_auth.h"

#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <chrono>
#include <cstdint>
#include <memory>

#include "transfer/messages.h"
#include "transfer/wire.h"

namespace siesta::transfer {
namespace {

// OpenSSL's HMAC implementation, fetched once (an immutable library handle,
// safe to share between threads).
EVP_MAC* hmac_algorithm() {
  static EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  return mac;
}

std::string le64(uint64_t v) {
  WireWriter w;
  w.u64(v);
  return w.take();
}

// The ids in a proof, each with its length before it (no two id pairs give the same bytes).
std::string ids(std::string_view client, std::string_view server) {
  WireWriter w;
  w.bytes(client);
  w.bytes(server);
  return w.take();
}

constexpr std::string_view kServerProof = "siesta side channel v1: server";
constexpr std::string_view kClientProof = "siesta side channel v1: client";
constexpr std::string_view kClientToServer = "siesta side channel v1: c2s";
constexpr std::string_view kServerToClient = "siesta side channel v1: s2c";

}  // namespace

std::string hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts) {
  std::unique_ptr<EVP_MAC_CTX, decltype(&EVP_MAC_CTX_free)> ctx(EVP_MAC_CTX_new(hmac_algorithm()), EVP_MAC_CTX_free);
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  bool ok = ctx && EVP_MAC_init(ctx.get(), reinterpret_cast<const unsigned char*>(key.data()), key.size(), params) == 1;
  for (std::string_view p : parts)
    ok = ok && EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(p.data()), p.size()) == 1;
  ok = ok && EVP_MAC_final(ctx.get(), out, &len, sizeof(out)) == 1;
  // A MAC that cannot be computed matches nothing: an empty string never equals a 32-byte MAC.
  if (!ok || len != kAuthMacBytes) return {};
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string random_nonce() {
  std::string nonce(kAuthNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1) {
    // The OS's source failed (nothing on Linux does): a nonce must never repeat, so
    // fall back to the time and the address of a fresh allocation, mixed by HMAC.
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    auto marker = std::make_unique<char>();
    nonce = hmac_sha256(le64(static_cast<uint64_t>(now)), {le64(reinterpret_cast<uintptr_t>(marker.get()))})
                .substr(0, kAuthNonceBytes);
  }
  return nonce;
}

bool same_secret(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Result<void> check_auth_key(std::string_view key) {
  if (key.size() < kMinAuthKeyBytes)
    return invalid_argument(fmt::format("the side channel's auth key has {} bytes; use at least {} (e.g. 32 random "
                                        "bytes, hex-encoded: openssl rand -hex 32)",
                                        key.size(), kMinAuthKeyBytes));
  return {};
}

std::string FrameSession::seal(const Frame& frame) {
  std::string out = encode_frame(frame);
  out += hmac_sha256(send_key_, {le64(sent_++), out});
  return out;
}

Result<void> FrameSession::open(const Frame& frame) {
  const std::string expected =
      hmac_sha256(receive_key_, {le64(received_), encode_frame_header(frame.type, frame.payload.size()), frame.payload});
  if (expected.empty() || !same_secret(expected, frame.mac))
    return corrupt(fmt::format("a {} frame failed its authentication check (altered, replayed or not from the peer "
                               "that opened the connection)",
                               frame_type_name(frame.type)));
  ++received_;
  return {};
}

ClientHandshake::ClientHandshake(std::string key, std::string engine_id)
    : key_(std::move(key)), engine_id_(std::move(engine_id)), nonce_(random_nonce()) {}

Frame ClientHandshake::hello() const { return to_frame(HelloMsg{engine_id_, nonce_}); }

Result<Frame> ClientHandshake::answer(const Frame& challenge) {
  if (challenge.type != FrameType::kChallenge)
    return corrupt(fmt::format("expected CHALLENGE, got {}", frame_type_name(challenge.type)));
  SIESTA_ASSIGN_OR_RETURN(ChallengeMsg c, decode_challenge(challenge.payload));
  const std::string who = ids(engine_id_, c.engine_id);
  if (!same_secret(hmac_sha256(key_, {kServerProof, nonce_, c.nonce, who}), c.proof))
    return invalid_argument(fmt::format("engine {} did not prove it holds our side-channel auth key; both engines "
                                        "need the same kv_connector_extra_config.auth_key",
                                        c.engine_id));
  server_id_ = c.engine_id;
  server_nonce_ = c.nonce;
  return to_frame(AuthMsg{hmac_sha256(key_, {kClientProof, nonce_, server_nonce_, who})});
}

FrameSession ClientHandshake::session() const {
  return FrameSession(hmac_sha256(key_, {kClientToServer, nonce_, server_nonce_}),
                      hmac_sha256(key_, {kServerToClient, nonce_, server_nonce_}));
}

ServerHandshake::ServerHandshake(std::string key, std::string engine_id)
    : key_(std::move(key)), engine_id_(std::move(engine_id)), nonce_(random_nonce()) {}

Result<Frame> ServerHandshake::challenge(const Frame& hello) {
  if (hello.type != FrameType::kHello) return corrupt(fmt::format("expected HELLO, got {}", frame_type_name(hello.type)));
  SIESTA_ASSIGN_OR_RETURN(HelloMsg h, decode_hello(hello.payload));
  client_id_ = h.engine_id;
  client_nonce_ = h.nonce;
  return to_frame(
      ChallengeMsg{engine_id_, nonce_, hmac_sha256(key_, {kServerProof, client_nonce_, nonce_, ids(client_id_, engine_id_)})});
}

Result<FrameSession> ServerHandshake::verify(const Frame& auth) const {
  if (auth.type != FrameType::kAuth) return corrupt(fmt::format("expected AUTH, got {}", frame_type_name(auth.type)));
  SIESTA_ASSIGN_OR_RETURN(AuthMsg a, decode_auth(auth.payload));
  if (client_id_.empty() ||
      !same_secret(hmac_sha256(key_, {kClientProof, client_nonce_, nonce_, ids(client_id_, engine_id_)}), a.proof))
    return invalid_argument(fmt::format("engine '{}' did not prove it holds this side channel's auth key", client_id_));
  return FrameSession(hmac_sha256(key_, {kServerToClient, client_nonce_, nonce_}),
                      hmac_sha256(key_, {kClientToServer, client_nonce_, nonce_}));
}

}  // namespace siesta::transfer
