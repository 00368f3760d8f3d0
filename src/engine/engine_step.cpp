#include "engine/engine_step.h"

#include <memory>

namespace siesta {
namespace {

// The host path: every sequence's row of logits comes back and the engine
// sampler picks from it.
Result<std::vector<SampledToken>> forward_and_sample(const SchedulerOutput& out, Model& model, const KvCacheView& kv,
                                                     Sampler& sampler, ForwardOutput& logits) {
  SIESTA_TRY(model.forward(out.chunks, kv, logits));
  std::vector<SampledToken> sampled;
  sampled.reserve(out.num_samples());
  for (size_t i = 0; i < out.sequences.size(); ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (!seq.sample) continue;
    const std::span<const float> row = logits.last(i);
    sampled.push_back(sampler.sample(row, *seq.params, seq.sample_step));
    if (seq.keep_logits) sampled.back().logits = std::make_shared<const std::vector<float>>(row.begin(), row.end());
  }
  return sampled;
}

// The device path (Model::forward_choose): only tokens come back. nullopt
// when a sequence of the step needs its logits here (log-probabilities, a
// producer's kept row, more banned ids than the device takes); no draw has
// been taken then.
Result<std::optional<std::vector<SampledToken>>> forward_and_choose(const SchedulerOutput& out, Model& model,
                                                                    const KvCacheView& kv, Sampler& sampler,
                                                                    ForwardOutput& logits) {
  using Chosen = std::optional<std::vector<SampledToken>>;
  const size_t n = out.sequences.size();
  std::vector<std::vector<int32_t>> banned(n);
  std::vector<TokenChoice> choices(n);  // greedy for sequences that do not sample this step
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    if (!seq.sample) continue;
    if (seq.keep_logits) return Chosen();
    auto c = sampler.device_choice(*seq.params, seq.sample_step, 0.0, banned[i]);
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
      sampled.push_back(sampler.sample_drawn(logits.last(i), *seq.params, seq.sample_step, draws[i]));
    } else {
      SampledToken t;
      t.token = tokens[i];
      sampled.push_back(t);
    }
  }
  return Chosen(std::move(sampled));
}

}  // namespace

Result<std::vector<RequestOutput>> run_step(Scheduler& scheduler, Model& model, const KvCacheView& kv,
                                            Sampler& sampler, ForwardOutput& logits, bool choose_on_device) {
  SchedulerOutput out = scheduler.schedule();
  if (out.empty()) return std::vector<RequestOutput>{};
  std::optional<std::vector<SampledToken>> sampled;
  if (choose_on_device && model.chooses_tokens()) {
    SIESTA_ASSIGN_OR_RETURN(sampled, forward_and_choose(out, model, kv, sampler, logits));
  }
  if (!sampled) {
    SIESTA_ASSIGN_OR_RETURN(sampled, forward_and_sample(out, model, kv, sampler, logits));
  }
  return scheduler.update(out, *sampled);
}

}  // namespace siesta
