// Reading OpenAI request bodies into engine requests, and rendering engine
// outputs as OpenAI responses and stream chunks, without sockets.
#include <gtest/gtest.h>

#include "server/openai_request.h"
#include "server/openai_response.h"
#include "server/prometheus_text.h"

namespace siesta::server {
namespace {

const Tokenizer& tokenizer() {
  static Tokenizer tok = *Tokenizer::load(std::string(SIESTA_SOURCE_DIR) + "/models/tiny-qwen3");
  return tok;
}

Result<GenerationJob> completion(const char* body) {
  return parse_completion_request(nlohmann::json::parse(body), tokenizer(), SamplingDefaults{});
}

std::string error_of(const char* body) {
  auto r = completion(body);
  return r ? std::string("(accepted)") : r.error().message;
}

TEST(CompletionRequest, PromptFormsAndChoices) {
  auto text = completion(R"({"prompt": "Hello world"})");
  ASSERT_TRUE(text) << text.error().message;
  ASSERT_EQ(text->requests.size(), 1u);
  EXPECT_EQ(text->requests[0].prompt_tokens, tokenizer().encode("Hello world"));
  EXPECT_EQ(text->requests[0].params.max_tokens, 16);  // the completions default

  auto batch = completion(R"({"prompt": ["a b", [5, 6, 7]], "n": 2, "seed": 10, "temperature": 0.7})");
  ASSERT_TRUE(batch) << batch.error().message;
  ASSERT_EQ(batch->requests.size(), 4u);
  EXPECT_EQ(batch->prompt_of_choice, (std::vector<size_t>{0, 0, 1, 1}));
  EXPECT_EQ(batch->requests[2].prompt_tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(*batch->requests[0].params.seed, 10u);
  EXPECT_EQ(*batch->requests[1].params.seed, 11u);  // vLLM: seed + k for choice k
  assign_request_ids(*batch, "cmpl-x");
  EXPECT_EQ(batch->requests[3].id, "cmpl-x-3");
}

TEST(CompletionRequest, BadInputNamesTheField) {
  EXPECT_NE(error_of(R"({})").find("'prompt' is required"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": 5})").find("'prompt' must be"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": []})").find("empty"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": [1, 99999]})").find("'prompt[1]' is token id 99999"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "max_tokens": "ten"})").find("'max_tokens' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "max_tokens": 0})").find("'max_tokens'"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "temperature": "hot"})").find("'temperature' must be a number"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "top_p": 0})").find("top_p"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "stream": "yes"})").find("'stream' must be a boolean"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "logprobs": 21})").find("'logprobs'"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "stop": [1]})").find("'stop'"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "presence_penalty": 0.5})").find("not supported"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "echo": true, "logprobs": 1})").find("'echo'"), std::string::npos);
  EXPECT_EQ(error_of(R"({"prompt": "x", "presence_penalty": 0, "max_tokens": 3.0})"), "(accepted)");
}

TEST(ChatRequest, RendersTheConversationAndReadsChatFields) {
  auto r = parse_chat_request(nlohmann::json::parse(R"({
      "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "chat_template_kwargs": {"enable_thinking": false}, "logprobs": true, "top_logprobs": 2,
      "max_completion_tokens": 7})"),
                              tokenizer(), SamplingDefaults{});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->prompt_text, "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(r->requests[0].prompt_tokens, tokenizer().encode(r->prompt_text));
  EXPECT_EQ(r->requests[0].params.max_tokens, 7);
  EXPECT_EQ(r->requests[0].params.logprobs, 2);
  EXPECT_TRUE(r->chat_logprobs);

  auto no_max = parse_chat_request(nlohmann::json::parse(R"({"messages": [{"role": "user", "content": "x"}]})"),
                                   tokenizer(), SamplingDefaults{});
  ASSERT_TRUE(no_max);
  EXPECT_FALSE(no_max->requests[0].params.max_tokens);  // chat: up to max_model_len

  EXPECT_FALSE(parse_chat_request(nlohmann::json::parse(R"({"messages": "hi"})"), tokenizer(), {}));
  EXPECT_FALSE(parse_chat_request(nlohmann::json::parse(R"({"messages": [{"content": "x"}]})"), tokenizer(), {}));
  EXPECT_FALSE(parse_chat_request(
      nlohmann::json::parse(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})"),
      tokenizer(), {}));
}

TEST(SamplingDefaults, GenerationConfigValuesApplyUnlessTheRequestSetsThem) {
  SamplingDefaults d;
  d.temperature = 0.6;
  d.top_k = 20;
  auto r = parse_completion_request(nlohmann::json::parse(R"({"prompt": "x", "top_k": 5})"), tokenizer(), d);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->requests[0].params.temperature, 0.6);
  EXPECT_EQ(r->requests[0].params.top_k, 5);
}

