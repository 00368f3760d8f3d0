// What the proxy sends to each leg and accepts from prefill, how it reads
// instance URLs and its configuration, and which instances an admin call reaches.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "proxy/admin_fanout.h"
#include "proxy/instance_url.h"
#include "proxy/openai_error.h"
#include "proxy/pd_request.h"
#include "proxy/proxy_config.h"

namespace siesta::proxy {
namespace {

using nlohmann::json;

const json kClient = {{"model", "qwen3"},  {"prompt", "hi"},  {"max_tokens", 64},
                      {"stream", true},    {"min_tokens", 8}, {"stream_options", {{"include_usage", true}}},
                      {"temperature", 0.7}};

TEST(PdRequest, PrefillGetsOneTokenNoStreamAndDoRemoteDecode) {
  const json body = prefill_request_body(kClient, Endpoint::kCompletions);
  EXPECT_EQ(body["max_tokens"], 1);
  EXPECT_FALSE(body.contains("max_completion_tokens"));
  EXPECT_EQ(body["stream"], false);
  EXPECT_FALSE(body.contains("stream_options"));
  EXPECT_FALSE(body.contains("min_tokens"));
  EXPECT_EQ(body["prompt"], "hi");
  EXPECT_EQ(body["temperature"], 0.7);
  EXPECT_EQ(body["kv_transfer_params"], json({{"do_remote_decode", true},
                                              {"do_remote_prefill", false},
                                              {"remote_engine_id", nullptr},
                                              {"remote_block_ids", nullptr},
                                              {"remote_host", nullptr},
                                              {"remote_port", nullptr}}));
}

TEST(PdRequest, ChatPrefillAlsoCapsMaxCompletionTokens) {
  const json body =
      prefill_request_body({{"messages", json::array()}, {"max_completion_tokens", 50}}, Endpoint::kChatCompletions);
  EXPECT_EQ(body["max_tokens"], 1);
  EXPECT_EQ(body["max_completion_tokens"], 1);
}

TEST(PdRequest, SequentialDecodeGetsPrefillParamsAsReturned) {
  const json params = {{"do_remote_prefill", true},
                       {"remote_engine_id", "e1"},
                       {"remote_block_ids", {4, 5}},
                       {"remote_host", "10.0.0.1"},
                       {"remote_port", 5600},
                       {"remote_request_id", "r-1"},
                       {"extra", "kept"}};
  const json body = decode_request_body_sequential(kClient, params);
  EXPECT_EQ(body["kv_transfer_params"], params);
  json without = body;
  without.erase("kv_transfer_params");
  EXPECT_EQ(without, kClient);
}

TEST(PdRequest, ConcurrentDecodeWaitsForParamsThroughTheSideChannel) {
  const json body = decode_request_body_concurrent(kClient, "req-9", "http://10.0.0.1:8100");
  const json& kv = body["kv_transfer_params"];
  EXPECT_EQ(kv["do_remote_prefill"], true);
  EXPECT_EQ(kv["do_remote_decode"], false);
  EXPECT_TRUE(kv["remote_engine_id"].is_null());
  EXPECT_TRUE(kv["remote_block_ids"].is_null());
  EXPECT_EQ(kv["remote_request_id"], "req-9");
  EXPECT_EQ(kv["remote_prefill_url"], "http://10.0.0.1:8100");
  EXPECT_EQ(body["max_tokens"], 64);
  EXPECT_EQ(body["stream"], true);
}

TEST(PdRequest, PrefillAnswerMustCarryUsableParams) {
  const json good = {{"do_remote_prefill", true},
                     {"remote_engine_id", "e1"},
                     {"remote_block_ids", {1}},
                     {"remote_host", "h"},
                     {"remote_port", 1}};
  Result<json> ok = prefill_kv_transfer_params(json({{"kv_transfer_params", good}}).dump(), true);
  ASSERT_TRUE(ok);
  EXPECT_EQ(*ok, good);

  auto why = [](const std::string& answer, bool need_address) {
    Result<json> r = prefill_kv_transfer_params(answer, need_address);
    return r ? std::string("accepted") : r.error().message;
  };
  EXPECT_EQ(why("<html>", false), "the answer is not JSON");
  EXPECT_EQ(why("[1]", false), "the answer is not a JSON object");
  EXPECT_EQ(why("{}", false), "the answer has no kv_transfer_params");
  EXPECT_EQ(why(R"({"kv_transfer_params": null})", false), "the answer has no kv_transfer_params");
  EXPECT_EQ(why(R"({"kv_transfer_params": 3})", false), "kv_transfer_params is not an object");
  EXPECT_EQ(why(R"({"kv_transfer_params": {"do_remote_prefill": false}})", false),
            "kv_transfer_params lacks \"do_remote_prefill\": true");
  // Concurrent mode needs only the flag; sequential mode needs where to read from.
  EXPECT_EQ(why(R"({"kv_transfer_params": {"do_remote_prefill": true}})", false), "accepted");
  EXPECT_EQ(why(R"({"kv_transfer_params": {"do_remote_prefill": true}})", true),
            "kv_transfer_params lacks a valid \"remote_engine_id\"");
  json no_port = good;
  no_port["remote_port"] = "5600";
  EXPECT_EQ(why(json({{"kv_transfer_params", no_port}}).dump(), true),
            "kv_transfer_params lacks a valid \"remote_port\"");
}

TEST(InstanceUrl, AcceptsTheUsualFormsAndNormalises) {
  EXPECT_EQ(parse_instance_url("http://127.0.0.1:8100")->text, "http://127.0.0.1:8100");
  EXPECT_EQ(parse_instance_url("127.0.0.1:8100/")->text, "http://127.0.0.1:8100");
  Result<InstanceUrl> v6 = parse_instance_url("http://[::1]:9000");
  ASSERT_TRUE(v6);
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 9000);
  EXPECT_EQ(v6->text, "http://[::1]:9000");
}

TEST(InstanceUrl, RefusesWhatItCannotReach) {
  for (const char* bad : {"https://h:1", "http://h", "http://h:0", "http://h:70000", "http://h:1/v1", "http://:80",
                          "http://::1:80", "http://[::1", "h:x"}) {
    Result<InstanceUrl> url = parse_instance_url(bad);
    EXPECT_FALSE(url) << bad;
    if (!url) {
      EXPECT_NE(url.error().message.find(bad), std::string::npos) << url.error().message;
    }
  }
}

TEST(ProxyConfig, RefusesEmptyRolesDuplicatesAndBadLimits) {
  ProxyConfig config;
  config.prefill = {*parse_instance_url("http://a:1")};
  config.decode = {*parse_instance_url("http://b:1")};
  EXPECT_TRUE(validate_proxy_config(config));
  // One instance may serve both roles (kv_both).
  ProxyConfig both = config;
  both.decode = both.prefill;
  EXPECT_TRUE(validate_proxy_config(both));

  ProxyConfig no_decode = config;
  no_decode.decode.clear();
  EXPECT_NE(validate_proxy_config(no_decode).error().message.find("--decode"), std::string::npos);
  ProxyConfig twice = config;
  twice.prefill.push_back(twice.prefill[0]);
  EXPECT_NE(validate_proxy_config(twice).error().message.find("listed twice"), std::string::npos);
  ProxyConfig zero = config;
  zero.timeout = std::chrono::milliseconds(0);
  EXPECT_NE(validate_proxy_config(zero).error().message.find("--timeout-s"), std::string::npos);
  EXPECT_FALSE(parse_proxy_mode("write"));
  EXPECT_EQ(*parse_proxy_mode("sequential"), ProxyMode::kSequential);
}

TEST(AdminTargets, AllOneOrARole) {
  InstanceSet prefill(Role::kPrefill, {*parse_instance_url("http://p:1"), *parse_instance_url("http://both:1")});
  InstanceSet decode(Role::kDecode, {*parse_instance_url("http://d:1"), *parse_instance_url("http://both:1")});
  auto names = [](const Result<std::vector<AdminTarget>>& targets) {
    std::vector<std::string> out;
    for (const AdminTarget& t : *targets) out.push_back(t.url.text + " " + t.roles);
    return out;
  };
  EXPECT_EQ(names(select_admin_targets(prefill, decode, std::nullopt, std::nullopt)),
            (std::vector<std::string>{"http://p:1 prefill", "http://both:1 prefill+decode", "http://d:1 decode"}));
  EXPECT_EQ(names(select_admin_targets(prefill, decode, std::nullopt, "decode")),
            (std::vector<std::string>{"http://d:1 decode", "http://both:1 decode"}));
  EXPECT_EQ(names(select_admin_targets(prefill, decode, "d:1", std::nullopt)),
            (std::vector<std::string>{"http://d:1 decode"}));
  EXPECT_EQ(select_admin_targets(prefill, decode, "http://x:1", std::nullopt).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(select_admin_targets(prefill, decode, std::nullopt, "both").error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(select_admin_targets(prefill, decode, "http://d:1", "decode").error().code, ErrorCode::kInvalidArgument);
}

TEST(OpenAiError, HasMessageTypeParamAndCode) {
  const json body = json::parse(
      openai_error_body(502, error_code::kPrefillFailed, "prefill instance http://p:1 failed: cannot connect"));
  EXPECT_EQ(body, json({{"error",
                         {{"message", "prefill instance http://p:1 failed: cannot connect"},
                          {"type", "server_error"},
                          {"param", nullptr},
                          {"code", "prefill_failed"}}}}));
  const json bad = json::parse(openai_error_body(400, error_code::kInvalidValue, "bad stream", "stream"));
  EXPECT_EQ(bad["error"]["type"], "invalid_request_error");
  EXPECT_EQ(bad["error"]["param"], "stream");
  EXPECT_EQ(json::parse(openai_error_body(401, error_code::kInvalidApiKey, "no key"))["error"]["type"],
            "authentication_error");
}

}  // namespace
}  // namespace siesta::proxy
