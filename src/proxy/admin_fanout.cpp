#include "proxy/admin_fanout.h"

#include "common/json_depth.h"

#include <memory>
#include <set>
#include <utility>

namespace siesta::proxy {

using nlohmann::json;

Result<std::vector<AdminTarget>> select_admin_targets(const InstanceSet& prefill, const InstanceSet& decode,
                                                      const std::optional<std::string>& instance,
                                                      const std::optional<std::string>& role) {
  if (instance && role) return invalid_argument("give ?instance= or ?role=, not both");
  std::vector<AdminTarget> targets;
  auto add = [&](const InstanceUrl& url, Role r) {
    for (AdminTarget& t : targets) {
      if (t.url == url) {
        t.roles += std::string("+") + role_name(r);
        return;
      }
    }
    targets.push_back({url, role_name(r)});
  };
  auto add_all = [&](const InstanceSet& set) {
    for (const InstanceUrl& url : set.urls()) add(url, set.role());
  };
  if (instance) {
    Result<InstanceUrl> url = parse_instance_url(*instance);
    if (!url) return url.error();
    for (const InstanceSet* set : {&prefill, &decode})
      if (set->find(url->text)) add(*url, set->role());
    if (targets.empty()) return not_found("no configured instance is " + url->text);
    return targets;
  }
  if (!role || *role == "prefill") add_all(prefill);
  if (!role || *role == "decode") add_all(decode);
  if (role && *role != "prefill" && *role != "decode")
    return invalid_argument("?role=: expected prefill or decode, got \"" + *role + "\"");
  return targets;
}

AdminAnswer forward_admin(const std::vector<AdminTarget>& targets, const LegRequest& request, const LegLimits& limits,
                          const Interrupt& interrupt) {
  std::vector<std::unique_ptr<Leg>> legs;
  legs.reserve(targets.size());
  for (const AdminTarget& target : targets) legs.push_back(Leg::start(target.url, request, limits));

  AdminAnswer answer;
  answer.body = json::object();
  std::set<int> statuses;
  bool all_answered = true;
  for (size_t i = 0; i < targets.size(); ++i) {
    json entry = {{"role", targets[i].roles}};
    Result<LegHead> head = legs[i]->wait_head(interrupt);
    Result<std::string> body = head ? legs[i]->wait_body(interrupt) : Result<std::string>(head.error());
    if (!head || !body) {
      entry["status"] = nullptr;
      entry["error"] = (head ? body.error() : head.error()).message;
      all_answered = false;
    } else {
      entry["status"] = head->status;
      Result<json> parsed = parse_json(*body);
      entry["body"] = parsed ? std::move(*parsed) : json(*body);
      statuses.insert(head->status);
    }
    answer.body[targets[i].url.text] = std::move(entry);
  }
  answer.status = (all_answered && statuses.size() == 1) ? *statuses.begin() : 502;
  if (targets.empty()) answer.status = 200;
  return answer;
}

}  // namespace siesta::proxy
