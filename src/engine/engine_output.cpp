#include "engine/engine_output.h"

#include <algorithm>

#include "common/log.h"

namespace siesta {
namespace {

double seconds(OutputProcessor::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

FinishReason reason_of(RequestState state) {
  switch (state) {
    case RequestState::kFinishedStopped: return FinishReason::kStop;
    case RequestState::kFinishedLength: return FinishReason::kLength;
    default: return FinishReason::kAbort;
  }
}

}  // namespace

OutputProcessor::OutputProcessor(const Tokenizer& tokenizer, EngineMetrics& metrics,
                                 std::function<void(const RequestId&)> released)
    : tokenizer_(tokenizer), metrics_(metrics), released_(std::move(released)) {}

void OutputProcessor::add(EngineRequest request, std::shared_ptr<StreamState> stream, size_t index,
                          Clock::time_point arrival) {
  const bool skip_special = request.skip_special_tokens;
  std::vector<std::string> stops = request.params.stop;
  const bool include_stop = request.params.include_stop_str_in_output;
  RequestId id = request.id;
  live_.emplace(std::move(id), Live{std::move(request), std::move(stream), index,
                                    IncrementalDetokenizer(tokenizer_, skip_special),
                                    StopStringChecker(std::move(stops), include_stop), arrival, arrival, 0});
}

std::vector<RequestId> OutputProcessor::ids() const {
  std::vector<RequestId> out;
  out.reserve(live_.size());
  for (const auto& [id, live] : live_) out.push_back(id);
  return out;
}

void OutputProcessor::process(const std::vector<RequestOutput>& outputs, Scheduler& scheduler,
                              KvConnector* connector, Clock::time_point now) {
  for (const RequestOutput& out : outputs) {
    auto it = live_.find(out.request_id);
    if (it == live_.end()) continue;
    Live& live = it->second;
    const SamplingParams& params = live.request.params;
    RequestDelta delta;
    if (params.prompt_logprobs && live.num_output_tokens == 0 && !out.new_tokens.empty())
      delta.prompt_logprobs = out.prompt_logprobs;
    for (size_t t = 0; t < out.new_tokens.size(); ++t) {
      const SampledToken& token = out.new_tokens[t];
      delta.token_ids.push_back(token.token);
      if (token.logprobs) delta.logprobs.push_back(*token.logprobs);
      if (live.num_output_tokens == 0)
        metrics_.record_first_token(out.num_prompt_tokens, seconds(now - live.arrival));
      else
        metrics_.record_token(seconds(now - live.last_token));
      live.last_token = now;
      ++live.num_output_tokens;
      // The token that ends the request on eos or a stop token id gives no text.
      const bool last = t + 1 == out.new_tokens.size();
      const bool ended_by_token = last && out.state == RequestState::kFinishedStopped;
      if (live.stops.stopped() || (ended_by_token && !params.include_stop_str_in_output)) continue;
      const StopCheck c =
          live.stops.push(live.detokenizer.push(token.token), live.num_output_tokens > params.min_tokens);
      delta.text += c.text;
    }
    metrics_.record_generated(out.new_tokens.size());

    const bool stopped_by_string = live.stops.stopped();
    if (!out.finished() && !stopped_by_string) {
      if (!delta.empty()) push_quiet(live, std::move(delta));
      continue;
    }
    RequestOutput final_out = out;
    if (!out.finished()) {
      // A stop string: end the request in the scheduler.
      auto stopped = scheduler.stop(out.request_id);
      if (stopped) {
        final_out = std::move(*stopped);
      } else {
        SIESTA_LOG_ERROR("engine: request {}: stop string found but the stop failed: {}", out.request_id,
                         stopped.error().message);
        final_out.state = RequestState::kFinishedStopped;
      }
    }
    RequestFinish finish;
    if (stopped_by_string) {
      finish.reason = FinishReason::kStop;
      finish.stop_reason = std::string(live.stops.stop_string());
    } else {
      // Whatever the detokenizer and the stop strings still hold.
      const StopCheck c = live.stops.push(live.detokenizer.finish(), live.num_output_tokens > params.min_tokens);
      delta.text += c.text;
      if (c.stopped) {
        finish.reason = FinishReason::kStop;
        finish.stop_reason = std::string(live.stops.stop_string());
      } else {
        delta.text += live.stops.finish();
        finish.reason = reason_of(final_out.state);
        if (final_out.stop_token) finish.stop_reason = *final_out.stop_token;
      }
    }
    finish.num_prompt_tokens = final_out.num_prompt_tokens;
    finish.num_output_tokens = live.num_output_tokens;
    finish.num_cached_tokens = final_out.num_cached_tokens;
    if (connector) finish.kv_transfer_params = connector->on_request_finished(live.request, final_out);
    this->finish(live, std::move(delta), std::move(finish), now, /*notify=*/false);
    live_.erase(it);
  }
  wake_pushed();
}

void OutputProcessor::push_quiet(Live& live, RequestDelta delta) {
  live.stream->push(live.index, std::move(delta), /*notify=*/false);
  // A stream's requests are usually consecutive in a step's outputs.
  if (pushed_.empty() || pushed_.back() != live.stream) pushed_.push_back(live.stream);
}

void OutputProcessor::wake_pushed() {
  std::sort(pushed_.begin(), pushed_.end());
  pushed_.erase(std::unique(pushed_.begin(), pushed_.end()), pushed_.end());
  for (const auto& s : pushed_) s->notify();
  pushed_.clear();
}

void OutputProcessor::finish_aborted(const RequestId& id, const RequestOutput* aborted, std::optional<Status> error,
                                     Clock::time_point now) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  Live& live = it->second;
  RequestFinish finish;
  finish.reason = FinishReason::kAbort;
  finish.num_prompt_tokens = static_cast<int32_t>(live.request.prompt_tokens.size());
  finish.num_output_tokens = live.num_output_tokens;
  if (aborted) finish.num_cached_tokens = aborted->num_cached_tokens;
  finish.error = std::move(error);
  this->finish(live, RequestDelta{}, std::move(finish), now, /*notify=*/true);
  live_.erase(it);
}

void OutputProcessor::finish(Live& live, RequestDelta delta, RequestFinish finish, Clock::time_point now, bool notify) {
  metrics_.record_finish(finish.reason, seconds(now - live.arrival));
  if (released_) released_(live.request.id);
  delta.finish = std::move(finish);
  if (notify)
    live.stream->push(live.index, std::move(delta));
  else
    push_quiet(live, std::move(delta));
}

}  // namespace siesta
