#include "server/admin_handlers.h"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "memory/tag.h"
#include "server/admin_params.h"
#include "server/json_fields.h"

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

nlohmann::json status_json(const EngineStatus& s) {
  nlohmann::json call{{"released_bytes", tag_bytes(s.call.released_bytes)},
                      {"offloaded_bytes", tag_bytes(s.call.offloaded_bytes)},
                      {"mapped_bytes", tag_bytes(s.call.mapped_bytes)},
                      {"restored_bytes", tag_bytes(s.call.restored_bytes)},
                      {"discarded_bytes", s.call.discarded_bytes},
                      {"seconds", s.call.seconds}};
  call["weights_loaded_from"] =
      s.call.weights_loaded_from.empty() ? nlohmann::json() : nlohmann::json(s.call.weights_loaded_from);
  return {{"state", engine_state_name(s.state)},
          {"is_sleeping", engine_is_sleeping(s.state)},
          {"is_paused", engine_is_paused(s.state)},
          {"resident_tags", tag_list(s.resident)},
          {"not_resident_tags", tag_list(s.not_resident)},
          {"weights_loaded", s.weights_loaded},
          {"weights_dir", s.weights_dir},
          {"requests", {{"running", s.running_requests}, {"waiting", s.waiting_requests}, {"held", s.held_requests}}},
          {"call", std::move(call)}};
}

nlohmann::json usage_json(const memory::TagUsage& u) {
  return {{"allocations", u.allocations},         {"resident_bytes", u.resident_bytes},
          {"offloaded_bytes", u.offloaded_bytes}, {"released_bytes", u.released_bytes},
          {"held_by_exports_bytes", u.held_by_exports_bytes}, {"total_bytes", u.total_bytes()}};
}

nlohmann::json memory_json(const EngineMemoryReport& r, EngineState state) {
  nlohmann::json tags = nlohmann::json::object();
  for (memory::Tag t : memory::kAllTags) tags[memory::tag_name(t)] = usage_json(r.pool[t]);
  nlohmann::json out{{"state", engine_state_name(state)},
                     {"tags", std::move(tags)},
                     {"total", usage_json(r.pool.total())},
                     {"open_exports", r.pool.open_exports}};
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

// 400 unless sleep mode is on; false after answering.
bool check_sleep_mode(const ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  if (ctx.engine.options().enable_sleep_mode) return true;
  send_error(res, ApiError{400, "invalid_request_error", "sleep_mode_disabled",
                           req.method + " " + req.path +
                               " is an admin endpoint of sleep mode, which is off; restart siesta serve with "
                               "--enable-sleep-mode to use it",
                           {}});
  return false;
}


void answer(httplib::Response& res, const Result<EngineStatus>& r) {
  if (!r) return send_error(res, ApiError::from_status(r.error()));
  send_json(res, 200, status_json(*r));
}

// Parses a POST body as JSON, allowing an empty one (null); false after answering.
bool optional_json_body(const std::string& body, httplib::Response& res, nlohmann::json& out) {
  if (body.find_first_not_of(" \t\r\n") == std::string::npos) {
    out = nullptr;
    return true;
  }
  return parse_json_body(body, res, out);
}

void handle_reload_weights(ServerContext& ctx, const httplib::Request& req,
                           const std::optional<std::filesystem::path>& dir, httplib::Response& res, bool as_rpc) {
  auto deadline = deadline_param(req);
  if (!deadline) return send_error(res, ApiError::from_status(deadline.error()));
  Result<EngineStatus> r = ctx.engine.reload_weights(dir, *deadline);
  if (!r) return send_error(res, ApiError::from_status(r.error()));
  if (as_rpc) return send_json(res, 200, {{"results", nlohmann::json::array({status_json(*r)})}});
  send_json(res, 200, status_json(*r));
}

}  // namespace

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
    auto mode = mode_param(req, PauseMode::kKeep);
    if (!mode) return fail(res, mode.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(res, ctx.engine.sleep(*level, *mode, *deadline));
  });
  post("/wake_up", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto tags = tags_param(req);
    if (!tags) return fail(res, tags.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(res, ctx.engine.wake_up(*tags, *deadline));
  });
  get("/is_sleeping", [&ctx](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"is_sleeping", engine_is_sleeping(ctx.engine.state())}});
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
    Result<EngineStatus> r = ctx.engine.pause(*mode, *deadline);
    if (r && clear_cache->value_or(true)) r = ctx.engine.reset_prefix_cache(/*reset_running_requests=*/true, *deadline);
    answer(res, r);
  });
  post("/resume", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(res, ctx.engine.resume(*deadline));
  });
  get("/is_paused", [&ctx](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"is_paused", engine_is_paused(ctx.engine.state())}});
  });
  post("/reset_prefix_cache", [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
    auto running = bool_param(req, "reset_running_requests");
    if (!running) return fail(res, running.error());
    auto deadline = deadline_param(req);
    if (!deadline) return fail(res, deadline.error());
    answer(res, ctx.engine.reset_prefix_cache(running->value_or(false), *deadline));
  });
  post("/release_kv_cache_memory",
       [&ctx, fail](const httplib::Request& req, const std::string&, httplib::Response& res) {
         auto deadline = deadline_param(req);
         if (!deadline) return fail(res, deadline.error());
         answer(res, ctx.engine.release_kv_cache_memory(*deadline));
       });
  post("/reload_weights", [&ctx, fail](const httplib::Request& req, const std::string& text, httplib::Response& res) {
    nlohmann::json body;
    if (!optional_json_body(text, res, body)) return;
    auto dir = model_dir_of(body);
    if (!dir) return fail(res, dir.error());
    handle_reload_weights(ctx, req, *dir, res, /*as_rpc=*/false);
  });
  post("/collective_rpc", [&ctx, fail](const httplib::Request& req, const std::string& text, httplib::Response& res) {
    nlohmann::json body;
    if (!parse_json_body(text, res, body)) return;
    if (!body.is_object())
      return fail(res, invalid_argument("the request body must be a JSON object, got " + json_type_name(body)));
    auto method = read_string(body, "method");
    if (!method) return fail(res, method.error());
    if (!*method) return fail(res, invalid_argument("'method' is required; this server supports 'reload_weights'"));
    if (**method != "reload_weights")
      return fail(res, invalid_argument("collective_rpc method '" + **method +
                                        "' is not supported; this server supports 'reload_weights' only"));
    // The checkpoint: kwargs.model, or a string as the first of args.
    auto kwargs = read_object(body, "kwargs");
    if (!kwargs) return fail(res, kwargs.error());
    auto dir = model_dir_of(*kwargs);
    if (!dir) return fail(res, dir.error());
    auto args = body.find("args");
    if (!*dir && args != body.end() && args->is_array() && !args->empty()) {
      if (!(*args)[0].is_string() || (*args)[0].get<std::string>().empty())
        return fail(res, invalid_argument("'args[0]' of reload_weights must name a checkpoint directory"));
      *dir = std::filesystem::path((*args)[0].get<std::string>());
    }
    handle_reload_weights(ctx, req, *dir, res, /*as_rpc=*/true);
  });
  get("/memory", [&ctx](const httplib::Request&, httplib::Response& res) {
    const EngineMemoryReport r = ctx.engine.memory_report(Clock::now() + std::chrono::seconds(10));
    send_json(res, 200, memory_json(r, ctx.engine.state()));
  });
}

}  // namespace siesta::server
