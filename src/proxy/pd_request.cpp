#include "proxy/pd_request.h"

#include "common/json_depth.h"

namespace siesta::proxy {

using nlohmann::json;

const char* endpoint_path(Endpoint endpoint) {
  return endpoint == Endpoint::kCompletions ? "/v1/completions" : "/v1/chat/completions";
}

json prefill_request_body(const json& client_body, Endpoint endpoint) {
  json body = client_body;
  body["max_tokens"] = 1;
  if (endpoint == Endpoint::kChatCompletions) body["max_completion_tokens"] = 1;
  body["stream"] = false;
  // vLLM refuses stream_options without streaming, and min_tokens above max_tokens.
  body.erase("stream_options");
  body.erase("min_tokens");
  body["kv_transfer_params"] = {
      {"do_remote_decode", true},    {"do_remote_prefill", false}, {"remote_engine_id", nullptr},
      {"remote_block_ids", nullptr}, {"remote_host", nullptr},     {"remote_port", nullptr},
  };
  return body;
}

json decode_request_body_concurrent(const json& client_body, const std::string& request_id,
                                    const std::string& prefill_url) {
  json body = client_body;
  body["kv_transfer_params"] = {
      {"do_remote_prefill", true},       {"do_remote_decode", false},
      {"remote_engine_id", nullptr},     {"remote_block_ids", nullptr},
      {"remote_host", nullptr},          {"remote_port", nullptr},
      {"remote_request_id", request_id}, {"remote_prefill_url", prefill_url},
  };
  return body;
}

json decode_request_body_sequential(const json& client_body, const json& prefill_kv_transfer_params) {
  json body = client_body;
  body["kv_transfer_params"] = prefill_kv_transfer_params;
  return body;
}

bool prefill_answer_aborted(const std::string& answer_body) {
  json answer = json::parse(answer_body, nullptr, /*allow_exceptions=*/false);
  if (!answer.is_object()) return false;
  auto choices = answer.find("choices");
  if (choices == answer.end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object()) return false;
  auto reason = (*choices)[0].find("finish_reason");
  return reason != (*choices)[0].end() && reason->is_string() && reason->get<std::string>() == "abort";
}

Result<json> prefill_kv_transfer_params(const std::string& answer_body, bool need_address) {
  Result<json> parsed = parse_json(answer_body);
  if (!parsed && parsed.error().code == ErrorCode::kInvalidArgument) return corrupt("the answer: " + parsed.error().message);
  if (!parsed) return corrupt("the answer is not JSON");
  const json answer = std::move(*parsed);
  if (!answer.is_object()) return corrupt("the answer is not a JSON object");
  auto it = answer.find("kv_transfer_params");
  if (it == answer.end() || it->is_null()) return corrupt("the answer has no kv_transfer_params");
  const json& params = *it;
  if (!params.is_object()) return corrupt("kv_transfer_params is not an object");
  auto flag = params.find("do_remote_prefill");
  if (flag == params.end() || !flag->is_boolean() || !flag->get<bool>())
    return corrupt("kv_transfer_params lacks \"do_remote_prefill\": true");
  if (need_address) {
    auto require = [&](const char* key, bool ok) -> Result<void> {
      if (!ok) return corrupt(std::string("kv_transfer_params lacks a valid \"") + key + "\"");
      return {};
    };
    auto field = [&](const char* key) -> const json* {
      auto f = params.find(key);
      return f == params.end() ? nullptr : &*f;
    };
    const json* engine = field("remote_engine_id");
    const json* blocks = field("remote_block_ids");
    const json* host = field("remote_host");
    const json* port = field("remote_port");
    SIESTA_TRY(require("remote_engine_id", engine && engine->is_string() && !engine->get<std::string>().empty()));
    SIESTA_TRY(require("remote_block_ids", blocks && blocks->is_array()));
    SIESTA_TRY(require("remote_host", host && host->is_string() && !host->get<std::string>().empty()));
    SIESTA_TRY(require("remote_port", port && port->is_number_integer()));
  }
  return params;
}

}  // namespace siesta::proxy
