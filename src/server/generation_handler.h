// The /v1/completions and /v1/chat/completions handlers: read the body into
// a GenerationJob, submit it to the engine, and answer with the whole
// response or a stream of server-sent events (`data: {...}` chunks, then
// `data: [DONE]`).
//
// A waiting handler looks at its client every client_poll_interval: a client
// that is gone (ConnectionProbe) or a stream write that fails aborts the
// engine requests. An engine failure becomes an error response, or in a
// stream an error event before [DONE]. Called on the HTTP thread pool.
#pragma once

#include <httplib.h>

#include "server/sampling_request.h"
#include "server/server_context.h"

namespace siesta::server {

void handle_generation(ServerContext& ctx, ApiKind kind, const httplib::Request& req, const std::string& body,
                       httplib::Response& res);

}  // namespace siesta::server
