// What a chain of dependent steps costs on this GPU, whatever the steps do: the
// floor under a batch-1 decode step, which is ~140 steps that each need every
// output of the one before (28 layers x 5, embedding, LM head, sampling).
//
//   cuda_sync_floor_bench [--steps 143] [--repeat 50] [--out FILE.json] [--commit SHA]
//
// Measured, each as the mean per step over CUDA-graph replays of `steps` steps:
//   empty_kernel        an empty kernel per step (launch and completion only);
//   empty_kernel_pdl    the same with programmatic dependent launch (the next
//                       kernel starts while this one ends; griddepcontrol.wait);
//   stage_kernel_pdl    one kernel per step of 2 CTAs per SM, each CTA reading
//                       the previous step's 1024 floats (all of them, written by
//                       every CTA of the step before) and writing its 8: the
//                       smallest all-to-all step, as the decode kernels chain them;
//   stage_grid_barrier  the same steps inside one persistent kernel of one CTA
//                       per SM, a grid barrier (release add, acquire poll) between
//                       steps: what a persistent decode kernel would pay.
// The host's round trip of a step (metadata up, token down) in four forms:
// round_trip_* below. And the device-to-device copy bandwidth, for the bytes side of the floor; and
// siesta's own decode GEMVs alone, with Qwen3-0.6B's shapes at batch 1 (QKV,
// O, gate/up, down: 28 layers of distinct weights in a graph, with and without
// programmatic launch), per layer: what the projections cost without attention;
// and the same chain reading one layer's weights 28 times (from L2).
// And the latency of a chain of dependent bf16 m16n8k16 MMAs (mma_chain_*: one
// warp per SM, 1, 2, 4 or 8 independent accumulators, clock64 cycles per MMA):
// what one fp32 chain over a whole K would cost a batch-1 GEMV (K / 16 MMAs,
// none of which may start before the one before it ends).
// And the read bandwidth from L2 (l2_read_GBps): a 16 MiB buffer, which L2
// holds, read 20 times over by 2, 4 and 8 CTAs per SM with 16-byte loads that
// bypass L1 (the best of the three): the rate that feeds a GEMM's tiles when
// its operands stay in L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kVector = 1024;  // floats a step reads (the hidden size of Qwen3-0.6B)
constexpr int kPerCta = 8;     // floats a CTA writes

#define CHECK(x)                                                                               \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "cuda_sync_floor_bench: %s: %s\n", #x, cudaGetErrorString(e_));     \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

__device__ __forceinline__ void allow_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_previous() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__global__ void empty_kernel() {
  allow_next();
  wait_previous();
}

// Sum of the input vector (read through L2), then this CTA's 8 outputs.
__device__ __forceinline__ void stage(const float* in, float* out, float* scratch) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < kVector; i += kThreads) s += __ldcg(in + i);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x < kPerCta) {
    float t = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) t += scratch[w];
    const int i = (blockIdx.x * kPerCta + threadIdx.x) % kVector;
    out[i] = t * 1e-3f + static_cast<float>(threadIdx.x);
  }
  __syncthreads();
}

__global__ void stage_kernel(const float* in, float* out) {
  __shared__ float scratch[kThreads / 32];
  allow_next();
  wait_previous();
  stage(in, out, scratch);
}

__global__ void persistent_kernel(float* a, float* b, int steps, unsigned* arrivals) {
  __shared__ float scratch[kThreads / 32];
  unsigned target = 0;
  for (int s = 0; s < steps; ++s) {
    stage(s % 2 ? b : a, s % 2 ? a : b, scratch);
    target += gridDim.x;
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrivals) : "memory");
      unsigned seen = 0;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrivals) : "memory");
      } while (static_cast<int>(seen - target) < 0);
    }
    __syncthreads();
  }
}

// A step's metadata in (kMetaWords words, from the host or device memory),
// its token out: the kernels around a decode step's host round trip.
constexpr int kMetaWords = 256;
__global__ void token_kernel(const int* meta, int* meta_copy, int* token) {
  __shared__ int scratch[kThreads / 32];
  int v = threadIdx.x < kMetaWords ? meta[threadIdx.x] : 0;
  if (meta_copy && threadIdx.x < kMetaWords) meta_copy[threadIdx.x] = v;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = 0;
    for (int w = 0; w < kThreads / 32; ++w) t += scratch[w];
    *token = t;
  }
}

