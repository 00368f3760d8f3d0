// Safetensors reading and writing: round trips, sharded checkpoints, and every kind
// of broken file a user might hand us (each must be a one-line error, never a crash).
#include "model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "temp_dir.h"
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>

#include "model/config.h"
#include "model/make_model.h"
#include "test_data.h"

namespace siesta {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kSource = siesta::testing::test_data_root();

// Each test's scratch directory.
class TempDir : public siesta::testing::TempDir {
 public:
  TempDir() : siesta::testing::TempDir("siesta_safetensors_test") {}
};

template <class T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// A file with a hand-written header: what a broken writer or a hostile peer could produce.
void write_raw(const fs::path& p, const std::string& header, size_t data_bytes) {
  std::string s(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  s += header;
  s.append(data_bytes, '\x11');
  write_file(p, s);
}

std::string error_of(const Result<TensorStore>& r) {
  EXPECT_FALSE(r.has_value());
  return r ? std::string() : r.error().message;
}

// One tensor of every dtype, with recognisable contents.
struct Sample {
  std::vector<uint16_t> bf16 = {f32_to_bf16(1.0f), f32_to_bf16(-2.5f), f32_to_bf16(0.125f), f32_to_bf16(3.0f),
                                f32_to_bf16(-0.0f), f32_to_bf16(1e-3f)};
  std::vector<uint16_t> f16 = {f32_to_f16(1.0f), f32_to_f16(-2.5f), f32_to_f16(65504.0f)};
  std::vector<float> f32 = {1.5f, -7.25f, 1e-20f, 3.0e30f};
  std::vector<int32_t> i32 = {1, -2, std::numeric_limits<int32_t>::max()};
  std::vector<int64_t> i64 = {std::numeric_limits<int64_t>::min(), 42};
  std::vector<uint8_t> u8 = {0, 7, 255, 1, 2};

  std::vector<TensorData> tensors() const {
    return {{"a.bf16", DType::kBF16, {2, 3}, bytes_of(bf16)},
            {"b.f16", DType::kF16, {3}, bytes_of(f16)},
            {"c.f32", DType::kF32, {2, 1, 2}, bytes_of(f32)},
            {"d.i32", DType::kI32, {3}, bytes_of(i32)},
            {"e.i64", DType::kI64, {2}, bytes_of(i64)},
            {"f.u8", DType::kU8, {5}, bytes_of(u8)},
            {"g.scalar", DType::kF32, {}, bytes_of(f32).first(4)},
            {"h.empty", DType::kBF16, {0, 4}, {}}};
  }
};

TEST(Safetensors, RoundTripsEveryDType) {
  TempDir dir;
  Sample s;
  const auto file = dir.path() / "x.safetensors";
  ASSERT_TRUE(write_safetensors(file, s.tensors(), {{"format", "pt"}}));
  auto store = TensorStore::open_file(file);
  ASSERT_TRUE(store) << store.error().message;
  EXPECT_EQ(store->names().size(), s.tensors().size());
  for (const TensorData& t : s.tensors()) {
    auto v = store->get(t.name, t.shape, {t.dtype});
    ASSERT_TRUE(v) << v.error().message;
    EXPECT_EQ(v->dtype, t.dtype);
    EXPECT_EQ(v->shape, t.shape);
    ASSERT_EQ(v->nbytes, t.bytes.size()) << t.name;
    if (!t.bytes.empty()) {
      EXPECT_EQ(std::memcmp(v->data, t.bytes.data(), v->nbytes), 0) << t.name;
    }
  }
  auto bf = store->get_f32("a.bf16", {2, 3});
  ASSERT_TRUE(bf);
  EXPECT_EQ(*bf, (std::vector<float>{1.0f, -2.5f, 0.125f, 3.0f, -0.0f, bf16_to_f32(f32_to_bf16(1e-3f))}));
  auto h = store->get_f32("b.f16", {3});
  ASSERT_TRUE(h);
  EXPECT_EQ(*h, (std::vector<float>{1.0f, -2.5f, 65504.0f}));
  auto f = store->get_f32("c.f32", {2, 1, 2});
  ASSERT_TRUE(f);
  EXPECT_EQ(*f, s.f32);
  auto scalar = store->get_f32("g.scalar", {});
  ASSERT_TRUE(scalar);
  EXPECT_EQ(*scalar, std::vector<float>{1.5f});
  // Integer tensors are not weights: get_f32 refuses them rather than reinterpreting.
  auto ints = store->get_f32("d.i32", {3});
  ASSERT_FALSE(ints);
  EXPECT_THAT(ints.error().message, HasSubstr("I32"));
}

TEST(Safetensors, HeaderIsPaddedWithSpacesToEightBytes) {
  TempDir dir;
  std::vector<float> one = {1.0f};
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    const auto file = dir.path() / (name + ".safetensors");
    ASSERT_TRUE(write_safetensors(file, {{name, DType::kF32, {1}, bytes_of(one)}}));
    const std::string raw = read_file(file);
    uint64_t n = 0;
    std::memcpy(&n, raw.data(), 8);
    EXPECT_EQ(n % 8, 0u) << name;
    EXPECT_EQ(raw.size(), 8 + n + 4);
    const std::string header = raw.substr(8, n);
    EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1).back(), '}');
    ASSERT_TRUE(TensorStore::open_file(file));
  }
}

