#include "engine/random.h"

#include <random>

namespace siesta {

RandomGenerator RandomGenerator::from_entropy() {
  std::random_device rd;
  const uint64_t hi = rd();
  const uint64_t lo = rd();
  return RandomGenerator((hi << 32) ^ lo);
}

}  // namespace siesta
