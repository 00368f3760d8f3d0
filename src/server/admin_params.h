// The readers of the admin routes' query parameters and bodies
// (admin_handlers.h has the routes): each turns what a client sent into a
// value or a kInvalidArgument naming the parameter and what came. Pure
// functions of the request; fuzzed (tests/fuzz/admin_params_fuzzer.cpp).
#pragma once

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>

#include "common/status.h"
#include "engine/engine_state.h"
#include "engine/engine_stream.h"
#include "memory/tag.h"

namespace siesta::server {

// true|True|1, false|False|0; absent: nullopt.
Result<std::optional<bool>> bool_param(const httplib::Request& req, const char* name);
// A whole decimal int; absent: fallback.
Result<int> int_param(const httplib::Request& req, const char* name, int fallback);
// `timeout` seconds in (0, 86400] from now (default 120).
Result<Deadline> deadline_param(const httplib::Request& req);
// The deadline of a call without `timeout`: 120 s from now.
Deadline default_admin_deadline();
// `mode`: abort|wait|keep; absent: fallback.
Result<PauseMode> mode_param(const httplib::Request& req, PauseMode fallback);
// `tags` repeated or comma-separated; none: every tag.
Result<memory::TagSet> tags_param(const httplib::Request& req);
// {"weights_path": DIR} (vLLM's), {"model": DIR} or null: the checkpoint
// directory of reload_weights; `what` names the object in errors.
Result<std::optional<std::filesystem::path>> model_dir_of(const nlohmann::json& obj, const std::string& what);

}  // namespace siesta::server
