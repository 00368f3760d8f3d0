#include "server/admin_params.h"

#include <string>
#include <vector>

#include "server/json_fields.h"

namespace siesta::server {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kDefaultTimeoutSeconds = 120.0;

}  // namespace

Result<std::optional<bool>> bool_param(const httplib::Request& req, const char* name) {
  if (!req.has_param(name)) return std::optional<bool>{};
  const std::string v = req.get_param_value(name);
  if (v == "true" || v == "True" || v == "1") return std::optional<bool>{true};
  if (v == "false" || v == "False" || v == "0") return std::optional<bool>{false};
  return invalid_argument(std::string("query parameter '") + name + "' must be true or false, got '" + v + "'");
}

Result<int> int_param(const httplib::Request& req, const char* name, int fallback) {
  if (!req.has_param(name)) return fallback;
  const std::string v = req.get_param_value(name);
  size_t used = 0;
  int out = 0;
  try {
    out = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size())
    return invalid_argument(std::string("query parameter '") + name + "' must be an integer, got '" + v + "'");
  return out;
}

Deadline default_admin_deadline() {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kDefaultTimeoutSeconds));
}

Result<Deadline> deadline_param(const httplib::Request& req) {
  double seconds = kDefaultTimeoutSeconds;
  if (req.has_param("timeout")) {
    const std::string v = req.get_param_value("timeout");
    size_t used = 0;
    try {
      seconds = std::stod(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (v.empty() || used != v.size() || !(seconds > 0) || seconds > 86400)
      return invalid_argument("query parameter 'timeout' must be a number of seconds in (0, 86400], got '" + v + "'");
  }
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

Result<PauseMode> mode_param(const httplib::Request& req, PauseMode fallback) {
  if (!req.has_param("mode")) return fallback;
  return parse_pause_mode(req.get_param_value("mode"));
}

// `tags` repeated (vLLM) or comma-separated; none: every tag.
Result<memory::TagSet> tags_param(const httplib::Request& req) {
  std::vector<std::string> names;
  const size_t n = req.get_param_value_count("tags");
  for (size_t i = 0; i < n; ++i) {
    const std::string v = req.get_param_value("tags", i);
    size_t start = 0;
    while (start <= v.size()) {
      const size_t comma = v.find(',', start);
      const std::string name = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!name.empty()) names.push_back(name);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  if (names.empty()) return memory::TagSet::all();
  return memory::parse_tags(names);
}

// The checkpoint directory of reload_weights: {"weights_path": DIR} (vLLM's
// worker argument) or {"model": DIR}, or none. `what` names the object.
Result<std::optional<std::filesystem::path>> model_dir_of(const nlohmann::json& obj, const std::string& what) {
  if (obj.is_null()) return std::optional<std::filesystem::path>{};
  if (!obj.is_object()) return invalid_argument(what + " must be a JSON object, got " + json_type_name(obj));
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& k = it.key();
    if (k == "weights_path" || k == "model") continue;
    if (k == "is_checkpoint_format" && (it->is_null() || (it->is_boolean() && it->get<bool>()))) continue;
    return invalid_argument(
        what + ": '" + k + "' is not supported by reload_weights here; it takes weights_path (a checkpoint directory)");
  }
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> path, read_string(obj, "weights_path"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> model, read_string(obj, "model"));
  if (path && model && *path != *model)
    return invalid_argument(what + ": 'weights_path' and 'model' name different directories");
  const std::optional<std::string> dir = path ? path : model;
  if (!dir) return std::optional<std::filesystem::path>{};
  if (dir->empty()) return invalid_argument(what + ": the checkpoint directory must not be an empty string");
  return std::optional<std::filesystem::path>{std::filesystem::path(*dir)};
}

}  // namespace siesta::server
