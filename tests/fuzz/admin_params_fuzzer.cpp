// libFuzzer target: the query and body readers of `siesta serve`'s admin
// routes (server/admin_params.h) on any query string and body: /sleep's
// level and mode, /pause's flags, /wake_up's tags, every route's timeout,
// /reload_weights' {"model": DIR}. A refusal must name what is wrong; nothing
// may crash or throw out of them.
#include <httplib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/json_depth.h"
#include "server/admin_params.h"

using namespace siesta;
using namespace siesta::server;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

template <class T>
void refused_with_reason(const Result<T>& r) {
  if (!r) require(!r.error().message.empty() && r.error().code == ErrorCode::kInvalidArgument);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The query string up to the first NUL, the body after it.
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  httplib::Request req;
  httplib::detail::parse_query_text(in.substr(0, nul), req.params);
  refused_with_reason(bool_param(req, "clear_cache"));
  refused_with_reason(bool_param(req, "reset_running_requests"));
  refused_with_reason(int_param(req, "level", 1));
  refused_with_reason(deadline_param(req));
  refused_with_reason(mode_param(req, PauseMode::kKeep));
  refused_with_reason(tags_param(req));
  if (nul != std::string::npos) {
    Result<nlohmann::json> body = parse_json(std::string_view(in).substr(nul + 1));
    if (body) refused_with_reason(model_dir_of(*body, "the request body"));
  }
  return 0;
}
