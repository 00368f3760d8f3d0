// The projections of the Qwen3 shapes, one GEMM at a time: cuBLASLt (the
// default mode's projection) against the batch-invariant fixed-order GEMM,
// on its mma.sync kernel and on its warpgroup-MMA kernel (sm_90a builds), in
// the same run. Each time is the median of 20 launches (CUDA events) after
// 3 untimed ones, bf16 output, fp32 for the LM head.
//
//   cuda_gemm_bench [--out FILE.json] [--commit SHA] [--m 16,32,64,128,256,512,4096]
#if defined(SIESTA_HAVE_CUDA)

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_report.h"
#include "model/cuda/cublaslt_gemm.h"
#include "model/cuda/kernels.h"

using namespace siesta;

namespace {

struct Shape {
  const char* model;
  const char* name;
  int N, K;
  bool f32;
};

void die(const std::string& what) {
  std::fprintf(stderr, "cuda_gemm_bench: %s\n", what.c_str());
  std::exit(1);
}
void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

template <typename F>
double median_us(F&& launch, cudaStream_t s) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "event");
  ok(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) launch();
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    ok(cudaEventRecord(a, s), "record");
    launch();
    ok(cudaEventRecord(b, s), "record");
    ok(cudaEventSynchronize(b), "sync");
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(ms * 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string out, commit = "unknown";
  std::vector<int> ms = {16, 32, 64, 128, 256, 512, 4096};
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die(k + " needs a value");
      return argv[++i];
    };
    if (k == "--out") {
      out = next();
    } else if (k == "--commit") {
      commit = next();
    } else if (k == "--m") {
      ms.clear();
      std::string v = next();
      for (size_t p = 0; p <= v.size();) {
        const size_t q = v.find(',', p);
        ms.push_back(std::atoi(v.substr(p, q - p).c_str()));
        if (q == std::string::npos) break;
        p = q + 1;
      }
    } else {
      die("unknown argument " + k);
    }
  }
  const std::vector<Shape> shapes = {
      {"0.6b", "qkv", 4096, 1024, false},       {"0.6b", "o", 1024, 2048, false},
      {"0.6b", "gate_up", 6144, 1024, false},   {"0.6b", "down", 1024, 3072, false},
      {"0.6b", "lm_head", 151936, 1024, true},  {"8b", "qkv", 6144, 4096, false},
      {"8b", "o", 4096, 4096, false},           {"8b", "gate_up", 24576, 4096, false},
      {"8b", "down", 4096, 12288, false},
  };
  size_t max_w = 0, max_a = 0, max_y = 0;
  const int max_m = *std::max_element(ms.begin(), ms.end());
  for (const Shape& s : shapes) {
    max_w = std::max(max_w, static_cast<size_t>(s.N) * s.K);
    max_a = std::max(max_a, static_cast<size_t>(max_m) * s.K);
    max_y = std::max(max_y, static_cast<size_t>(max_m) * s.N * 4);
  }
  void *w, *a, *y, *ws;
  const size_t ws_bytes = 64u << 20;
  ok(cudaMalloc(&w, max_w * 2), "weights");
  ok(cudaMalloc(&a, max_a * 2), "input");
  ok(cudaMalloc(&y, max_y), "output");
  ok(cudaMalloc(&ws, ws_bytes), "workspace");
  // Random-ish bf16 bits (finite, small): the time does not depend on the values.
  {
    std::vector<uint16_t> h(std::max(max_w, max_a));
    uint32_t x = 12345;
    for (auto& v : h) {
      x = x * 1664525u + 1013904223u;
      v = static_cast<uint16_t>(0x3c00 | (x >> 22));
    }
    ok(cudaMemcpy(w, h.data(), max_w * 2, cudaMemcpyHostToDevice), "upload");
    ok(cudaMemcpy(a, h.data(), max_a * 2, cudaMemcpyHostToDevice), "upload");
  }
  cudaStream_t s;
  ok(cudaStreamCreate(&s), "stream");
  auto gemm = cuda::CublasLtGemm::create(ws, ws_bytes);
  if (!gemm) die("cuBLASLt: " + gemm.error().message);
  const bool wgmma = cuda::fixed_gemm_wgmma_supported(1024, 1024);
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%-5s %-8s %6s %6s %6s %10s %10s %10s %8s\n", "model", "gemm", "M", "N", "K", "cublas_us", "mma_us",
              "wgmma_us", "ratio");
  for (const Shape& sh : shapes) {
    for (int M : ms) {
      const cuda::bf16* A = static_cast<const cuda::bf16*>(a);
      const cuda::bf16* W = static_cast<const cuda::bf16*>(w);
      const double cublas = median_us(
          [&] {
            auto r = (*gemm)->run(A, W, y, sh.f32, M, sh.N, sh.K, s);
            if (!r) die(r.error().message);
          },
          s);
      cuda::FixedGemmOptions mma;
      mma.kernel = 1;
      const double t_mma =
          median_us([&] { ok(cuda::launch_fixed_gemm(A, W, y, sh.f32, M, sh.N, sh.K, s, mma), "mma"); }, s);
      double t_wg = 0;
      nlohmann::json tiles;  // the wgmma kernel at each tile shape (unsplit), against its own choice
      if (wgmma && cuda::fixed_gemm_wgmma_supported(sh.N, sh.K)) {
        cuda::FixedGemmOptions o;
        o.workspace = ws;
        o.workspace_bytes = ws_bytes;
        t_wg = median_us([&] { ok(cuda::launch_fixed_gemm(A, W, y, sh.f32, M, sh.N, sh.K, s, o), "wgmma"); }, s);
        for (auto [tm, tn] : {std::pair{64, 64}, std::pair{64, 128}, std::pair{128, 64}, std::pair{128, 128}}) {
          cuda::FixedGemmOptions t = o;
          t.tile_m = tm;
          t.tile_n = tn;
          t.splits = 1;
          tiles[std::to_string(tm) + "x" + std::to_string(tn)] = median_us(
              [&] { ok(cuda::launch_fixed_gemm(A, W, y, sh.f32, M, sh.N, sh.K, s, t), "wgmma tile"); }, s);
        }
        cuda::FixedGemmOptions cp = o;  // the cp.async kernel at its own tile and split choice
        cp.kernel = 2;
        tiles["cp_async"] =
            median_us([&] { ok(cuda::launch_fixed_gemm(A, W, y, sh.f32, M, sh.N, sh.K, s, cp), "wgmma cp"); }, s);
        // The TMA kernel unsplit at each tile width, alone and in clusters of two (multicast weights).
        for (int kernel : {3, 4})
          for (int tn : {128, 64}) {
            cuda::FixedGemmOptions tma;
            tma.kernel = kernel;
            tma.tile_n = tn;
            tma.splits = 1;
            tiles[std::string(kernel == 3 ? "tma128x" : "tma_cluster128x") + std::to_string(tn)] = median_us(
                [&] { ok(cuda::launch_fixed_gemm(A, W, y, sh.f32, M, sh.N, sh.K, s, tma), "wgmma tma"); }, s);
          }
      }
      const double best = t_wg > 0 ? std::min(t_wg, t_mma) : t_mma;
      std::printf("%-5s %-8s %6d %6d %6d %10.1f %10.1f %10.1f %8.2f", sh.model, sh.name, M, sh.N, sh.K, cublas,
                  t_mma, t_wg, cublas / best);
      for (auto it = tiles.begin(); it != tiles.end(); ++it)
        std::printf("  %s %.1f", it.key().c_str(), it.value().get<double>());
      std::printf("\n");
      rows.push_back({{"model", sh.model}, {"gemm", sh.name}, {"M", M}, {"N", sh.N}, {"K", sh.K},
                      {"cublaslt_us", cublas}, {"fixed_mma_us", t_mma}, {"fixed_wgmma_us", t_wg},
                      {"cublaslt_over_fixed", cublas / best},
                      {"tflops_fixed", 2.0 * M * sh.N * sh.K / best / 1e6}, {"wgmma_tiles_us", tiles}});
    }
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json doc = {{"machine", bench::machine()}, {"gpu", prop.name}, {"date", date}, {"commit", commit},
                        {"what", "median of 20 launches per GEMM; ratio = cuBLASLt time / fixed-order time"},
                        {"rows", rows}};
  if (!out.empty()) std::ofstream(out) << doc.dump(2) << "\n";
  return 0;
}

#else
#include <cstdio>
int main() {
  std::puts("cuda_gemm_bench: built without CUDA");
  return 0;
}
#endif
