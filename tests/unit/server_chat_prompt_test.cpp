// The Qwen3 chat format, case by case against what Qwen3's chat template renders.
#include <gtest/gtest.h>

#include "server/chat_prompt.h"

namespace siesta::server {
namespace {

std::string render(const std::vector<ChatMessage>& m, ChatPromptOptions o = {}) {
  auto r = render_qwen3_chat(m, o);
  EXPECT_TRUE(r) << r.error().message;
  return r ? *r : std::string();
}

TEST(Qwen3ChatFormat, SystemAndUserWithGenerationPrompt) {
  EXPECT_EQ(render({{"system", "Be brief.", {}}, {"user", "Hi", {}}}),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Qwen3ChatFormat, ThinkingDisabledAppendsAnEmptyThinkBlock) {
  ChatPromptOptions o;
  o.enable_thinking = false;
  EXPECT_EQ(render({{"user", "Hi", {}}}, o),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(Qwen3ChatFormat, EarlierAssistantTurnsLoseTheirReasoning) {
  const std::vector<ChatMessage> m{{"user", "a", {}},
                                   {"assistant", "<think>\nhmm\n</think>\n\nb", {}},
                                   {"user", "c", {}}};
  EXPECT_EQ(render(m), "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
                       "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Qwen3ChatFormat, AssistantTurnAfterTheLastQueryKeepsReasoning) {
  ChatPromptOptions o;
  o.add_generation_prompt = false;
  const std::vector<ChatMessage> m{{"user", "a", {}}, {"assistant", "b", std::string("why")}};
  EXPECT_EQ(render(m, o), "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nwhy\n</think>\n\nb<|im_end|>\n");
}

TEST(Qwen3ChatFormat, ToolMessagesBecomeOneUserTurn) {
  ChatPromptOptions o;
  o.add_generation_prompt = false;
  const std::vector<ChatMessage> m{{"user", "q", {}}, {"tool", "r1", {}}, {"tool", "r2", {}}};
  EXPECT_EQ(render(m, o), "<|im_start|>user\nq<|im_end|>\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
                          "<tool_response>\nr2\n</tool_response><|im_end|>\n");
}

TEST(Qwen3ChatFormat, ContinueFinalMessageLeavesTheTurnOpen) {
  ChatPromptOptions o;
  o.add_generation_prompt = false;
  o.continue_final_message = true;
  EXPECT_EQ(render({{"user", "a", {}}, {"assistant", "The answer is", {}}}, o),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is");
}

TEST(Qwen3ChatFormat, RefusesWhatItCannotRender) {
  EXPECT_FALSE(render_qwen3_chat({}, {}));
  EXPECT_FALSE(render_qwen3_chat({{"wizard", "x", {}}}, {}));
  ChatPromptOptions o;
  o.continue_final_message = true;  // with add_generation_prompt still true
  EXPECT_FALSE(render_qwen3_chat({{"assistant", "x", {}}}, o));
}

}  // namespace
}  // namespace siesta::server