TEST(Safetensors, WriterRefusesWrongByteCounts) {
  TempDir dir;
  std::vector<float> three = {1, 2, 3};
  auto r = write_safetensors(dir.path() / "x.safetensors", {{"t", DType::kF32, {4}, bytes_of(three)}});
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message, HasSubstr("12 bytes given"));

  auto w = SafetensorsWriter::create(dir.path() / "y.safetensors", {{"t", DType::kF32, {2}}});
  ASSERT_TRUE(w);
  ASSERT_TRUE(w->append(bytes_of(three).first(4)));
  auto too_many = w->append(bytes_of(three));
  ASSERT_FALSE(too_many);
  auto short_finish = w->finish();
  ASSERT_FALSE(short_finish);
  // A failed write leaves nothing that could be mistaken for a checkpoint.
  EXPECT_FALSE(fs::exists(dir.path() / "y.safetensors"));
  EXPECT_FALSE(fs::exists(dir.path() / "y.safetensors.partial"));

  auto dup = SafetensorsWriter::create(dir.path() / "z.safetensors", {{"t", DType::kF32, {2}}, {"t", DType::kF32, {2}}});
  ASSERT_FALSE(dup);
  EXPECT_THAT(dup.error().message, HasSubstr("twice"));
}

TEST(Safetensors, ReadsShardedCheckpointThroughIndex) {
  TempDir dir;
  std::vector<float> a = {1, 2}, b = {3, 4, 5};
  ASSERT_TRUE(write_safetensors(dir.path() / "model-00001-of-00002.safetensors", {{"a", DType::kF32, {2}, bytes_of(a)}}));
  ASSERT_TRUE(write_safetensors(dir.path() / "model-00002-of-00002.safetensors", {{"b", DType::kF32, {3}, bytes_of(b)}}));
  write_file(dir.path() / "model.safetensors.index.json",
             R"({"metadata": {"total_size": 20}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                 "b": "model-00002-of-00002.safetensors"}})");
  auto store = TensorStore::open(dir.path());
  ASSERT_TRUE(store) << store.error().message;
  EXPECT_EQ(store->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(*store->get_f32("a", {2}), a);
  EXPECT_EQ(*store->get_f32("b", {3}), b);
  auto missing = store->get("c", {1});
  ASSERT_FALSE(missing);
  EXPECT_THAT(missing.error().message, HasSubstr("c: not found in " + dir.path().string()));
}

TEST(Safetensors, RejectsInconsistentIndex) {
  TempDir dir;
  std::vector<float> a = {1, 2};
  ASSERT_TRUE(write_safetensors(dir.path() / "s1.safetensors", {{"a", DType::kF32, {2}, bytes_of(a)}}));
  ASSERT_TRUE(write_safetensors(dir.path() / "s2.safetensors", {{"a", DType::kF32, {2}, bytes_of(a)}}));
  const auto index = dir.path() / "model.safetensors.index.json";

  write_file(index, R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  EXPECT_THAT(error_of(TensorStore::open(dir.path())), HasSubstr("names s1.safetensors for b"));

  write_file(index, R"({"weight_map": {"a": "s1.safetensors", "x": "s2.safetensors"}})");
  EXPECT_THAT(error_of(TensorStore::open(dir.path())), HasSubstr("appears in both"));

  write_file(index, R"({"weight_map": {"a": "gone.safetensors"}})");
  EXPECT_THAT(error_of(TensorStore::open(dir.path())), HasSubstr("gone.safetensors"));

  write_file(index, R"({"weight_map": {"a": "../s1.safetensors"}})");
  EXPECT_THAT(error_of(TensorStore::open(dir.path())), HasSubstr("not a plain file name"));

  write_file(index, R"({"weight_map": [1, 2]})");
  EXPECT_THAT(error_of(TensorStore::open(dir.path())), HasSubstr("weight_map"));

  write_file(index, R"({"weight_map": )");
  EXPECT_THAT(error_of(TensorStore::open(dir.path())), HasSubstr("not valid JSON"));
}

TEST(Safetensors, MissingCheckpointNamesBothFiles) {
  TempDir dir;
  auto msg = error_of(TensorStore::open(dir.path()));
  EXPECT_THAT(msg, HasSubstr("model.safetensors"));
  EXPECT_THAT(msg, HasSubstr("model.safetensors.index.json"));
  EXPECT_THAT(error_of(TensorStore::open_file(dir.path() / "nope.safetensors")), HasSubstr("no such file"));
}

TEST(Safetensors, TruncatedFileIsAnErrorAtEveryCut) {
  TempDir dir;
  Sample s;
  const auto good = dir.path() / "good.safetensors";
  ASSERT_TRUE(write_safetensors(good, s.tensors()));
  const std::string raw = read_file(good);
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  const auto cut = dir.path() / "cut.safetensors";
  // Every cut point: inside the length, inside the header, inside the data.
  for (size_t size = 0; size < raw.size(); ++size) {
    write_file(cut, raw.substr(0, size));
    const std::string msg = error_of(TensorStore::open_file(cut));
    EXPECT_THAT(msg, HasSubstr(cut.string())) << "cut at " << size;
    const char* expected = size < 8                ? "too short"
                           : size < 8 + header_len ? "header length"
                                                   : "extend past the data section";
    EXPECT_THAT(msg, HasSubstr(expected)) << "cut at " << size;
  }
}

TEST(Safetensors, HeaderLengthLargerThanFile) {
  TempDir dir;
  const auto file = dir.path() / "x.safetensors";
  for (uint64_t n : {uint64_t{1000}, uint64_t{1} << 40, std::numeric_limits<uint64_t>::max()}) {
    std::string raw(8, '\0');
    for (int i = 0; i < 8; ++i) raw[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    raw += "{}      ";
    write_file(file, raw);
    EXPECT_THAT(error_of(TensorStore::open_file(file)), HasSubstr("exceeds")) << n;
  }
}

TEST(Safetensors, MalformedHeaders) {
  TempDir dir;
  const auto file = dir.path() / "x.safetensors";
  struct Case {
    std::string header;
    size_t data;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"{not json", 0, "not valid JSON"},
      {"[1, 2]", 0, "not a JSON object"},
      {R"({"t": 3})", 0, "entry is not an object"},
      {R"({"t": {"shape": [1], "data_offsets": [0, 4]}})", 4, "dtype"},
      {R"({"t": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}})", 1, "F8_E4M3"},
      {R"({"t": {"dtype": "F32", "data_offsets": [0, 4]}})", 4, "shape"},
      {R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4, "non-negative"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4, "data_offsets"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8, "begin after end"},
      {R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4, "extend past the data section"},
      {R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [100, 104]}})", 8, "extend past the data section"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, "F32 [3] needs 12"},
      {R"({"t": {"dtype": "BF16", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8, "overflows"},
      {R"({"__metadata__": "pt"})", 0, "__metadata__"},
  };
  for (const Case& c : cases) {
    write_raw(file, c.header, c.data);
    const std::string msg = error_of(TensorStore::open_file(file));
    EXPECT_THAT(msg, HasSubstr(c.expect)) << c.header;
    EXPECT_THAT(msg, HasSubstr(file.string())) << c.header;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // Overlapping tensors are legal: two names may share bytes.
  write_raw(file, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8);
  EXPECT_TRUE(TensorStore::open_file(file));
}

// Random byte damage anywhere in a small file: open() may succeed or fail, but never crash.
TEST(Safetensors, RandomCorruptionNeverCrashes) {
  TempDir dir;
  Sample s;
  const auto good = dir.path() / "good.safetensors";
  ASSERT_TRUE(write_safetensors(good, s.tensors()));
  const std::string raw = read_file(good);
  const auto bad = dir.path() / "bad.safetensors";
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string damaged = raw;
    for (int k = 0; k < 1 + iter % 4; ++k) damaged[rng() % damaged.size()] = static_cast<char>(rng());
    write_file(bad, damaged);
    auto store = TensorStore::open_file(bad);
    if (!store) {
      EXPECT_EQ(store.error().message.find('\n'), std::string::npos);
      continue;
    }
    // Whatever the header now says, every byte it points at is inside the file.
    for (const std::string& name : store->names()) {
      const TensorView* v = store->find(name);
      ASSERT_NE(v, nullptr);
      unsigned sum = 0;
      for (size_t i = 0; i < v->nbytes; ++i) sum += static_cast<unsigned>(v->data[i]);
      (void)sum;
      if (v->dtype == DType::kBF16 || v->dtype == DType::kF16 || v->dtype == DType::kF32) {
        std::vector<float> out(static_cast<size_t>(v->numel()));
        EXPECT_TRUE(convert_to_f32(*v, out));
      }
    }
  }
}

TEST(Safetensors, GetChecksPresenceShapeAndDType) {
  TempDir dir;
  std::vector<uint16_t> norm(128, f32_to_bf16(1.0f));
  const auto file = dir.path() / "model.safetensors";
  ASSERT_TRUE(write_safetensors(file, {{"model.norm.weight", DType::kBF16, {128}, bytes_of(norm)}}));
  auto store = TensorStore::open(dir.path());
  ASSERT_TRUE(store);
  EXPECT_TRUE(store->contains("model.norm.weight"));

  auto shape = store->get("model.norm.weight", {256});
  ASSERT_FALSE(shape);
  EXPECT_EQ(shape.error().message, "model.norm.weight: shape [128] in " + file.string() + ", expected [256]");

  auto dtype = store->get("model.norm.weight", {128}, {DType::kF32});
  ASSERT_FALSE(dtype);
  EXPECT_EQ(dtype.error().message, "model.norm.weight: dtype BF16 in " + file.string() + ", expected F32");

  auto missing = store->get("lm_head.weight", {128, 4});
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
  EXPECT_THAT(missing.error().message, HasSubstr("lm_head.weight"));

  std::vector<float> wrong_size(3);
  auto conv = convert_to_f32(*store->get("model.norm.weight", {128}), wrong_size);
  ASSERT_FALSE(conv);
}

TEST(Safetensors, EmbeddedTinyModelHasEveryQwen3Tensor) {
  const fs::path dir = kSource / "models" / "tiny-qwen3";
  auto cfg = ModelConfig::load(dir);
  ASSERT_TRUE(cfg) << cfg.error().message;
  auto store = TensorStore::open(dir);
  ASSERT_TRUE(store) << store.error().message;
  const auto specs = qwen3_tensor_specs(*cfg);
  EXPECT_EQ(store->names().size(), specs.size());
  for (const TensorSpec& spec : specs) {
    auto t = store->get(spec.name, spec.shape, {DType::kBF16});
    EXPECT_TRUE(t) << t.error().message;
  }
  auto norm = store->get_f32("model.norm.weight", {cfg->hidden_size});
  ASSERT_TRUE(norm);
  for (float x : *norm) EXPECT_TRUE(std::isfinite(x));
}

TEST(Conversions, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);  // just above half rounds up
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf, as torch does
  // A NaN whose payload is only in the low bits must not turn into infinity.
  const float low_nan = std::bit_cast<float>(0x7f800001u);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(low_nan))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(-std::numeric_limits<float>::quiet_NaN()))));
  // Every bf16 value survives bf16 -> f32 -> bf16.
  for (uint32_t v = 0; v < 65536; ++v) {
    const float f = bf16_to_f32(static_cast<uint16_t>(v));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
    } else {
      ASSERT_EQ(f32_to_bf16(f), v);
    }
  }
}

TEST(Conversions, F16) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // halfway to 65536 rounds to even: infinity
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);  // half of it ties to even zero
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0xfc00)));
  for (uint32_t v = 0; v < 65536; ++v) {
    const float f = f16_to_f32(static_cast<uint16_t>(v));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
    } else {
      ASSERT_EQ(f32_to_f16(f), v);
    }
  }
}

TEST(DTypes, NamesAndSizes) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64, DType::kU8}) {
    auto parsed = parse_dtype(dtype_name(d));
    ASSERT_TRUE(parsed);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_FALSE(parse_dtype("bf16"));
}

}  // namespace
}  // namespace siesta
