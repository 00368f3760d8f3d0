#include "engine/engine_step.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

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

// The host path, for a model that does not choose tokens (or a caller that
// asks for the host): every sequence's row of logits comes back and the
// engine sampler picks from it.
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

// The device path (Model::forward_choose), one call for the whole step. A
// sequence is chosen on the device unless it needs its logits here (its
// output's or its prompt's log-probabilities, a producer's kept row,
// adjusted logits, a forced token, more banned ids than the device takes):
// those are marked on_host, their rows come back and the host sampler picks
// them with the same draw, exactly as forward_and_sample would. Which path a
// sequence takes depends on its own request only, never on its batch-mates.
Result<HostStep> forward_and_choose(const SchedulerOutput& out, Model& model, const KvCacheView& kv, Sampler& sampler,
                                    ForwardOutput& logits) {
  const size_t n = out.sequences.size();
  std::vector<std::vector<int32_t>> banned(n);
  std::vector<TokenChoice> choices(n);  // greedy for sequences that neither sample nor score
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (seq.prompt_logprobs) {
      choices[i].on_host = true;  // every row of its chunk comes back
      continue;
    }
    if (!seq.sample) continue;
    std::optional<TokenChoice> c;
    if (!seq.keep_logits) c = sampler.device_choice(*seq.params, seq.sample_step, 0.0, banned[i], history_of(seq));
    if (c) {
      choices[i] = *c;
    } else {
      choices[i].on_host = true;
    }
  }
  // The draws, in the order the host sampler takes them (sequence order),
  // whichever side picks the token.
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
  // The rows of the sequences chosen here must have come back.
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] != kChooseOnHost) {
      if (choices[i].on_host)
        return internal_error("the model chose a token for sequence " + std::to_string(i) + ", which the host chooses");
      continue;
    }
    const size_t want = choices[i].on_host && out.chunks[i].all_logits ? out.chunks[i].tokens.size() : 1;
    if (logits.num_rows.size() != n || logits.first_row.size() != n || logits.num_rows[i] != want ||
        (logits.first_row[i] + want) * static_cast<size_t>(logits.vocab_size) > logits.logits.size())
      return internal_error("the model returned no logits (or too few rows) for sequence " + std::to_string(i) +
                            ", which the host chooses");
  }

  HostStep step;
  step.sampled.reserve(out.num_samples());
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (seq.prompt_logprobs) {
      step.prompt_logprobs.resize(n);
      step.prompt_logprobs[i] = score_prompt(seq, logits, i);
    }
    if (!seq.sample) continue;
    if (tokens[i] != kChooseOnHost) {
      SampledToken t;
      t.token = tokens[i];
      step.sampled.push_back(t);
      continue;
    }
    const std::span<const float> row = logits.last(i);
    step.sampled.push_back(sampler.sample_drawn(row, *seq.params, seq.sample_step, draws[i], history_of(seq)));
    if (seq.keep_logits)
      step.sampled.back().logits = std::make_shared<const std::vector<float>>(row.begin(), row.end());
  }
  return step;
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
  HostStep step;
  if (choose_on_device && model.chooses_tokens()) {
    SIESTA_ASSIGN_OR_RETURN(step, forward_and_choose(out, model, kv, sampler, logits));
  } else {
    SIESTA_ASSIGN_OR_RETURN(step, forward_and_sample(out, model, kv, sampler, logits));
  }
  return scheduler.update(out, step.sampled, step.prompt_logprobs);
}

}  // namespace siesta
