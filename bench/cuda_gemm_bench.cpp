// The projections of the Qwen3 shapes, one GEMM at a time: cuBLASLt (the
// default mode's projection) against the batch-invariant fixed-order GEMM,
// on its mma.sync kernel and on its warpgroup-MMA kernel (sm_90a builds), in
// the same run. Each time is the median of 20 launches (CUDA events) after
// 3 untimed ones, bf16 output, fp32 for the LM head.
//
// --cublas-tiles M,...: at these row counts, also cuBLASLt held to one tile
// shape at a time, unsplit: the heuristic's list (64 entries at most; its
// first is what the default mode runs), each entry again at every tile shape
// of 64 to 256 a side, and every algorithm id at each of its tiles and stage
// counts; each configuration that cublasLtMatmulAlgoCheck accepts timed as
// the median of 7 launches (15 s per GEMM at most), the fastest kept per tile
// shape: what cuBLASLt reaches with its output tile held to the fixed GEMM's
// 128 x 128, against its best at any tile.
//
//   cuda_gemm_bench [--out FILE.json] [--commit SHA] [--m 16,32,64,128,256,512,4096]
//                   [--cublas-tiles 4096]
#if defined(SIESTA_HAVE_CUDA)

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

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

void ok_lt(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS) die(std::string(what) + ": " + cublasLtGetStatusString(e));
}

template <typename F>
double median_us(F&& launch, cudaStream_t s, int reps = 20) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "event");
  ok(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) launch();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
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

// The tile shape a cuBLASLt tile id names, as "RxC" in cuBLASLt's column-major
// view (rows along the weights' N, columns along the tokens' M).
std::string tile_name(uint32_t id) {
  static const std::map<uint32_t, const char*> names = {
      {CUBLASLT_MATMUL_TILE_64x64, "64x64"},     {CUBLASLT_MATMUL_TILE_64x128, "64x128"},
      {CUBLASLT_MATMUL_TILE_128x64, "128x64"},   {CUBLASLT_MATMUL_TILE_128x128, "128x128"},
      {CUBLASLT_MATMUL_TILE_64x256, "64x256"},   {CUBLASLT_MATMUL_TILE_256x64, "256x64"},
      {CUBLASLT_MATMUL_TILE_128x256, "128x256"}, {CUBLASLT_MATMUL_TILE_256x128, "256x128"},
      {CUBLASLT_MATMUL_TILE_128x192, "128x192"}, {CUBLASLT_MATMUL_TILE_192x128, "192x128"},
      {CUBLASLT_MATMUL_TILE_64x192, "64x192"},   {CUBLASLT_MATMUL_TILE_192x64, "192x64"},
      {CUBLASLT_MATMUL_TILE_128x160, "128x160"}, {CUBLASLT_MATMUL_TILE_160x128, "160x128"},
      {CUBLASLT_MATMUL_TILE_256x192, "256x192"}, {CUBLASLT_MATMUL_TILE_192x256, "192x256"},
  };
  auto it = names.find(id);
  return it != names.end() ? it->second : "";
}

template <typename T>
std::vector<T> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0)
    return {};
  std::vector<T> v(bytes / sizeof(T));
  ok_lt(cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &bytes), "algorithm capability");
  return v;
}

