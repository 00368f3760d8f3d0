// Host->device copy bandwidth into cuMem VMM memory as sleep/wake use it: is the
// ~28 GB/s restore of level-1 wake (bench/results/host_dma_probe_h200.md) a
// property of memory mapped again, of the zero-filled KV cache beside it, or of
// the host buffer after device->host copies filled it?
//   cp h2d_remap_probe.cpp /tmp/p.cu && nvcc -O2 -std=c++17 -arch=sm_90a /tmp/p.cu -o h2d_remap_probe
//       -lcuda -lpthread        (with nvcc: also case n, the copy by SMs; g++ builds the rest)
//   ./h2d_remap_probe [GiB of weights, default 8] [GiB of KV, default 64]
// Each line: the case, the round, GB/s of one H->D copy of the whole buffer in
// 256 MiB cuMemcpyHtoDAsync pieces on one stream (or two), from a THP buffer
// touched by 8 threads and registered in 256 MiB pieces, as the CUDA backend
// keeps its offload buffer.
#include <cuda.h>
#include <sys/mman.h>
#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;
static double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
#define CK(x)                                                              \
  do {                                                                     \
    CUresult r_ = (x);                                                     \
    if (r_ != CUDA_SUCCESS) {                                              \
      const char* s_ = nullptr;                                            \
      cuGetErrorString(r_, &s_);                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

static const size_t kPiece = size_t{256} << 20;
static CUdevice dev;
static CUstream s1, s2;

struct Vmm {
  CUdeviceptr va = 0;
  size_t bytes = 0, chunk = 0;
  std::vector<CUmemGenericAllocationHandle> h;
  void reserve(size_t b, size_t c) {
    bytes = b;
    chunk = c;
    CK(cuMemAddressReserve(&va, bytes, 0, 0, 0));
  }
  void map(bool zero) {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    for (size_t o = 0; o < bytes; o += chunk) {
      CUmemGenericAllocationHandle x;
      CK(cuMemCreate(&x, chunk, &p, 0));
      CK(cuMemMap(va + o, chunk, 0, x, 0));
      h.push_back(x);
    }
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(va, bytes, &a, 1));
    if (zero) {
      CK(cuMemsetD8(va, 0, bytes));
      CK(cuCtxSynchronize());
    }
  }
  void unmap() {
    CK(cuMemUnmap(va, bytes));
    for (auto x : h) CK(cuMemRelease(x));
    h.clear();
  }
};

static double copy(CUdeviceptr d, char* host, size_t bytes, bool up, int streams) {
  auto t = Clock::now();
  int i = 0;
  for (size_t o = 0; o < bytes; o += kPiece, ++i) {
    CUstream s = streams == 2 && (i & 1) ? s2 : s1;
    const size_t n = std::min(kPiece, bytes - o);
    if (up)
      CK(cuMemcpyHtoDAsync(d + o, host + o, n, s));
    else
      CK(cuMemcpyDtoHAsync(host + o, d + o, n, s));
  }
  CK(cuStreamSynchronize(s1));
  CK(cuStreamSynchronize(s2));
  return bytes / ms_since(t) / 1e6;
}

#if defined(__CUDACC__)
// n: the copy done by SMs reading the registered host buffer through its device
// mapping (no copy engine): 16-byte loads, grid-stride.
__global__ void sm_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}
static double sm_copy_gbs(CUdeviceptr d, char* host, size_t bytes, int blocks) {
  CUdeviceptr hd;
  CK(cuMemHostGetDevicePointer(&hd, host, 0));
  auto t = Clock::now();
  sm_copy<<<blocks, 512, 0, reinterpret_cast<cudaStream_t>(s1)>>>(reinterpret_cast<const uint4*>(hd),
                                                                    reinterpret_cast<uint4*>(d), bytes / 16);
  CK(cuStreamSynchronize(s1));
  return bytes / ms_since(t) / 1e6;
}
#endif

