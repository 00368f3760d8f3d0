// OpenAiResponse: renders the outputs of a GenerationJob in OpenAI's (and
// vLLM's) JSON shapes: the whole response, or the chunks of a stream.
//
//   OpenAiResponse r(job, "cmpl-...", "served-name", unix_time, tokenizer);
//   not streaming:  r.add(delta) for every delta; then r.response()
//   streaming:      r.start_chunks(); r.chunks(delta) per delta; r.usage_chunk() at the end
//
// Completions: choices[{index, text, logprobs{tokens, token_logprobs,
// top_logprobs, text_offset}, finish_reason, stop_reason}], object
// "text_completion"; with echo and logprobs the prompt's tokens lead the
// logprobs (the first without a value). Chat: choices[{index,
// message{role, content, reasoning_content, reasoning, tool_calls, ...},
// logprobs{content[{token, logprob, bytes, top_logprobs}]}, finish_reason
// ("tool_calls" when tools were called: auto always, required when it
// stopped), stop_reason}], object "chat.completion"; stream chunks
// "chat.completion.chunk" with `delta`, the first one per choice carrying
// the role. Reasoning and tool calls are read as chat_output.h says.
// return_token_ids adds prompt_token_ids (first chunk of a choice) and
// token_ids; return_tokens_as_token_ids names logprob tokens "token_id:N";
// prompt_logprobs ([null, {"id": {logprob, rank, decoded_token}}, ...]) per
// choice (completions) or at the top (chat). usage: prompt tokens counted
// once per prompt, completion tokens over all choices, cached prompt tokens
// in prompt_tokens_details; with continuous_usage_stats every chunk carries
// its choice's usage so far. Logprobs of -inf are written as -9999.0, as
// vLLM does.
// Not thread-safe; one per HTTP request.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_stream.h"
#include "model/tokenizer.h"
#include "server/chat_output.h"
#include "server/openai_request.h"

namespace siesta::server {

class OpenAiResponse {
 public:
  OpenAiResponse(const GenerationJob& job, std::string id, std::string model, int64_t created,
                 const Tokenizer& tokenizer);

  std::vector<nlohmann::json> start_chunks();
  std::vector<nlohmann::json> chunks(const IndexedDelta& delta);
  nlohmann::json usage_chunk() const;

  void add(const IndexedDelta& delta);
  nlohmann::json response() const;

  // The first error the engine ended a choice with, if any.
  const std::optional<Status>& error() const { return error_; }
  bool all_finished() const;

 private:
  struct Choice {
    std::vector<int32_t> prompt_tokens;
    std::string text;
    std::vector<int32_t> token_ids;
    nlohmann::json logprobs;        // accumulated (non-streaming)
    std::optional<std::vector<TokenLogprobs>> prompt_logprobs;
    std::optional<RequestFinish> finish;
    bool started = false;           // streaming: first chunk sent
    size_t text_offset = 0;         // completions logprobs: characters so far
    std::shared_ptr<ChatStreamParser> parser;  // chat streaming
    int64_t completion_tokens = 0;
  };

  nlohmann::json envelope(bool chunk) const;
  std::string token_name(int32_t id) const;
  nlohmann::json logprobs_json(Choice& c, const std::vector<TokenLogprobs>& lps);
  nlohmann::json echo_logprobs_json(Choice& c, const std::vector<TokenLogprobs>& prompt_lps);
  nlohmann::json prompt_logprobs_json(const Choice& c) const;
  void append_logprobs(nlohmann::json& into, const nlohmann::json& more) const;
  nlohmann::json usage() const;
  nlohmann::json choice_usage(const Choice& c) const;
  nlohmann::json chat_message(const Choice& c, size_t index) const;
  std::string chat_finish_reason(const RequestFinish& f, bool tools_called) const;
  void note(const RequestDelta& d);

  const GenerationJob& job_;
  std::string id_;
  std::string model_;
  int64_t created_;
  const Tokenizer& tok_;
  std::vector<Choice> choices_;
  std::optional<Status> error_;
};

}  // namespace siesta::server
