#include "server/admin_handlers.h"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "memory/tag.h"
#include "server/admin_params.h"
#include "server/json_fields.h"
#include "server/weight_update_request.h"

namespace siesta::server {
namespace {

using Clock = std::chrono::steady_clock;

nlohmann::json tag_list(memory::TagSet tags) {
  nlohmann::json out = nlohmann::json::array();
  for (memory::Tag t : memory::kAllTags)
    if (tags.contains(t)) out.push_back(memory::tag_name(t));
  return out;
}

nlohmann::json tag_bytes(const memory::TagBytes& bytes) {
  nlohmann::json out = nlohmann::json::object();
  for (memory::Tag t : memory::kAllTags) out[memory::tag_name(t)] = bytes[memory::tag_index(t)];
  return out;
}

nlohmann::json kv_transfer_json(const KvReleaseReport& kv) {
  return {{"loads_ended", kv.loads_ended}, {"sends_ended", kv.sends_ended}, {"invalidated", kv.invalidated},
          {"acked", kv.acked},             {"unanswered", kv.unanswered},   {"deregistered", kv.deregistered}};
}

nlohmann::json weights_update_json(const WeightUpdateReport& w) {
  return {{"source", weight_source_name(w.source)}, {"from", w.from},
          {"tensors", w.tensors},                    {"bytes", w.bytes},
          {"skipped", w.skipped},                    {"prepare_seconds", w.prepare_seconds},
          {"write_seconds", w.write_seconds},        {"gb_per_s", w.gb_per_s()}};
}

nlohmann::json status_json(const EngineStatus& s) {
  nlohmann::json call{{"released_bytes", tag_bytes(s.call.released_bytes)},
                      {"offloaded_bytes", tag_bytes(s.call.offloaded_bytes)},
                      {"mapped_bytes", tag_bytes(s.call.mapped_bytes)},
                      {"restored_bytes", tag_bytes(s.call.restored_bytes)},
                      {"discarded_bytes", s.call.discarded_bytes},
                      {"seconds", s.call.seconds}};
  call["weights_loaded_from"] =
      s.call.weights_loaded_from.empty() ? nlohmann::json() : nlohmann::json(s.call.weights_loaded_from);
  if (s.call.weights_update) call["weights_update"] = weights_update_json(*s.call.weights_update);
  if (s.call.kv_transfer) call["kv_transfer"] = kv_transfer_json(*s.call.kv_transfer);
  return {{"state", engine_state_name(s.state)},
          {"is_sleeping", engine_is_sleeping(s.state)},
          {"is_paused", engine_is_paused(s.state)},
          {"resident_tags", tag_list(s.resident)},
          {"not_resident_tags", tag_list(s.not_resident)},
          {"weights_loaded", s.weights_loaded},
          {"weights_dir", s.weights_dir},
          {"weights_source", s.weights_source},
          {"weights_unwritten", s.weights_unwritten},
          {"requests", {{"running", s.running_requests}, {"waiting", s.waiting_requests}, {"held", s.held_requests}}},
          {"call", std::move(call)}};
}

nlohmann::json usage_json(const memory::TagUsage& u) {
  return {{"allocations", u.allocations},         {"resident_bytes", u.resident_bytes},
          {"offloaded_bytes", u.offloaded_bytes}, {"released_bytes", u.released_bytes},
          {"held_by_exports_bytes", u.held_by_exports_bytes}, {"kept_host_bytes", u.kept_host_bytes},
          {"total_bytes", u.total_bytes()}};
}

nlohmann::json memory_json(const EngineMemoryReport& r, EngineState state) {
  nlohmann::json tags = nlohmann::json::object();
  for (memory::Tag t : memory::kAllTags) tags[memory::tag_name(t)] = usage_json(r.pool[t]);
  nlohmann::json out{{"state", engine_state_name(state)},
                     {"tags", std::move(tags)},
                     {"total", usage_json(r.pool.total())},
                     {"open_exports", r.pool.open_exports},
                     {"pinned_host_bytes", r.pinned_host_bytes}};
  out["process_rss_bytes"] = r.process_resident_bytes ? nlohmann::json(*r.process_resident_bytes) : nlohmann::json();
  nlohmann::json device{{"kind", memory::backend_kind_name(r.backend)}, {"description", r.backend_description}};
  if (r.device) {
    device["free_bytes"] = r.device->free_bytes;
    device["total_bytes"] = r.device->total_bytes;
    device["used_bytes"] = r.device->total_bytes - r.device->free_bytes;
  }
  out["device"] = std::move(device);
  return out;
}

// The 400 of an admin route (`route`: "POST /sleep") while sleep mode is off.
std::optional<ApiError> sleep_mode_error(const Engine& engine, const std::string& route) {
  if (engine.options().enable_sleep_mode) return std::nullopt;
  return ApiError{400, "invalid_request_error", "sleep_mode_disabled",
                  route +
                      " is an admin endpoint of sleep mode, which is off; restart siesta serve with "
                      "--enable-sleep-mode to use it",
                  {}};
}

// 400 unless sleep mode is on; false after answering.
bool check_sleep_mode(const ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  auto error = sleep_mode_error(ctx.engine, req.method + " " + req.path);
  if (!error) return true;
  send_error(res, *error);
  return false;
}


// vLLM's answer to a call (`vllm_body`; null: an empty 200), or siesta's
// EngineStatus with ?verbose=true. A call that ended P/D transfers (sleep,
// a pause that cleared the cache) also names the peers it invalidated:
// {"kv_transfer": {...}} beside vLLM's fields (a body where vLLM sends none).
void answer(const httplib::Request& req, httplib::Response& res, const Result<EngineStatus>& r,
            nlohmann::json vllm_body) {
  if (!r) return send_error(res, ApiError::from_status(r.error()));
  auto verbose = bool_param(req, "verbose");
  if (verbose && verbose->value_or(false)) return send_json(res, 200, status_json(*r));
  if (r->call.kv_transfer) {
    if (vllm_body.is_null()) vllm_body = nlohmann::json::object();
    vllm_body["kv_transfer"] = kv_transfer_json(*r->call.kv_transfer);
  }
  if (vllm_body.is_null()) {
    res.status = 200;
    return;
  }
  send_json(res, 200, vllm_body);
}

// Parses a POST body as JSON, allowing an empty one (null); false after answering.
bool optional_json_body(const std::string& body, httplib::Response& res, nlohmann::json& out) {
  if (body.find_first_not_of(" \t\r\n") == std::string::npos) {
    out = nullptr;
    return true;
  }
  return parse_json_body(body, res, out);
}

// collective_rpc's body `timeout` (seconds), else the query's.
Result<Deadline> rpc_deadline(const httplib::Request& req, const nlohmann::json& body) {
  auto t = body.find("timeout");
  if (t == body.end() || t->is_null()) return deadline_param(req);
  if (!t->is_number() || !(t->get<double>() > 0) || t->get<double>() > 86400)
    return invalid_argument("'timeout' must be a number of seconds in (0, 86400], got " + t->dump());
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t->get<double>()));
}

}  // namespace

