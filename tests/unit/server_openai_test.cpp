// Reading OpenAI request bodies into engine requests, and rendering engine
// outputs as OpenAI responses and stream chunks, without sockets.
#include <gtest/gtest.h>

#include "server/openai_request.h"
#include "server/openai_response.h"
#include "server/prometheus_text.h"
#include "test_data.h"

namespace siesta::server {
namespace {

const Tokenizer& tokenizer() {
  static Tokenizer tok = *Tokenizer::load(siesta::testing::tiny_model_dir().string());
  return tok;
}

const ChatTemplate& qwen3_template() {
  static ChatTemplate t = *ChatTemplate::from_source(builtin_qwen3_template(), "qwen3");
  return t;
}

const SamplingDefaults kDefaults{};

RequestContext context(ChatConfig chat = {}, const SamplingDefaults& d = kDefaults) {
  return RequestContext{tokenizer(), d, &qwen3_template(), std::move(chat), 512};
}

// The server's flags for tool calls and reasoning, as a vLLM user starts it.
ChatConfig tools_on() {
  ChatConfig c;
  c.enable_auto_tool_choice = true;
  c.tool_call_parser = "hermes";
  c.reasoning_parser = "qwen3";
  return c;
}

Result<GenerationJob> completion(const char* body) {
  return parse_completion_request(nlohmann::json::parse(body), context());
}

Result<GenerationJob> chat(const std::string& body, ChatConfig cfg = {}) {
  return parse_chat_request(nlohmann::json::parse(body), nlohmann::ordered_json::parse(body), context(std::move(cfg)));
}

std::string chat_error(const std::string& body, ChatConfig cfg = {}) {
  auto r = chat(body, std::move(cfg));
  return r ? std::string("(accepted)") : r.error().message;
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
  EXPECT_NE(error_of(R"({"prompt": "x", "presence_penalty": 2.5})").find("presence_penalty must be in [-2, 2]"),
            std::string::npos);
  EXPECT_EQ(error_of(R"({"prompt": "x", "presence_penalty": 0, "max_tokens": 3.0})"), "(accepted)");
}

TEST(CompletionRequest, NothingIsSilentlyIgnored) {
  // Unknown fields, and known ones this server cannot honour, are refused by name.
  EXPECT_NE(error_of(R"({"prompt": "x", "temprature": 0.5})").find("'temprature' is not a field"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "messages": []})").find("belongs to /v1/chat/completions"), std::string::npos);
  for (const char* body :
       {R"({"prompt": "x", "structured_outputs": {"json": {}}})", R"({"prompt": "x", "guided_json": {}})",
        R"({"prompt": "x", "guided_choice": ["a"]})", R"({"prompt": "x", "logprob_token_ids": [1]})",
        R"({"prompt": "x", "response_format": {"type": "json_object"}})", R"({"prompt": "x", "stream_interval": 4})",
        R"({"prompt": "x", "priority": 1})", R"({"prompt": "x", "thinking_token_budget": 10})",
        R"({"prompt": "x", "use_beam_search": true})"})
    EXPECT_NE(error_of(body).find("not supported"), std::string::npos) << body << ": " << error_of(body);
  // Their neutral values, and the fields vLLM ignores too, are accepted.
  EXPECT_EQ(error_of(R"({"prompt": "x", "structured_outputs": null, "guided_json": null, "stream_interval": 1,
                         "priority": 0, "thinking_token_budget": -1, "response_format": {"type": "text"},
                         "user": "u", "spaces_between_special_tokens": false, "length_penalty": 1.5,
                         "add_special_tokens": true, "session_id": "s"})"),
            "(accepted)");
  EXPECT_NE(error_of(R"({"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": true}})")
                .find("needs 'stream_options.include_usage'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": true, "x": 1}})")
                .find("'stream_options.x'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "stream": true, "prompt_logprobs": 1})").find("stream=True"),
            std::string::npos);
}

