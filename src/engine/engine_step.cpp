#include "engine/engine_step.h"

#include <memory>

namespace siesta {

Result<std::vector<RequestOutput>> run_step(Scheduler& scheduler, Model& model, const KvCacheView& kv,
                                            Sampler& sampler, ForwardOutput& logits) {
  SchedulerOutput out = scheduler.schedule();
  if (out.empty()) return std::vector<RequestOutput>{};
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
  return scheduler.update(out, sampled);
}

}  // namespace siesta
