// Admin calls (/sleep, /wake_up, /pause, ...) forwarded to several instances
// at once, and the answer that gathers theirs.
//
//   select_admin_targets(): every instance, or the one named by
//   ?instance=URL, or those of ?role=prefill|decode.
//   forward_admin(): the same call to each target in parallel, each bounded by
//   `limits`; answers {"<url>": {"role", "status", "body"} or {"role",
//   "status": null, "error"}} with the status every instance answered when
//   they agree, else 502.
//
// Threads: both are free functions; forward_admin() blocks its caller until
// every target answered or hit its limit.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "proxy/instance_set.h"
#include "proxy/leg.h"

namespace siesta::proxy {

// One instance to call; an instance configured in both roles is called once.
struct AdminTarget {
  InstanceUrl url;
  std::string roles;  // "prefill", "decode" or "prefill+decode"
};

// instance / role: the query parameters, when given. A URL that is not one of
// the configured instances is kNotFound; a role other than prefill|decode, or
// both parameters at once, kInvalidArgument.
Result<std::vector<AdminTarget>> select_admin_targets(const InstanceSet& prefill, const InstanceSet& decode,
                                                      const std::optional<std::string>& instance,
                                                      const std::optional<std::string>& role);

struct AdminAnswer {
  int status = 200;
  nlohmann::json body;
};

AdminAnswer forward_admin(const std::vector<AdminTarget>& targets, const LegRequest& request, const LegLimits& limits,
                          const Interrupt& interrupt);

}  // namespace siesta::proxy