RequestDelta delta(std::string text, std::vector<int32_t> ids, std::optional<FinishReason> finish = std::nullopt) {
  RequestDelta d;
  d.text = std::move(text);
  d.token_ids = std::move(ids);
  if (finish) {
    RequestFinish f;
    f.reason = *finish;
    f.num_prompt_tokens = 3;
    f.num_output_tokens = 2;
    f.num_cached_tokens = 0;
    f.stop_reason = std::string("END");
    d.finish = f;
  }
  return d;
}

TEST(OpenAiResponse, CompletionWholeAndStreamed) {
  auto job = completion(R"({"prompt": [1, 2, 3], "return_token_ids": true, "stream": true})");
  ASSERT_TRUE(job);
  OpenAiResponse whole(*job, "cmpl-1", "m", 100, tokenizer());
  whole.add({0, delta("ab", {7})});
  whole.add({0, delta("c", {8}, FinishReason::kStop)});
  const nlohmann::json r = whole.response();
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "abc");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["choices"][0]["stop_reason"], "END");
  EXPECT_EQ(r["choices"][0]["token_ids"], nlohmann::json({7, 8}));
  EXPECT_EQ(r["choices"][0]["prompt_token_ids"], nlohmann::json({1, 2, 3}));
  EXPECT_EQ(r["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(r["usage"]["completion_tokens"], 2);
  EXPECT_EQ(r["usage"]["total_tokens"], 5);

  OpenAiResponse streamed(*job, "cmpl-1", "m", 100, tokenizer());
  EXPECT_TRUE(streamed.start_chunks().empty());
  auto c1 = streamed.chunks({0, delta("ab", {7})});
  ASSERT_EQ(c1.size(), 1u);
  EXPECT_EQ(c1[0]["choices"][0]["text"], "ab");
  EXPECT_TRUE(c1[0]["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(c1[0]["choices"][0]["prompt_token_ids"], nlohmann::json({1, 2, 3}));
  auto c2 = streamed.chunks({0, delta("c", {8}, FinishReason::kLength)});
  EXPECT_FALSE(c2[0]["choices"][0].contains("prompt_token_ids"));
  EXPECT_EQ(c2[0]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(streamed.usage_chunk()["usage"]["completion_tokens"], 2);
  EXPECT_TRUE(streamed.usage_chunk()["choices"].empty());
}

TEST(OpenAiResponse, ChatChunksStartWithTheRole) {
  auto job = parse_chat_request(nlohmann::json::parse(R"({"messages": [{"role": "user", "content": "x"}], "n": 2})"),
                                tokenizer(), SamplingDefaults{});
  ASSERT_TRUE(job);
  OpenAiResponse r(*job, "chatcmpl-1", "m", 100, tokenizer());
  auto start = r.start_chunks();
  ASSERT_EQ(start.size(), 2u);
  EXPECT_EQ(start[1]["object"], "chat.completion.chunk");
  EXPECT_EQ(start[1]["choices"][0]["index"], 1);
  EXPECT_EQ(start[1]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(r.chunks({0, delta("", {9})}).empty());  // held-back text: no empty delta
  auto c = r.chunks({0, delta("hi", {10}, FinishReason::kStop)});
  EXPECT_EQ(c[0]["choices"][0]["delta"]["content"], "hi");
  EXPECT_EQ(c[0]["choices"][0]["finish_reason"], "stop");
}

TEST(PrometheusText, VllmNamesAndHistogramBuckets) {
  EngineMetrics m;
  m.record_first_token(10, 0.003);
  m.record_finish(FinishReason::kAbort, 0.2);
  m.set_state(2, 1, 0.25, 64, 100, 48, 3);
  const std::string text = render_prometheus(m.snapshot(), "tiny");
  for (const char* needle :
       {"siesta:num_requests_running{model_name=\"tiny\"} 2", "siesta:num_requests_waiting{model_name=\"tiny\"} 1",
        "siesta:kv_cache_usage_perc{model_name=\"tiny\"} 0.25", "siesta:prompt_tokens_total{model_name=\"tiny\"} 10",
        "siesta:request_success_total{finished_reason=\"abort\",model_name=\"tiny\"} 1",
        "siesta:prefix_cache_queries_total{model_name=\"tiny\"} 100",
        "siesta:prefix_cache_hits_total{model_name=\"tiny\"} 48", "siesta:num_preemptions_total{model_name=\"tiny\"} 3",
        "siesta:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.005\"} 1",
        "siesta:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.001\"} 0",
        "siesta:e2e_request_latency_seconds_count{model_name=\"tiny\"} 1", "# TYPE siesta:inter_token_latency_seconds histogram"})
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
}

}  // namespace
}  // namespace siesta::server