AdminAnswer update_weights_answer(Engine& engine, const std::string& text, PassedDescriptors passed,
                                  Deadline deadline) {
  auto refuse = AdminAnswer::refusal;
  if (auto error = sleep_mode_error(engine, "POST /update_weights")) return refuse(*error);
  nlohmann::json body;
  if (auto error = parse_json_text(text, body)) return refuse(*error);
  auto update = parse_weight_update(body, passed);
  if (!update) return refuse(ApiError::from_status(update.error()));
  Result<EngineStatus> r = engine.update_weights(std::move(*update), deadline);
  if (!r) return refuse(ApiError::from_status(r.error()));
  nlohmann::json out = status_json(*r);
  const WeightUpdateReport& w = *r->call.weights_update;
  out["updated"] = w.tensors;
  out["bytes"] = w.bytes;
  out["seconds"] = r->call.seconds;
  return AdminAnswer{200, std::move(out)};
}

void add_admin_routes(httplib::Server& s, ServerContext& ctx) {
  // A POST admin route: sleep mode checked, body read (content reader, as the
  // other POST routes), then the handler.
  auto post = [&s, &ctx](const char* path, auto handler) {
    s.Post(path, [&ctx, handler](const httplib::Request& req, httplib::Response& res,
                                 const httplib::ContentReader& reader) {
      std::string body;
      if (!read_body(req, reader, res, body) || !check_sleep_mode(ctx, req, res)) return;
      handler(req, body, res);
    });
  };
  auto get = [&s, &ctx](const char* path, auto handler) {
    s.Get(path, [&ctx, handler](const httplib::Request& req, httplib::Response& res) {
      if (check_sleep_mode(ctx, req, res)) handler(req, res);
    });
  };
  auto fail = [](httplib::Response& res, const Status& st) { send_error(res, ApiError::from_status(st)); };

  post("/sleep", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto level = int_param(req, "level", 1);
    if (!level) return fail(res, level.error());
    auto mode = mode_param(req, PauseMode::kAbort);  // vLLM's default
    if (!mode) return fail(res, mode.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(req, res, ctx.engine.sleep(*level, *mode, *deadline), nullptr);
  });
  post("/wake_up", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto tags = tags_param(req);
    if (!tags) return fail(res, tags.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(req, res, ctx.engine.wake_up(*tags, *deadline), nullptr);
  });
  get("/is_sleeping", [&ctx, fail](const httplib::Request& req, httplib::Response& res) {
    auto verbose = bool_param(req, "verbose");
    if (!verbose) return fail(res, verbose.error());
    if (!verbose->value_or(false))
      return send_json(res, 200, {{"is_sleeping", engine_is_sleeping(ctx.engine.state())}});
    nlohmann::json s = status_json(ctx.engine.status());
    s.erase("call");
    send_json(res, 200, s);
  });
  get("/engine_state", [&ctx](const httplib::Request&, httplib::Response& res) {
    nlohmann::json s = status_json(ctx.engine.status());
    s.erase("call");
    send_json(res, 200, s);
  });
  post("/pause", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto mode = mode_param(req, PauseMode::kAbort);
    if (!mode) return fail(res, mode.error());
    // vLLM's older form: wait_for_inflight_requests=true is mode wait.
    auto wait = bool_param(req, "wait_for_inflight_requests");
    if (!wait) return fail(res, wait.error());
    if (wait->value_or(false)) *mode = PauseMode::kWait;
    auto clear_cache = bool_param(req, "clear_cache");
    if (!clear_cache) return fail(res, clear_cache.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    // clear_cache (default true, as vLLM's) also with mode keep: siesta's kept requests recompute, so the
    // cache can go; P/D transfers holding blocks are ended first (Engine::pause).
    answer(req, res, ctx.engine.pause(*mode, *deadline, clear_cache->value_or(true)), {{"status", "paused"}});
  });
  post("/resume", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(req, res, ctx.engine.resume(*deadline), {{"status", "resumed"}});
  });
  get("/is_paused", [&ctx](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"is_paused", engine_is_paused(ctx.engine.state())}});
  });
  post("/reset_prefix_cache", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto running = bool_param(req, "reset_running_requests");
    if (!running) return fail(res, running.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    Result<EngineStatus> r = ctx.engine.reset_prefix_cache(running->value_or(false), *deadline);
    // vLLM: {"success": false} while blocks are still held; the caller may retry.
    if (!r && r.error().code == ErrorCode::kConflict) {
      auto verbose = bool_param(req, "verbose");
      if (!verbose || !verbose->value_or(false)) return send_json(res, 200, {{"success", false}});
    }
    answer(req, res, r, {{"success", true}});
  });
  post("/release_kv_cache_memory",
       [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
         auto deadline = deadline_param(req);
         if (!deadline) return fail(res, deadline.error());
         Result<EngineStatus> r = ctx.engine.release_kv_cache_memory(*deadline);
         if (!r) return fail(res, r.error());
         send_json(res, 200, status_json(*r));
       });
  post("/reload_weights", [&ctx, fail](const httplib::Request& req, const std::string& text, httplib::Response& res) {
    nlohmann::json body;
    if (!optional_json_body(text, res, body)) return;
    auto dir = model_dir_of(body, "the request body");
    if (!dir) return fail(res, dir.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    Result<EngineStatus> r = ctx.engine.reload_weights(*dir, *deadline);
    if (!r) return fail(res, r.error());
    send_json(res, 200, status_json(*r));
  });
  post("/collective_rpc", [&ctx, fail](const httplib::Request& req, const std::string& text, httplib::Response& res) {
    nlohmann::json body;
    if (!parse_json_body(text, res, body)) return;
    if (!body.is_object())
      return fail(res, invalid_argument("the request body must be a JSON object, got " + json_type_name(body)));
    for (auto it = body.begin(); it != body.end(); ++it)
      if (it.key() != "method" && it.key() != "args" && it.key() != "kwargs" && it.key() != "timeout")
        return fail(res,
                    invalid_argument("'" + it.key() +
                                     "' is not a field of /collective_rpc; it takes method, args, kwargs, timeout"));
    auto method = read_string(body, "method");
    if (!method) return fail(res, method.error());
    if (!*method) return fail(res, invalid_argument("Missing 'method' in request body"));
    if (**method != "reload_weights")
      return fail(res, invalid_argument("collective_rpc method '" + **method +
                                        "' is not supported; this server supports 'reload_weights' only"));
    // reload_weights(weights_path): kwargs.weights_path, or a string as the only positional argument.
    auto kwargs = read_object(body, "kwargs");
    if (!kwargs) return fail(res, kwargs.error());
    auto dir = model_dir_of(*kwargs, "'kwargs'");
    if (!dir) return fail(res, dir.error());
    auto args = body.find("args");
    if (args != body.end() && !args->is_null()) {
      if (!args->is_array()) return fail(res, invalid_argument("'args' must be an array"));
      if (args->size() > 1 || (!args->empty() && (!(*args)[0].is_string() || (*args)[0].get<std::string>().empty())))
        return fail(res,
                    invalid_argument("'args' of reload_weights: at most one, the checkpoint directory (a string)"));
      if (!args->empty()) {
        if (*dir)
          return fail(res, invalid_argument("reload_weights: give the directory in 'args' or 'kwargs', not both"));
        *dir = std::filesystem::path((*args)[0].get<std::string>());
      }
    }
    auto deadline = rpc_deadline(req, body);
    if (!deadline) return fail(res, deadline.error());
    // One worker, returning nothing: vLLM's {"results": [null]}.
    answer(req, res, ctx.engine.reload_weights(*dir, *deadline), {{"results", nlohmann::json::array({nullptr})}});
  });
  // Weights pushed by a trainer (weight_update_request.h): {"updated", "bytes", "seconds"} and the status.
  // The weight socket (weight_socket.h) answers the same through update_weights_answer.
  post("/update_weights", [&ctx, fail](const httplib::Request& req, const std::string& text, httplib::Response& res) {
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    const AdminAnswer a = update_weights_answer(ctx.engine, text, PassedDescriptors{}, *deadline);
    send_json(res, a.status, a.body);
  });
  get("/memory", [&ctx](const httplib::Request&, httplib::Response& res) {
    const EngineMemoryReport r = ctx.engine.memory_report(Clock::now() + std::chrono::seconds(10));
    send_json(res, 200, memory_json(r, ctx.engine.state()));
  });
}

}  // namespace siesta::server