// Every unsplit cuBLASLt configuration of y = x w^T (the layout CublasLtGemm
// uses) that passes cublasLtMatmulAlgoCheck, timed; the fastest per tile shape,
// and the heuristic's own first choice.
nlohmann::json cublas_tiles(cublasLtHandle_t lt, const cuda::bf16* x, const cuda::bf16* w, void* y, bool f32, int M,
                            int N, int K, void* ws, size_t ws_bytes, cudaStream_t s) {
  const cudaDataType_t yt = f32 ? CUDA_R_32F : CUDA_R_16BF;
  cublasLtMatmulDesc_t op;
  ok_lt(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  ok_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)), "transa");
  ok_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)), "transb");
  cublasLtMatrixLayout_t la, lb, lc;
  ok_lt(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K), "layout w");
  ok_lt(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K), "layout x");
  ok_lt(cublasLtMatrixLayoutCreate(&lc, yt, N, M, N), "layout y");
  const float alpha = 1.0f, beta = 0.0f;
  auto time_algo = [&](const cublasLtMatmulAlgo_t& algo) {
    return median_us(
        [&] {
          ok_lt(cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &algo, ws, ws_bytes, s), "matmul");
        },
        s, 7);
  };
  auto tile_of = [](const cublasLtMatmulAlgo_t& algo) {
    uint32_t tile = 0;
    size_t n = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &n);
    return tile;
  };
  nlohmann::json doc;
  auto config = [](const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t n = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &n);
    return v;
  };
  std::map<std::string, nlohmann::json> best;  // per tile: fastest unsplit configuration
  std::set<std::array<uint64_t, 8>> seen;
  int tried = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  // Times one configuration (once) if cuBLASLt accepts it unsplit.
  auto consider = [&](const cublasLtMatmulAlgo_t& algo, const char* source) {
    std::array<uint64_t, 8> key;
    std::memcpy(key.data(), algo.data, sizeof(key));
    if (!seen.insert(key).second || std::chrono::steady_clock::now() > deadline) return;
    const std::string name = tile_name(tile_of(algo));
    if (name.empty() || config(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1) return;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(lt, op, la, lb, lc, lc, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > ws_bytes)
      return;
    const double us = time_algo(algo);
    ++tried;
    if (!best.count(name) || us < best[name]["us"].get<double>())
      best[name] = {{"us", us},
                    {"algo_id", config(algo, CUBLASLT_ALGO_CONFIG_ID)},
                    {"stages_id", config(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID)},
                    {"cluster_shape_id", config(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)},
                    {"from", source}};
  };
  // The heuristic's list (its first entry is what the default mode runs), and
  // each entry again at every named tile shape: the Hopper kernels need the
  // cluster and inner shapes the heuristic fills in.
  {
    cublasLtMatmulPreference_t pref;
    ok_lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
    ok_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                               sizeof(ws_bytes)),
          "workspace preference");
    std::vector<cublasLtMatmulHeuristicResult_t> hs(64);
    int found = 0;
    ok_lt(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, static_cast<int>(hs.size()), hs.data(), &found),
          "heuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    hs.resize(found);
    if (found > 0)
      doc["heuristic"] = {{"tile", tile_name(tile_of(hs[0].algo))},
                          {"tile_id", tile_of(hs[0].algo)},
                          {"algo_id", config(hs[0].algo, CUBLASLT_ALGO_CONFIG_ID)},
                          {"splitk", config(hs[0].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)},
                          {"us", time_algo(hs[0].algo)}};
    doc["heuristic_results"] = found;
    for (const auto& h : hs) consider(h.algo, "heuristic");
    for (const auto& h : hs) {
      uint32_t tiles_tried[] = {
          CUBLASLT_MATMUL_TILE_64x128,  CUBLASLT_MATMUL_TILE_128x64,  CUBLASLT_MATMUL_TILE_128x128,
          CUBLASLT_MATMUL_TILE_128x192, CUBLASLT_MATMUL_TILE_192x128, CUBLASLT_MATMUL_TILE_128x256,
          CUBLASLT_MATMUL_TILE_256x128, CUBLASLT_MATMUL_TILE_64x256,  CUBLASLT_MATMUL_TILE_256x64};
      for (uint32_t tile : tiles_tried) {
        cublasLtMatmulAlgo_t a = h.algo;
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
        consider(a, "heuristic, tile changed");
      }
    }
  }
  // Every algorithm id at each of its tiles and stage counts, unsplit.
  int ids[256];
  int n_ids = 0;
  ok_lt(
      cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, yt, yt, 256, ids, &n_ids),
      "algorithm ids");
  for (int i = 0; i < n_ids; ++i) {
    cublasLtMatmulAlgo_t algo;
    if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, yt, yt, ids[i], &algo) !=
        CUBLAS_STATUS_SUCCESS)
      continue;
    std::vector<uint32_t> tiles = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_TILE_IDS);
    std::vector<uint32_t> stages = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_STAGES_IDS);
    if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
    for (uint32_t tile : tiles) {
      if (tile_name(tile).empty()) continue;  // only the tiles of 64 to 256 a side named above
      for (uint32_t stage : stages) {
        const uint32_t one = 1;
        const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stage, sizeof(stage));
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one));
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction,
                                             sizeof(no_reduction));
        consider(algo, "algorithm id");
      }
    }
  }
  nlohmann::json per_tile;
  double fastest = 0;
  std::string fastest_tile;
  for (auto& [name, row] : best) {
    per_tile[name] = row;
    if (fastest == 0 || row["us"].get<double>() < fastest) {
      fastest = row["us"].get<double>();
      fastest_tile = name;
    }
  }
  doc["configurations_timed"] = tried;
  doc["sweep_cut_short"] = std::chrono::steady_clock::now() > deadline;
  doc["unsplit_best_per_tile"] = per_tile;
  doc["unsplit_best"] = {{"tile", fastest_tile}, {"us", fastest}};
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  return doc;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out, commit = "unknown";
  std::vector<int> ms = {16, 32, 64, 128, 256, 512, 4096};
  std::vector<int> tile_ms;
  auto parse_list = [](const std::string& v) {
    std::vector<int> r;
    for (size_t p = 0; p <= v.size();) {
      const size_t q = v.find(',', p);
      r.push_back(std::atoi(v.substr(p, q - p).c_str()));
      if (q == std::string::npos) break;
      p = q + 1;
    }
    return r;
  };
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
      ms = parse_list(next());
    } else if (k == "--cublas-tiles") {
      tile_ms = parse_list(next());
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
  for (int m : ms)
    if (m <= 0) die("--m takes positive row counts");
  for (int m : tile_ms)
    if (m <= 0) die("--cublas-tiles takes positive row counts");
  size_t max_w = 0, max_a = 0, max_y = 0;
  int max_m = *std::max_element(ms.begin(), ms.end());
  if (!tile_ms.empty()) max_m = std::max(max_m, *std::max_element(tile_ms.begin(), tile_ms.end()));
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
  // cuBLASLt held to each tile shape, unsplit, beside the fixed GEMM's own choice.
  nlohmann::json tile_rows = nlohmann::json::array();
  if (!tile_ms.empty()) {
    cublasLtHandle_t lt;
    ok_lt(cublasLtCreate(&lt), "cuBLASLt handle");
    for (const Shape& sh : shapes) {
      if (sh.f32) continue;  // the LM head is not one of the prefill points' projections
      for (int M : tile_ms) {
        const cuda::bf16* A = static_cast<const cuda::bf16*>(a);
        const cuda::bf16* W = static_cast<const cuda::bf16*>(w);
        nlohmann::json row = cublas_tiles(lt, A, W, y, sh.f32, M, sh.N, sh.K, ws, ws_bytes, s);
        cuda::FixedGemmOptions o;
        o.workspace = ws;
        o.workspace_bytes = ws_bytes;
        const double fixed =
            median_us([&] { ok(cuda::launch_fixed_gemm(A, W, y, sh.f32, M, sh.N, sh.K, s, o), "fixed"); }, s);
        row["model"] = sh.model;
        row["gemm"] = sh.name;
        row["M"] = M;
        row["N"] = sh.N;
        row["K"] = sh.K;
        row["fixed_us"] = fixed;
        const auto& per_tile = row["unsplit_best_per_tile"];
        if (per_tile.contains("128x128")) {
          const double t128 = per_tile["128x128"]["us"].get<double>();
          row["cublas_128x128_over_best"] = row["unsplit_best"]["us"].get<double>() / t128;
          row["cublas_128x128_over_fixed"] = fixed / t128;
        }
        std::printf("tiles %-5s %-8s M=%d: fixed %.1f us, cuBLASLt unsplit best %s %.1f us", sh.model, sh.name, M,
                    fixed, row["unsplit_best"]["tile"].get<std::string>().c_str(),
                    row["unsplit_best"]["us"].get<double>());
        if (per_tile.contains("128x128")) std::printf(", at 128x128 %.1f us", per_tile["128x128"]["us"].get<double>());
        std::printf(" (%d configurations)\n", row["configurations_timed"].get<int>());
        tile_rows.push_back(row);
      }
    }
    cublasLtDestroy(lt);
  }

  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json doc = {{"machine", bench::machine()}, {"gpu", prop.name}, {"date", date}, {"commit", commit},
                        {"what", "median of 20 launches per GEMM; ratio = cuBLASLt time / fixed-order time"},
                        {"rows", rows}};
  if (!tile_rows.empty()) {
    doc["cublas_tiles"] = tile_rows;
    doc["cublas_tiles_what"] =
        "every unsplit cuBLASLt configuration that cublasLtMatmulAlgoCheck accepts, median of 7 launches; tiles "
        "in cuBLASLt's column-major view (rows along the weights' N, columns along the tokens' M); fixed_us: the "
        "batch-invariant GEMM at its own tile and split choice";
  }
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