TEST(CompletionRequest, SamplingFieldsOfVllm) {
  auto r = completion(R"({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
                          "logit_bias": {"7": 3.5, "5": -500}, "allowed_token_ids": [9, 3, 9], "min_tokens": 2,
                          "prompt_logprobs": 3, "max_tokens": 4})");
  ASSERT_TRUE(r) << r.error().message;
  const SamplingParams& p = r->requests[0].params;
  EXPECT_EQ(p.presence_penalty, 0.5);
  EXPECT_EQ(p.frequency_penalty, -0.25);
  EXPECT_EQ(p.repetition_penalty, 1.2);
  EXPECT_EQ(p.logit_bias, (std::vector<std::pair<int32_t, double>>{{5, -100.0}, {7, 3.5}}));  // clamped, by id
  EXPECT_EQ(p.allowed_token_ids, (std::vector<int32_t>{3, 9}));
  EXPECT_EQ(p.min_tokens, 2);
  EXPECT_EQ(p.prompt_logprobs, 3);
  EXPECT_TRUE(r->prompt_logprobs);

  EXPECT_NE(error_of(R"({"prompt": "x", "logit_bias": {"abc": 1}})").find("keys must be token ids"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "logit_bias": {"99999": 1}})").find("outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "allowed_token_ids": []})").find("empty list"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "allowed_token_ids": [99999]})").find("'allowed_token_ids'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "repetition_penalty": 0})").find("repetition_penalty"), std::string::npos);
  EXPECT_NE(error_of(R"({"prompt": "x", "prompt_logprobs": -1})").find("at most 20"), std::string::npos);

  // bad_words: as written and with a leading space (when that is a different word of as many tokens).
  auto b = completion(R"({"prompt": "x", "bad_words": ["hello", " world"]})");
  ASSERT_TRUE(b) << b.error().message;
  const auto& words = b->requests[0].params.bad_words_token_ids;
  ASSERT_FALSE(words.empty());
  EXPECT_EQ(words[0], tokenizer().encode("hello"));
  EXPECT_NE(std::find(words.begin(), words.end(), tokenizer().encode("world")), words.end());
}

TEST(CompletionRequest, TruncationEchoAndIds) {
  auto left = completion(R"({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2})");
  ASSERT_TRUE(left);
  EXPECT_EQ(left->requests[0].prompt_tokens, (std::vector<int32_t>{4, 5}));
  auto right = completion(R"({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2, "truncation_side": "right"})");
  ASSERT_TRUE(right);
  EXPECT_EQ(right->requests[0].prompt_tokens, (std::vector<int32_t>{1, 2}));
  auto all = completion(R"({"prompt": [1, 2, 3], "truncate_prompt_tokens": -1})");
  ASSERT_TRUE(all);
  EXPECT_EQ(all->requests[0].prompt_tokens.size(), 3u);
  EXPECT_NE(error_of(R"({"prompt": [1], "truncate_prompt_tokens": 600})").find("greater than max_model_len (512)"),
            std::string::npos);

  // echo with logprobs: the prompt's log-probabilities come first (vLLM computes them as prompt_logprobs).
  auto echo = completion(R"({"prompt": [1, 2, 3], "echo": true, "logprobs": 2})");
  ASSERT_TRUE(echo) << echo.error().message;
  EXPECT_TRUE(echo->echo_logprobs);
  EXPECT_EQ(echo->requests[0].params.prompt_logprobs, 2);

  auto ids = completion(R"({"prompt": "x", "request_id": "abc", "return_tokens_as_token_ids": true})");
  ASSERT_TRUE(ids);
  EXPECT_EQ(ids->request_id, std::optional<std::string>("abc"));
  EXPECT_TRUE(ids->return_tokens_as_token_ids);
}

