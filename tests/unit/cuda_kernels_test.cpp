// The CUDA model's kernels, one at a time, against host references on fresh
// random inputs (never zeros), with outputs poisoned before each launch.
// Skips without a GPU.
#include <gtest/gtest.h>

#if defined(SIESTA_HAVE_CUDA)

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/random.h"
#include "engine/sampler.h"
#include "model/cuda/kernels.h"
#include "model/cuda/qwen3_cuda.h"
#include "model/safetensors.h"

namespace siesta::cuda {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

float rb(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// The largest argmax key of a row (device_util.cuh: argmax_key), on the host.
uint64_t first_max_key(const float* row, int n) {
  uint64_t best = 0;
  for (int i = 0; i < n; ++i) {
    float v = row[i];
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();
    else if (v == std::numeric_limits<float>::infinity()) v = std::numeric_limits<float>::max();
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t ok = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    best = std::max(best, (static_cast<uint64_t>(ok) << 32) | (0xffffffffu - static_cast<uint32_t>(i)));
  }
  return best;
}

// A device array with host mirror helpers; poisoned (0xFF bytes = NaN) on creation.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
    if (p_) cudaMemset(p_, 0xFF, std::max<size_t>(n, 1) * sizeof(T));
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  T* get() const { return p_; }
  void upload(const std::vector<T>& v) { cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

using Bf16Array = DeviceArray<uint16_t>;
bf16* B(const Bf16Array& a) { return reinterpret_cast<bf16*>(a.get()); }

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float scale = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}
std::vector<float> to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(v[i]);
  return f;
}

// max |a - b| / max |b|; NaN anywhere gives infinity.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double md = 0, mr = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    md = std::max(md, std::abs(static_cast<double>(a[i]) - b[i]));
    mr = std::max(mr, std::abs(static_cast<double>(b[i])));
  }
  return md / std::max(mr, 1e-30);
}

// What every attention launch of these tests sets: the cache and its shape,
// and the per-sequence metadata (device arrays).
AttentionArgs attention_args(KvCacheDesc kv, int layer, int heads, const int32_t* q_start, const int32_t* q_len,
                             const int32_t* kv_len, const int32_t* table_start, const int32_t* block_tables) {
  AttentionArgs a;
  a.kv = kv;
  a.layer = layer;
  a.num_heads = heads;
  a.num_kv_heads = kv.num_kv_heads;
  a.head_dim = kv.head_dim;
  a.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
  a.seq_q_start = q_start;
  a.seq_q_len = q_len;
  a.seq_kv_len = kv_len;
  a.seq_table_start = table_start;
  a.block_tables = block_tables;
  return a;
}

// Whether the staged 256-token partitions fit this device (kernels.h); on one
// with Hopper's 227 KB of shared memory per block they must.
bool staged_fits(int heads, int kvh, int hd) {
  int device = 0, optin = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), cudaSuccess);
  const bool fits = decode_staged_partitions_supported(heads, kvh, hd);
  if (optin >= 227 * 1024) {
    EXPECT_TRUE(fits) << heads << "/" << kvh << " heads, head_dim " << hd;
  }
  return fits;
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  }
  std::mt19937 rng{1234};
};

