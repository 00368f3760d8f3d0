#include "pd/pd_config.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cctype>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "common/json_depth.h"
#include "common/log.h"
#include "transfer/frame_auth.h"

namespace siesta::pd {
namespace {

using nlohmann::json;

const char* const kPrefix = "--kv-transfer-config: ";

Status bad(const std::string& what) { return invalid_argument(kPrefix + what); }

std::string type_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::binary: return "binary";
    case json::value_t::discarded: return "invalid";
    default: return "a number";
  }
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

Result<void> refuse_unknown(const json& obj, const std::vector<std::string>& known, const std::string& where) {
  const std::set<std::string> k(known.begin(), known.end());
  for (const auto& [key, value] : obj.items())
    if (!k.count(key)) return bad("unknown key '" + key + "' in " + where + " (known: " + join(known) + ")");
  return {};
}

Result<std::string> string_field(const json& obj, const char* key, const std::string& where) {
  const json& v = obj.at(key);
  if (!v.is_string()) return bad(where + "." + key + " must be a string, got " + type_of(v));
  return v.get<std::string>();
}

// Seconds (a number, fractions allowed) in (0, 1 day].
Result<std::chrono::milliseconds> seconds_field(const json& obj, const char* key) {
  const json& v = obj.at(key);
  if (!v.is_number()) return bad(std::string("kv_connector_extra_config.") + key + " must be a number of seconds, got " +
                                 type_of(v));
  const double s = v.get<double>();
  if (!(s > 0) || s > 86400.0 || !std::isfinite(s))
    return bad(std::string("kv_connector_extra_config.") + key + " must be in (0, 86400] seconds, got " + v.dump());
  const auto ms = std::chrono::milliseconds(static_cast<int64_t>(std::llround(s * 1000.0)));
  if (ms.count() < 1)
    return bad(std::string("kv_connector_extra_config.") + key + " must be at least 0.001 seconds, got " + v.dump());
  return ms;
}

std::string seconds_text(std::chrono::milliseconds ms) {
  std::string s = std::to_string(static_cast<double>(ms.count()) / 1000.0);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

const char* kv_role_name(KvRole role) {
  switch (role) {
    case KvRole::kProducer: return "kv_producer";
    case KvRole::kConsumer: return "kv_consumer";
    case KvRole::kBoth: return "kv_both";
  }
  return "?";
}

const char* transfer_mode_name(TransferMode m) { return m == TransferMode::kWrite ? "write" : "read"; }

transfer::TransferConfig default_pd_transfer_config() {
  transfer::TransferConfig t;
  t.backend = transfer::BackendKind::kUcx;
  t.side_channel.host = "127.0.0.1";
  t.side_channel.port = 0;
  return t;
}

Result<PdConfig> parse_kv_transfer_config(std::string_view text) {
  Result<json> parsed = parse_json(text);
  if (!parsed) return bad(parsed.error().message + ": " + std::string(text.substr(0, 80)));
  json root = std::move(*parsed);
  if (!root.is_object()) return bad("must be a JSON object, got " + type_of(root));
  SIESTA_TRY(refuse_unknown(root, {"kv_connector", "kv_role", "engine_id", "kv_connector_extra_config"}, "the config"));

  PdConfig c;
  if (!root.contains("kv_connector")) return bad("kv_connector is required (\"SiestaConnector\")");
  SIESTA_ASSIGN_OR_RETURN(std::string connector, string_field(root, "kv_connector", "config"));
  if (connector != "SiestaConnector")
    return bad("kv_connector '" + connector + "' is not known; this server implements \"SiestaConnector\"");
  if (!root.contains("kv_role")) return bad("kv_role is required (kv_producer, kv_consumer or kv_both)");
  SIESTA_ASSIGN_OR_RETURN(std::string role, string_field(root, "kv_role", "config"));
  if (role == "kv_producer") c.role = KvRole::kProducer;
  else if (role == "kv_consumer") c.role = KvRole::kConsumer;
  else if (role == "kv_both") c.role = KvRole::kBoth;
  else return bad("kv_role '" + role + "' is not one of kv_producer, kv_consumer, kv_both");
  if (root.contains("engine_id")) {
    SIESTA_ASSIGN_OR_RETURN(c.transfer.engine_id, string_field(root, "engine_id", "config"));
    if (c.transfer.engine_id.empty()) return bad("engine_id must not be empty (leave it out for a random one)");
  }

  json extra = json::object();
  if (root.contains("kv_connector_extra_config")) {
    extra = root.at("kv_connector_extra_config");
    if (!extra.is_object()) return bad("kv_connector_extra_config must be an object, got " + type_of(extra));
  }
  const std::string where = "kv_connector_extra_config";
  SIESTA_TRY(refuse_unknown(extra,
                            {"backend", "mode", "side_channel_host", "side_channel_port", "load_timeout_s",
                             "hold_timeout_s", "transfer_timeout_s", "message_timeout_s", "write_grace_s",
                             "worker_threads", "ucx_transports", "ucx_net_devices", "ucx_peer_error_handling",
                             "ucx_guarded", "ipc_copy", "auth_key", "auth_key_file", "allow_unauthenticated_peers"},
                            where));
  if (extra.contains("backend")) {
    SIESTA_ASSIGN_OR_RETURN(std::string backend, string_field(extra, "backend", where));
    auto kind = transfer::parse_backend_kind(backend);
    if (!kind) return bad(where + ".backend '" + backend + "' is not one of ucx, ipc");
    c.transfer.backend = *kind;
  }
  if (extra.contains("mode")) {
    SIESTA_ASSIGN_OR_RETURN(std::string mode, string_field(extra, "mode", where));
    if (mode == "write") c.mode = TransferMode::kWrite;
    else if (mode == "read") c.mode = TransferMode::kRead;
    else return bad(where + ".mode '" + mode + "' is not one of write, read");
  }
  if (extra.contains("side_channel_host")) {
    SIESTA_ASSIGN_OR_RETURN(c.transfer.side_channel.host, string_field(extra, "side_channel_host", where));
    if (c.transfer.side_channel.host.empty()) return bad(where + ".side_channel_host must not be empty");
  }
  if (extra.contains("side_channel_port")) {
    const json& v = extra.at("side_channel_port");
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 65535)
      return bad(where + ".side_channel_port must be an integer in [0, 65535] (0: a free port), got " + v.dump());
    c.transfer.side_channel.port = static_cast<uint16_t>(v.get<int64_t>());
  }
  if (extra.contains("load_timeout_s")) {
    SIESTA_ASSIGN_OR_RETURN(c.load_timeout, seconds_field(extra, "load_timeout_s"));
  }
  if (extra.contains("hold_timeout_s")) {
    SIESTA_ASSIGN_OR_RETURN(c.hold_timeout, seconds_field(extra, "hold_timeout_s"));
  }
  if (extra.contains("transfer_timeout_s")) {
    SIESTA_ASSIGN_OR_RETURN(c.transfer_timeout, seconds_field(extra, "transfer_timeout_s"));
  }
  if (extra.contains("message_timeout_s")) {
    SIESTA_ASSIGN_OR_RETURN(c.message_timeout, seconds_field(extra, "message_timeout_s"));
  }
  if (extra.contains("write_grace_s")) {
    SIESTA_ASSIGN_OR_RETURN(c.write_grace, seconds_field(extra, "write_grace_s"));
  }
  if (extra.contains("worker_threads")) {
    const json& v = extra.at("worker_threads");
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 64)
      return bad(where + ".worker_threads must be an integer in [1, 64], got " + v.dump());
    c.worker_threads = static_cast<int>(v.get<int64_t>());
  }
  for (const char* key : {"ucx_transports", "ucx_net_devices", "ucx_peer_error_handling", "ucx_guarded"}) {
    if (!extra.contains(key)) continue;
    if (c.transfer.backend != transfer::BackendKind::kUcx)
      return bad(where + "." + key + " applies to the ucx backend, and backend is '" +
                 transfer::backend_kind_name(c.transfer.backend) + "'");
  }
  if (extra.contains("ucx_transports")) {
    SIESTA_ASSIGN_OR_RETURN(c.transfer.ucx_transports, string_field(extra, "ucx_transports", where));
  }
  if (extra.contains("ucx_net_devices")) {
    SIESTA_ASSIGN_OR_RETURN(c.transfer.ucx_net_devices, string_field(extra, "ucx_net_devices", where));
  }
  if (extra.contains("ucx_peer_error_handling")) {
    const json& v = extra.at("ucx_peer_error_handling");
    if (!v.is_boolean()) return bad(where + ".ucx_peer_error_handling must be a boolean, got " + type_of(v));
    c.transfer.ucx_peer_error_handling = v.get<bool>();
  }
  if (extra.contains("ucx_guarded")) {
    const json& v = extra.at("ucx_guarded");
    if (!v.is_boolean()) return bad(where + ".ucx_guarded must be a boolean, got " + type_of(v));
    c.transfer.ucx_guarded = v.get<bool>();
  }

