// The chat template: siesta's rendering of the requests in
// tests/data/chat_template/conversations.json, through the server's own path
// (vLLM's conversion of messages and tools, then the template of the real
// Qwen3 tokenizer_config.json, or Qwen2.5's), against expected.json (the
// text Hugging Face's settings render and its token ids), character for
// character and token for token.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "server/chat_template.h"
#include "server/openai_request.h"
#include "test_data.h"

namespace siesta::server {
namespace {

namespace fs = std::filesystem;
const fs::path kData = siesta::testing::test_data_root() / "tests" / "data" / "chat_template";

fs::path assets_dir() {
  const char* env = std::getenv("SIESTA_ASSETS");
  if (env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr ? home : "") / ".cache" / "siesta" / "assets";
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Fixture {
  Tokenizer tok;
  ChatTemplate qwen3;
  ChatTemplate qwen25;
};

// The real Qwen3 tokenizer and its template; missing assets are a failure
// with the fix, never a skip.
const Fixture* fixture() {
  static const std::optional<Fixture> f = []() -> std::optional<Fixture> {
    const fs::path dir = assets_dir() / "qwen3-tokenizer";
    auto tok = Tokenizer::load(dir);
    auto qwen3 = ChatTemplate::load(dir);
    auto qwen25 = ChatTemplate::from_source(read_text(kData / "qwen2.5.jinja"), "qwen2.5.jinja");
    if (!tok || !qwen3 || !qwen25) return std::nullopt;
    return Fixture{std::move(*tok), std::move(*qwen3), std::move(*qwen25)};
  }();
  if (!f)
    ADD_FAILURE() << "the Qwen3 tokenizer assets are missing under " << assets_dir()
                  << ": run scripts/setup, or point SIESTA_ASSETS at them";
  return f ? &*f : nullptr;
}

TEST(ChatTemplate, RendersEveryConversationAsHuggingFaceDoes) {
  const Fixture* f = fixture();
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->qwen3.origin(), (assets_dir() / "qwen3-tokenizer" / "tokenizer_config.json").string());
  const auto cases = nlohmann::ordered_json::parse(read_text(kData / "conversations.json"))["cases"];
  const auto expected = nlohmann::json::parse(read_text(kData / "expected.json"))["cases"];
  ASSERT_GE(cases.size(), 20u);
  SamplingDefaults defaults;
  for (const auto& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const ChatTemplate& t = c.value("template", std::string("qwen3")) == "qwen2.5" ? f->qwen25 : f->qwen3;
    RequestContext ctx{f->tok, defaults, &t, {}, 0};
    auto rendered = render_chat_prompt(c["request"], ctx);
    ASSERT_TRUE(rendered) << rendered.error().message;
    ASSERT_TRUE(expected.contains(name));
    EXPECT_EQ(rendered->text, expected[name]["text"].get<std::string>());
    EXPECT_EQ(f->tok.encode(rendered->text), expected[name]["token_ids"].get<std::vector<int32_t>>());
  }
}

TEST(ChatTemplate, TheBuiltInTemplateIsQwen3s) {
  const Fixture* f = fixture();
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(builtin_qwen3_template(), f->qwen3.source());
  // A model directory without a template (the embedded test model) chats with it.
  auto tiny = ChatTemplate::load(siesta::testing::tiny_model_dir());
  ASSERT_TRUE(tiny) << tiny.error().message;
  EXPECT_EQ(tiny->source(), builtin_qwen3_template());
}

TEST(ChatTemplate, ContinueFinalMessageCutsAfterTheMessage) {
  auto t = ChatTemplate::from_source(builtin_qwen3_template(), "qwen3");
  ASSERT_TRUE(t);
  ChatRenderInput in;
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello, I am "}])");
  in.add_generation_prompt = false;
  in.continue_final_message = true;
  auto r = t->render(in);
  ASSERT_TRUE(r) << r.error().message;
  // The trailing space survives: the template keeps the content as written.
  EXPECT_EQ(*r, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello, I am ");
  in.add_generation_prompt = true;
  EXPECT_FALSE(t->render(in));
}

TEST(ChatTemplate, ErrorsNameTheConstructAndTheLine) {
  auto bad_tag = ChatTemplate::from_source("{% if x %}\n{% call foo() %}{% endcall %}{% endif %}", "t");
  ASSERT_FALSE(bad_tag);
  EXPECT_NE(bad_tag.error().message.find("{% call %}"), std::string::npos) << bad_tag.error().message;
  EXPECT_NE(bad_tag.error().message.find("line 2"), std::string::npos) << bad_tag.error().message;

  auto bad_filter = ChatTemplate::from_source("{{ messages | wordcount }}", "t");
  ASSERT_TRUE(bad_filter);
  ChatRenderInput in;
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  auto r = bad_filter->render(in);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("the filter 'wordcount' is not supported"), std::string::npos) << r.error().message;

  auto raising = ChatTemplate::from_source("{{ raise_exception('Only user and assistant roles') }}", "t");
  ASSERT_TRUE(raising);
  r = raising->render(in);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("Only user and assistant roles"), std::string::npos);

  // chat_template_kwargs may not set what the request's own fields set.
  in.kwargs = {{"messages", 1}};
  EXPECT_FALSE(ChatTemplate::from_source("x", "t")->render(in));
}

}  // namespace
}  // namespace siesta::server
