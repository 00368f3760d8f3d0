// The admin routes of sleep mode, with the paths, parameters, status codes
// and bodies of vLLM's dev-mode routers:
//   POST /sleep?level=0|1|2&mode=abort|wait|keep    200, empty body (level 1, mode abort by default, as vLLM)
//   POST /wake_up[?tags=weights&tags=kv_cache]      200, empty body (no tags: everything)
//   GET  /is_sleeping                               {"is_sleeping": bool}
//   POST /pause?mode=abort|wait|keep[&clear_cache=true|false]   {"status": "paused"}
//                                                   (mode abort, clear_cache true by default)
//   POST /resume                                    {"status": "resumed"}
//   GET  /is_paused                                 {"is_paused": bool}
//   POST /reset_prefix_cache[?reset_running_requests=true]       {"success": bool} (false: blocks in use)
//   POST /collective_rpc                            body {"method": "reload_weights", "args": [...],
//                                                   "kwargs": {"weights_path": DIR}, "timeout": S}
//                                                   -> {"results": [null]} (one worker, nothing returned)
// siesta's own, answering the EngineStatus they left:
//   POST /release_kv_cache_memory                   (after a pause)
//   POST /reload_weights                            body: none, or {"weights_path": DIR} ("model" too)
//   POST /update_weights                            body: weight_update_request.h (shm, cuda_ipc, dir);
//                                                   answers {"updated": tensors, "bytes", "seconds"} + the status
//   GET  /engine_state                              the EngineStatus now
//   GET  /memory                                    bytes per tag and state, process RSS, device
// Every POST takes ?verbose=true to answer siesta's EngineStatus instead of
// vLLM's body (engine_status.h as JSON: "state", "is_sleeping", "is_paused",
// "resident_tags", "not_resident_tags", "weights_loaded", "weights_dir",
// "requests", and "call": what the call did); GET /is_sleeping?verbose=true
// adds it to {"is_sleeping"}. Every POST accepts `timeout` (seconds, default
// 120): the deadline of the call (collective_rpc also in its body).
//
// Without --enable-sleep-mode every route answers 400 saying so. The API key
// applies as on every other route (the server's pre-routing check). A call
// the engine's state does not allow is 409 with what to call first; bad
// parameters (and fields or collective_rpc methods this server does not
// know) are 400; the engine keeps serving either way. Errors are OpenAI
// error JSON.
//
// Handlers parse, validate and translate; the Engine does the work. They run
// on the HTTP thread pool, several at once; the engine serialises them.
//
// update_weights_answer is POST /update_weights without HTTP: the route and
// the weight socket (weight_socket.h) both call it, so a push is checked,
// refused and answered the same whichever brought it.
#pragma once

#include <httplib.h>

#include <string>

#include "common/clock.h"
#include "server/admin_answer.h"
#include "server/server_context.h"
#include "server/weight_update_request.h"

namespace siesta::server {

void add_admin_routes(httplib::Server& server, ServerContext& ctx);

// POST /update_weights of the body `text` (JSON) with the descriptors passed
// with it (none over HTTP), until `deadline`: sleep mode (400 without), the
// JSON, its fields (weight_update_request.h), then Engine::update_weights (409
// while the engine serves; 400 naming each tensor at fault) and its answer:
// the EngineStatus with "updated", "bytes", "seconds". The descriptors stay
// the caller's: it closes them once this returns.
AdminAnswer update_weights_answer(Engine& engine, const std::string& text, PassedDescriptors passed,
                                  Deadline deadline);

}  // namespace siesta::server
