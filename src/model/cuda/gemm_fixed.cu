// The batch-invariant projection: C[m, n] = sum_k A[m, k] * W[n, k].
//
// cuBLAS picks its kernel (tile shape, split-K, stream-K) from M, so a row's
// result changes with the batch it sits in. Here every output element follows
// the projection order of kernels.h: bf16 m16n8k16 MMAs over k in ascending
// 32-wide tiles, two k16 steps each, into an fp32 chain that is added to the
// element's total at every segment's end (kProjectionSegments), never split
// across CTAs. The CTA tile shape (chosen from M for occupancy) only decides
// which rows share a CTA, never an element's arithmetic, so a row is
// bit-identical for every M and equal to the canonical GEMV's.
//
// A classic multistage design: cp.async into a 3-stage shared-memory ring
// (rows padded by 16 bytes so ldmatrix is conflict-free), ldmatrix fragments.
#include <cuda_bf16.h>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"

namespace siesta::cuda {
namespace {

constexpr int kBK = 32;
constexpr int kLD = kBK + 8;  // padded smem row (bf16)
constexpr int kStages = 3;

template <int BM, int BN, int WM, int WN>
struct Tile {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int kWarpM = BM / WM;  // rows per warp
  static constexpr int kWarpN = BN / WN;  // columns per warp
  static constexpr int kMT = kWarpM / 16;
  static constexpr int kNT = kWarpN / 8;
  static constexpr size_t kSmem = static_cast<size_t>(kStages) * (BM + BN) * kLD * sizeof(bf16);
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile must be whole m16 x n16 blocks");
};

template <int BM, int BN, int WM, int WN, bool kOutF32>
__global__ __launch_bounds__(Tile<BM, BN, WM, WN>::kThreads) void fixed_gemm_kernel(const bf16* __restrict__ A,
                                                                                  const bf16* __restrict__ W,
                                                                                  void* out, int M, int N, int K,
                                                                                  int segment_tiles) {
  dev::begin_dependent_kernel();
  using T = Tile<BM, BN, WM, WN>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* As = reinterpret_cast<bf16*>(smem_raw);  // [kStages][BM][kLD]
  bf16* Ws = As + kStages * BM * kLD;            // [kStages][BN][kLD]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bm0 = blockIdx.y * BM, bn0 = blockIdx.x * BN;
  const int wm0 = (warp / WN) * T::kWarpM, wn0 = (warp % WN) * T::kWarpN;
  const int ktiles = K / kBK;

  auto load_tile = [&](int kt, int st) {
    bf16* as = As + st * BM * kLD;
    bf16* ws = Ws + st * BN * kLD;
    const int k0 = kt * kBK;
    for (int i = tid; i < BM * 4; i += T::kThreads) {
      const int r = i >> 2, c = (i & 3) * 8;
      const bool ok = bm0 + r < M;
      dev::cp_async16(as + r * kLD + c, ok ? A + static_cast<size_t>(bm0 + r) * K + k0 + c : A, ok);
    }
    for (int i = tid; i < BN * 4; i += T::kThreads) {
      const int r = i >> 2, c = (i & 3) * 8;
      const bool ok = bn0 + r < N;
      dev::cp_async16(ws + r * kLD + c, ok ? W + static_cast<size_t>(bn0 + r) * K + k0 + c : W, ok);
    }
  };

  float acc[T::kMT][T::kNT][4], tot[T::kMT][T::kNT][4];
#pragma unroll
  for (int i = 0; i < T::kMT; ++i)
#pragma unroll
    for (int j = 0; j < T::kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_tile(s, s);
    dev::cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    dev::cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt visible; every warp is done with the stage refilled next
    const int next = kt + kStages - 1;
    if (next < ktiles) load_tile(next, next % kStages);
    dev::cp_async_commit();

    const bf16* as = As + (kt % kStages) * BM * kLD;
    const bf16* ws = Ws + (kt % kStages) * BN * kLD;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[T::kMT][4];
#pragma unroll
      for (int i = 0; i < T::kMT; ++i)
        dev::ldmatrix_x4(af[i], as + (wm0 + i * 16 + (lane & 15)) * kLD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int jp = 0; jp < T::kNT / 2; ++jp) {
        uint32_t b[4];
        dev::ldmatrix_x4(b, ws + (wn0 + jp * 16 + (lane >> 4) * 8 + (lane & 7)) * kLD + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int i = 0; i < T::kMT; ++i) {
          dev::mma_bf16(acc[i][2 * jp], af[i], b[0], b[1]);
          dev::mma_bf16(acc[i][2 * jp + 1], af[i], b[2], b[3]);
        }
      }
    }
    if ((kt + 1) % segment_tiles == 0) {  // a segment's end: its chain into the total
#pragma unroll
      for (int i = 0; i < T::kMT; ++i)
#pragma unroll
        for (int j = 0; j < T::kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            tot[i][j][e] += acc[i][j][e];
            acc[i][j][e] = 0.0f;
          }
    }
  }
  dev::cp_async_wait<0>();

  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < T::kMT; ++i) {
#pragma unroll
    for (int j = 0; j < T::kNT; ++j) {
      const int col = bn0 + wn0 + j * 8 + 2 * t4;
      if (col >= N) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = bm0 + wm0 + i * 16 + g + half * 8;
        if (row >= M) continue;
        const size_t idx = static_cast<size_t>(row) * N + col;
        if constexpr (kOutF32) {
          const float2 r = __bfloat1622float2(__floats2bfloat162_rn(tot[i][j][2 * half], tot[i][j][2 * half + 1]));
          *reinterpret_cast<float2*>(static_cast<float*>(out) + idx) = r;
        } else {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(out) + idx) =
              __floats2bfloat162_rn(tot[i][j][2 * half], tot[i][j][2 * half + 1]);
        }
      }
    }
  }
}