// Small batches (one CTA per row) at the hidden sizes of Qwen3-0.6B, -4B, -8B
// and -14B.
TEST_F(CudaKernels, EmbedAndAddRmsNormRoundLikeHuggingFace) {
  for (int H : {1024, 2560, 4096, 5120}) {
    SCOPED_TRACE("hidden " + std::to_string(H));
    const int T = 7, V = 50;
    auto table = random_bf16(static_cast<size_t>(V) * H, rng);
    auto delta = random_bf16(static_cast<size_t>(T) * H, rng, 0.5f);
    auto w = random_bf16(H, rng, 0.1f, 1.0f);
    std::vector<int32_t> tokens = {3, 0, 49, 7, 7, 12, 30};
    DeviceArray<int32_t> d_tok(T);
    Bf16Array d_table(table.size()), d_x(static_cast<size_t>(T) * H), d_delta(delta.size()), d_w(H), d_out(T * H);
    d_tok.upload(tokens);
    d_table.upload(table);
    d_delta.upload(delta);
    d_w.upload(w);
    CUDA_OK(launch_embed(d_tok.get(), T, B(d_table), H, B(d_x), nullptr));
    CUDA_OK(launch_add_rms_norm(B(d_x), B(d_delta), B(d_w), T, H, 1e-6f, nullptr, B(d_out), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto x = to_f32(d_x.download()), out = to_f32(d_out.download());
    const auto tf = to_f32(table), df = to_f32(delta), wf = to_f32(w);
    std::vector<float> want_x(T * H), want_out(T * H);
    for (int t = 0; t < T; ++t) {
      double ss = 0;
      for (int i = 0; i < H; ++i) {
        want_x[t * H + i] = rb(tf[tokens[t] * H + i] + df[t * H + i]);
        ss += static_cast<double>(want_x[t * H + i]) * want_x[t * H + i];
      }
      const float rs = static_cast<float>(1.0 / std::sqrt(ss / H + 1e-6));
      for (int i = 0; i < H; ++i) want_out[t * H + i] = rb(wf[i] * rb(want_x[t * H + i] * rs));
    }
    EXPECT_EQ(x, want_x);  // one rounding of an exact sum: bit-identical
    EXPECT_LT(rel_err(out, want_out), 1e-2);

    // The gathered form: rows 5 and 1, x untouched.
    std::vector<int32_t> rows = {5, 1};
    DeviceArray<int32_t> d_rows(2);
    d_rows.upload(rows);
    Bf16Array d_g(2 * H);
    CUDA_OK(launch_add_rms_norm(B(d_x), nullptr, B(d_w), 2, H, 1e-6f, d_rows.get(), B(d_g), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto g = to_f32(d_g.download());
    EXPECT_EQ(std::vector<float>(g.begin(), g.begin() + H), std::vector<float>(out.begin() + 5 * H, out.begin() + 6 * H));
    EXPECT_EQ(to_f32(d_x.download()), want_x);
  }
}

// Batches of 1024 rows or more take one warp per row (fewer, one CTA per
// row): a ragged row count at widths of 4, 10 and 16 chunks per lane, the
// residual written back, and the gathered form over as many rows.
TEST_F(CudaKernels, AddRmsNormOneWarpPerRowForLargeBatches) {
  for (int H : {1024, 2560, 4096}) {
    SCOPED_TRACE("hidden " + std::to_string(H));
    const int T = 1031;
    auto x0 = random_bf16(static_cast<size_t>(T) * H, rng);
    auto delta = random_bf16(static_cast<size_t>(T) * H, rng, 0.5f);
    auto w = random_bf16(H, rng, 0.1f, 1.0f);
    Bf16Array d_x(x0.size()), d_delta(delta.size()), d_w(H), d_out(x0.size());
    d_x.upload(x0);
    d_delta.upload(delta);
    d_w.upload(w);
    CUDA_OK(launch_add_rms_norm(B(d_x), B(d_delta), B(d_w), T, H, 1e-6f, nullptr, B(d_out), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto x = to_f32(d_x.download()), out = to_f32(d_out.download());
    const auto xf = to_f32(x0), df = to_f32(delta), wf = to_f32(w);
    std::vector<float> want_x(x0.size()), want_out(x0.size());
    for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
      double ss = 0;
      for (int i = 0; i < H; ++i) {
        want_x[t * H + i] = rb(xf[t * H + i] + df[t * H + i]);
        ss += static_cast<double>(want_x[t * H + i]) * want_x[t * H + i];
      }
      const float rs = static_cast<float>(1.0 / std::sqrt(ss / H + 1e-6));
      for (int i = 0; i < H; ++i) want_out[t * H + i] = rb(wf[i] * rb(want_x[t * H + i] * rs));
    }
    EXPECT_EQ(x, want_x);
    EXPECT_LT(rel_err(out, want_out), 1e-2);

    // Gathered: every row in reverse order, x untouched, each row as it was.
    std::vector<int32_t> rows(T);
    for (int r = 0; r < T; ++r) rows[r] = T - 1 - r;
    DeviceArray<int32_t> d_rows(T);
    d_rows.upload(rows);
    Bf16Array d_g(x0.size());
    CUDA_OK(launch_add_rms_norm(B(d_x), nullptr, B(d_w), T, H, 1e-6f, d_rows.get(), B(d_g), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto g = to_f32(d_g.download());
    for (int r = 0; r < T; r += 97)
      EXPECT_EQ(std::vector<float>(g.begin() + static_cast<size_t>(r) * H, g.begin() + static_cast<size_t>(r + 1) * H),
                std::vector<float>(out.begin() + static_cast<size_t>(T - 1 - r) * H,
                                   out.begin() + static_cast<size_t>(T - r) * H))
          << "row " << r;
    EXPECT_EQ(to_f32(d_x.download()), want_x);
  }
}

TEST_F(CudaKernels, QkNormRopeWritesQAndThePagedCache) {
  for (int hd : {64, 128}) {
    const int T = 5, heads = 4, kvh = 2, L = 3, layer = 1, blocks = 4;
    const int qd = heads * hd, kvd = kvh * hd, cols = qd + 2 * kvd;
    auto qkv = random_bf16(static_cast<size_t>(T) * cols, rng);
    auto qn = random_bf16(hd, rng, 0.1f, 1.0f), kn = random_bf16(hd, rng, 0.1f, 1.0f);
    std::vector<int32_t> pos = {0, 1, 17, 300, 4095}, slots = {3 * 16 + 0, 3 * 16 + 1, 0 * 16 + 5, -1, 2 * 16 + 15};
    std::vector<float> inv(hd / 2);
    for (int i = 0; i < hd / 2; ++i) inv[i] = static_cast<float>(1.0 / std::pow(1e6, (2.0 * i) / hd));
    const size_t cache_elems = static_cast<size_t>(blocks) * L * 2 * 16 * kvd;
    Bf16Array d_qkv(qkv.size()), d_qn(hd), d_kn(hd), d_q(static_cast<size_t>(T) * qd), d_cache(cache_elems);
    DeviceArray<int32_t> d_pos(T), d_slots(T);
    DeviceArray<float> d_inv(hd / 2);
    const int max_pos = 4096;
    DeviceArray<__nv_bfloat162> d_rope(static_cast<size_t>(max_pos) * hd / 2);
    d_qkv.upload(qkv);
    d_qn.upload(qn);
    d_kn.upload(kn);
    d_pos.upload(pos);
    d_slots.upload(slots);
    d_inv.upload(inv);
    KvCacheDesc kv{B(d_cache), L, kvh, hd};
    CUDA_OK(launch_rope_table(d_inv.get(), hd, max_pos, d_rope.get(), nullptr));
    CUDA_OK(launch_qk_norm_rope_kv(B(d_qkv), T, d_pos.get(), d_slots.get(), B(d_qn), B(d_kn), d_rope.get(), heads,
                                   kvh, hd, 1e-6f, B(d_q), kv, layer, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto q = to_f32(d_q.download()), cache = to_f32(d_cache.download());
    const auto f = to_f32(qkv), qnf = to_f32(qn), knf = to_f32(kn);
    auto ref = [&](const float* src, const std::vector<float>& w, int p, float* dst) {
      double ss = 0;
      for (int i = 0; i < hd; ++i) ss += static_cast<double>(src[i]) * src[i];
      const float rs = static_cast<float>(1.0 / std::sqrt(ss / hd + 1e-6));
      std::vector<float> y(hd);
      for (int i = 0; i < hd; ++i) y[i] = rb(w[i] * rb(src[i] * rs));
      for (int i = 0; i < hd / 2; ++i) {
        const float ang = static_cast<float>(p) * inv[i];
        const float c = rb(std::cos(ang)), s = rb(std::sin(ang));
        dst[i] = rb(rb(y[i] * c) + rb(-y[i + hd / 2] * s));
        dst[i + hd / 2] = rb(rb(y[i + hd / 2] * c) + rb(y[i] * s));
      }
    };
    std::vector<float> want(hd);
    double worst = 0;
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < heads; ++h) {
        ref(&f[t * cols + h * hd], qnf, pos[t], want.data());
        worst = std::max(worst, rel_err(std::vector<float>(q.begin() + (t * heads + h) * hd,
                                                           q.begin() + (t * heads + h + 1) * hd), want));
      }
      if (slots[t] < 0) continue;
      const int blk = slots[t] / 16, off = slots[t] % 16;
      for (int h = 0; h < kvh; ++h) {
        const size_t kbase = ((static_cast<size_t>(blk) * L + layer) * 2 + 0) * 16 * kvd + off * kvd + h * hd;
        const size_t vbase = ((static_cast<size_t>(blk) * L + layer) * 2 + 1) * 16 * kvd + off * kvd + h * hd;
        ref(&f[t * cols + qd + h * hd], knf, pos[t], want.data());
        worst = std::max(worst, rel_err(std::vector<float>(cache.begin() + kbase, cache.begin() + kbase + hd), want));
        for (int i = 0; i < hd; ++i) EXPECT_EQ(cache[vbase + i], f[t * cols + qd + kvd + h * hd + i]);
      }
    }
    EXPECT_LT(worst, 2e-2) << "head_dim " << hd;
    // Slot -1 (padding) wrote nothing: block 1 is still poison.
    const size_t b1 = ((1ull * L + layer) * 2) * 16 * kvd;
    EXPECT_TRUE(std::isnan(cache[b1]));

    // Decode attention of a pure decode pass does this work itself for the new
    // token (its own code: dev::norm_rope_head): each token as a one-token
    // sequence must leave the same K and V bits in a second cache, and, with
    // one position to attend to, V itself as the output of every query head.
    std::vector<int32_t> seq(T), ones(T, 1), tables(T, 0);
    std::iota(seq.begin(), seq.end(), 0);
    DeviceArray<int32_t> d_seq(T), d_ones(T), d_tables(T);
    d_seq.upload(seq);
    d_ones.upload(ones);
    d_tables.upload(tables);
    // With 64-token partitions (staged, tensor cores) and with staged 128- and 256-token ones.
    for (auto [partition, staged] : {std::pair{64, false}, std::pair{128, true}, std::pair{256, true}}) {
      if (staged && !staged_fits(heads, kvh, hd)) continue;
      Bf16Array d_cache2(cache_elems), d_out(static_cast<size_t>(T) * qd);
      AttentionArgs a = attention_args({B(d_cache2), L, kvh, hd}, layer, heads, d_seq.get(), d_ones.get(), d_ones.get(),
                                       d_seq.get(), d_tables.get());
      a.out = B(d_out);
      a.decode_seqs = d_seq.get();
      a.partition_tokens = partition;
      a.staged_partitions = staged;
      a.qkv = B(d_qkv);
      a.positions = d_pos.get();
      a.slots = d_slots.get();
      a.q_norm = B(d_qn);
      a.k_norm = B(d_kn);
      a.rope_table = d_rope.get();
      a.eps = 1e-6f;
      CUDA_OK(launch_decode_attention(a, T, 1, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const auto bits = d_cache.download(), bits2 = d_cache2.download(), out_bits = d_out.download();
      for (int t = 0; t < T; ++t) {
        if (slots[t] < 0) continue;
        const int blk = slots[t] / 16, off = slots[t] % 16;
        for (int kind = 0; kind < 2; ++kind) {
          const size_t base = ((static_cast<size_t>(blk) * L + layer) * 2 + kind) * 16 * kvd + off * kvd;
          EXPECT_TRUE(std::equal(bits.begin() + base, bits.begin() + base + kvd, bits2.begin() + base))
              << "head_dim " << hd << ", partition " << partition << ", token " << t << (kind ? ", V" : ", K");
          if (kind == 0) continue;
          for (int h = 0; h < heads; ++h)
            EXPECT_TRUE(std::equal(out_bits.begin() + (static_cast<size_t>(t) * heads + h) * hd,
                                   out_bits.begin() + (static_cast<size_t>(t) * heads + h + 1) * hd,
                                   bits.begin() + base + (h / (heads / kvh)) * hd))
                << "head_dim " << hd << ", partition " << partition << ", token " << t << ", head " << h;
        }
      }
    }
  }
}

TEST_F(CudaKernels, SiluMul) {
  const int T = 3, I = 768;
  auto gu = random_bf16(static_cast<size_t>(T) * 2 * I, rng, 2.0f);
  Bf16Array d_gu(gu.size()), d_out(static_cast<size_t>(T) * I);
  d_gu.upload(gu);
  CUDA_OK(launch_silu_mul(B(d_gu), T, I, B(d_out), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto out = to_f32(d_out.download()), f = to_f32(gu);
  std::vector<float> want(static_cast<size_t>(T) * I);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < I; ++i) {
      const float g = f[t * 2 * I + i], u = f[t * 2 * I + I + i];
      want[t * I + i] = rb(rb(g / (1.0f + std::exp(-g))) * u);
    }
  EXPECT_LT(rel_err(out, want), 1e-2);
}

// Host reference of y = a w^T in double.
std::vector<float> matmul_ref(const std::vector<float>& a, const std::vector<float>& w, int M, int N, int K) {
  std::vector<float> y(static_cast<size_t>(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += static_cast<double>(a[m * K + k]) * w[static_cast<size_t>(n) * K + k];
      y[static_cast<size_t>(m) * N + n] = static_cast<float>(s);
    }
  return y;
}

TEST_F(CudaKernels, GemvWithEachPrologueAndEpilogue) {
  // Output widths that take 8, 16 and 24 weight rows per CTA, and 16 in several
  // waves (on 132 SMs: up to 2112, 4224, 6336 rows in one wave).
  const int max_n = 7000, K = 1024;
  auto w = random_bf16(static_cast<size_t>(max_n) * K, rng, 0.05f);
  auto nw = random_bf16(K, rng, 0.1f, 1.0f);
  Bf16Array d_w(w.size()), d_nw(K);
  d_w.upload(w);
  d_nw.upload(nw);
  const auto wf = to_f32(w), nwf = to_f32(nw);
  for (int M : {1, 3, 8}) {
    for (GemvInput in : {GemvInput::kPlain, GemvInput::kRmsNorm, GemvInput::kSiluMul}) {
      const int in_cols = in == GemvInput::kSiluMul ? 2 * K : K;
      auto x = random_bf16(static_cast<size_t>(M) * in_cols, rng);
      const auto xf = to_f32(x);
      std::vector<float> a(static_cast<size_t>(M) * K);
      for (int m = 0; m < M; ++m) {
        double ss = 0;
        for (int k = 0; k < K; ++k) ss += static_cast<double>(xf[m * in_cols + k]) * xf[m * in_cols + k];
        const float rs = static_cast<float>(1.0 / std::sqrt(ss / K + 1e-6));
        for (int k = 0; k < K; ++k) {
          const float v = xf[m * in_cols + k];
          if (in == GemvInput::kPlain) a[m * K + k] = v;
          if (in == GemvInput::kRmsNorm) a[m * K + k] = rb(nwf[k] * rb(v * rs));
          if (in == GemvInput::kSiluMul) a[m * K + k] = rb(rb(v / (1.0f + std::exp(-v))) * xf[m * in_cols + K + k]);
        }
      }
      const auto want_all = matmul_ref(a, wf, M, max_n, K);
      Bf16Array d_x(x.size());
      d_x.upload(x);
      auto res = random_bf16(static_cast<size_t>(M) * max_n, rng);
      // The N = 3000 logits (two weight tiles per warp): 4500 (three) and 7000 (two, the
      // looping kernel from two rows on) must give the same bits. N = 1000 (one tile per
      // warp) adds each value in two chains (gemv.cu), so its bits are its own.
      std::vector<float> first;
      for (int N : {1000, 3000, 4500, 7000}) {
        const std::string what = "M " + std::to_string(M) + " input " + std::to_string(static_cast<int>(in)) +
                                 " N " + std::to_string(N);
        std::vector<float> want(static_cast<size_t>(M) * N);
        for (int m = 0; m < M; ++m)
          std::copy_n(want_all.begin() + static_cast<size_t>(m) * max_n, N, want.begin() + static_cast<size_t>(m) * N);
        // f32 out, with each row's first maximum as a key
        DeviceArray<float> d_f(static_cast<size_t>(M) * N);
        DeviceArray<unsigned long long> d_keys(M);
        CUDA_OK(cudaMemset(d_keys.get(), 0, M * sizeof(unsigned long long)));
        GemvArgs g{B(d_x), B(d_nw), 1e-6f, B(d_w), M, N, K, in, GemvOutput::kLogits, d_f.get(), d_keys.get()};
        CUDA_OK(launch_gemv(g, nullptr));
        g.argmax = nullptr;
        // residual add
        Bf16Array d_res(static_cast<size_t>(M) * N);
        const std::vector<uint16_t> res_n(res.begin(), res.begin() + static_cast<size_t>(M) * N);
        d_res.upload(res_n);
        g.output_kind = GemvOutput::kAddBf16;
        g.out = d_res.get();
        CUDA_OK(launch_gemv(g, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        // Logits output: bf16-rounded values in fp32.
        const auto got_f = d_f.download();
        EXPECT_LT(rel_err(got_f, want), 5e-3) << what;
        const auto keys = d_keys.download();
        for (int m = 0; m < M; ++m)
          EXPECT_EQ(keys[m], first_max_key(got_f.data() + static_cast<size_t>(m) * N, N)) << what << " row " << m;
        const auto resf = to_f32(res_n), got = to_f32(d_res.download());
        std::vector<float> want_res(resf.size());
        for (size_t i = 0; i < want_res.size(); ++i) want_res[i] = rb(resf[i] + rb(want[i]));
        EXPECT_LT(rel_err(got, want_res), 1e-2) << what;
        // A row's value does not depend on how many tiles (from two) each warp takes.
        std::vector<float> head;
        for (int m = 0; m < M; ++m)
          head.insert(head.end(), got_f.begin() + static_cast<size_t>(m) * N, got_f.begin() + static_cast<size_t>(m) * N + 1000);
        if (N > 1000) {
          if (first.empty()) first = head;
          EXPECT_EQ(head, first) << what;
        }
        // Nor on how many rows the launch takes: row 0 alone gives the same bits.
        if (M > 1) {
          DeviceArray<float> d_one(N);
          GemvArgs one{B(d_x), B(d_nw), 1e-6f, B(d_w), 1, N, K, in, GemvOutput::kLogits, d_one.get()};
          CUDA_OK(launch_gemv(one, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          const auto alone = d_one.download();
          EXPECT_TRUE(std::equal(alone.begin(), alone.end(), got_f.begin())) << what << ": row 0 alone differs";
        }
      }
      if (in == GemvInput::kSiluMul) continue;
      // The SiLU-mul epilogue (weight rows [0, N/2) as gate, [N/2, N) as up): bit
      // for bit launch_silu_mul on the bf16 output of the same rows, which also
      // feeds a kSiluMul staging.
      for (int N : {1024, 6000, 6144}) {
        const std::string what = "M " + std::to_string(M) + " input " + std::to_string(static_cast<int>(in)) +
                                 " SiLU-mul N " + std::to_string(N);
        Bf16Array d_gu(static_cast<size_t>(M) * N), d_want(static_cast<size_t>(M) * N / 2),
            d_got(static_cast<size_t>(M) * N / 2);
        GemvArgs g{B(d_x), B(d_nw), 1e-6f, B(d_w), M, N, K, in, GemvOutput::kBf16, d_gu.get()};
        CUDA_OK(launch_gemv(g, nullptr));
        CUDA_OK(launch_silu_mul(B(d_gu), M, N / 2, B(d_want), nullptr));
        g.output_kind = GemvOutput::kSiluMul;
        g.out = d_got.get();
        CUDA_OK(launch_gemv(g, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const auto got = d_got.download();
        EXPECT_TRUE(got == d_want.download()) << what;
        // The bf16 projection itself against the reference product.
        std::vector<float> want(static_cast<size_t>(M) * N);
        for (int m = 0; m < M; ++m)
          std::copy_n(want_all.begin() + static_cast<size_t>(m) * max_n, N, want.begin() + static_cast<size_t>(m) * N);
        EXPECT_LT(rel_err(to_f32(d_gu.download()), want), 1e-2) << what;
        EXPECT_TRUE(std::any_of(got.begin(), got.end(), [](uint16_t v) { return (v & 0x7fff) != 0; }))
            << what << ": all zeros";
        g.N = N - 1;  // no gate/up split: refused before any launch
        EXPECT_EQ(launch_gemv(g, nullptr), cudaErrorInvalidValue) << what;
      }
    }
  }
}

TEST_F(CudaKernels, GemvSiluMulStagingOfOneLongRow) {
  // One row of K = 3072 (the down projection of Qwen3-0.6B at batch 1): the
  // one-row staging loads two chunks per thread before storing either; it must
  // give the bits of the same row staged among others, and the reference.
  const int K = 3072, N = 1024;
  auto w = random_bf16(static_cast<size_t>(N) * K, rng, 0.05f);
  auto x = random_bf16(static_cast<size_t>(3) * 2 * K, rng, 2.0f);
  Bf16Array d_w(w.size()), d_x(x.size());
  d_w.upload(w);
  d_x.upload(x);
  const auto wf = to_f32(w), xf = to_f32(x);
  std::vector<float> a(K);
  for (int k = 0; k < K; ++k) {
    const float g = xf[k], u = xf[K + k];
    a[k] = rb(rb(g / (1.0f + std::exp(-g))) * u);
  }
  const auto want = matmul_ref(a, wf, 1, N, K);
  DeviceArray<float> d_one(N), d_three(static_cast<size_t>(3) * N);
  GemvArgs one{B(d_x), nullptr, 0.0f, B(d_w), 1, N, K, GemvInput::kSiluMul, GemvOutput::kLogits, d_one.get()};
  CUDA_OK(launch_gemv(one, nullptr));
  GemvArgs three = one;
  three.M = 3;
  three.out = d_three.get();
  CUDA_OK(launch_gemv(three, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto got = d_one.download(), rows = d_three.download();
  EXPECT_LT(rel_err(got, want), 5e-3);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), rows.begin())) << "row 0 alone differs from row 0 of three";
}

TEST_F(CudaKernels, GemvArgmaxKeysTakeTheFirstMaximum) {
  // Three rows of the weights equal the input: the largest logits, equal; in
  // different warps and CTAs. The key must name the lowest. N = 4500 is one
  // wave of CTAs; N = 20001 takes several (the LM head's case), its last row
  // alone in the last CTA.
  const int K = 1024;
  for (const int N : {4500, 20001}) {
    const std::vector<int> tied = {N / 2 + 3, 100, N - 1};
    auto w = random_bf16(static_cast<size_t>(N) * K, rng, 0.01f);
    const auto x = random_bf16(K, rng);
    for (int r : tied) std::copy(x.begin(), x.end(), w.begin() + static_cast<size_t>(r) * K);
    Bf16Array d_w(w.size()), d_x(K);
    d_w.upload(w);
    d_x.upload(x);
    DeviceArray<float> d_f(N);
    DeviceArray<unsigned long long> d_keys(1);
    CUDA_OK(cudaMemset(d_keys.get(), 0, sizeof(unsigned long long)));
    GemvArgs g{B(d_x), nullptr, 0.0f, B(d_w), 1, N, K, GemvInput::kPlain, GemvOutput::kLogits, d_f.get(), d_keys.get()};
    CUDA_OK(launch_gemv(g, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto f = d_f.download();
    for (int r : tied) ASSERT_EQ(f[r], f[100]) << "N " << N << " row " << r;
    ASSERT_EQ(*std::max_element(f.begin(), f.end()), f[100]) << "N " << N;
    const uint64_t key = d_keys.download()[0];
    EXPECT_EQ(0xffffffffu - static_cast<uint32_t>(key), 100u) << "N " << N;
    EXPECT_EQ(key, first_max_key(f.data(), N)) << "N " << N;
    // Every logit against the reference product (the last group included).
    EXPECT_LT(rel_err(f, matmul_ref(to_f32(x), to_f32(w), 1, N, K)), 5e-3) << "N " << N;
  }
}

TEST_F(CudaKernels, FixedGemmIsCorrectAndRowsDoNotDependOnM) {
  const int N = 264, K = 512;  // N not a multiple of the CTA tile
  auto w = random_bf16(static_cast<size_t>(N) * K, rng, 0.05f);
  auto a = random_bf16(static_cast<size_t>(300) * K, rng);
  Bf16Array d_w(w.size()), d_a(a.size());
  d_w.upload(w);
  d_a.upload(a);
  const auto want = matmul_ref(to_f32(a), to_f32(w), 300, N, K);
  std::vector<std::vector<float>> outs;
  for (int M : {1, 13, 37, 300}) {
    DeviceArray<float> d_y(static_cast<size_t>(M) * N);
    CUDA_OK(launch_fixed_gemm(B(d_a), B(d_w), d_y.get(), true, M, N, K, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    outs.push_back(d_y.download());
    EXPECT_LT(rel_err(outs.back(), std::vector<float>(want.begin(), want.begin() + static_cast<size_t>(M) * N)), 5e-3)
        << "M " << M;
  }
  // Row 0 (and row 12) bit-identical whatever M.
  for (size_t i = 1; i < outs.size(); ++i)
    EXPECT_TRUE(std::equal(outs[0].begin(), outs[0].begin() + N, outs[i].begin())) << "M index " << i;
  EXPECT_TRUE(std::equal(outs[1].begin() + 12 * N, outs[1].begin() + 13 * N, outs[3].begin() + 12 * N));
  // bf16 output rounds the same accumulators.
  Bf16Array d_yb(static_cast<size_t>(37) * N);
  CUDA_OK(launch_fixed_gemm(B(d_a), B(d_w), d_yb.get(), false, 37, N, K, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto yb = to_f32(d_yb.download());
  for (int i = 0; i < 37 * N; ++i) ASSERT_EQ(yb[i], rb(outs[2][i])) << i;
}

// The canonical GEMV and the fixed GEMM share one projection order
// (kernels.h: kProjectionSegments): each row's output is the same bits from
// either kernel, at every M, whatever the GEMV's tiles per warp (N = 1000:
// one, 3000 and 7000: two, 7000 looping from two rows on, 4600: three), and
// with each of the GEMV's stagings against the separate kernels that the
// larger batches run: add_rms_norm (a pass of 1 row, and of 1031 rows, which
// takes the warp-per-row kernel) and silu_mul. Batch-invariant mode relies on
// it: decode rows go through the GEMV, prefill chunks through the fixed GEMM.
TEST_F(CudaKernels, GemvAndFixedGemmGiveEachRowTheSameBits) {
  const int max_n = 7000;
  for (int K : {256, 1024, 2048, 3072, 4096}) {
    auto w = random_bf16(static_cast<size_t>(max_n) * K, rng, 0.05f);
    auto nw = random_bf16(K, rng, 0.1f, 1.0f);
    Bf16Array d_w(w.size()), d_nw(K);
    d_w.upload(w);
    d_nw.upload(nw);
    const int big = 1031;  // rows of the fixed GEMM / norm pass; the GEMV's rows are its first M
    for (GemvInput in : {GemvInput::kPlain, GemvInput::kRmsNorm, GemvInput::kSiluMul}) {
      const int in_cols = in == GemvInput::kSiluMul ? 2 * K : K;
      auto x = random_bf16(static_cast<size_t>(big) * in_cols, rng);
      Bf16Array d_x(x.size()), d_a(static_cast<size_t>(big) * K), d_a1(K);
      d_x.upload(x);
      // The GEMM's input as the large passes make it.
      if (in == GemvInput::kRmsNorm) {
        CUDA_OK(launch_add_rms_norm(B(d_x), nullptr, B(d_nw), big, K, 1e-6f, nullptr, B(d_a), nullptr));
        CUDA_OK(launch_add_rms_norm(B(d_x), nullptr, B(d_nw), 1, K, 1e-6f, nullptr, B(d_a1), nullptr));
      } else if (in == GemvInput::kSiluMul) {
        CUDA_OK(launch_silu_mul(B(d_x), big, K, B(d_a), nullptr));
      } else {
        CUDA_OK(cudaMemcpy(d_a.get(), d_x.get(), x.size() * 2, cudaMemcpyDeviceToDevice));
      }
      CUDA_OK(cudaDeviceSynchronize());
      const auto a_all = d_a.download();
      if (in == GemvInput::kRmsNorm) {
        const auto alone = d_a1.download();
        ASSERT_TRUE(std::equal(alone.begin(), alone.end(), a_all.begin()))
            << "K " << K << ": row 0's norm in a pass of " << big << " rows differs from the row alone";
      }
      DeviceArray<float> d_ref(static_cast<size_t>(big) * max_n);
      CUDA_OK(launch_fixed_gemm(B(d_a), B(d_w), d_ref.get(), true, big, max_n, K, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const auto ref = d_ref.download();
      // Against the product in double, for rows 0..7.
      const std::vector<float> a8(to_f32(std::vector<uint16_t>(a_all.begin(), a_all.begin() + 8 * K)));
      const auto want = matmul_ref(a8, to_f32(w), 8, max_n, K);
      EXPECT_LT(rel_err(std::vector<float>(ref.begin(), ref.begin() + 8 * max_n), want), 5e-3) << "K " << K;
      for (int M : {1, 2, 5, 8}) {
        for (int N : {1000, 3000, 4600, 7000}) {
          const std::string what = "K " + std::to_string(K) + " input " + std::to_string(static_cast<int>(in)) +
                                   " M " + std::to_string(M) + " N " + std::to_string(N);
          DeviceArray<float> d_y(static_cast<size_t>(M) * N);
          CUDA_OK(cudaMemset(d_y.get(), 0xff, static_cast<size_t>(M) * N * sizeof(float)));
          GemvArgs g{B(d_x), B(d_nw), 1e-6f, B(d_w), M, N, K, in, GemvOutput::kLogits, d_y.get()};
          g.canonical = true;
          CUDA_OK(launch_gemv(g, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          const auto y = d_y.download();
          size_t differ = 0;
          for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) {
              const float got = y[static_cast<size_t>(m) * N + n], exp = ref[static_cast<size_t>(m) * max_n + n];
              if (std::memcmp(&got, &exp, sizeof(float)) != 0) ++differ;
            }
          EXPECT_EQ(differ, 0u) << what << ": elements that differ from the fixed GEMM's";
        }
      }
    }
    // The epilogues: bf16 and the residual add at M = 3, SiLU-mul at M = 8, each
    // against the fixed GEMM's bf16 output and the separate kernels.
    auto x = random_bf16(static_cast<size_t>(8) * K, rng);
    Bf16Array d_x(x.size());
    d_x.upload(x);
    const int N = 3072;
    Bf16Array d_ref(static_cast<size_t>(8) * N), d_gemv(static_cast<size_t>(8) * N);
    CUDA_OK(launch_fixed_gemm(B(d_x), B(d_w), d_ref.get(), false, 8, N, K, nullptr));
    GemvArgs g{B(d_x), nullptr, 0.0f, B(d_w), 3, N, K, GemvInput::kPlain, GemvOutput::kBf16, d_gemv.get()};
    g.canonical = true;
    CUDA_OK(launch_gemv(g, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto ref_b = d_ref.download(), got_b = d_gemv.download();
    EXPECT_TRUE(std::equal(got_b.begin(), got_b.begin() + 3 * N, ref_b.begin())) << "K " << K << " bf16 output";
    auto res = random_bf16(static_cast<size_t>(3) * N, rng);
    Bf16Array d_res(res.size());
    d_res.upload(res);
    g.output_kind = GemvOutput::kAddBf16;
    g.out = d_res.get();
    CUDA_OK(launch_gemv(g, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    {  // the large passes' residual add (add_rms_norm): bf16(x + the GEMM's bf16 output)
      const auto rf = to_f32(res), got = to_f32(d_res.download()), refb = to_f32(ref_b);
      size_t differ = 0;
      for (int m = 0; m < 3; ++m)
        for (int n = 0; n < N; ++n)
          if (got[m * N + n] != rb(rf[m * N + n] + refb[m * N + n])) ++differ;
      EXPECT_EQ(differ, 0u) << "K " << K << " residual add";
    }
    Bf16Array d_act(static_cast<size_t>(8) * N / 2), d_act_ref(static_cast<size_t>(8) * N / 2);
    g.M = 8;
    g.output_kind = GemvOutput::kSiluMul;
    g.out = d_act.get();
    CUDA_OK(launch_gemv(g, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    // silu_mul of the fixed GEMM's [gate | up] halves, row by row.
    std::vector<uint16_t> act_ref;
    for (int m = 0; m < 8; ++m) {
      Bf16Array d_row(N), d_out_row(N / 2);
      d_row.upload(std::vector<uint16_t>(ref_b.begin() + static_cast<size_t>(m) * N, ref_b.begin() + static_cast<size_t>(m + 1) * N));
      CUDA_OK(launch_silu_mul(B(d_row), 1, N / 2, B(d_out_row), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const auto r = d_out_row.download();
      act_ref.insert(act_ref.end(), r.begin(), r.end());
    }
    EXPECT_TRUE(d_act.download() == act_ref) << "K " << K << " SiLU-mul output";
  }
}

// The TMA kernel's forced variants: alone (kernel 3) and in clusters of two sharing the weight
// tiles (kernel 4), at both tile widths and each split.
struct TmaVariant {
  int kernel, tile_n, splits;
};
constexpr TmaVariant kTmaVariants[] = {{3, 128, 1}, {3, 128, 2}, {3, 128, 4}, {3, 128, 8}, {3, 64, 1}, {3, 64, 2},
                                       {3, 64, 4},  {3, 64, 8},  {4, 128, 1}, {4, 128, 2}, {4, 128, 8}, {4, 64, 1},
                                       {4, 64, 8}};
// Variant v's output into `got` (bytes of M x N fp32 or bf16), from a poisoned buffer.
void run_tma_variant(const TmaVariant& v, const bf16* a, const bf16* w, bool f32, int M, int N, int K, void* ws,
                     size_t ws_bytes, std::vector<uint8_t>& got) {
  FixedGemmOptions tma;
  tma.kernel = v.kernel;
  tma.tile_n = v.tile_n;
  tma.splits = v.splits;
  tma.workspace = ws;
  tma.workspace_bytes = ws_bytes;
  const size_t bytes = static_cast<size_t>(M) * N * (f32 ? 4 : 2);
  DeviceArray<uint8_t> d_got(bytes);
  CUDA_OK(cudaMemset(d_got.get(), 0xff, bytes));
  CUDA_OK(launch_fixed_gemm(a, w, d_got.get(), f32, M, N, K, nullptr, tma));
  CUDA_OK(cudaDeviceSynchronize());
  got = d_got.download();
}
std::string describe(const TmaVariant& v) {
  return " kernel " + std::to_string(v.kernel) + " 128x" + std::to_string(v.tile_n) + " splits " +
         std::to_string(v.splits);
}

// The warpgroup-MMA fixed GEMM (sm_90a builds, K % 512 == 0) gives the
// mma.sync kernel's bits for every element, whatever its tile shape, its split
// of K across CTAs (whole segments, combined in order) and M, in both outputs.
TEST_F(CudaKernels, FixedGemmWgmmaGivesTheMmaKernelsBitsForEveryTileAndSplit) {
  if (!fixed_gemm_wgmma_supported(1024, 1024)) GTEST_SKIP() << "built without sm_90a";
  DeviceArray<float> d_ws(static_cast<size_t>(kProjectionSegments) * 1031 * 1032);
  for (auto [N, K] : {std::pair{1032, 1024}, std::pair{4096, 1024}, std::pair{1024, 3072}, std::pair{264, 12288},
                      std::pair{2048, 2048}}) {
    auto w = random_bf16(static_cast<size_t>(N) * K, rng, 0.05f);
    const int max_m = N * 1031 <= 1031 * 1032 ? 1031 : 200;
    auto a = random_bf16(static_cast<size_t>(max_m) * K, rng);
    Bf16Array d_w(w.size()), d_a(a.size());
    d_w.upload(w);
    d_a.upload(a);
    for (int M : {1, 13, 64, 100, max_m}) {
      for (bool f32 : {true, false}) {
        const size_t bytes = static_cast<size_t>(M) * N * (f32 ? 4 : 2);
        DeviceArray<uint8_t> d_ref(bytes), d_got(bytes);
        FixedGemmOptions mma;
        mma.kernel = 1;
        CUDA_OK(launch_fixed_gemm(B(d_a), B(d_w), d_ref.get(), f32, M, N, K, nullptr, mma));
        CUDA_OK(cudaDeviceSynchronize());
        const auto ref = d_ref.download();
        if (f32 && M == 13) {  // the reference itself against the product in double
          std::vector<float> got(static_cast<size_t>(M) * N);
          std::memcpy(got.data(), ref.data(), bytes);
          const auto want = matmul_ref(to_f32(std::vector<uint16_t>(a.begin(), a.begin() + static_cast<size_t>(M) * K)),
                                       to_f32(w), M, N, K);
          EXPECT_LT(rel_err(got, want), 5e-3) << "N " << N << " K " << K;
        }
        for (int tile : {64064, 64128, 128064, 128128}) {
          for (int splits : {1, 2, 4, 8}) {
            const int tile_m = tile / 1000, tile_n = tile % 1000;
            const std::string what = "N " + std::to_string(N) + " K " + std::to_string(K) + " M " +
                                     std::to_string(M) + (f32 ? " f32" : " bf16") + " tile " +
                                     std::to_string(tile_m) + "x" + std::to_string(tile_n) + " splits " +
                                     std::to_string(splits);
            FixedGemmOptions o;
            o.kernel = 2;
            o.tile_m = tile_m;
            o.tile_n = tile_n;
            o.splits = splits;
            o.workspace = d_ws.get();
            o.workspace_bytes = static_cast<size_t>(kProjectionSegments) * 1031 * 1032 * sizeof(float);
            CUDA_OK(cudaMemset(d_got.get(), 0xff, bytes));
            CUDA_OK(launch_fixed_gemm(B(d_a), B(d_w), d_got.get(), f32, M, N, K, nullptr, o));
            CUDA_OK(cudaDeviceSynchronize());
            EXPECT_TRUE(d_got.download() == ref) << what;
          }
        }
        // The TMA kernel (128 x 128 and 128 x 64 tiles, walked in groups of tile rows; a partial last group
        // at M 1031), at every split; alone (kernel 3) and in clusters of two sharing the weight tiles
        // (kernel 4; an odd count of tile rows leaves a cluster's second tile past M).
        for (const TmaVariant& v : kTmaVariants) {
          std::vector<uint8_t> got;
          run_tma_variant(v, B(d_a), B(d_w), f32, M, N, K, d_ws.get(),
                          static_cast<size_t>(kProjectionSegments) * 1031 * 1032 * sizeof(float), got);
          EXPECT_TRUE(got == ref) << "N " << N << " K " << K << " M " << M << (f32 ? " f32" : " bf16") << describe(v);
        }
      }
    }
  }
  // A split without a workspace is refused, not run unsplit.
  Bf16Array d_w(static_cast<size_t>(64) * 1024), d_a(1024);
  DeviceArray<float> d_y(64);
  FixedGemmOptions o;
  o.splits = 4;
  EXPECT_EQ(launch_fixed_gemm(B(d_a), B(d_w), d_y.get(), true, 1, 64, 1024, nullptr, o), cudaErrorInvalidValue);
}

// The TMA kernel is persistent: with more work units than SMs each CTA walks
// several tiles (and, split, several units of a tile's segments), carrying its
// accumulators from one unit to the next. Every element still gets the
// mma.sync kernel's bits, including when a CTA's count of segments is odd.
TEST_F(CudaKernels, FixedGemmTmaKernelWalkingManyTilesPerSmGivesTheMmaKernelsBits) {
  if (!fixed_gemm_wgmma_supported(1024, 1024)) GTEST_SKIP() << "built without sm_90a";
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (auto [M, N, K] : {std::tuple{1031, 4096, 1024}, std::tuple{4100, 1024, 3072}, std::tuple{2000, 6144, 1024}}) {
    ASSERT_GT(((M + 127) / 128) * (N / 128), sms) << "the case must give some CTA two tiles";
    auto w = random_bf16(static_cast<size_t>(N) * K, rng, 0.05f);
    auto a = random_bf16(static_cast<size_t>(M) * K, rng);
    Bf16Array d_w(w.size()), d_a(a.size());
    d_w.upload(w);
    d_a.upload(a);
    const size_t ws_bytes = static_cast<size_t>(kProjectionSegments) * M * N * sizeof(float);
    DeviceArray<uint8_t> d_ws(ws_bytes);
    for (bool f32 : {true, false}) {
      const size_t bytes = static_cast<size_t>(M) * N * (f32 ? 4 : 2);
      DeviceArray<uint8_t> d_ref(bytes);
      FixedGemmOptions mma;
      mma.kernel = 1;
      CUDA_OK(launch_fixed_gemm(B(d_a), B(d_w), d_ref.get(), f32, M, N, K, nullptr, mma));
      CUDA_OK(cudaDeviceSynchronize());
      const auto ref = d_ref.download();
      for (const TmaVariant& v : kTmaVariants) {
        if (v.splits == 4) continue;  // the other splits take the same paths here
        std::vector<uint8_t> got;
        run_tma_variant(v, B(d_a), B(d_w), f32, M, N, K, d_ws.get(), ws_bytes, got);
        EXPECT_TRUE(got == ref) << "M " << M << " N " << N << " K " << K << (f32 ? " f32" : " bf16") << describe(v);
      }
    }
  }
}

// A paged cache with scrambled block tables, random K/V, for attention tests.
struct AttnFixture {
  int heads, kvh, hd, L = 2, layer = 1, blocks;
  std::vector<float> cache;  // host copy (bf16 values)
  Bf16Array* d_cache = nullptr;
  size_t cache_elems() const { return static_cast<size_t>(blocks) * L * 2 * 16 * kvh * hd; }
  size_t kv_base(int blk, int kind) const {
    return ((static_cast<size_t>(blk) * L + layer) * 2 + kind) * 16 * kvh * hd;
  }
  const float* k(const std::vector<int32_t>& table, int p, int h) const {
    return &cache[kv_base(table[p / 16], 0) + (p % 16) * kvh * hd + h * hd];
  }
  const float* v(const std::vector<int32_t>& table, int p, int h) const {
    return &cache[kv_base(table[p / 16], 1) + (p % 16) * kvh * hd + h * hd];
  }
};

// out[d] = softmax(q . k_p * scale, p < n) . v_p, in double.
std::vector<float> attend_ref(const AttnFixture& f, const std::vector<int32_t>& table, const float* q, int h, int n) {
  const int kvh = h / (f.heads / f.kvh);
  std::vector<double> s(n);
  double mx = -1e300;
  for (int p = 0; p < n; ++p) {
    double d = 0;
    for (int i = 0; i < f.hd; ++i) d += static_cast<double>(q[i]) * f.k(table, p, kvh)[i];
    s[p] = d / std::sqrt(static_cast<double>(f.hd));
    mx = std::max(mx, s[p]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - mx));
  std::vector<float> o(f.hd);
  for (int i = 0; i < f.hd; ++i) {
    double acc = 0;
    for (int p = 0; p < n; ++p) acc += s[p] * f.v(table, p, kvh)[i];
    o[i] = static_cast<float>(acc / sum);
  }
  return o;
}

TEST_F(CudaKernels, DecodeAttentionSplitsLongContextsAndMatchesReference) {
  // Partitions of 64 (staged, tensor cores), 128 and 256 (fp32), and 128 and
  // 256 staged (AttentionArgs::staged_partitions, 8 or 16 warps of 16 tokens).
  for (auto [partition, staged] : {std::pair{64, false}, std::pair{128, false}, std::pair{256, false},
                                   std::pair{128, true}, std::pair{256, true}})
  // Group sizes 2, 4, 5 (Qwen3-14B) and 3.
  for (auto [heads, kvh, hd] : {std::tuple{16, 8, 128}, std::tuple{4, 2, 64}, std::tuple{32, 8, 128},
                                std::tuple{40, 8, 128}, std::tuple{6, 2, 64}}) {
    if (staged && !staged_fits(heads, kvh, hd)) continue;
    AttnFixture f{heads, kvh, hd};
    f.blocks = 200;
    const std::vector<int> lens = {1, 17, 256, 257, 1000, 3000, 0};  // 0: padding row
    const int S = static_cast<int>(lens.size());
    std::vector<int32_t> perm(f.blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int32_t> tables, table_start, kv_len, q_start, q_len, decode;
    std::vector<std::vector<int32_t>> per_seq;
    int next = 0;
    for (int s = 0; s < S; ++s) {
      const int nb = (lens[s] + 15) / 16;
      table_start.push_back(static_cast<int32_t>(tables.size()));
      std::vector<int32_t> t;
      for (int b = 0; b < nb; ++b) t.push_back(perm[(next++) % f.blocks]);  // reads may share blocks
      tables.insert(tables.end(), t.begin(), t.end());
      per_seq.push_back(t);
      kv_len.push_back(lens[s]);
      q_start.push_back(s);
      q_len.push_back(1);
      decode.push_back(s);
    }
    const size_t cache_elems = static_cast<size_t>(f.blocks) * f.L * 2 * 16 * kvh * hd;
    auto cache = random_bf16(cache_elems, rng);
    f.cache = to_f32(cache);
    auto q = random_bf16(static_cast<size_t>(S) * heads * hd, rng);
    const auto qf = to_f32(q);
    Bf16Array d_cache(cache_elems), d_q(q.size()), d_out(static_cast<size_t>(S) * heads * hd);
    d_cache.upload(cache);
    d_q.upload(q);
    DeviceArray<int32_t> d_tables(tables.size()), d_ts(S), d_kv(S), d_qs(S), d_ql(S), d_dec(S);
    d_tables.upload(tables);
    d_ts.upload(table_start);
    d_kv.upload(kv_len);
    d_qs.upload(q_start);
    d_ql.upload(q_len);
    d_dec.upload(decode);
    const int parts = (3000 + partition - 1) / partition;
    DeviceArray<float> d_po(static_cast<size_t>(S) * heads * parts * hd), d_ml(static_cast<size_t>(S) * heads * parts * 2);
    AttentionArgs a = attention_args({B(d_cache), f.L, kvh, hd}, f.layer, heads, d_qs.get(), d_ql.get(), d_kv.get(),
                                     d_ts.get(), d_tables.get());
    a.q = B(d_q);
    a.out = B(d_out);
    a.decode_seqs = d_dec.get();
    a.partial_out = d_po.get();
    a.partial_ml = d_ml.get();
    a.partial_parts = parts;
    a.partition_tokens = partition;
    a.staged_partitions = staged;
    const std::string what = std::to_string(heads) + "/" + std::to_string(kvh) + ", partitions of " +
                             std::to_string(partition) + (staged ? " staged" : "");
    CUDA_OK(launch_decode_attention(a, S, parts, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto out_bits = d_out.download();
    const auto out = to_f32(out_bits);
    // The partitions combined by their last CTA instead of the reduction kernel:
    // the same bits, twice in a row (the counters return to zero).
    DeviceArray<uint32_t> d_done(static_cast<size_t>(S) * kvh);
    CUDA_OK(cudaMemset(d_done.get(), 0, static_cast<size_t>(S) * kvh * sizeof(uint32_t)));
    a.partition_done = d_done.get();
    for (int run = 0; run < 2; ++run) {
      CUDA_OK(cudaMemset(d_out.get(), 0xff, static_cast<size_t>(S) * heads * hd * 2));
      CUDA_OK(launch_decode_attention(a, S, parts, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(d_out.download(), out_bits) << what << ", run " << run;
    }
    EXPECT_EQ(d_done.download(), std::vector<uint32_t>(static_cast<size_t>(S) * kvh, 0u));
    a.partition_done = nullptr;
    // The sequences of up to 8 partitions (2 to 8, and one of a single
    // partition, and the padding row) as clusters that combine in shared memory.
    if (partition == 64 || staged) {
      std::vector<int32_t> short_seqs;
      int short_parts = 1;
      for (int s = 0; s < S; ++s)
        if (lens[s] <= 8 * partition) {
          short_seqs.push_back(s);
          short_parts = std::max(short_parts, (lens[s] + partition - 1) / partition);
        }
      DeviceArray<int32_t> d_short(short_seqs.size());
      d_short.upload(short_seqs);
      a.decode_seqs = d_short.get();
      a.cluster_partitions = true;
      CUDA_OK(cudaMemset(d_out.get(), 0xff, static_cast<size_t>(S) * heads * hd * 2));
      CUDA_OK(launch_decode_attention(a, static_cast<int>(short_seqs.size()), short_parts, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const auto clustered = d_out.download();
      const size_t row_elems = static_cast<size_t>(heads) * hd;
      for (int s : short_seqs)
        EXPECT_TRUE(std::equal(clustered.begin() + s * row_elems, clustered.begin() + (s + 1) * row_elems,
                               out_bits.begin() + s * row_elems))
            << what << ": sequence " << s << " (" << lens[s] << " tokens) in a cluster";
      // Each short sequence alone: grids small enough to run one CTA per SM (more shared memory
      // per CTA), the same bits.
      for (int s : short_seqs) {
        DeviceArray<int32_t> d_one(1);
        d_one.upload(std::vector<int32_t>{s});
        a.decode_seqs = d_one.get();
        CUDA_OK(cudaMemset(d_out.get(), 0xff, static_cast<size_t>(S) * heads * hd * 2));
        CUDA_OK(launch_decode_attention(a, 1, std::max(1, (lens[s] + partition - 1) / partition), nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const auto alone = d_out.download();
        EXPECT_TRUE(std::equal(alone.begin() + s * row_elems, alone.begin() + (s + 1) * row_elems,
                               out_bits.begin() + s * row_elems))
            << what << ": sequence " << s << " (" << lens[s] << " tokens) alone";
      }
      a.cluster_partitions = false;
      a.decode_seqs = d_dec.get();
    }
    double worst = 0;
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < heads; ++h) {
        std::vector<float> got(out.begin() + (s * heads + h) * hd, out.begin() + (s * heads + h + 1) * hd);
        if (lens[s] == 0) {
          for (float g : got) EXPECT_EQ(g, 0.0f);
          continue;
        }
        const auto want = attend_ref(f, per_seq[s], &qf[(s * heads + h) * hd], h, lens[s]);
        worst = std::max(worst, rel_err(got, want));
      }
    EXPECT_LT(worst, 1e-2) << what << ", head_dim " << hd;
  }
}

// One sequence of a prefill attention launch: the new tokens [start, start + n)
// of a prompt whose queries by position are q_all and whose cache blocks are
// table (positions up to start + n written). n == 0: a padding row (kv_len 0).
struct PrefillSeq {
  const std::vector<int32_t>* table = nullptr;
  const std::vector<uint16_t>* q_all = nullptr;
  int start = 0, n = 0;
};

// Which prefill kernel: the mma.sync kernel's query rows per warp, or the wgmma
// kernel; query heads per CTA (0: the default).
struct PrefillKernel {
  int warp_rows = 32;
  int heads_per_cta = 0;
  bool wgmma = false;
  std::string name() const {
    return (wgmma ? std::string("wgmma") : std::to_string(warp_rows) + " rows per warp") + ", " +
           std::to_string(heads_per_cta) + " heads per CTA";
  }
};

// The prefill kernels built for head_dim hd: the mma.sync kernel with 32 and 16
// rows per warp, and the wgmma kernel where this build has it.
std::vector<PrefillKernel> prefill_kernels(int heads, int kvh, int hd) {
  std::vector<PrefillKernel> k = {{32}, {16}};
  if (prefill_wgmma_supported(heads, kvh, hd)) k.push_back({0, 0, true});
  return k;
}

// Runs prefill attention over a batch (work items in a scrambled order);
// returns the output rows of every sequence in order, [rows, heads * hd].
std::vector<float> run_prefill_batch(const AttnFixture& f, Bf16Array& d_cache, const std::vector<PrefillSeq>& seqs,
                                     PrefillKernel kernel = {}) {
  const int heads = f.heads, hd = f.hd;
  const size_t row = static_cast<size_t>(heads) * hd;
  std::vector<uint16_t> q;
  std::vector<int32_t> tables = {0}, table_start, kv_len, q_start, q_len, items;
  int rows = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const PrefillSeq& p = seqs[s];
    const int n = std::max(p.n, 1);
    q_start.push_back(rows);
    q_len.push_back(n);
    kv_len.push_back(p.n == 0 ? 0 : p.start + p.n);
    table_start.push_back(static_cast<int32_t>(tables.size()));
    if (p.n == 0) {
      q.insert(q.end(), row, f32_to_bf16(1.0f));
    } else {
      tables.insert(tables.end(), p.table->begin(), p.table->begin() + (p.start + p.n + 15) / 16);
      q.insert(q.end(), p.q_all->begin() + p.start * row, p.q_all->begin() + (p.start + p.n) * row);
    }
    for (int t = 0; t * kPrefillTileRows < n; ++t) items.insert(items.end(), {static_cast<int32_t>(s), t});
    rows += n;
  }
  // The kernel must not care about the order of its work items (the plan sorts them by work).
  std::vector<int> order(items.size() / 2);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<uint32_t>(order.size())));
  std::vector<int32_t> scrambled;
  for (int i : order) scrambled.insert(scrambled.end(), {items[2 * i], items[2 * i + 1]});

  const int S = static_cast<int>(seqs.size());
  Bf16Array d_q(q.size()), d_out(q.size());
  d_q.upload(q);
  DeviceArray<int32_t> d_tables(tables.size()), d_ts(S), d_kv(S), d_qs(S), d_ql(S), d_items(scrambled.size());
  d_tables.upload(tables);
  d_ts.upload(table_start);
  d_kv.upload(kv_len);
  d_qs.upload(q_start);
  d_ql.upload(q_len);
  d_items.upload(scrambled);
  AttentionArgs a = attention_args({B(d_cache), f.L, f.kvh, hd}, f.layer, heads, d_qs.get(), d_ql.get(), d_kv.get(),
                                   d_ts.get(), d_tables.get());
  a.q = B(d_q);
  a.out = B(d_out);
  a.prefill_items = d_items.get();
  a.prefill_heads_per_cta = kernel.heads_per_cta;
  a.prefill_warp_rows = kernel.warp_rows;
  if (kernel.wgmma) {
    EXPECT_EQ(launch_prefill_attention_wgmma(a, static_cast<int>(order.size()), nullptr), cudaSuccess);
  } else {
    EXPECT_EQ(launch_prefill_attention(a, static_cast<int>(order.size()), nullptr), cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return to_f32(d_out.download());
}

// Runs prefill attention for one sequence whose first `start` positions are
// already cached, over its new tokens [start, start + n).
std::vector<float> run_prefill(const AttnFixture& f, Bf16Array& d_cache, const std::vector<int32_t>& table,
                               const std::vector<uint16_t>& q_all, int start, int n, PrefillKernel kernel = {}) {
  return run_prefill_batch(f, d_cache, {{&table, &q_all, start, n}}, kernel);
}

// Fills d_cache (f.cache_elems()) with `tables.size()` prompts of `positions`
// tokens, each in its own scrambled blocks (f.blocks must hold them all);
// every other slot is NaN, which the kernels must never let in.
void fill_prompts(AttnFixture& f, std::vector<std::vector<int32_t>>& tables, int positions, std::mt19937& rng,
                  Bf16Array& d_cache) {
  const int per_table = (positions + 15) / 16;
  std::vector<int32_t> perm(f.blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<uint16_t> cache(f.cache_elems(), 0x7FC0);
  const auto filled = random_bf16(cache.size(), rng);
  for (size_t t = 0; t < tables.size(); ++t) {
    tables[t].assign(perm.begin() + t * per_table, perm.begin() + (t + 1) * per_table);
    for (int p = 0; p < positions; ++p)
      for (int kind = 0; kind < 2; ++kind)
        for (int i = 0; i < f.kvh * f.hd; ++i) {
          const size_t at = f.kv_base(tables[t][p / 16], kind) + (p % 16) * f.kvh * f.hd + i;
          cache[at] = filled[at];
        }
  }
  f.cache = to_f32(cache);
  d_cache.upload(cache);
}

TEST_F(CudaKernels, PrefillAttentionIsCausalMatchesReferenceAndIgnoresChunking) {
  for (auto [heads, kvh, hd] : {std::tuple{16, 8, 128}, std::tuple{4, 2, 64}}) {
    AttnFixture f{heads, kvh, hd};
    f.blocks = 40;
    const int total = 300;  // positions; chunks below cover [0, 300)
    std::vector<std::vector<int32_t>> tables(1);
    Bf16Array d_cache(f.cache_elems());
    fill_prompts(f, tables, total, rng, d_cache);
    const std::vector<int32_t>& table = tables[0];
    auto q = random_bf16(static_cast<size_t>(total) * heads * hd, rng, 2.0f);
    const auto qf = to_f32(q);
    const size_t row = static_cast<size_t>(heads) * hd;

    std::vector<float> whole_by_rows[2];
    for (PrefillKernel k : prefill_kernels(heads, kvh, hd)) {
      const std::string what = "head_dim " + std::to_string(hd) + ", " + k.name();
      // Prefix of 70 cached, then 230 new tokens at once; compare with the reference.
      const auto whole = run_prefill(f, d_cache, table, q, 70, 230, k);
      double worst = 0;
      for (int i = 0; i < 230; i += 7)
        for (int h = 0; h < heads; ++h) {
          const auto want = attend_ref(f, table, &qf[(static_cast<size_t>(70 + i) * heads + h) * hd], h, 70 + i + 1);
          std::vector<float> got(whole.begin() + i * row + h * hd, whole.begin() + i * row + (h + 1) * hd);
          worst = std::max(worst, rel_err(got, want));
        }
      EXPECT_LT(worst, 2e-2) << what;
      // The same rows computed as the chunk [150, 300) (they sit 16 rows earlier in
      // their tiles, so in the other m16 tile of a 32-row warp, or in another warp of
      // a warpgroup): bit-identical.
      const auto tail = run_prefill(f, d_cache, table, q, 150, 150, k);
      EXPECT_TRUE(std::equal(tail.begin(), tail.end(), whole.begin() + 80 * row)) << what;
      // One query head per CTA instead of two: the same arithmetic per row.
      PrefillKernel one_head = k;
      one_head.heads_per_cta = 1;
      EXPECT_EQ(run_prefill(f, d_cache, table, q, 70, 230, one_head), whole) << what;
      if (!k.wgmma) whole_by_rows[k.warp_rows == 16] = whole;
    }
    // At head_dim 64 both kernels take 64-key softmax steps: the same bits.
    if (hd == 64) {
      EXPECT_EQ(whole_by_rows[0], whole_by_rows[1]);
    }
  }
}

TEST_F(CudaKernels, PrefillAttentionRaggedBatchMatchesReferenceAndEachSequenceAlone) {
  // Group sizes 2, 8, 1 and 5 (the odd ones: one query head per CTA), head_dim 128 and 64.
  for (auto [heads, kvh, hd] : {std::tuple{16, 8, 128}, std::tuple{32, 4, 64}, std::tuple{8, 8, 128},
                                std::tuple{4, 2, 64}, std::tuple{40, 8, 128}}) {
    AttnFixture f{heads, kvh, hd};
    f.blocks = 40;
    const int total = 300;
    std::vector<std::vector<int32_t>> tables(2);
    Bf16Array d_cache(f.cache_elems());
    fill_prompts(f, tables, total, rng, d_cache);
    const std::vector<uint16_t> qs[2] = {random_bf16(static_cast<size_t>(total) * heads * hd, rng, 2.0f),
                                         random_bf16(static_cast<size_t>(total) * heads * hd, rng, 2.0f)};
    const std::vector<float> qfs[2] = {to_f32(qs[0]), to_f32(qs[1])};
    // Ragged lengths (tails of 1, 5, 31, 33, 1, 36, 1, 4 rows in the last 64-row
    // tile), cached prefixes aligned or not to the 64-key tiles, a padding row.
    const std::vector<std::tuple<int, int, int>> shape = {{0, 0, 1},    {1, 0, 5},   {0, 7, 31},   {1, 0, 33},
                                                          {-1, 0, 0},   {0, 64, 64}, {1, 13, 65},  {0, 100, 100},
                                                          {1, 3, 129},  {0, 0, 300}, {1, 171, 129}};
    std::vector<PrefillSeq> seqs;
    for (auto [t, start, n] : shape)
      seqs.push_back(t < 0 ? PrefillSeq{} : PrefillSeq{&tables[t], &qs[t], start, n});
    const size_t row = static_cast<size_t>(heads) * hd;
    const std::string config = std::to_string(heads) + "/" + std::to_string(kvh) + " heads, head_dim " +
                               std::to_string(hd);

    std::vector<float> by_rows[2];
    std::vector<float> by_wgmma;
    std::vector<PrefillKernel> kernels;
    for (PrefillKernel k : prefill_kernels(heads, kvh, hd))
      for (int heads_per_cta : {0, 1}) {
        k.heads_per_cta = heads_per_cta;
        kernels.push_back(k);
      }
    for (PrefillKernel k : kernels) {
      const std::string what = config + ", " + k.name();
      const auto out = run_prefill_batch(f, d_cache, seqs, k);
      std::vector<float>& first = k.wgmma ? by_wgmma : by_rows[k.warp_rows == 16];
      if (!first.empty()) {
        EXPECT_EQ(out, first) << what;  // heads per CTA change nothing
        continue;
      }
      first = out;
      double worst = 0;
      size_t at = 0;
      for (size_t s = 0; s < seqs.size(); ++s) {
        const PrefillSeq& p = seqs[s];
        if (p.n == 0) {
          for (size_t i = 0; i < row; ++i) EXPECT_EQ(out[at * row + i], 0.0f) << what << ": padding row";
          ++at;
          continue;
        }
        const int t = p.table == &tables[0] ? 0 : 1;
        for (int i = 0; i < p.n; ++i, ++at)
          for (int h : {0, 1, heads / 2, heads - 1}) {  // the first and last kv heads, and one between
            const int pos = p.start + i;
            const auto want = attend_ref(f, *p.table, &qfs[t][(static_cast<size_t>(pos) * heads + h) * hd], h, pos + 1);
            std::vector<float> got(out.begin() + at * row + h * hd, out.begin() + at * row + (h + 1) * hd);
            worst = std::max(worst, rel_err(got, want));
          }
      }
      EXPECT_LT(worst, 2e-2) << what;
      // Each sequence run alone: the same bits as inside the batch.
      at = 0;
      for (const PrefillSeq& p : seqs) {
        const size_t n = std::max(p.n, 1);
        if (p.n > 0) {
          const auto alone = run_prefill_batch(f, d_cache, {p}, k);
          EXPECT_TRUE(std::equal(alone.begin(), alone.end(), out.begin() + at * row))
              << what << ": chunk [" << p.start << ", " << p.start + p.n << ") alone";
        }
        at += n;
      }
    }
    if (hd == 64) {
      EXPECT_EQ(by_rows[0], by_rows[1]) << config;
    }
  }
}

// Long prompts (24 key tiles, both K/V stages many times over): the wgmma kernel
// against the reference and against the mma.sync kernel, row by row.
TEST_F(CudaKernels, PrefillAttentionWgmmaMatchesTheMmaKernelOnLongPrompts) {
  const int heads = 16, kvh = 8, hd = 128;
  if (!prefill_wgmma_supported(heads, kvh, hd)) GTEST_SKIP() << "built without the wgmma kernels (sm_90a)";
  AttnFixture f{heads, kvh, hd};
  const int total = 1500;
  f.blocks = 2 * (total + 15) / 16;
  std::vector<std::vector<int32_t>> tables(2);
  Bf16Array d_cache(f.cache_elems());
  fill_prompts(f, tables, total, rng, d_cache);
  const auto q0 = random_bf16(static_cast<size_t>(total) * heads * hd, rng, 2.0f);
  const auto q1 = random_bf16(static_cast<size_t>(total) * heads * hd, rng, 2.0f);
  const auto qf = to_f32(q0);
  // A whole prompt and, beside it, the second half of another behind its cached first half.
  const std::vector<PrefillSeq> seqs = {{&tables[0], &q0, 0, total}, {&tables[1], &q1, 700, total - 700}};
  const auto got = run_prefill_batch(f, d_cache, seqs, {0, 0, true});
  const auto mma = run_prefill_batch(f, d_cache, seqs, {32});
  const size_t row = static_cast<size_t>(heads) * hd;
  ASSERT_EQ(got.size(), mma.size());
  double worst_mma = 0;
  for (size_t r = 0; r < got.size() / row; ++r)
    worst_mma = std::max(worst_mma, rel_err(std::vector<float>(got.begin() + r * row, got.begin() + (r + 1) * row),
                                            std::vector<float>(mma.begin() + r * row, mma.begin() + (r + 1) * row)));
  EXPECT_LT(worst_mma, 1e-2);
  double worst = 0;
  for (int pos = 0; pos < total; pos += 97)
    for (int h : {0, 7, 15}) {
      const auto want = attend_ref(f, tables[0], &qf[(static_cast<size_t>(pos) * heads + h) * hd], h, pos + 1);
      worst = std::max(worst, rel_err(std::vector<float>(got.begin() + pos * row + h * hd,
                                                         got.begin() + pos * row + (h + 1) * hd),
                                      want));
    }
  EXPECT_LT(worst, 2e-2);
}

// Batch-invariant mode: a one-token chunk (a 1-row work item: row 0 of warp 0)
// must give the bits its row gets inside a longer chunk, at any of the 64 row
// slots of a tile (either warp, either m16 tile of a 32-row warp, rows g and g + 8).
TEST_F(CudaKernels, PrefillAttentionOneTokenChunksMatchTheirRowsInLongerChunks) {
  for (auto [heads, kvh, hd] : {std::tuple{16, 8, 128}, std::tuple{4, 2, 64}}) {
    AttnFixture f{heads, kvh, hd};
    f.blocks = 40;
    const int total = 300;
    std::vector<std::vector<int32_t>> tables(1);
    Bf16Array d_cache(f.cache_elems());
    fill_prompts(f, tables, total, rng, d_cache);
    const auto q = random_bf16(static_cast<size_t>(total) * heads * hd, rng, 2.0f);
    const size_t row = static_cast<size_t>(heads) * hd;
    for (PrefillKernel k : prefill_kernels(heads, kvh, hd))
      for (auto [start, n] : {std::pair{0, 200}, std::pair{70, 230}}) {
        const std::string what = "head_dim " + std::to_string(hd) + ", " + k.name() + ", chunk [" +
                                 std::to_string(start) + ", " + std::to_string(start + n) + ")";
        const auto chunk = run_prefill(f, d_cache, tables[0], q, start, n, k);
        // Every row of the chunk again as a one-token chunk, all in one launch (as a
        // batch-invariant decode step runs them), with a padding row among them.
        std::vector<PrefillSeq> singles;
        for (int i = 0; i < n; ++i) {
          singles.push_back({&tables[0], &q, start + i, 1});
          if (i == n / 2) singles.push_back({});
        }
        const auto one = run_prefill_batch(f, d_cache, singles, k);
        for (int i = 0, at = 0; i < n; ++i, ++at) {
          if (i == n / 2 + 1) ++at;  // the padding row
          EXPECT_TRUE(std::equal(one.begin() + at * row, one.begin() + (at + 1) * row, chunk.begin() + i * row))
              << what << ": position " << start + i << " (row " << i % kPrefillTileRows << " of its tile)";
        }
      }
  }
}

// Batch-invariant decode attention (launch_decode_attention_invariant) against
// the prefill kernel it reproduces, over the same rows run as one-token chunks
// (what batch-invariant mode ran before, and what it runs for a decode row's
// token inside a chunk): every output row and the KV it writes bit-identical,
// for every prefill kernel of the build (the wgmma kernel, the mma.sync kernel
// at 32 and at 16 rows per warp), at the 0.6B shape, a GQA-group-5 shape and
// head_dim 64, alone at contexts of 1, 63, 64, 65, 200, 1000 and 4097 tokens and
// in batches of 3, 37 and 256 mixed ones (37: a padding row among them; 37 and
// 256 take the kernel of two K/V stages, the smaller grids four),
// both with q and the new K/V row from launch_qk_norm_rope_kv (a mixed pass) and
// doing that work itself (a pure decode pass); and within bf16 tolerance of
// attention in double. The cache holds NaN past each context and at the new
// token's slot until it is written, which neither kernel may let in.
struct InvariantDecodeBatch {
  std::string name;
  std::vector<int> lens;  // context per sequence, the new token included (0: padding)
};

std::vector<InvariantDecodeBatch> invariant_decode_batches() {
  const std::vector<int> contexts = {1, 63, 64, 65, 200, 1000, 4097};
  std::vector<InvariantDecodeBatch> out;
  for (int c : contexts) out.push_back({"alone, context " + std::to_string(c), {c}});
  out.push_back({"batch 3", {4097, 1, 200}});
  InvariantDecodeBatch b37{"batch 37", {}};
  for (int i = 0; i < 37; ++i) b37.lens.push_back(i == 17 ? 0 : contexts[(5 * i) % 7]);
  out.push_back(b37);
  InvariantDecodeBatch b256{"batch 256", {}};
  const int mix[8] = {1, 63, 64, 65, 200, 1000, 129, 2};
  for (int i = 0; i < 256; ++i) b256.lens.push_back(i == 3 || i == 100 || i == 200 || i == 255 ? 4097 : mix[i % 8]);
  out.push_back(b256);
  return out;
}

// softmax(q . k_p / sqrt(hd), p < n) . v_p in double, over a bf16 cache on the host.
std::vector<float> attend_ref_bf16(const std::vector<uint16_t>& cache, int L, int layer, int kvh, int hd,
                                   const std::vector<int32_t>& table, const uint16_t* q, int kv_head, int n) {
  auto at = [&](int p, int kind) {
    return &cache[((static_cast<size_t>(table[p / 16]) * L + layer) * 2 + kind) * 16 * kvh * hd +
                  (static_cast<size_t>(p % 16) * kvh + kv_head) * hd];
  };
  std::vector<double> s(n);
  double mx = -1e300;
  for (int p = 0; p < n; ++p) {
    double d = 0;
    for (int i = 0; i < hd; ++i) d += static_cast<double>(bf16_to_f32(q[i])) * bf16_to_f32(at(p, 0)[i]);
    s[p] = d / std::sqrt(static_cast<double>(hd));
    mx = std::max(mx, s[p]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - mx));
  std::vector<double> acc(hd, 0.0);
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < hd; ++i) acc[i] += s[p] * bf16_to_f32(at(p, 1)[i]);
  std::vector<float> o(hd);
  for (int i = 0; i < hd; ++i) o[i] = static_cast<float>(acc[i] / sum);
  return o;
}

// Where two output images first differ: "row r, head h, dimension d: x vs y", or "".
std::string first_difference(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int heads, int hd) {
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    if (got[i] != want[i]) {
      const size_t row = i / (static_cast<size_t>(heads) * hd), h = i / hd % heads, d = i % hd;
      return "row " + std::to_string(row) + ", head " + std::to_string(h) + ", dimension " + std::to_string(d) + ": " +
             std::to_string(bf16_to_f32(got[i])) + " vs " + std::to_string(bf16_to_f32(want[i]));
    }
  return got.size() == want.size() ? "" : "sizes differ";
}

TEST_F(CudaKernels, InvariantDecodeAttentionGivesThePrefillKernelsBits) {
  for (auto [heads, kvh, hd] : {std::tuple{16, 8, 128}, std::tuple{40, 8, 128}, std::tuple{4, 2, 64}}) {
    const int L = 2, layer = 1, group = heads / kvh;
    const int qd = heads * hd, kvd = kvh * hd, cols = qd + 2 * kvd;
    const size_t block_elems = static_cast<size_t>(L) * 2 * 16 * kvd;
    auto slot_at = [&](int block, int kind, int slot) {
      return ((static_cast<size_t>(block) * L + layer) * 2 + kind) * 16 * kvd + static_cast<size_t>(slot) * kvd;
    };
    // q/k norm + RoPE inputs of the pure decode pass.
    const int max_pos = 4097;
    std::vector<float> inv(hd / 2);
    for (int i = 0; i < hd / 2; ++i) inv[i] = static_cast<float>(1.0 / std::pow(1e6, (2.0 * i) / hd));
    DeviceArray<float> d_inv(hd / 2);
    d_inv.upload(inv);
    DeviceArray<__nv_bfloat162> d_rope(static_cast<size_t>(max_pos) * hd / 2);
    CUDA_OK(launch_rope_table(d_inv.get(), hd, max_pos, d_rope.get(), nullptr));
    Bf16Array d_qn(hd), d_kn(hd);
    d_qn.upload(random_bf16(hd, rng, 0.1f, 1.0f));
    d_kn.upload(random_bf16(hd, rng, 0.1f, 1.0f));

    for (const InvariantDecodeBatch& batch : invariant_decode_batches()) {
      const std::vector<int>& lens = batch.lens;
      const int S = static_cast<int>(lens.size());
      const std::string config = std::to_string(heads) + "/" + std::to_string(kvh) + " heads, head_dim " +
                                 std::to_string(hd) + ", " + batch.name;
      // Each sequence in scrambled blocks of its own; NaN past its context in its last block.
      int blocks = 0;
      for (int n : lens) blocks += (n + 15) / 16;
      blocks = std::max(blocks, 1);
      std::vector<int32_t> perm(blocks);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<std::vector<int32_t>> tables(S);
      std::vector<int32_t> flat = {0}, table_start, kv_len, q_start, q_len, positions, slots, items, decode;
      int next = 0;
      for (int s = 0; s < S; ++s) {
        for (int b = 0; b < (lens[s] + 15) / 16; ++b) tables[s].push_back(perm[next++]);
        table_start.push_back(lens[s] > 0 ? static_cast<int32_t>(flat.size()) : 0);
        flat.insert(flat.end(), tables[s].begin(), tables[s].end());
        kv_len.push_back(lens[s]);
        q_start.push_back(s);
        q_len.push_back(1);
        const int pos = std::max(lens[s] - 1, 0);
        positions.push_back(pos);
        slots.push_back(lens[s] > 0 ? tables[s][pos / 16] * 16 + pos % 16 : -1);
        items.insert(items.end(), {s, 0});
        decode.push_back(s);
      }
      // Neither kernel may depend on the order of its sequences or work items.
      std::shuffle(decode.begin(), decode.end(), rng);
      std::vector<int> order(S);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<int32_t> scrambled;
      for (int i : order) scrambled.insert(scrambled.end(), {items[2 * i], items[2 * i + 1]});

      const size_t cache_elems = static_cast<size_t>(blocks) * block_elems;
      Bf16Array d_base(cache_elems), d_ref(cache_elems), d_new(cache_elems);
      CUDA_OK(launch_fill_random_bf16(B(d_base), cache_elems, 77 + S, 1.0f, nullptr));
      auto poison = [&](Bf16Array& cache, int s, int p) {
        for (int kind = 0; kind < 2; ++kind)
          CUDA_OK(cudaMemset(cache.get() + slot_at(tables[s][p / 16], kind, p % 16), 0xFF, kvd * 2));
      };
      for (int s = 0; s < S; ++s)
        for (int p = lens[s]; p < (lens[s] + 15) / 16 * 16; ++p) poison(d_base, s, p);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> base = d_base.download();

      DeviceArray<int32_t> d_tables(flat.size()), d_ts(S), d_kv(S), d_qs(S), d_ql(S), d_pos(S), d_slots(S),
          d_items(2 * S), d_dec(S);
      d_tables.upload(flat);
      d_ts.upload(table_start);
      d_kv.upload(kv_len);
      d_qs.upload(q_start);
      d_ql.upload(q_len);
      d_pos.upload(positions);
      d_slots.upload(slots);
      d_items.upload(scrambled);
      d_dec.upload(decode);
      const auto q = random_bf16(static_cast<size_t>(S) * qd, rng, 2.0f);
      const auto qkv = random_bf16(static_cast<size_t>(S) * cols, rng);
      Bf16Array d_q(q.size()), d_qkv(qkv.size()), d_q_roped(q.size()), d_out(q.size());
      d_q.upload(q);
      d_qkv.upload(qkv);
      auto args = [&](bf16* cache, const bf16* q_rows) {
        AttentionArgs a = attention_args({cache, L, kvh, hd}, layer, heads, d_qs.get(), d_ql.get(), d_kv.get(),
                                         d_ts.get(), d_tables.get());
        a.q = q_rows;
        a.out = B(d_out);
        a.decode_seqs = d_dec.get();
        a.prefill_items = d_items.get();
        return a;
      };
      auto prefill = [&](const AttentionArgs& a, const PrefillKernel& k) {
        AttentionArgs p = a;
        p.prefill_heads_per_cta = k.heads_per_cta;
        p.prefill_warp_rows = k.warp_rows;
        CUDA_OK(cudaMemset(d_out.get(), 0xFF, q.size() * 2));
        if (k.wgmma) {
          CUDA_OK(launch_prefill_attention_wgmma(p, S, nullptr));
        } else {
          CUDA_OK(launch_prefill_attention(p, S, nullptr));
        }
        CUDA_OK(cudaDeviceSynchronize());
      };
      auto decode_rows = [&](AttentionArgs a, const PrefillKernel& k, int warps = 0) {
        a.prefill_warp_rows = k.warp_rows;
        CUDA_OK(cudaMemset(d_out.get(), 0xFF, q.size() * 2));
        CUDA_OK(launch_decode_attention_invariant(a, S, k.wgmma, nullptr, warps));
        CUDA_OK(cudaDeviceSynchronize());
      };
      auto check_reference = [&](const std::vector<uint16_t>& out, const std::vector<uint16_t>& q_rows,
                                 const std::vector<uint16_t>& cache, const std::string& what) {
        double worst = 0;
        for (int s = 0; s < S; ++s) {
          if (lens[s] == 0) {
            for (int i = 0; i < qd; ++i) ASSERT_EQ(out[static_cast<size_t>(s) * qd + i], 0) << what << ": padding";
            continue;
          }
          if (s % std::max(1, S / 6) != 0 && lens[s] != 4097) continue;
          for (int h : {0, group - 1, heads / 2, heads - 1}) {
            const uint16_t* qh = &q_rows[(static_cast<size_t>(s) * heads + h) * hd];
            const auto want = attend_ref_bf16(cache, L, layer, kvh, hd, tables[s], qh, h / group, lens[s]);
            std::vector<float> got(hd);
            for (int i = 0; i < hd; ++i) got[i] = bf16_to_f32(out[(static_cast<size_t>(s) * heads + h) * hd + i]);
            worst = std::max(worst, rel_err(got, want));
          }
        }
        EXPECT_LT(worst, 2e-2) << what;
      };

      for (PrefillKernel k : prefill_kernels(heads, kvh, hd)) {
        const std::string what = config + ", " + k.name();
        // A mixed pass: q and the new K/V row from launch_qk_norm_rope_kv (here: given).
        prefill(args(B(d_base), B(d_q)), k);
        const auto want = d_out.download();
        decode_rows(args(B(d_base), B(d_q)), k);
        const auto got = d_out.download();
        EXPECT_TRUE(got == want) << what << ", q given: " << first_difference(got, want, heads, hd);
        check_reference(got, q, base, what + ", q given");
        // Each warp count the build has for this kernel, named: the same bits (8 warps only at
        // head_dim 128 with 64-key softmax steps).
        for (int warps : {4, 8}) {
          if (warps == 8 && !(hd == 128 && (k.wgmma || k.warp_rows == 16))) {
            AttentionArgs a = args(B(d_base), B(d_q));
            a.prefill_warp_rows = k.warp_rows;
            EXPECT_EQ(launch_decode_attention_invariant(a, S, k.wgmma, nullptr, warps), cudaErrorInvalidValue) << what;
            continue;
          }
          decode_rows(args(B(d_base), B(d_q)), k, warps);
          const auto got_w = d_out.download();
          EXPECT_TRUE(got_w == want) << what << ", " << warps << " warps: " << first_difference(got_w, want, heads, hd);
        }
        // The same row as the last of a 70-row chunk.
        if (S == 1 && lens[0] >= 70) {
          const int n = 70;
          auto chunk_q = random_bf16(static_cast<size_t>(n) * qd, rng, 2.0f);
          std::copy(q.begin(), q.end(), chunk_q.end() - qd);
          Bf16Array d_chunk_q(chunk_q.size()), d_chunk_out(chunk_q.size());
          d_chunk_q.upload(chunk_q);
          DeviceArray<int32_t> d_zero(1), d_n(1), d_chunk_items(4);
          d_zero.upload(std::vector<int32_t>{0});
          d_n.upload(std::vector<int32_t>{n});
          d_chunk_items.upload(std::vector<int32_t>{0, 0, 0, 1});  // its two tiles: the row is row 5 of the second
          AttentionArgs c = attention_args({B(d_base), L, kvh, hd}, layer, heads, d_zero.get(), d_n.get(), d_kv.get(),
                                           d_ts.get(), d_tables.get());
          c.q = B(d_chunk_q);
          c.out = B(d_chunk_out);
          c.prefill_items = d_chunk_items.get();
          c.prefill_heads_per_cta = k.heads_per_cta;
          c.prefill_warp_rows = k.warp_rows;
          CUDA_OK(k.wgmma ? launch_prefill_attention_wgmma(c, 2, nullptr) : launch_prefill_attention(c, 2, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          const auto chunk_out = d_chunk_out.download();
          EXPECT_TRUE(std::equal(got.begin(), got.end(), chunk_out.end() - qd))
              << what << ": the row inside a chunk of " << n;
        }

        // A pure decode pass: launch_qk_norm_rope_kv then the prefill kernel, against the
        // decode kernel doing the q/k norm, RoPE and KV write itself. The new slots start as NaN.
        for (Bf16Array* c : {&d_ref, &d_new}) {
          CUDA_OK(cudaMemcpy(c->get(), d_base.get(), cache_elems * 2, cudaMemcpyDeviceToDevice));
          for (int s = 0; s < S; ++s)
            if (lens[s] > 0) poison(*c, s, lens[s] - 1);
        }
        CUDA_OK(launch_qk_norm_rope_kv(B(d_qkv), S, d_pos.get(), d_slots.get(), B(d_qn), B(d_kn), d_rope.get(), heads,
                                       kvh, hd, 1e-6f, B(d_q_roped), {B(d_ref), L, kvh, hd}, layer, nullptr));
        prefill(args(B(d_ref), B(d_q_roped)), k);
        const auto want_fused = d_out.download();
        AttentionArgs a = args(B(d_new), nullptr);
        a.qkv = B(d_qkv);
        a.positions = d_pos.get();
        a.slots = d_slots.get();
        a.q_norm = B(d_qn);
        a.k_norm = B(d_kn);
        a.rope_table = d_rope.get();
        a.eps = 1e-6f;
        decode_rows(a, k);
        const auto got_fused = d_out.download();
        EXPECT_TRUE(got_fused == want_fused)
            << what << ", q/k norm + RoPE fused: " << first_difference(got_fused, want_fused, heads, hd);
        const auto cache_ref = d_ref.download(), cache_new = d_new.download();
        EXPECT_TRUE(cache_ref == cache_new) << what << ": the KV written";
        check_reference(got_fused, d_q_roped.download(), cache_ref, what + ", fused");
        // Twice in a row: the same bits (nothing carries over between launches).
        decode_rows(a, k);
        EXPECT_TRUE(d_out.download() == got_fused) << what << ", second launch";
      }
    }
  }
  // Shapes without a kernel are refused, not run.
  AttentionArgs bad;
  bad.num_heads = 16;
  bad.num_kv_heads = 8;
  bad.head_dim = 96;
  EXPECT_EQ(launch_decode_attention_invariant(bad, 1, false, nullptr), cudaErrorInvalidValue);
  bad.head_dim = 64;
  EXPECT_EQ(launch_decode_attention_invariant(bad, 1, true, nullptr), cudaErrorInvalidValue);  // wgmma: head_dim 128
  bad.head_dim = 128;
  EXPECT_EQ(launch_decode_attention_invariant(bad, 1, true, nullptr, 6), cudaErrorInvalidValue);  // no 6-warp kernel
}

TEST_F(CudaKernels, SamplingMatchesTheEngineSampler) {
  const int V = 151936, R = 48;
  std::vector<float> logits(static_cast<size_t>(R) * V);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (auto& x : logits) x = d(rng);
  // Row 0: ties at the max (lowest id wins), NaN and +inf handling in row 1.
  logits[17] = logits[5] = 100.0f;
  logits[V + 9] = std::numeric_limits<float>::quiet_NaN();
  logits[V + 99] = std::numeric_limits<float>::infinity();
  DeviceArray<float> d_logits(logits.size());
  d_logits.upload(logits);

  std::vector<SamplingRowParams> params(R);
  std::vector<SamplingParams> host(R);
  std::vector<int32_t> banned;
  for (int r = 0; r < R; ++r) {
    SamplingParams& p = host[r];
    p.seed = 1000 + r;
    switch (r % 8) {
      case 0: p.temperature = 0.0; break;
      case 1: p.temperature = 0.8; break;
      case 2: p.temperature = 1.0; p.top_k = 50; break;
      case 3: p.temperature = 0.7; p.top_p = 0.9; break;
      case 4: p.temperature = 1.3; p.top_k = 200; p.top_p = 0.5; break;
      case 5: p.temperature = 0.9; p.min_p = 0.05; break;
      case 6: p.temperature = 2.0; p.top_p = 0.95; p.min_p = 0.01; break;
      case 7: p.temperature = 0.6; p.top_k = 1; break;
    }
    SamplingRowParams& g = params[r];
    g.temperature = p.temperature;
    g.top_p = p.top_p;
    g.top_k = p.top_k;
    g.min_p = p.min_p;
    g.uniform = to_unit_interval(request_draw(*p.seed, 3));
    g.banned_begin = static_cast<int32_t>(banned.size());
    if (r % 5 == 1) banned.push_back(7);
    g.banned_end = static_cast<int32_t>(banned.size());
  }
  if (banned.empty()) banned.push_back(0);
  DeviceArray<SamplingRowParams> d_params(R);
  d_params.upload(params);
  DeviceArray<int32_t> d_banned(banned.size()), d_tokens(R);
  d_banned.upload(banned);
  CUDA_OK(launch_sample_tokens(d_logits.get(), R, V, d_params.get(), d_banned.get(), d_tokens.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto tokens = d_tokens.download();
  RandomGenerator unused(1);
  int host_fallbacks = 0;
  for (int r = 0; r < R; ++r) {
    std::vector<float> row(logits.begin() + static_cast<size_t>(r) * V, logits.begin() + static_cast<size_t>(r + 1) * V);
    for (int b = params[r].banned_begin; b < params[r].banned_end; ++b) row[banned[b]] = -std::numeric_limits<float>::infinity();
    const int32_t want = sample(row, host[r], 3, unused);
    if (tokens[r] == kSampleOnHost) {
      ++host_fallbacks;
      continue;
    }
    EXPECT_EQ(tokens[r], want) << "row " << r << " (case " << r % 8 << ")";
  }
  EXPECT_EQ(tokens[0], 5);
  EXPECT_EQ(tokens[8], static_cast<int32_t>(std::max_element(logits.begin() + 8 * V, logits.begin() + 9 * V) -
                                            (logits.begin() + 8 * V)));
  // With each row's first maximum given as a key (the LM head GEMV's): the same
  // tokens (rows with banned ids ignore the key). Row 2 with NaN and +inf, unbanned.
  logits[2 * V + 11] = std::numeric_limits<float>::quiet_NaN();
  logits[2 * V + 12] = std::numeric_limits<float>::infinity();
  d_logits.upload(logits);
  CUDA_OK(launch_sample_tokens(d_logits.get(), R, V, d_params.get(), d_banned.get(), d_tokens.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto scanned = d_tokens.download();
  std::vector<unsigned long long> keys(R);
  for (int r = 0; r < R; ++r) keys[r] = first_max_key(logits.data() + static_cast<size_t>(r) * V, V);
  DeviceArray<unsigned long long> d_keys(R);
  d_keys.upload(keys);
  CUDA_OK(launch_sample_tokens(d_logits.get(), R, V, d_params.get(), d_banned.get(), d_tokens.get(), nullptr,
                               d_keys.get()));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(d_tokens.download(), scanned);
  EXPECT_EQ(scanned[2], 12);  // +inf counts as the largest float
  // With logits of scale 3 over 152k ids, a 0.9 nucleus may exceed the sorted
  // capacity; those rows are for the host, never a wrong token.
  RecordProperty("host_fallbacks", host_fallbacks);
}

}  // namespace
}  // namespace siesta::cuda

#else

TEST(CudaKernels, NotBuilt) { GTEST_SKIP() << "siesta was built without CUDA (nvcc not found)"; }

#endif
