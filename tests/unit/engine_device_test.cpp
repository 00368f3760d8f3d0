// The engine's device options on any machine: --device parsing, the
// --gpu-memory-utilization arithmetic (vLLM's meaning), and --device cuda on a
// machine without a GPU failing with the reason instead of crashing.
#include <gtest/gtest.h>

#include <filesystem>

#include "engine/engine.h"
#include "engine/engine_model.h"
#include "memory/cuda_backend.h"
#include "test_data.h"

namespace siesta {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
const std::filesystem::path kTiny = siesta::testing::tiny_model_dir();

TEST(EngineDevice, ParsesCpuAndCudaOnly) {
  EXPECT_EQ(parse_device("cpu").value(), Device::kCpu);
  EXPECT_EQ(parse_device("cuda").value(), Device::kCuda);
  auto bad = parse_device("gpu");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("cpu or cuda"), std::string::npos);
  EXPECT_STREQ(device_name(Device::kCuda), "cuda");
}

TEST(EngineDevice, UtilizationMustBeAFractionAboveZero) {
  EXPECT_TRUE(validate_gpu_memory_utilization(0.9));
  EXPECT_TRUE(validate_gpu_memory_utilization(1.0));
  for (double bad : {0.0, -0.1, 1.01, 90.0}) {
    auto r = validate_gpu_memory_utilization(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.error().message.find("--gpu-memory-utilization"), std::string::npos);
  }
}

TEST(EngineDevice, KvCacheGetsWhatUtilizationLeavesAfterWeightsAndActivations) {
  // 140 GiB device, 139 free once the context exists; weights and scratch take 17 GiB.
  const memory::DeviceMemoryInfo start{139 * kGiB, 140 * kGiB};
  const memory::DeviceMemoryInfo now{122 * kGiB, 140 * kGiB};
  const uint64_t kv = kv_cache_bytes_for_utilization(0.9, start, now).value();
  EXPECT_EQ(kv, static_cast<uint64_t>(0.9 * 140 * kGiB) - 17 * kGiB);
  // Other processes' memory is not this engine's: same answer with less free at start, as long as it fits.
  const memory::DeviceMemoryInfo busy_start{127 * kGiB, 140 * kGiB}, busy_now{110 * kGiB, 140 * kGiB};
  EXPECT_EQ(kv_cache_bytes_for_utilization(0.9, busy_start, busy_now).value(), kv);
}

TEST(EngineDevice, UtilizationErrorsNameTheNumbersAndTheFlags) {
  const memory::DeviceMemoryInfo start{50 * kGiB, 140 * kGiB};
  auto busy = kv_cache_bytes_for_utilization(0.9, start, start);
  ASSERT_FALSE(busy);
  EXPECT_EQ(busy.error().code, ErrorCode::kOutOfMemory);
  EXPECT_NE(busy.error().message.find("only 50.00 GiB was free"), std::string::npos) << busy.error().message;
  EXPECT_NE(busy.error().message.find("--kv-cache-memory-bytes"), std::string::npos);

  const memory::DeviceMemoryInfo fresh{139 * kGiB, 140 * kGiB}, full{100 * kGiB, 140 * kGiB};
  auto nothing_left = kv_cache_bytes_for_utilization(0.2, fresh, full);
  ASSERT_FALSE(nothing_left);
  EXPECT_NE(nothing_left.error().message.find("leaves nothing for the KV cache"), std::string::npos);
}

TEST(EngineDevice, ExplicitKvBytesTakePrecedenceOverUtilization) {
  EngineOptions o;
  o.device = Device::kCuda;
  o.gpu_memory_utilization = 0.5;
  o.kv_cache_memory_bytes = 3 * kGiB;
  EngineModel m;
  m.device_at_start = memory::DeviceMemoryInfo{139 * kGiB, 140 * kGiB};
  m.device_after_load = memory::DeviceMemoryInfo{100 * kGiB, 140 * kGiB};
  EXPECT_EQ(kv_cache_budget(o, m).value(), 3 * kGiB);
  o.kv_cache_memory_bytes.reset();
  EXPECT_EQ(kv_cache_budget(o, m).value(), static_cast<uint64_t>(0.5 * 140 * kGiB) - 39 * kGiB);
  o.device = Device::kCpu;
  EXPECT_EQ(kv_cache_budget(o, m).value(), kDefaultCpuKvCacheBytes);
}

TEST(EngineDevice, DeviceSpecNamesTheCudaOrdinal) {
  EXPECT_EQ(parse_device_spec("cpu").value().device, Device::kCpu);
  auto cuda = parse_device_spec("cuda").value();
  EXPECT_EQ(cuda.device, Device::kCuda);
  EXPECT_EQ(cuda.cuda_device, 0);
  auto one = parse_device_spec("cuda:1").value();
  EXPECT_EQ(one.device, Device::kCuda);
  EXPECT_EQ(one.cuda_device, 1);
  EXPECT_EQ(parse_device_spec("cuda:12").value().cuda_device, 12);
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "gpu", "cuda1", "CPU", ""}) {
    auto r = parse_device_spec(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.error().message.find("--device"), std::string::npos) << r.error().message;
  }
}

TEST(EngineDevice, CudaWithoutAGpuIsAnErrorThatSaysWhy) {
  if (memory::make_cuda_backend({.device = 0})) GTEST_SKIP() << "a GPU is present here (cuda_engine_test covers it)";
  EngineOptions o;
  o.model_dir = kTiny;
  o.device = Device::kCuda;
  o.num_kv_blocks = 16;
  auto e = Engine::create(o);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().code, ErrorCode::kUnavailable);
  EXPECT_NE(e.error().message.find("--device cuda"), std::string::npos) << e.error().message;
  EXPECT_EQ(e.error().message.find('\n'), std::string::npos) << "one line: " << e.error().message;
}

}  // namespace
}  // namespace siesta