TEST(ChatRequest, RendersTheConversationAndReadsChatFields) {
  auto r = chat(R"({
      "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "chat_template_kwargs": {"enable_thinking": false}, "logprobs": true, "top_logprobs": 2,
      "max_completion_tokens": 7})");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->prompt_text, "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(r->requests[0].prompt_tokens, tokenizer().encode(r->prompt_text));
  EXPECT_EQ(r->requests[0].params.max_tokens, 7);
  EXPECT_EQ(r->requests[0].params.logprobs, 2);
  EXPECT_TRUE(r->chat_logprobs);

  auto no_max = chat(R"({"messages": [{"role": "user", "content": "x"}]})");
  ASSERT_TRUE(no_max);
  EXPECT_FALSE(no_max->requests[0].params.max_tokens);  // chat: up to max_model_len
  EXPECT_EQ(no_max->output.reasoning, ReasoningMode::kNone);  // no --reasoning-parser

  // developer is system; messages take no fields this server does not know.
  auto dev = chat(R"({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}]})");
  ASSERT_TRUE(dev);
  EXPECT_EQ(dev->prompt_text.rfind("<|im_start|>system\nBe brief.<|im_end|>\n", 0), 0u) << dev->prompt_text;
  EXPECT_NE(chat_error(R"({"messages": [{"role": "user", "content": "x", "weight": 2}]})").find("'messages[0].weight'"),
            std::string::npos);
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                           "refusal": null, "audio": null, "function_call": null, "annotations": []}]})"),
            "(accepted)");
  EXPECT_FALSE(chat(R"({"messages": "hi"})"));
  EXPECT_FALSE(chat(R"({"messages": [{"content": "x"}]})"));
  EXPECT_NE(chat_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})")
                .find("text models"),
            std::string::npos);
  EXPECT_NE(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"})")
                .find("--trust-request-chat-template"),
            std::string::npos);
  ChatConfig trusted;
  trusted.trust_request_chat_template = true;
  auto own = chat(R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "T:{{ messages[0].content }}"})",
                  trusted);
  ASSERT_TRUE(own) << own.error().message;
  EXPECT_EQ(own->prompt_text, "T:x");
}

TEST(ChatRequest, ToolChoiceAsVllmValidatesIt) {
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}}}}])";
  const std::string msgs = R"("messages": [{"role": "user", "content": "Weather?"}])";
  // tools default to tool_choice auto, which needs the server's parser flags.
  EXPECT_NE(chat_error("{" + msgs + "," + tools + "}").find("--enable-auto-tool-choice"), std::string::npos);
  EXPECT_EQ(chat_error("{" + msgs + "," + tools + R"(, "tool_choice": "none"})"), "(accepted)");
  EXPECT_NE(chat_error("{" + msgs + R"(, "tool_choice": "auto"})", tools_on()).find("`tools` must be set"),
            std::string::npos);
  EXPECT_NE(chat_error("{" + msgs + R"(, "tools": []})", tools_on()).find("must not be an empty array"),
            std::string::npos);
  EXPECT_NE(
      chat_error("{" + msgs + "," + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "x"}}})",
                 tools_on())
          .find("does not match any"),
      std::string::npos);
  EXPECT_NE(chat_error("{" + msgs + "," + tools + R"(, "tool_choice": "sometimes"})", tools_on()).find("Invalid value"),
            std::string::npos);

  auto auto_job = chat("{" + msgs + "," + tools + "}", tools_on());
  ASSERT_TRUE(auto_job) << auto_job.error().message;
  EXPECT_EQ(auto_job->tool_choice, ToolChoice::kAuto);
  EXPECT_TRUE(auto_job->output.parse_tools);
  EXPECT_EQ(auto_job->output.reasoning, ReasoningMode::kSplit);
  EXPECT_TRUE(auto_job->requests[0].params.forced_tokens.empty());
  EXPECT_NE(auto_job->prompt_text.find("\"name\": \"get_weather\", \"description\": null"), std::string::npos)
      << "tools reach the template as vLLM's model_dump: " << auto_job->prompt_text;

  // required / named: the answer starts with the tool call (this tokenizer has no </think> token:
  // from the first token on).
  auto named =
      chat("{" + msgs + "," + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})",
           tools_on());
  ASSERT_TRUE(named) << named.error().message;
  EXPECT_EQ(named->tool_choice, ToolChoice::kNamed);
  EXPECT_TRUE(named->output.single_tool_call);
  EXPECT_EQ(tokenizer().decode(named->requests[0].params.forced_tokens),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ");
  EXPECT_FALSE(named->requests[0].params.force_after_token);
  auto required =
      chat("{" + msgs + "," + tools + R"(, "tool_choice": "required", "parallel_tool_calls": false})", tools_on());
  ASSERT_TRUE(required);
  EXPECT_EQ(tokenizer().decode(required->requests[0].params.forced_tokens), "<tool_call>\n");
  EXPECT_TRUE(required->output.single_tool_call);

  // Thinking off: the reasoning parser reads everything as content.
  auto off = chat("{" + msgs + R"(, "chat_template_kwargs": {"enable_thinking": false}})", tools_on());
  ASSERT_TRUE(off);
  EXPECT_EQ(off->output.reasoning, ReasoningMode::kContentOnly);
  auto effort = chat("{" + msgs + R"(, "reasoning_effort": "none", "include_reasoning": false})", tools_on());
  ASSERT_TRUE(effort);
  EXPECT_EQ(effort->output.reasoning, ReasoningMode::kContentOnly);
  EXPECT_FALSE(effort->output.include_reasoning);
}

