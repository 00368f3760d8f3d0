#include "pd/prefill_locator.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/json_depth.h"

namespace siesta::pd {

Result<PrefillSideChannel> PrefillLocator::resolve(const std::string& url, Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(url);
    if (it != cache_.end() && Clock::now() - it->second.fetched < ttl_) return it->second.side_channel;
  }
  std::string base = url;
  while (!base.empty() && base.back() == '/') base.pop_back();
  if (base.rfind("http://", 0) != 0)
    return invalid_argument("remote_prefill_url '" + url + "' is not an http:// URL");
  const int ms = millis_left(deadline);
  if (ms <= 0) return timeout("no time left to look up the prefill instance at " + url);
  PrefillSideChannel found;
  try {
    httplib::Client client(base);
    client.set_connection_timeout(std::chrono::milliseconds(ms));
    client.set_read_timeout(std::chrono::milliseconds(ms));
    client.set_write_timeout(std::chrono::milliseconds(ms));
    if (!api_key_.empty()) client.set_bearer_token_auth(api_key_);
    auto res = client.Get("/kv_transfer_info");
    if (!res) return unavailable("GET " + base + "/kv_transfer_info: " + httplib::to_string(res.error()));
    if (res->status == 401)
      return unavailable("GET " + base + "/kv_transfer_info answered HTTP 401: the prefill instance has an API key; "
                         "start this engine with the same --api-key");
    if (res->status != 200)
      return unavailable("GET " + base + "/kv_transfer_info answered HTTP " + std::to_string(res->status) +
                         " (is it a siesta serve with --kv-transfer-config?)");
    Result<nlohmann::json> parsed = parse_json(res->body);
    if (!parsed) return corrupt("GET " + base + "/kv_transfer_info: " + parsed.error().message);
    nlohmann::json& j = *parsed;
    if (!j.is_object() || !j.contains("engine_id") || !j["engine_id"].is_string() ||
        !j.contains("side_channel_address") || !j["side_channel_address"].is_string())
      return corrupt("GET " + base + "/kv_transfer_info: no engine_id and side_channel_address in the answer");
    found.engine_id = j["engine_id"].get<std::string>();
    found.address = j["side_channel_address"].get<std::string>();
  } catch (const std::exception& e) {
    return unavailable("GET " + base + "/kv_transfer_info: " + e.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  cache_[url] = Entry{found, Clock::now()};
  return found;
}

void PrefillLocator::forget(const std::string& url) {
  std::lock_guard<std::mutex> lock(mu_);
  cache_.erase(url);
}

}  // namespace siesta::pd