template <class... KArgs, class... Args>
void launch(void (*k)(KArgs...), int grid, bool pdl, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = kThreads;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  CHECK(cudaLaunchKernelEx(&cfg, k, args...));
}

// Milliseconds on `stream` for `times` calls of `enqueue` (event to event).
template <class Enqueue>
float stream_ms(cudaStream_t stream, int times, Enqueue enqueue) {
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0, stream));
  for (int i = 0; i < times; ++i) enqueue();
  CHECK(cudaEventRecord(t1, stream));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  return ms;
}

// The graph of what `body` enqueues on `stream`, instantiated.
template <class Body>
cudaGraphExec_t capture_graph(cudaStream_t stream, Body body) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphDestroy(graph));
  return exec;
}

// Mean microseconds per step over `repeat` replays of a graph that `body` captures.
template <class Body>
double per_step_us(cudaStream_t stream, int steps, int repeat, Body body) {
  cudaGraphExec_t exec = capture_graph(stream, body);
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  const float ms = stream_ms(stream, repeat, [&] { CHECK(cudaGraphLaunch(exec, stream)); });
  CHECK(cudaGraphExecDestroy(exec));
  return 1000.0 * ms / repeat / steps;
}

// `steps` rounds of kChains independent m16n8k16 MMAs, each accumulating into
// its own fp32 registers; lane 0 writes the cycles the rounds took.
template <int kChains>
__global__ void mma_chain_kernel(int steps, float* out, long long* cycles) {
  const uint32_t a[4] = {0x3c003c00u + threadIdx.x, 0x3c013c01u, 0x3c023c02u, 0x3c033c03u};
  const uint32_t b0 = 0x3c043c04u, b1 = 0x3c053c05u;
  float d[kChains][4] = {};
  __syncwarp();
  const long long t0 = clock64();
  for (int s = 0; s < steps; ++s) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) siesta::cuda::dev::mma_bf16(d[c], a, b0, b1);
  }
  float sum = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) sum += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  const long long t1 = clock64();
  out[blockIdx.x * 32 + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// Every thread XORs the 16-byte words it reads (ld.global.cg: from L2, not L1),
// `reps` passes over [0, n); the XOR reaches memory only if it is a given value,
// so the loads stay.
__global__ void l2_read_kernel(const uint4* p, size_t n, int reps, uint4* sink) {
  uint4 acc{0, 0, 0, 0};
  for (int r = 0; r < reps; ++r)
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
      uint4 v;
      asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(p + i));
      acc.x ^= v.x;
      acc.y ^= v.y;
      acc.z ^= v.z;
      acc.w ^= v.w;
    }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u) *sink = acc;
}