TEST(ChatRequest, EchoAndTheAnswersRole) {
  auto r = chat(R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Once upon"}],
                    "continue_final_message": true, "add_generation_prompt": false, "echo": true})");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->role, "assistant");
  EXPECT_EQ(r->echo[0], "Once upon");
  EXPECT_EQ(r->prompt_text.substr(r->prompt_text.size() - 9), "Once upon");
  auto user = chat(R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false, "echo": true})");
  ASSERT_TRUE(user);
  EXPECT_EQ(user->role, "user");  // vLLM: the last message's role without a generation prompt
}

TEST(SamplingDefaults, GenerationConfigValuesApplyUnlessTheRequestSetsThem) {
  SamplingDefaults d;
  d.temperature = 0.6;
  d.top_k = 20;
  auto r = parse_completion_request(nlohmann::json::parse(R"({"prompt": "x", "top_k": 5})"), context({}, d));
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
  auto job = chat(R"({"messages": [{"role": "user", "content": "x"}], "n": 2})");
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
        "siesta:e2e_request_latency_seconds_count{model_name=\"tiny\"} 1",
        "# TYPE siesta:inter_token_latency_seconds histogram"})
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
}

TEST(OpenAiResponse, ChatReasoningAndToolCallsWholeAndStreamed) {
  const std::string body = R"({"messages": [{"role": "user", "content": "Weather?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather"}}]})";
  const std::string text =
      "<think>\nI should call the tool.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", "
      "\"arguments\": {\"city\":\"Paris\",\"days\":2}}\n</tool_call>";
  auto job = chat(body, tools_on());
  ASSERT_TRUE(job) << job.error().message;
  OpenAiResponse whole(*job, "chatcmpl-1", "m", 1, tokenizer());
  whole.add({0, delta(text, {5, 6}, FinishReason::kStop)});
  const nlohmann::json r = whole.response();
  const nlohmann::json& m = r["choices"][0]["message"];
  EXPECT_EQ(m["reasoning_content"], "\nI should call the tool.\n");
  EXPECT_EQ(m["reasoning"], m["reasoning_content"]);
  EXPECT_EQ(m["content"], "\n\nLet me check.\n");
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(m["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\", \"days\": 2}");  // json.dumps
  EXPECT_EQ(m["tool_calls"][0]["id"].get<std::string>().rfind("chatcmpl-tool-", 0), 0u);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");

  // Streamed a character at a time: the same reasoning, content and call.
  auto sjob = chat(body.substr(0, body.size() - 1) + R"(, "stream": true})", tools_on());
  ASSERT_TRUE(sjob) << sjob.error().message;
  OpenAiResponse streamed(*sjob, "chatcmpl-1", "m", 1, tokenizer());
  streamed.start_chunks();
  std::string reasoning, content;
  nlohmann::json calls = nlohmann::json::array();
  std::string finish;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool last = i + 1 == text.size();
    for (const nlohmann::json& c : streamed.chunks(
             {0, delta(text.substr(i, 1), {5}, last ? std::optional(FinishReason::kStop) : std::nullopt)})) {
      const nlohmann::json& d = c["choices"][0]["delta"];
      if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("content")) content += d["content"].get<std::string>();
      if (d.contains("tool_calls"))
        for (const auto& t : d["tool_calls"]) calls.push_back(t);
      if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
    }
  }
  EXPECT_EQ(reasoning, m["reasoning_content"]);
  EXPECT_EQ(content, m["content"]);
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["function"]["arguments"], m["tool_calls"][0]["function"]["arguments"]);
  EXPECT_EQ(finish, "tool_calls");
}

