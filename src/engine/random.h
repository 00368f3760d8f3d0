// Random numbers for sampling.
//
// A seeded request owns its random stream: the draw for its n-th generated
// token is request_draw(seed, n), a pure function of the two. Batch
// composition, preemption and recompute therefore never change what a seeded
// request samples. Requests without a seed draw from the engine's
// RandomGenerator, one value per sampled token, in step order.
//
//   RandomGenerator rng(1234);                 // or RandomGenerator::from_entropy()
//   double u = to_unit_interval(rng.next());   // [0, 1)
//   double v = to_unit_interval(request_draw(seed, step));
//
// RandomGenerator is a value; one instance is used from one thread.
#pragma once

#include <cstdint>

namespace siesta {

// The splitmix64 finaliser: a bijection on 64-bit words with full avalanche.
inline constexpr uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;

// Counter-based draw keyed by (seed, step).
inline constexpr uint64_t request_draw(uint64_t seed, uint64_t step) {
  return mix64(mix64(seed + kGoldenGamma) ^ mix64(step * kGoldenGamma + 0xD1B54A32D192ED03ULL));
}

// A double in [0, 1) from the top 53 bits.
inline constexpr double to_unit_interval(uint64_t bits) {
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// The engine-level generator (splitmix64).
class RandomGenerator {
 public:
  explicit RandomGenerator(uint64_t seed) : state_(seed) {}
  // Seeded from std::random_device.
  static RandomGenerator from_entropy();

  uint64_t next() {
    state_ += kGoldenGamma;
    return mix64(state_);
  }

 private:
  uint64_t state_;
};

}  // namespace siesta
