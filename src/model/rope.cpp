#include "model/rope.h"

#include <cmath>

#include "model/safetensors.h"

namespace siesta {

std::vector<float> rope_inv_freq(const ModelConfig& cfg) {
  const int half = cfg.head_dim / 2;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(cfg.head_dim);
    float f = static_cast<float>(1.0 / std::pow(cfg.rope_theta, static_cast<double>(exponent)));
    if (cfg.dtype == "bfloat16") f = bf16_to_f32(f32_to_bf16(f));
    if (cfg.dtype == "float16") f = f16_to_f32(f32_to_f16(f));
    inv_freq[i] = f;
  }
  return inv_freq;
}

}  // namespace siesta