// Mean cycles per round of mma_chain_kernel<kChains> over one warp per SM.
template <int kChains>
double mma_chain_cycles(int sms, int steps, float* out, long long* cycles, cudaStream_t stream) {
  mma_chain_kernel<kChains><<<sms, 32, 0, stream>>>(steps, out, cycles);  // warm-up
  mma_chain_kernel<kChains><<<sms, 32, 0, stream>>>(steps, out, cycles);
  CHECK(cudaGetLastError());
  std::vector<long long> host(sms);
  CHECK(cudaMemcpyAsync(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  double total = 0;
  for (long long c : host) total += static_cast<double>(c);
  return total / sms / steps;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 143, repeat = 50;
  std::string out, commit = "unknown";
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "cuda_sync_floor_bench: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--steps") steps = std::atoi(next().c_str());
    else if (k == "--repeat") repeat = std::atoi(next().c_str());
    else if (k == "--out") out = next();
    else if (k == "--commit") commit = next();
    else {
      std::fprintf(stderr, "cuda_sync_floor_bench: unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  if (steps < 2 || repeat < 1) {
    std::fprintf(stderr, "cuda_sync_floor_bench: --steps must be at least 2 and --repeat at least 1\n");
    return 2;
  }
  int device = 0, sms = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, device));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *a = nullptr, *b = nullptr;
  unsigned* arrivals = nullptr;
  CHECK(cudaMalloc(&a, kVector * sizeof(float)));
  CHECK(cudaMalloc(&b, kVector * sizeof(float)));
  CHECK(cudaMalloc(&arrivals, sizeof(unsigned)));
  CHECK(cudaMemset(a, 0, kVector * sizeof(float)));
  CHECK(cudaMemset(b, 0, kVector * sizeof(float)));

  nlohmann::json r;
  r["steps"] = steps;
  r["repeat"] = repeat;
  const int stage_ctas = 2 * sms;
  r["empty_kernel_us"] = per_step_us(stream, steps, repeat, [&] {
    for (int s = 0; s < steps; ++s) launch(empty_kernel, stage_ctas, false, stream);
  });
  r["empty_kernel_pdl_us"] = per_step_us(stream, steps, repeat, [&] {
    for (int s = 0; s < steps; ++s) launch(empty_kernel, stage_ctas, true, stream);
  });
  r["stage_kernel_us"] = per_step_us(stream, steps, repeat, [&] {
    for (int s = 0; s < steps; ++s) launch(stage_kernel, stage_ctas, false, stream, s % 2 ? b : a, s % 2 ? a : b);
  });
  r["stage_kernel_pdl_us"] = per_step_us(stream, steps, repeat, [&] {
    for (int s = 0; s < steps; ++s) launch(stage_kernel, stage_ctas, true, stream, s % 2 ? b : a, s % 2 ? a : b);
  });
  // One CTA per SM, all resident (a cooperative launch guarantees it); each
  // launch runs every step, so its own launch is spread over them.
  {
    int n = steps;
    void* args[] = {&a, &b, &n, &arrivals};
    auto run = [&] {
      CHECK(cudaMemsetAsync(arrivals, 0, sizeof(unsigned), stream));
      CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), sms, kThreads, args, 0, stream));
    };
    run();  // warm-up
    r["stage_grid_barrier_us"] = 1000.0 * stream_ms(stream, repeat, run) / repeat / steps;
  }

  // The host's round trip of a decode step at its floor, host clock per step,
  // with a one-kernel graph for the step (which takes ~2 us on the device):
  //   copies         metadata up with cudaMemcpyAsync, graph launch, token down
  //                  with cudaMemcpyAsync, stream synchronize (the engine's way);
  //   graph_copies   both copies as memcpy nodes of the graph: one launch;
  //   mapped         the kernel reads the metadata from mapped host memory and
  //                  writes the token there: no copies;
  //   launch_only    the graph's launch and synchronize alone.
  {
    int *host_meta = nullptr, *host_token = nullptr, *meta = nullptr, *token = nullptr;
    CHECK(cudaHostAlloc(&host_meta, kMetaWords * sizeof(int), cudaHostAllocMapped));
    CHECK(cudaHostAlloc(&host_token, sizeof(int), cudaHostAllocMapped));
    CHECK(cudaMalloc(&meta, kMetaWords * sizeof(int)));
    CHECK(cudaMalloc(&token, sizeof(int)));
    for (int i = 0; i < kMetaWords; ++i) host_meta[i] = i;
    auto kernel = [&](const int* in, int* copy, int* out) { token_kernel<<<1, kThreads, 0, stream>>>(in, copy, out); };
    cudaGraphExec_t plain = capture_graph(stream, [&] { kernel(meta, nullptr, token); });
    cudaGraphExec_t with_copies = capture_graph(stream, [&] {
      CHECK(cudaMemcpyAsync(meta, host_meta, kMetaWords * sizeof(int), cudaMemcpyHostToDevice, stream));
      kernel(meta, nullptr, token);
      CHECK(cudaMemcpyAsync(host_token, token, sizeof(int), cudaMemcpyDeviceToHost, stream));
    });
    cudaGraphExec_t mapped = capture_graph(stream, [&] { kernel(host_meta, meta, host_token); });
    const int iters = 2000;
    auto host_us = [&](auto step) {
      for (int i = 0; i < 50; ++i) step();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) step();
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    };
    r["round_trip_copies_us"] = host_us([&] {
      CHECK(cudaMemcpyAsync(meta, host_meta, kMetaWords * sizeof(int), cudaMemcpyHostToDevice, stream));
      CHECK(cudaGraphLaunch(plain, stream));
      CHECK(cudaMemcpyAsync(host_token, token, sizeof(int), cudaMemcpyDeviceToHost, stream));
      CHECK(cudaStreamSynchronize(stream));
    });
    auto launch_and_sync_us = [&](cudaGraphExec_t exec) {
      return host_us([&] {
        CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaStreamSynchronize(stream));
      });
    };
    r["round_trip_graph_copies_us"] = launch_and_sync_us(with_copies);
    r["round_trip_mapped_us"] = launch_and_sync_us(mapped);
    r["round_trip_launch_only_us"] = launch_and_sync_us(plain);
    if (*host_token != (kMetaWords - 1) * kMetaWords / 2) {
      std::fprintf(stderr, "cuda_sync_floor_bench: the mapped round trip returned %d\n", *host_token);
      std::exit(1);
    }
    for (cudaGraphExec_t e : {plain, with_copies, mapped}) CHECK(cudaGraphExecDestroy(e));
    CHECK(cudaFreeHost(host_meta));
    CHECK(cudaFreeHost(host_token));
    CHECK(cudaFree(meta));
    CHECK(cudaFree(token));
  }

  // Copy bandwidth: 1 GiB device to device, read + write bytes per second.
  const size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMemsetAsync(src, 1, bytes, stream));
  CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  const float ms =
      stream_ms(stream, 10, [&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); });
  r["d2d_copy_GBps"] = 2.0 * bytes * 10 / (ms * 1e-3) / 1e9;
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));

  // L2 read bandwidth: a 16 MiB buffer read 20 times over, the best of 2, 4 and 8 CTAs per SM.
  {
    const size_t l2_bytes = size_t{16} << 20;
    constexpr int kReps = 20;
    uint4 *buf = nullptr, *sink = nullptr;
    CHECK(cudaMalloc(&buf, l2_bytes));
    CHECK(cudaMalloc(&sink, sizeof(uint4)));
    CHECK(cudaMemsetAsync(buf, 0x5a, l2_bytes, stream));
    double best = 0;
    for (int per_sm : {2, 4, 8}) {
      const unsigned blocks = static_cast<unsigned>(per_sm * sms), threads = std::min(1024u, 2048u / static_cast<unsigned>(per_sm));
      l2_read_kernel<<<blocks, threads, 0, stream>>>(buf, l2_bytes / 16, 2, sink);  // warm: the buffer into L2
      const float l2_ms =
          stream_ms(stream, 1, [&] { l2_read_kernel<<<blocks, threads, 0, stream>>>(buf, l2_bytes / 16, kReps, sink); });
      CHECK(cudaGetLastError());
      best = std::max(best, static_cast<double>(l2_bytes) * kReps / (l2_ms * 1e-3) / 1e9);
    }
    r["l2_read_GBps"] = best;
    CHECK(cudaFree(buf));
    CHECK(cudaFree(sink));
  }

  // siesta's decode GEMVs, Qwen3-0.6B at batch 1: 28 layers of distinct weights.
  {
    using siesta::cuda::GemvArgs;
    using siesta::cuda::GemvInput;
    using siesta::cuda::GemvOutput;
    using bf16 = siesta::cuda::bf16;
    const int layers = 28, H = 1024, QKV = 4096, QD = 2048, I = 3072;
    const size_t per_layer = static_cast<size_t>(QKV) * H + static_cast<size_t>(H) * QD +
                             static_cast<size_t>(2 * I) * H + static_cast<size_t>(H) * I + H;
    bf16 *w = nullptr, *act = nullptr;
    CHECK(cudaMalloc(&w, per_layer * layers * sizeof(bf16)));
    CHECK(cudaMalloc(&act, (H + QKV + QD + 2 * I) * sizeof(bf16)));
    CHECK(siesta::cuda::launch_fill_random_bf16(w, per_layer * layers, 1, 0.05f, stream));
    CHECK(siesta::cuda::launch_fill_random_bf16(act, H + QKV + QD + 2 * I, 2, 1.0f, stream));
    bf16 *x = act, *qkv = x + H, *attn = qkv + QKV, *gu = attn + QD;
    // hot: every layer reads layer 0's weights, which stay in L2 (31.5 MB of its
    // 50): what the same chain costs when its bytes come at L2 rather than HBM speed.
    auto chain = [&](bool pdl, bool hot) {
      for (int l = 0; l < layers; ++l) {
        const bf16* lw = w + per_layer * (hot ? 0 : l);
        const bf16 *wqkv = lw, *wo = wqkv + static_cast<size_t>(QKV) * H, *wgu = wo + static_cast<size_t>(H) * QD;
        const bf16 *wd = wgu + static_cast<size_t>(2 * I) * H, *norm = wd + static_cast<size_t>(H) * I;
        const siesta::cuda::LaunchConfig lc(stream, pdl);
        CHECK(launch_gemv(GemvArgs{x, norm, 1e-6f, wqkv, 1, QKV, H, GemvInput::kRmsNorm, GemvOutput::kBf16, qkv}, lc));
        CHECK(launch_gemv(GemvArgs{attn, nullptr, 0.0f, wo, 1, H, QD, GemvInput::kPlain, GemvOutput::kAddBf16, x}, lc));
        CHECK(launch_gemv(GemvArgs{x, norm, 1e-6f, wgu, 1, 2 * I, H, GemvInput::kRmsNorm, GemvOutput::kBf16, gu}, lc));
        CHECK(launch_gemv(GemvArgs{gu, nullptr, 0.0f, wd, 1, H, I, GemvInput::kSiluMul, GemvOutput::kAddBf16, x}, lc));
      }
    };
    r["gemv_layer_pdl_us"] = per_step_us(stream, layers, repeat, [&] { chain(true, false); });
    r["gemv_layer_us"] = per_step_us(stream, layers, repeat, [&] { chain(false, false); });
    r["gemv_layer_pdl_l2_hot_us"] = per_step_us(stream, layers, repeat, [&] { chain(true, true); });
    r["gemv_layer_bytes"] = per_layer * sizeof(bf16);
    CHECK(cudaFree(w));
    CHECK(cudaFree(act));
  }

  // Dependent MMA chains: cycles per MMA with 1 chain is the latency a single
  // fp32 chain over K pays K / 16 times; with 8 chains, the issue rate.
  {
    float* out = nullptr;
    long long* cycles = nullptr;
    CHECK(cudaMalloc(&out, sms * 32 * sizeof(float)));
    CHECK(cudaMalloc(&cycles, sms * sizeof(long long)));
    const int rounds = 4096;
    const double c1 = mma_chain_cycles<1>(sms, rounds, out, cycles, stream);
    const double c2 = mma_chain_cycles<2>(sms, rounds, out, cycles, stream) / 2;
    const double c4 = mma_chain_cycles<4>(sms, rounds, out, cycles, stream) / 4;
    const double c8 = mma_chain_cycles<8>(sms, rounds, out, cycles, stream) / 8;
    int clock_khz = 0;
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
    r["mma_chain_cycles_per_mma"] = {{"chains_1", c1}, {"chains_2", c2}, {"chains_4", c4}, {"chains_8", c8}};
    r["mma_chain_clock_mhz"] = clock_khz / 1000.0;
    // One chain over K at the attribute's clock: K / 16 dependent MMAs.
    nlohmann::json single;
    for (int k : {1024, 2048, 3072, 4096, 12288}) single["K" + std::to_string(k)] = k / 16 * c1 / (clock_khz * 1e-3);
    r["mma_single_chain_us"] = single;
    CHECK(cudaFree(out));
    CHECK(cudaFree(cycles));
  }

  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json doc = {{"machine", {{"gpu", prop.name}, {"sm_count", sms}}}, {"date", date}, {"commit", commit},
                        {"per_step", r}};
  std::printf("%s\n", doc.dump(1).c_str());
  if (!out.empty()) std::ofstream(out) << doc.dump(1) << "\n";
  return 0;
}
