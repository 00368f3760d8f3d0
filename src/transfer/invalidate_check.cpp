#include "transfer/invalidate_check.h"

#include <asio/ip/address.hpp>
#include <fmt/format.h>

#include "common/host_port.h"

namespace siesta::transfer {
namespace {

// The host of "host:port" or "[v6]:port".
std::string host_of(const std::string& address) {
  const std::optional<HostPort> hp = split_host_port(address);
  return unbracketed(hp ? hp->host : address);
}

}  // namespace

Result<void> check_invalidate(const InvalidateMsg& msg, const RequestOrigin& from, std::optional<Epoch> held,
                              const std::string& known_address) {
  if (!from.engine_id.empty()) {
    if (from.engine_id != msg.engine_id)
      return invalid_argument(fmt::format("INVALIDATE names engine {} but comes from engine {}; only an engine "
                                          "invalidates its own memory",
                                          msg.engine_id, from.engine_id));
  } else if (!known_address.empty()) {
    asio::error_code ec1, ec2;
    const asio::ip::address known = asio::ip::make_address(host_of(known_address), ec1);
    const asio::ip::address sender = asio::ip::make_address(host_of(from.address), ec2);
    if (!ec1 && !ec2 && !known.is_unspecified() && known != sender)
      return invalid_argument(fmt::format("INVALIDATE names engine {}, whose side channel is at {}, but comes from {}",
                                          msg.engine_id, known_address, from.address));
  }
  if (held) {
    if (msg.epoch < *held)
      return conflict(fmt::format("INVALIDATE from {} names epoch {}, older than the epoch {} we hold; ignored as stale",
                                  msg.engine_id, msg.epoch.value, held->value));
    if (msg.epoch.value - held->value > kInvalidateEpochSlack)
      return invalid_argument(fmt::format("INVALIDATE from {} names epoch {}, which does not follow the epoch {} we "
                                          "hold (at most {} ahead); refused",
                                          msg.engine_id, msg.epoch.value, held->value, kInvalidateEpochSlack));
  }
  return {};
}

Result<void> check_sender(FrameType type, const std::string& claimed, const RequestOrigin& from) {
  if (from.engine_id.empty() || from.engine_id == claimed) return {};
  return invalid_argument(fmt::format("{} says it comes from engine {} but its sender proved engine {}; an engine "
                                      "speaks only for itself",
                                      frame_type_name(type), claimed, from.engine_id));
}

}  // namespace siesta::transfer
