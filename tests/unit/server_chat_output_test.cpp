// Reading a chat answer: reasoning split at </think> as vLLM's qwen3
// reasoning parser splits it, tool calls parsed from <tool_call> blocks as
// vLLM's hermes parser parses them, and the same result streamed in any
// pieces.
#include <gtest/gtest.h>

#include "engine/random.h"
#include "server/chat_output.h"

namespace siesta::server {
namespace {

TEST(ChatOutput, ReasoningSplitsAtTheEndOfThinking) {
  auto r = split_reasoning("<think>\nplan\n</think>\n\nanswer", ReasoningMode::kSplit);
  EXPECT_EQ(r.reasoning, std::optional<std::string>("\nplan\n"));
  EXPECT_EQ(r.content, std::optional<std::string>("\n\nanswer"));
  // The template put <think> in the prompt: only </think> is generated.
  r = split_reasoning("plan</think>answer", ReasoningMode::kSplit);
  EXPECT_EQ(r.reasoning, std::optional<std::string>("plan"));
  EXPECT_EQ(r.content, std::optional<std::string>("answer"));
  // Cut short while thinking: all of it is reasoning, no content.
  r = split_reasoning("<think>still thinking", ReasoningMode::kSplit);
  EXPECT_EQ(r.reasoning, std::optional<std::string>("still thinking"));
  EXPECT_FALSE(r.content);
  // Nothing after </think>: null content.
  r = split_reasoning("<think>x</think>", ReasoningMode::kSplit);
  EXPECT_FALSE(r.content);
  // Thinking off: everything is content.
  r = split_reasoning("no think tags", ReasoningMode::kContentOnly);
  EXPECT_FALSE(r.reasoning);
  EXPECT_EQ(r.content, std::optional<std::string>("no think tags"));
}

TEST(ChatOutput, ToolCallsAsTheHermesParserReadsThem) {
  auto t = parse_tool_calls(
      "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\":1,\"y\":[true,null],\"z\":\"é\"}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>");
  ASSERT_TRUE(t.tools_called);
  ASSERT_EQ(t.calls.size(), 2u);
  EXPECT_EQ(t.calls[0].name, "a");
  EXPECT_EQ(t.calls[0].arguments, "{\"x\": 1, \"y\": [true, null], \"z\": \"é\"}");  // json.dumps, ensure_ascii off
  EXPECT_EQ(t.calls[1].arguments, "{}");
  EXPECT_NE(t.calls[0].id, t.calls[1].id);
  EXPECT_EQ(t.content, std::optional<std::string>("Sure.\n"));
  // The last call may be unclosed (the answer ended there).
  t = parse_tool_calls("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": 2}}");
  ASSERT_TRUE(t.tools_called);
  EXPECT_EQ(t.calls[0].arguments, "{\"k\": 2}");
  EXPECT_FALSE(t.content);
  // One block that is not a call: nothing is a call, the text stays content.
  t = parse_tool_calls("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call><tool_call>oops</tool_call>");
  EXPECT_FALSE(t.tools_called);
  EXPECT_EQ(t.content->find("oops") != std::string::npos, true);
  t = parse_tool_calls("<tool_call>{\"name\": \"a\"}</tool_call>");  // no arguments
  EXPECT_FALSE(t.tools_called);
  t = parse_tool_calls("plain answer");
  EXPECT_FALSE(t.tools_called);
  EXPECT_EQ(t.content, std::optional<std::string>("plain answer"));
}

ParsedChatOutput streamed(const std::string& text, const ChatOutputOptions& o, uint64_t seed) {
  ChatStreamParser p(o);
  ParsedChatOutput out;
  std::string reasoning, content;
  auto take = [&](const ChatStreamParser::Delta& d) {
    reasoning += d.reasoning;
    content += d.content;
    for (const ParsedToolCall& c : d.tool_calls) out.tool_calls.push_back(c);
  };
  size_t i = 0;
  uint64_t step = 0;
  while (i < text.size()) {
    const size_t n = 1 + request_draw(seed, step++) % 7;  // pieces of 1 to 7 bytes
    take(p.push(text.substr(i, n)));
    i += n;
  }
  take(p.finish());
  if (!reasoning.empty()) out.reasoning = reasoning;
  if (!content.empty()) out.content = content;
  return out;
}

TEST(ChatOutput, StreamingGivesWhatTheWholeTextGives) {
  const std::vector<std::string> texts = {
      "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
      "<think>a</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"x\"}}\n</tool_call>",
      "<think>r</think>Intro <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
      "{\"name\": \"g\", \"arguments\": {\"n\": 1.5}}\n</tool_call>",
      "no tags at all, < and <tool and <think",
      "<think>unfinished thought",
      "<think>x</think>truncated <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
  };
  ChatOutputOptions o;
  o.reasoning = ReasoningMode::kSplit;
  o.parse_tools = true;
  for (const std::string& t : texts) {
    SCOPED_TRACE(t);
    const ParsedChatOutput whole = parse_chat_output(t, o);
    for (uint64_t seed = 0; seed < 20; ++seed) {
      const ParsedChatOutput s = streamed(t, o, seed);
      EXPECT_EQ(s.reasoning, whole.reasoning);
      EXPECT_EQ(s.content, whole.content);
      ASSERT_EQ(s.tool_calls.size(), whole.tool_calls.size());
      for (size_t k = 0; k < s.tool_calls.size(); ++k) {
        EXPECT_EQ(s.tool_calls[k].name, whole.tool_calls[k].name);
        EXPECT_EQ(s.tool_calls[k].arguments, whole.tool_calls[k].arguments);
      }
    }
  }
  // include_reasoning off drops it; single_tool_call keeps the first call.
  o.include_reasoning = false;
  o.single_tool_call = true;
  const ParsedChatOutput r = parse_chat_output(texts[2], o);
  EXPECT_FALSE(r.reasoning);
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(streamed(texts[2], o, 3).tool_calls.size(), 1u);
  EXPECT_FALSE(streamed(texts[2], o, 3).reasoning);
}

}  // namespace
}  // namespace siesta::server
