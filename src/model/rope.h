// Rotary position embedding frequencies, shared by every Model implementation.
#pragma once

#include <vector>

#include "model/config.h"

namespace siesta {

// inv_freq[i] = 1 / rope_theta^(2i / head_dim), i < head_dim / 2, in fp32 and
// then rounded to the checkpoint's dtype. The rounding reproduces Hugging
// Face transformers, whose non-persistent inv_freq buffer is cast along with
// the weights when a model is loaded in (or cast to) bf16/f16; its logits drift
// from an fp32-frequency computation by ~1e-3 within a few dozen positions.
std::vector<float> rope_inv_freq(const ModelConfig& cfg);

}  // namespace siesta