int main(int argc, char** argv) {
  const size_t W = (argc > 1 ? std::atol(argv[1]) : 8) << 30, KV = (argc > 2 ? std::atol(argv[2]) : 64) << 30;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  char* host = static_cast<char*>(mmap(nullptr, W, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  madvise(host, W, MADV_HUGEPAGE);
  {
    std::vector<std::thread> t;
    for (int i = 0; i < 8; ++i) t.emplace_back([=] { std::memset(host + W / 8 * i, 1, W / 8); });
    for (auto& x : t) x.join();
  }
  for (size_t o = 0; o < W; o += kPiece) CK(cuMemHostRegister(host + o, kPiece, CU_MEMHOSTREGISTER_DEVICEMAP));

  CUdeviceptr plain;
  CK(cuMemAlloc(&plain, W));
  for (int r = 0; r < 3; ++r) std::printf("a cuMemAlloc            round %d  H2D %5.1f GB/s\n", r, copy(plain, host, W, true, 1));
  for (int r = 0; r < 2; ++r) std::printf("a cuMemAlloc            round %d  D2H %5.1f GB/s\n", r, copy(plain, host, W, false, 1));
  CK(cuMemFree(plain));

  for (size_t chunk : {W, size_t{2} << 30}) {
    Vmm w;
    w.reserve(W, chunk);
    w.map(false);
    for (int r = 0; r < 3; ++r)
      std::printf("b vmm mapped once %3zu MiB  round %d  H2D %5.1f GB/s\n", chunk >> 20, r, copy(w.va, host, W, true, 1));
    for (int r = 0; r < 3; ++r) {
      w.unmap();
      w.map(false);
      std::printf("c vmm remapped    %3zu MiB  round %d  H2D %5.1f GB/s\n", chunk >> 20, r, copy(w.va, host, W, true, 1));
    }
    w.unmap();
  }
  // d, e: the level-1 cycle: D2H (sleep), unmap weights and KV, map KV zero-filled, map weights, H2D (wake).
  Vmm w, kv;
  w.reserve(W, W);
  kv.reserve(KV, size_t{2} << 30);
  w.map(false);
  kv.map(true);
  for (int streams : {1, 2}) {
    for (int r = 0; r < 3; ++r) {
      const double down = copy(w.va, host, W, false, 1);
      w.unmap();
      kv.unmap();
      auto t = Clock::now();
      kv.map(true);
      const double kv_ms = ms_since(t);
      w.map(false);
      const double up = copy(w.va, host, W, true, streams);
      std::printf("d cycle, %d stream(s)        round %d  D2H %5.1f  KV map+zero %6.1f ms  H2D %5.1f GB/s\n", streams, r,
                  down, kv_ms, up);
    }
  }
  // g: D2H then H2D, the weights remapped between, the KV cache left alone.
  for (int r = 0; r < 3; ++r) {
    copy(w.va, host, W, false, 1);
    w.unmap();
    w.map(false);
    std::printf("g D2H, remap weights only   round %d  H2D %5.1f GB/s\n", r, copy(w.va, host, W, true, 1));
  }
  // h: no D2H; weights and KV unmapped, KV mapped and zero-filled first, then the weights.
  for (int r = 0; r < 3; ++r) {
    w.unmap();
    kv.unmap();
    kv.map(true);
    w.map(false);
    std::printf("h no D2H, KV mapped first   round %d  H2D %5.1f GB/s\n", r, copy(w.va, host, W, true, 1));
  }
  // i: the full cycle, but the weights mapped before the KV cache.
  for (int r = 0; r < 3; ++r) {
    copy(w.va, host, W, false, 1);
    w.unmap();
    kv.unmap();
    w.map(false);
    kv.map(true);
    std::printf("i cycle, weights mapped first round %d  H2D %5.1f GB/s\n", r, copy(w.va, host, W, true, 1));
  }
  // j: the full cycle with the KV cache mapped first and the host buffer read by the CPU
  // (8 threads) before the H2D.
  for (int r = 0; r < 3; ++r) {
    copy(w.va, host, W, false, 1);
    w.unmap();
    kv.unmap();
    kv.map(true);
    w.map(false);
    std::vector<std::thread> t;
    std::vector<unsigned long> sums(8);
    for (int k = 0; k < 8; ++k)
      t.emplace_back([&, k] {
        unsigned long x = 0;
        for (size_t o = W / 8 * k; o < W / 8 * (k + 1); o += 4096) x += static_cast<unsigned char>(host[o]);
        sums[k] = x;
      });
    for (auto& x : t) x.join();
    std::printf("j cycle, host pages touched round %d  H2D %5.1f GB/s (%lu)\n", r, copy(w.va, host, W, true, 1),
                sums[0]);
  }
  // k: the cycle with the KV cache mapped first, then 3 s idle before the H2D.
  for (int r = 0; r < 2; ++r) {
    copy(w.va, host, W, false, 1);
    w.unmap();
    kv.unmap();
    kv.map(true);
    w.map(false);
    std::this_thread::sleep_for(std::chrono::seconds(3));
    std::printf("k cycle, 3 s before the H2D round %d  H2D %5.1f GB/s\n", r, copy(w.va, host, W, true, 1));
  }
  // l: the weights mapped and restored first, the KV cache mapped (zero-filled) after:
  // the H2D's rate, and the whole wake (map weights + H2D + map KV) against m, the
  // KV cache first.
  for (int r = 0; r < 3; ++r) {
    copy(w.va, host, W, false, 1);
    w.unmap();
    kv.unmap();
    auto t = Clock::now();
    w.map(false);
    const double up = copy(w.va, host, W, true, 1);
    kv.map(true);
    const double wake = ms_since(t);
    copy(w.va, host, W, false, 1);
    w.unmap();
    kv.unmap();
    t = Clock::now();
    kv.map(true);
    w.map(false);
    const double up2 = copy(w.va, host, W, true, 1);
    const double wake2 = ms_since(t);
    std::printf("l weights first round %d  H2D %5.1f GB/s  wake %6.1f ms | m KV first  H2D %5.1f GB/s  wake %6.1f ms\n", r,
                up, wake, up2, wake2);
  }
#if defined(__CUDACC__)
  // n: the cycle (KV cache mapped first), the restore by SMs instead of a copy engine.
  // The buffer is one registration per 256 MiB piece, so the kernel copies piece by piece.
  for (int blocks : {132, 264, 528}) {
    for (int r = 0; r < 2; ++r) {
      copy(w.va, host, W, false, 1);
      w.unmap();
      kv.unmap();
      kv.map(true);
      w.map(false);
      auto t = Clock::now();
      for (size_t o = 0; o < W; o += kPiece) sm_copy_gbs(w.va + o, host + o, kPiece, blocks);
      std::printf("n cycle, SM copy %d CTAs     round %d  H2D %5.1f GB/s\n", blocks, r, W / ms_since(t) / 1e6);
    }
  }
  {  // n without the cycle: the SM copy's own rate
    auto t = Clock::now();
    for (size_t o = 0; o < W; o += kPiece) sm_copy_gbs(w.va + o, host + o, kPiece, 264);
    std::printf("n idle, SM copy 264 CTAs    H2D %5.1f GB/s\n", W / ms_since(t) / 1e6);
  }
#endif
  // f: the same with the KV zero-fill still running (not synchronised) while the weights copy.
  for (int r = 0; r < 3; ++r) {
    copy(w.va, host, W, false, 1);
    w.unmap();
    w.map(false);
    CK(cuMemsetD8Async(kv.va, 0, KV, s2));
    const double up = copy(w.va, host, W, true, 1);
    std::printf("f zero-fill beside H2D     round %d  H2D %5.1f GB/s\n", r, up);
  }
  return 0;
}
