// libFuzzer target: the P/D parameters that cross process borders: a
// prefill answer's kv_transfer_params as the proxy checks it and the legs it
// builds from a client body (proxy/pd_request.h), the P/D protocol messages
// and replies a peer sends over the side channel (pd/pd_messages.h), and
// --kv-transfer-config (pd/pd_config.h). Whatever the bytes: no crash, no
// leak, no exception; a refusal names what is wrong.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/json_depth.h"
#include "pd/pd_config.h"
#include "pd/pd_messages.h"
#include "proxy/pd_request.h"

using namespace siesta;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

// The first byte picks the parser (each input exercises one, so that every
// execution counts); the rest is what a peer, an instance or a user sends.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: {  // the proxy: a prefill answer, and the legs built from a client body
      Result<nlohmann::json> params = proxy::prefill_kv_transfer_params(text, (data[0] & 4) != 0);
      if (params) require(params->is_object());
      if (Result<nlohmann::json> body = parse_json(text); body && body->is_object()) {
        for (proxy::Endpoint e : {proxy::Endpoint::kCompletions, proxy::Endpoint::kChatCompletions})
          require(proxy::prefill_request_body(*body, e).is_object());
        (void)proxy::decode_request_body_concurrent(*body, "req-1", "http://127.0.0.1:1").dump();
        if (auto it = body->find("kv_transfer_params"); it != body->end())
          (void)proxy::decode_request_body_sequential(*body, *it).dump();
      }
      break;
    }
    case 1:  // a P/D request over the side channel
      if (auto m = pd::decode_message(text); !m) require(!m.error().message.empty());
      break;
    case 2:  // a written notification and a reply, logits attached
      if (auto w = pd::decode_written(text); !w) require(!w.error().message.empty());
      if (auto r = pd::decode_reply(text); !r) require(!r.error().message.empty());
      break;
    default:
      if (auto c = pd::parse_kv_transfer_config(text); !c) require(!c.error().message.empty());
      break;
  }
  return 0;
}