  if (extra.contains("ipc_copy")) {
    if (c.transfer.backend != transfer::BackendKind::kIpc)
      return bad(where + ".ipc_copy applies to the ipc backend, and backend is '" +
                 transfer::backend_kind_name(c.transfer.backend) + "'");
    SIESTA_ASSIGN_OR_RETURN(std::string copy, string_field(extra, "ipc_copy", where));
    auto parsed_copy = transfer::parse_ipc_copy(copy);
    if (!parsed_copy) return bad(where + ".ipc_copy '" + copy + "' is not one of auto, kernel, copy_engine");
    c.transfer.ipc_copy = *parsed_copy;
  }

  if (extra.contains("auth_key")) {
    std::string& key = c.transfer.side_channel.auth_key;
    SIESTA_ASSIGN_OR_RETURN(key, string_field(extra, "auth_key", where));
    if (key.size() < transfer::kMinAuthKeyBytes)
      return bad(where + ".auth_key has " + std::to_string(key.size()) + " bytes; use at least " +
                 std::to_string(transfer::kMinAuthKeyBytes) + " (e.g. openssl rand -hex 32)");
  }
  if (extra.contains("auth_key_file")) {
    if (extra.contains("auth_key")) return bad(where + ": give auth_key or auth_key_file, not both");
    SIESTA_ASSIGN_OR_RETURN(c.auth_key_file, string_field(extra, "auth_key_file", where));
    if (c.auth_key_file.empty()) return bad(where + ".auth_key_file must name a file");
  }
  if (extra.contains("allow_unauthenticated_peers")) {
    const json& v = extra.at("allow_unauthenticated_peers");
    if (!v.is_boolean()) return bad(where + ".allow_unauthenticated_peers must be a boolean, got " + type_of(v));
    c.allow_unauthenticated_peers = v.get<bool>();
    if (c.allow_unauthenticated_peers && (extra.contains("auth_key") || extra.contains("auth_key_file")))
      return bad(where + ": allow_unauthenticated_peers: true with an auth key; keep one of them");
  }