template <int BM, int BN, int WM, int WN>
cudaError_t launch_tile(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K,
                        const LaunchConfig& launch) {
  using T = Tile<BM, BN, WM, WN>;
  static const cudaError_t attr_bf16 = cudaFuncSetAttribute(
      fixed_gemm_kernel<BM, BN, WM, WN, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(T::kSmem));
  static const cudaError_t attr_f32 = cudaFuncSetAttribute(
      fixed_gemm_kernel<BM, BN, WM, WN, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(T::kSmem));
  if (attr_bf16 != cudaSuccess) return attr_bf16;
  if (attr_f32 != cudaSuccess) return attr_f32;
  const dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  const int segment_tiles = projection_segment_k(K) / kBK;
  if (out_f32)
    return launch_kernel(fixed_gemm_kernel<BM, BN, WM, WN, true>, grid, T::kThreads, T::kSmem, launch, a, w, out, M,
                         N, K, segment_tiles);
  return launch_kernel(fixed_gemm_kernel<BM, BN, WM, WN, false>, grid, T::kThreads, T::kSmem, launch, a, w, out, M, N,
                       K, segment_tiles);
}

}  // namespace

bool fixed_gemm_supported(int N, int K) { return N > 0 && K > 0 && K % kBK == 0 && N % 8 == 0; }

cudaError_t launch_fixed_gemm(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K,
                              LaunchConfig launch, const FixedGemmOptions& options) {
  if (M <= 0) return cudaSuccess;
  if (!fixed_gemm_supported(N, K)) return cudaErrorInvalidValue;
  if (options.kernel != 1 && fixed_gemm_wgmma_supported(N, K))
    return launch_fixed_gemm_wgmma(a, w, out, out_f32, M, N, K, launch, options);
  if (options.kernel == 2) return cudaErrorInvalidValue;
  if (M <= 16) return launch_tile<16, 64, 1, 4>(a, w, out, out_f32, M, N, K, launch);
  if (M <= 64) return launch_tile<64, 128, 2, 4>(a, w, out, out_f32, M, N, K, launch);
  return launch_tile<128, 128, 2, 4>(a, w, out, out_f32, M, N, K, launch);
}

}  // namespace siesta::cuda
