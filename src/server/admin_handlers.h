// The admin routes of sleep mode, with vLLM's paths, parameters and JSON:
//   POST /sleep?level=0|1|2&mode=abort|wait|keep    (level 1, mode keep by default: vLLM
//                                                   aborts by default; siesta never fails a request
//                                                   unless asked to)
//   POST /wake_up[?tags=weights&tags=kv_cache]      (no tags: everything)
//   GET  /is_sleeping                               {"is_sleeping": bool}
//   POST /pause?mode=abort|wait|keep[&clear_cache=true|false]   (mode abort, clear_cache true by default)
//   POST /resume
//   GET  /is_paused                                 {"is_paused": bool}
//   POST /reset_prefix_cache[?reset_running_requests=true]
//   POST /release_kv_cache_memory                   (after a pause)
//   POST /reload_weights                            body: none, or {"model": DIR}
//   POST /collective_rpc                            body: {"method": "reload_weights", "kwargs": {"model": DIR}}
//   POST /update_weights                            body: weight_update_request.h (shm, cuda_ipc, dir);
//                                                   answers {"updated": tensors, "bytes", "seconds"} + the status
//   GET  /memory                                    bytes per tag and state, process RSS, device
// Every POST answers the engine status it left (engine_status.h as JSON:
// "state", "is_sleeping", "is_paused", "resident_tags", "not_resident_tags",
// "weights_loaded", "weights_dir", "requests", and "call": what the call did).
// Every POST accepts `timeout` (seconds, default 120): the deadline of the call.
//
// Without --enable-sleep-mode every route answers 400 saying so. The API key
// applies as on every other route (the server's pre-routing check). A call
// the engine's state does not allow is 409 with what to call first; bad
// parameters are 400; the engine keeps serving either way.
//
// Handlers parse, validate and translate; the Engine does the work. They run
// on the HTTP thread pool, several at once; the engine serialises them.
#pragma once

#include <httplib.h>

#include "server/server_context.h"

namespace siesta::server {

void add_admin_routes(httplib::Server& server, ServerContext& ctx);

}  // namespace siesta::server