TEST(OpenAiResponse, PromptLogprobsEchoAndTokenIds) {
  auto job = completion(R"({"prompt": [1, 2, 3], "echo": true, "logprobs": 1, "return_tokens_as_token_ids": true})");
  ASSERT_TRUE(job) << job.error().message;
  OpenAiResponse r(*job, "cmpl-1", "m", 1, tokenizer());
  RequestDelta d = delta("x", {9}, FinishReason::kLength);
  d.logprobs = {TokenLogprobs{{9, -0.5, 1}, {{9, -0.5, 1}}}};
  d.prompt_logprobs = std::vector<TokenLogprobs>{TokenLogprobs{{2, -1.0, 3}, {{7, -0.1, 1}}},
                                                 TokenLogprobs{{3, -2.0, 5}, {{8, -0.2, 1}}}};
  r.add({0, d});
  const nlohmann::json c = r.response()["choices"][0];
  EXPECT_EQ(c["logprobs"]["tokens"], nlohmann::json({"token_id:1", "token_id:2", "token_id:3", "token_id:9"}));
  EXPECT_TRUE(c["logprobs"]["token_logprobs"][0].is_null());
  EXPECT_EQ(c["logprobs"]["token_logprobs"][1], -1.0);
  EXPECT_TRUE(c["logprobs"]["top_logprobs"][0].is_null());
  EXPECT_EQ(c["logprobs"]["top_logprobs"][1]["token_id:7"], -0.1);
  // vLLM's prompt_logprobs: null first, then {token id: {logprob, rank, decoded_token}}.
  ASSERT_EQ(c["prompt_logprobs"].size(), 3u);
  EXPECT_TRUE(c["prompt_logprobs"][0].is_null());
  EXPECT_EQ(c["prompt_logprobs"][1]["2"]["rank"], 3);
  EXPECT_EQ(c["prompt_logprobs"][1]["7"]["logprob"], -0.1);
  EXPECT_EQ(c["prompt_logprobs"][2]["3"]["decoded_token"], "token_id:3");
}

TEST(OpenAiResponse, ContinuousUsageInEveryChunk) {
  auto job = completion(R"({"prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": true,
                           "continuous_usage_stats": true}})");
  ASSERT_TRUE(job) << job.error().message;
  OpenAiResponse r(*job, "cmpl-1", "m", 1, tokenizer());
  auto c1 = r.chunks({0, delta("a", {7})});
  EXPECT_EQ(c1[0]["usage"], nlohmann::json({{"prompt_tokens", 3}, {"completion_tokens", 1}, {"total_tokens", 4}}));
  auto c2 = r.chunks({0, delta("b", {8}, FinishReason::kStop)});
  EXPECT_EQ(c2[0]["usage"]["completion_tokens"], 2);
}

TEST(PrometheusText, SleepStateAndVllmNames) {
  EngineMetrics m;
  m.set_state(1, 0, 0.5, 64, 0, 0, 0);
  PrometheusOptions o;
  o.state = EngineState::kSleepingLevel1;
  std::string text = render_prometheus(m.snapshot(), "tiny", o);
  for (const char* needle : {"siesta:engine_sleep_state{model_name=\"tiny\",sleep_state=\"awake\"} 0",
                             "siesta:engine_sleep_state{model_name=\"tiny\",sleep_state=\"weights_offloaded\"} 1",
                             "siesta:engine_sleep_state{model_name=\"tiny\",sleep_state=\"discard_all\"} 0",
                             "siesta:engine_state{model_name=\"tiny\",state=\"sleeping_level_1\"} 1"})
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
  EXPECT_EQ(text.find("vllm:"), std::string::npos);
  o.vllm_names = true;
  text = render_prometheus(m.snapshot(), "tiny", o);
  for (const char* needle :
       {"vllm:num_requests_running{model_name=\"tiny\",engine=\"0\"} 1",
        "vllm:kv_cache_usage_perc{model_name=\"tiny\",engine=\"0\"} 0.5",
        "vllm:gpu_cache_usage_perc{model_name=\"tiny\",engine=\"0\"} 0.5",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "vllm:engine_sleep_state{model_name=\"tiny\",sleep_state=\"weights_offloaded\",engine=\"0\"} 1"})
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
}

}  // namespace
}  // namespace siesta::server
