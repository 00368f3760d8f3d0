// libFuzzer target: the OpenAI request parsers of `siesta serve` on whatever
// JSON a client sends: /v1/completions, /v1/chat/completions and /tokenize's
// chat form (server/openai_request.h), with the embedded tiny model's
// tokenizer and chat template. They must refuse or accept without crashing,
// leaking or throwing; what they accept must give requests the engine can
// take (prompt token ids inside the vocabulary).
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>

#include "common/json_depth.h"
#include "model/tokenizer.h"
#include "server/openai_request.h"
#include "server/chat_template.h"

using namespace siesta;
using namespace siesta::server;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

const ChatTemplate& chat_template() {
  static const ChatTemplate* t = [] {
    auto c = ChatTemplate::load(SIESTA_SOURCE_DIR "/models/tiny-qwen3");
    if (!c) std::abort();
    return new ChatTemplate(std::move(*c));
  }();
  return *t;
}

const Tokenizer& tokenizer() {
  static const Tokenizer* tok = [] {
    auto t = Tokenizer::load(SIESTA_SOURCE_DIR "/models/tiny-qwen3");
    if (!t) std::abort();
    return new Tokenizer(std::move(*t));
  }();
  return *tok;
}

void check_job(const Result<GenerationJob>& job) {
  if (!job) {
    require(!job.error().message.empty());
    return;
  }
  require(!job->requests.empty());
  for (const EngineRequest& r : job->requests)
    for (int32_t id : r.prompt_tokens) require(id >= 0 && id < tokenizer().vocab_size());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  (void)chat_template();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Result<nlohmann::json> body = parse_json(text);
  if (!body) return 0;
  const SamplingDefaults defaults;
  RequestContext ctx{tokenizer(), defaults, &chat_template(), ChatConfig{}, 2048};
  const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  check_job(parse_completion_request(*body, ctx));
  if (!ordered.is_discarded()) {
    check_job(parse_chat_request(*body, ordered, ctx));
    if (Result<ChatPrompt> p = render_chat_prompt(ordered, ctx)) (void)tokenizer().encode(p->text);
  }
  return 0;
}
