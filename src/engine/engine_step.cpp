#include "engine/engine_step.h"

#include <memory>

namespace siesta {
namespace {

TokenHistory history_of(const ScheduledSequence& seq) { return TokenHistory{seq.prompt_tokens, seq.output_tokens}; }

// A scored prompt chunk: the log-probability of each prompt token that one of
// its rows predicts (the row of position p predicts token p + 1).
std::vector<TokenLogprobs> score_prompt(const ScheduledSequence& seq, const ForwardOutput& logits, size_t i) {
  std::vector<TokenLogprobs> out;
  const size_t rows = logits.num_rows[i];
  const size_t prompt_len = seq.prompt_tokens.size();
  for (size_t r = 0; r < rows; ++r) {
    const size_t target = static_cast<size_t>(seq.start_pos) + r + 1;
    if (target >= prompt_len) break;
    out.push_back(compute_logprobs(logits.row(i, r), seq.prompt_tokens[target], *seq.params->prompt_logprobs));
  }
  return out;
}

struct HostStep {
  std::vector<SampledToken> sampled;
  std::vector<std::vector<TokenLogprobs>> prompt_logprobs;  // empty, or one per sequence
};

// The host path: every sequence's row of logits comes back and the engine
// sampler picks from it.
Result<HostStep> forward_and_sample(const SchedulerOutput& out, Model& model, const KvCacheView& kv,
                                    Sampler& sampler, ForwardOutput& logits) {
  SIESTA_TRY(model.forward(out.chunks, kv, logits));
  HostStep step;
  std::vector<SampledToken>& sampled = step.sampled;
  sampled.reserve(out.num_samples());
  for (size_t i = 0; i < out.sequences.size(); ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (seq.prompt_logprobs) {
      step.prompt_logprobs.resize(out.sequences.size());
      step.prompt_logprobs[i] = score_prompt(seq, logits, i);
    }
    if (!seq.sample) continue;
    const std::span<const float> row = logits.last(i);
    sampled.push_back(sampler.sample(row, *seq.params, seq.sample_step, history_of(seq)));
    if (seq.keep_logits) sampled.back().logits = std::make_shared<const std::vector<float>>(row.begin(), row.end());
  }
  return step;
}

// The device path (Model::forward_choose): only tokens come back. nullopt
// when a sequence of the step needs its logits here (log-probabilities of
// its output or its prompt, a producer's kept row, adjusted logits, more
// banned ids than the device takes); no draw has been taken then.
Result<std::optional<std::vector<SampledToken>>> forward_and_choose(const SchedulerOutput& out, Model& model,
                                                                    const KvCacheView& kv, Sampler& sampler,
                                                                    ForwardOutput& logits) {
  using Chosen = std::optional<std::vector<SampledToken>>;
  const size_t n = out.sequences.size();
  std::vector<std::vector<int32_t>> banned(n);
  std::vector<TokenChoice> choices(n);  // greedy for sequences that do not sample this step
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (seq.prompt_logprobs) return Chosen();
    if (!seq.sample) continue;
    if (seq.keep_logits) return Chosen();
    auto c = sampler.device_choice(*seq.params, seq.sample_step, 0.0, banned[i], history_of(seq));
    if (!c) return Chosen();
    choices[i] = *c;
  }
  // Every sequence can be chosen on the device: take the draws, in the order
  // the host sampler takes them.
  std::vector<double> draws(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (!seq.sample) continue;
    draws[i] = sampler.draw(*seq.params, seq.sample_step);
    choices[i].uniform = draws[i];
  }
  std::vector<int32_t> tokens;
  SIESTA_TRY(model.forward_choose(out.chunks, kv, choices, tokens, logits));
  if (tokens.size() != n)
    return internal_error("the model chose " + std::to_string(tokens.size()) + " tokens for " + std::to_string(n) +
                          " sequences");
  std::vector<SampledToken> sampled;
  sampled.reserve(out.num_samples());
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (!seq.sample) continue;
    if (tokens[i] == kChooseOnHost) {
      sampled.push_back(sampler.sample_drawn(logits.last(i), *seq.params, seq.sample_step, draws[i], history_of(seq)));
    } else {
      SampledToken t;
      t.token = tokens[i];
      sampled.push_back(t);
    }
  }
  return Chosen(std::move(sampled));
}

StepShape shape_of(const SchedulerOutput& out) {
  StepShape s;
  s.sequences = static_cast<int32_t>(out.sequences.size());
  for (const ScheduledSequence& seq : out.sequences) {
    const bool decode = seq.num_tokens == 1 && seq.start_pos >= static_cast<int32_t>(seq.prompt_tokens.size());
    s.decodes += decode;
    s.samples += seq.sample;
    s.batched_tokens += seq.num_tokens;
    if (!decode) s.prefill_tokens += seq.num_tokens;
    s.context_tokens += static_cast<int64_t>(seq.start_pos) + seq.num_tokens;
  }
  return s;
}

}  // namespace

Result<std::vector<RequestOutput>> run_step(Scheduler& scheduler, Model& model, const KvCacheView& kv,
                                            Sampler& sampler, ForwardOutput& logits, bool choose_on_device,
                                            StepShape* shape) {
  SchedulerOutput out = scheduler.schedule();
  if (shape) *shape = shape_of(out);
  if (out.empty()) return std::vector<RequestOutput>{};
  std::optional<std::vector<SampledToken>> sampled;
  if (choose_on_device && model.chooses_tokens()) {
    SIESTA_ASSIGN_OR_RETURN(sampled, forward_and_choose(out, model, kv, sampler, logits));
  }
  if (sampled) return scheduler.update(out, *sampled);
  SIESTA_ASSIGN_OR_RETURN(HostStep host, forward_and_sample(out, model, kv, sampler, logits));
  return scheduler.update(out, host.sampled, host.prompt_logprobs);
}

}  // namespace siesta
