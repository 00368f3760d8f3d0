#include "engine/engine_step.h"

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
    if (seq.sample) sampled.push_back(sampler.sample(logits.last(i), *seq.params, seq.sample_step));
  }
  return scheduler.update(out, sampled);
}

}  // namespace siesta