  // Combinations: a load waits load_timeout_s in all, and it contains one
  // message round trip and one transfer.
  if (c.consumes() && c.transfer_timeout > c.load_timeout)
    return bad(where + ".transfer_timeout_s (" + seconds_text(c.transfer_timeout) +
               ") is longer than load_timeout_s (" + seconds_text(c.load_timeout) +
               "): a load could never wait for its transfer; raise load_timeout_s or lower transfer_timeout_s");
  if (c.consumes() && c.message_timeout > c.load_timeout)
    return bad(where + ".message_timeout_s (" + seconds_text(c.message_timeout) +
               ") is longer than load_timeout_s (" + seconds_text(c.load_timeout) +
               "); raise load_timeout_s or lower message_timeout_s");
  return c;
}

Result<void> load_auth_key(PdConfig& config) {
  const std::string where = "kv_connector_extra_config";
  if (!config.auth_key_file.empty()) {
    std::ifstream in(config.auth_key_file, std::ios::binary);
    if (!in) return bad(where + ".auth_key_file '" + config.auth_key_file + "' cannot be read");
    std::ostringstream text;
    text << in.rdbuf();
    std::string key = text.str();
    while (!key.empty() && std::isspace(static_cast<unsigned char>(key.back()))) key.pop_back();
    if (key.size() < transfer::kMinAuthKeyBytes)
      return bad(where + ".auth_key_file '" + config.auth_key_file + "' holds " + std::to_string(key.size()) +
                 " bytes; a key needs at least " + std::to_string(transfer::kMinAuthKeyBytes) + " (e.g. openssl rand -hex 32)");
    struct stat st {};
    if (::stat(config.auth_key_file.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
      SIESTA_LOG_WARN("pd: the auth key file {} can be read by other users (mode {:o}); chmod 600 it",
                      config.auth_key_file, st.st_mode & 0777);
    config.transfer.side_channel.auth_key = std::move(key);
  }
  if (config.transfer.side_channel.auth_key.empty() && !config.allow_unauthenticated_peers)
    return bad(where + " needs auth_key (a shared secret of at least 16 bytes, the same on the prefill and decode "
                       "engines) or auth_key_file (a file holding it), so that the side channel trusts only its "
                       "peers; or allow_unauthenticated_peers: true to run without (anyone who reaches the side "
                       "channel can then steer transfers)");
  if (config.transfer.side_channel.auth_key.empty())
    SIESTA_LOG_WARN("pd: the side channel runs without authentication (allow_unauthenticated_peers): any process "
                    "that reaches {}:{} can steer this engine's KV transfers",
                    config.transfer.side_channel.host, config.transfer.side_channel.port);
  return {};
}

}  // namespace siesta::pd
