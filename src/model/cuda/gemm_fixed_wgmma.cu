// The batch-invariant projection on Hopper's warpgroup MMA (sm_90a), for
// K % 512 == 0 (every projection of the Qwen3 shapes): the same projection
// order as gemm_fixed.cu's mma.sync kernel (kernels.h: kProjectionSegments),
// so the same bits for every element, at tensor-core rates the mma.sync
// kernel does not reach.
//
// A CTA is one or two warpgroups, each a 64 x BN output tile (BN 64 or 128),
// stacked along M. K is walked in 64-wide tiles through a kStages ring of
// 128-byte-swizzled shared memory (A rows and weight rows both K-major, as
// wgmma reads them), filled with cp.async; each tile is four m64nBNk16 wgmmas
// on one accumulator chain, issued while the previous tile's may still run,
// which is folded into the element's total at every segment's end (after
// waiting for it) and restarted from zero. An element's arithmetic is so: per segment, one fp32
// chain from zero over its natural k16 blocks in ascending order; the
// segments' sums added in order from zero. mma.sync m16n8k16 and wgmma give
// the same bits for the same k16 block and chain (tested against gemm_fixed.cu
// for every shape it takes: cuda_kernels_test).
//
// Split: where the tiles are fewer than the SMs (decode batches), the CTAs of
// grid.z take the segments in equal groups and store each segment's sum
// (fp32) in the workspace, and a second kernel adds each element's segment
// sums in order from zero: the same arithmetic as the unsplit fold.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>

#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"
#include "model/cuda/wgmma.cuh"

namespace siesta::cuda {

#if defined(SIESTA_CUDA_WGMMA)
namespace {

constexpr int kBK = 64;  // one 128-byte swizzled row of bf16
constexpr int kStages = 4;
// Tiles in flight ahead of the one the tensor cores take: a stage is refilled
// once the wgmmas that read it are done, and each tile's wgmmas may still run
// while the next tile's are issued (wgmma_wait<1>), so the ring holds the tile
// being multiplied, the one before it and kLookahead more.
constexpr int kLookahead = kStages - 2;

// A CTA: kWG warpgroups stacked along M, each a 64 x BN tile.
template <int kWG, int BN>
constexpr uint32_t stage_bytes() {
  return static_cast<uint32_t>((64 * kWG + BN) * kBK * sizeof(bf16));  // A rows then weight rows, 128 B each
}
template <int kWG, int BN>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(kStages) * stage_bytes<kWG, BN>() + 1024;  // +1 KB to align to 1024
}

template <int BN>
__device__ __forceinline__ void wgmma_step(float (&d)[BN / 2], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (BN == 128)
    dev::wgmma_m64n128k16_ss(d, a, b, accumulate);
  else
    dev::wgmma_m64n64k16_ss(d, a, b, accumulate);
}

// Stores a 64 x BN fragment set (wgmma.cuh's accumulator layout) at rows bm0..,
// columns bn0.. of a row-major [M, N] output: fp32, bf16-rounded fp32, or bf16.
// bf16 with N % 8 == 0 and a 16-byte-aligned output: the four lanes of a quad
// first trade their column pairs (a 4 x 4 transpose by shuffles), so that each
// lane stores 8 consecutive columns of one row in one 16-byte store, a quarter
// of the stores of one pair per lane (the scattered 4-byte stores held the
// multiplying warps long enough to idle the tensor cores at each tile's end).
template <int BN, int kKind>  // 0: fp32 as is, 1: fp32 holding bf16, 2: bf16
__device__ __forceinline__ void store_tile(const float (&d)[BN / 2], void* out, int M, int N, int bm0, int bn0) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kKind == 2 && BN % 32 == 0) {
    if (N % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0) {
      auto pick = [](uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, int i) {
        return i == 0 ? x0 : i == 1 ? x1 : i == 2 ? x2 : x3;
      };
#pragma unroll
      for (int q = 0; q < BN / 32; ++q) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          // x[b]: this lane's column pair (2t, 2t + 1) of n8 block 4q + b.
          uint32_t x[4];
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const __nv_bfloat162 v =
                __floats2bfloat162_rn(d[4 * (4 * q + b) + 2 * half], d[4 * (4 * q + b) + 2 * half + 1]);
            x[b] = *reinterpret_cast<const uint32_t*>(&v);
          }
          // Lane t gathers block 4q + t: at round r, from quad lane (t + r) % 4,
          // which sends its pair of block (its t - r) % 4.
          uint32_t y[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const uint32_t send = pick(x[0], x[1], x[2], x[3], (t - r) & 3);
            y[r] = r == 0 ? send : __shfl_sync(0xffffffffu, send, (lane & ~3) | ((t + r) & 3));
          }
          // y[r] holds columns 2 ((t + r) % 4) .. + 1 of the block: back into column order.
          uint4 v;
          v.x = pick(y[0], y[1], y[2], y[3], (0 - t) & 3);
          v.y = pick(y[0], y[1], y[2], y[3], (1 - t) & 3);
          v.z = pick(y[0], y[1], y[2], y[3], (2 - t) & 3);
          v.w = pick(y[0], y[1], y[2], y[3], (3 - t) & 3);
          const int row = bm0 + 16 * warp + g + 8 * half, col = bn0 + 8 * (4 * q + t);
          if (row < M && col < N)
            *reinterpret_cast<uint4*>(static_cast<bf16*>(out) + static_cast<size_t>(row) * N + col) = v;
        }
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = bn0 + 8 * j + 2 * t;
    if (col >= N) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = bm0 + 16 * warp + g + 8 * half;
      if (row >= M) continue;
      const size_t idx = static_cast<size_t>(row) * N + col;
      const float v0 = d[4 * j + 2 * half], v1 = d[4 * j + 2 * half + 1];
      if constexpr (kKind == 0) {
        *reinterpret_cast<float2*>(static_cast<float*>(out) + idx) = make_float2(v0, v1);
      } else if constexpr (kKind == 1) {
        *reinterpret_cast<float2*>(static_cast<float*>(out) + idx) =
            __bfloat1622float2(__floats2bfloat162_rn(v0, v1));
      } else {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(out) + idx) = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}

// kSplit: grid.z CTAs per tile, each over kProjectionSegments / gridDim.z
// segments, storing each segment's sum into partial[segment] ([M, N] fp32).
template <int kWG, int BN, bool kSplit, bool kOutF32>
__global__ __launch_bounds__(128 * kWG, 3 - kWG) void fixed_gemm_wgmma_kernel(const bf16* __restrict__ A,
                                                                         const bf16* __restrict__ W, void* out,
                                                                         float* partial, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kAcc = BN / 2;  // fp32 accumulators per thread (64 x BN over 128 threads)
  dev::begin_dependent_kernel();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = dev::smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  const uint32_t smem_base = dev::smem_addr(smem);

  constexpr int kThreads = 128 * kWG, kBM = 64 * kWG;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int bm0 = blockIdx.y * kBM, bn0 = blockIdx.x * BN;
  const int seg_tiles = K / kProjectionSegments / kBK;
  const int segs_per_cta = kSplit ? kProjectionSegments / static_cast<int>(gridDim.z) : kProjectionSegments;
  const int kt0 = (kSplit ? static_cast<int>(blockIdx.z) * segs_per_cta : 0) * seg_tiles;
  const int kt1 = kt0 + segs_per_cta * seg_tiles;

  auto load_tile = [&](int kt, int st) {
    unsigned char* base = smem + st * stage_bytes<kWG, BN>();
    const int k0 = kt * kBK;
#pragma unroll
    for (int j = 0; j < (kBM + BN) * 8 / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i >> 3, c = i & 7;
      const bf16* src;
      bool ok;
      if (r < kBM) {
        ok = bm0 + r < M;
        src = ok ? A + static_cast<size_t>(bm0 + r) * K + k0 + c * 8 : A;
      } else {
        ok = bn0 + r - kBM < N;
        src = ok ? W + static_cast<size_t>(bn0 + r - kBM) * K + k0 + c * 8 : W;
      }
      dev::cp_async16(base + dev::swizzle128(r, c), src, ok);
    }
  };

  float acc[kAcc];
  [[maybe_unused]] float tot[kSplit ? 1 : kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  if constexpr (!kSplit) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) tot[i] = 0.0f;
  }

#pragma unroll
  for (int s = 0; s < kLookahead; ++s) {
    if (kt0 + s < kt1) load_tile(kt0 + s, s);
    dev::cp_async_commit();
  }
  for (int seg_kt = kt0; seg_kt < kt1; seg_kt += seg_tiles) {
    // One segment: its tiles' wgmmas on one chain, each tile's issued while the
    // previous tile's may still run.
#pragma unroll 1
    for (int kt = seg_kt; kt < seg_kt + seg_tiles; ++kt) {
      const int i = kt - kt0;
      dev::cp_async_wait<kLookahead - 1>();
      dev::fence_async_shared();
      // Tile kt is visible to the async proxy, and every warpgroup is past its wait
      // for tile kt - 2's wgmmas, whose stage takes tile kt + kLookahead.
      __syncthreads();
      if (kt + kLookahead < kt1) load_tile(kt + kLookahead, (i + kLookahead) % kStages);
      dev::cp_async_commit();

      const uint32_t stage = smem_base + (i % kStages) * stage_bytes<kWG, BN>();
      const uint32_t a_smem = stage + wg * 64 * 128, b_smem = stage + kBM * 128;
      // The segment's chain starts from zero: its first wgmma overwrites acc (A B,
      // where the mma.sync kernel adds A B to zeros: the same bits, up to the sign
      // of a zero, which the total, started at +0, does not keep), so that no
      // instruction but the wgmmas writes acc while they may own it.
      const int accumulate = kt == seg_kt ? 0 : 1;
      dev::wgmma_hold(acc);
      dev::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_step<BN>(acc, dev::smem_desc128(a_smem + kk * 32, 16, 1024),
                       dev::smem_desc128(b_smem + kk * 32, 16, 1024), kk == 0 ? accumulate : 1);
      dev::wgmma_commit();
      dev::wgmma_hold(acc);
      dev::wgmma_wait<1>();  // tile kt - 1's wgmmas done; tile kt's may still run
    }
    dev::wgmma_wait<0>();
    dev::wgmma_hold(acc);
    if constexpr (kSplit) {
      const int seg = seg_kt / seg_tiles;
      store_tile<BN, 0>(acc, partial + static_cast<size_t>(seg) * M * N, M, N, bm0 + 64 * wg, bn0);
    } else {
#pragma unroll
      for (int e = 0; e < kAcc; ++e) tot[e] += acc[e];
    }
  }
  dev::cp_async_wait<0>();
  if constexpr (!kSplit) store_tile<BN, kOutF32 ? 1 : 2>(tot, out, M, N, bm0 + 64 * wg, bn0);
#endif
}

// out = the segments' sums added in order from zero, rounded as the unsplit kernel stores.
template <bool kOutF32>
__global__ void combine_segments_kernel(const float* __restrict__ partial, void* out, size_t elems) {
  dev::begin_dependent_kernel();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < elems;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = 0.0f;
#pragma unroll
    for (int s = 0; s < kProjectionSegments; ++s) v += partial[s * elems + i];
    if constexpr (kOutF32)
      static_cast<float*>(out)[i] = __bfloat162float(__float2bfloat16(v));
    else
      static_cast<bf16*>(out)[i] = __float2bfloat16(v);
  }
}

// The combine of a split: each element's segment sums added in order.
cudaError_t launch_combine(const float* partial, void* out, bool out_f32, int M, int N, const LaunchConfig& launch) {
  const size_t elems = static_cast<size_t>(M) * N;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((elems + 255) / 256, 8u * sm_count()));
  return out_f32 ? launch_kernel(combine_segments_kernel<true>, blocks, 256, 0, launch, partial, out, elems)
                 : launch_kernel(combine_segments_kernel<false>, blocks, 256, 0, launch, partial, out, elems);
}

// The large-M kernel: three warpgroups, one that loads and two that multiply
// (warp specialization), persistent: a CTA per SM walks the output tiles.
// One thread of the first warpgroup issues the tensor-memory copies (TMA) of
// each 64-wide K tile, the 128 A rows and BN weight rows of the output tile,
// in 128-byte-swizzled rows, into a kTmaStages ring that runs on across
// tiles; the copies signal a stage's `full` barrier as their bytes land, and
// the two multiplying warpgroups (64 rows each) signal its `empty` barrier
// once the wgmmas that read it are done. Each element's arithmetic is the
// kernel above's: per segment one chain from zero, folded into the total at
// the segment's end. The multiplying warpgroups keep two accumulator sets
// beside the totals (registers the loading warpgroup gives up) and take them
// in turn by segment: a segment's first wgmmas are issued before the previous
// segment's sum is folded, and a tile's total is stored while the next tile's
// first wgmmas run, so neither waits with the tensor cores idle. Tiles are
// walked in groups of kTmaGroupM tile rows, so the CTAs running together
// share A and weight rows in L2. FixedGemmOptions::kernel 4 runs it in
// clusters of two CTAs along M (kCluster below) that load half of each weight
// tile each, into both. Split (`splits` work units per tile, each
// over an equal share of the segments): each segment's sum goes to the
// workspace, as the kernel above's split stores it.
constexpr int kTmaStages = 6;
constexpr int kTmaGroupM = 8;
// Registers per thread of the loading and of the multiplying warpgroups (of the
// 65536 an SM has; the launch gives each of the 384 threads 168).
constexpr int kTmaLoadRegs = 40;
constexpr int kTmaMathRegs = 232;
static_assert(128 * kTmaLoadRegs + 256 * kTmaMathRegs <= 65536, "the register file");
template <int BN>
constexpr uint32_t tma_stage_bytes() {
  return static_cast<uint32_t>((128 + BN) * kBK * sizeof(bf16));
}
template <int BN>
constexpr size_t tma_smem_bytes() {
  return static_cast<size_t>(kTmaStages) * tma_stage_bytes<BN>() + 2 * kTmaStages * sizeof(uint64_t) + 1024;
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(dev::smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// The same box into the same shared-memory offset of every CTA of the cluster in
// cta_mask, each CTA's barrier at `bar`'s offset counting the bytes it receives.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                                      uint64_t* bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(dev::smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster: what each wrote before is visible to all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// An arrival on the barrier at `bar`'s offset in CTA `cta` of the cluster. The
// arrival only says the wgmmas that read a stage are done (their wait came
// first), so it carries the default CTA-scope release, as CUTLASS's cluster
// barriers do; a cluster-scope release (which orders all of the thread's
// earlier memory operations for the whole cluster) made the clusters half as
// fast as single CTAs (cuda_gemm_bench, the tma_cluster rows).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(dev::smem_addr(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Work unit u: its output tile's first row and column, and its first segment.
// With clusters of kCluster CTAs along M, unit u is a stack of kCluster tiles
// with the same columns, and CTA `rank` of the cluster takes the rank-th (past
// M where the tile rows run out: its rows are zeros and never stored).
struct TmaUnit {
  int bm0, bn0, seg0;
};
template <int BN, int kCluster>
__device__ __forceinline__ TmaUnit tma_unit(int u, int splits, int segs, int M, int N, int rank) {
  const int tile = u / splits, tiles_m = ((M + 127) / 128 + kCluster - 1) / kCluster, tiles_n = (N + BN - 1) / BN;
  constexpr int kGroup = kTmaGroupM / kCluster;
  const int in_group = kGroup * tiles_n;
  const int first_m = tile / in_group * kGroup, group_m = min(tiles_m - first_m, kGroup);
  return {((first_m + tile % in_group % group_m) * kCluster + rank) * 128, tile % in_group / group_m * BN,
          u % splits * segs};
}

// kCluster 2: clusters of two CTAs along M share each weight tile, each loading
// half of it into both (TMA multicast), so a CTA reads half the weight bytes
// from L2; a stage is refilled once the multiplying warps of both CTAs are done
// with it (each warp arrives on both CTAs' `empty` barriers).
template <int BN, bool kSplit, bool kOutF32, int kCluster>
__global__ __launch_bounds__(384, 1) void fixed_gemm_tma_kernel(const __grid_constant__ CUtensorMap a_map,
                                                                const __grid_constant__ CUtensorMap w_map, void* out,
                                                                float* partial, int M, int N, int K, int splits) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kAcc = BN / 2;
  dev::begin_dependent_kernel();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = dev::smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  const uint32_t smem_base = dev::smem_addr(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kTmaStages * tma_stage_bytes<BN>());
  uint64_t* empty = full + kTmaStages;

  const int tid = threadIdx.x, wg = tid >> 7;
  const int units = ((M + 127) / 128 + kCluster - 1) / kCluster * ((N + BN - 1) / BN) * splits;
  const int seg_tiles = K / kBK / kProjectionSegments, segs = kProjectionSegments / splits;
  const int rank = kCluster > 1 ? static_cast<int>(cluster_cta_rank()) : 0;
  const int first_unit = static_cast<int>(blockIdx.x) / kCluster, unit_step = static_cast<int>(gridDim.x) / kCluster;

  if (tid == 0) {
    for (int s = 0; s < kTmaStages; ++s) {
      dev::mbar_init(&full[s], 1);
      // Single CTAs: every multiplying thread; clusters: every multiplying warp of every CTA.
      dev::mbar_init(&empty[s], kCluster > 1 ? 8 * kCluster : 256);
    }
    dev::mbar_init_fence();
  }
  // The peers' barriers are initialised before any copy or arrival reaches them.
  if constexpr (kCluster > 1)
    cluster_sync();
  else
    __syncthreads();

  if (wg == 0) {
    // The loading warpgroup gives registers to the multiplying ones (which hold
    // three accumulator sets: 192 of them).
    dev::set_max_registers_dec<kTmaLoadRegs>();
    if (tid == 0) {
      int i = 0;  // K tiles loaded, over every unit: the ring's position
      for (int u = first_unit; u < units; u += unit_step) {
        const TmaUnit w = tma_unit<BN, kCluster>(u, splits, segs, M, N, rank);
        for (int kt = w.seg0 * seg_tiles; kt < (w.seg0 + segs) * seg_tiles; ++kt, ++i) {
          const int s = i % kTmaStages;
          if (i >= kTmaStages) dev::mbar_wait(&empty[s], ((i / kTmaStages) - 1) & 1);
          // The whole stage lands here: this CTA's A rows, and every CTA's share of the weight rows.
          dev::mbar_expect_tx(&full[s], tma_stage_bytes<BN>());
          const uint32_t stage = smem_base + s * tma_stage_bytes<BN>();
          tma_load_2d(stage, &a_map, kt * kBK, w.bm0, &full[s]);
          if constexpr (kCluster > 1) {
            constexpr int kShare = BN / kCluster;
            tma_load_2d_multicast(stage + 128 * 128 + rank * kShare * 128, &w_map, kt * kBK, w.bn0 + rank * kShare,
                                  &full[s], static_cast<uint16_t>((1u << kCluster) - 1));
          } else {
            tma_load_2d(stage + 128 * 128, &w_map, kt * kBK, w.bn0, &full[s]);
          }
        }
      }
    }
    if constexpr (kCluster > 1) {
      __syncwarp();
      cluster_sync();  // no CTA leaves while a peer may still copy into it or arrive on its barriers
    }
    return;
  }
  dev::set_max_registers_inc<kTmaMathRegs>();

  // The segments this CTA multiplies, j = 0, 1, ...: segment seg0 + j % segs of
  // unit first_unit + (j / segs) unit_step (its cluster's units: every CTA of a
  // cluster walks the same ones). Segment j runs on accumulator set
  // j % 2; segment j - 1's set is folded (or, split, stored) once segment j's
  // first wgmmas are issued, and a unit's total is stored then too, so the
  // tensor cores have work while the fold and the stores run.
  const int cw = wg - 1;  // this multiplying warpgroup's 64 rows
  const int my_units = first_unit < units ? (units - 1 - first_unit) / unit_step + 1 : 0;
  const int total = my_units * segs;
  float acc0[kAcc], acc1[kAcc];
  [[maybe_unused]] float tot[kSplit ? 1 : kAcc];
#pragma unroll
  for (int e = 0; e < kAcc; ++e) acc0[e] = acc1[e] = 0.0f;
  if constexpr (!kSplit) {
#pragma unroll
    for (int e = 0; e < kAcc; ++e) tot[e] = 0.0f;
  }
  // Segment j's sum, complete in `done`: into the unit's total (stored after the
  // unit's last segment), or, split, into the workspace.
  auto finish = [&](float (&done)[kAcc], int j) {
    const TmaUnit w = tma_unit<BN, kCluster>(first_unit + (j / segs) * unit_step, splits, segs, M, N, rank);
    if constexpr (kSplit) {
      store_tile<BN, 0>(done, partial + static_cast<size_t>(w.seg0 + j % segs) * M * N, M, N, w.bm0 + 64 * cw, w.bn0);
    } else {
#pragma unroll
      for (int e = 0; e < kAcc; ++e) tot[e] += done[e];
      if (j % segs == segs - 1) {
        store_tile<BN, kOutF32 ? 1 : 2>(tot, out, M, N, w.bm0 + 64 * cw, w.bn0);
#pragma unroll
        for (int e = 0; e < kAcc; ++e) tot[e] = 0.0f;
      }
    }
  };
  int i = 0;             // K tiles taken, over every unit: the ring's position
  int pending = -1;      // the stage whose wgmmas may still run
  // Stage s is read: each thread arrives (single CTAs), or each warp on every CTA's barrier.
  auto release = [&](int s) {
    if constexpr (kCluster > 1) {
      __syncwarp();
      if ((tid & 31) == 0)
        for (int c = 0; c < kCluster; ++c) mbar_arrive_cluster(&empty[s], static_cast<uint32_t>(c));
    } else {
      dev::mbar_arrive(&empty[s]);
    }
  };
  auto run = [&](float (&cur)[kAcc], float (&prev)[kAcc], int j) {
#pragma unroll 1
    for (int t = 0; t < seg_tiles; ++t, ++i) {
      const int s = i % kTmaStages;
      dev::mbar_wait(&full[s], (i / kTmaStages) & 1);
      const uint32_t stage = smem_base + s * tma_stage_bytes<BN>();
      const uint32_t a_smem = stage + cw * 64 * 128, b_smem = stage + 128 * 128;
      dev::wgmma_hold(cur);
      dev::wgmma_fence();
      // The segment's chain starts from zero (as in the kernel above).
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_step<BN>(cur, dev::smem_desc128(a_smem + kk * 32, 16, 1024),
                       dev::smem_desc128(b_smem + kk * 32, 16, 1024), kk == 0 && t == 0 ? 0 : 1);
      dev::wgmma_commit();
      dev::wgmma_hold(cur);
      dev::wgmma_wait<1>();  // the previous tile's wgmmas are done: its stage is free
      if (pending >= 0) release(pending);
      pending = s;
      if (t == 0 && j > 0) {  // segment j - 1's wgmmas were the previous tile's
        dev::wgmma_hold(prev);
        finish(prev, j - 1);
      }
    }
  };
  // The last segment: its wgmmas waited for, its stage freed, its sum folded.
  auto drain = [&](float (&last)[kAcc], int j) {
    dev::wgmma_wait<0>();
    dev::wgmma_hold(last);
    release(pending);
    finish(last, j);
  };
  if (total > 0) {
    for (int j = 0;; j += 2) {
      run(acc0, acc1, j);
      if (j + 1 == total) {
        drain(acc0, j);
        break;
      }
      run(acc1, acc0, j + 1);
      if (j + 2 == total) {
        drain(acc1, j + 1);
        break;
      }
    }
  }
  if constexpr (kCluster > 1) cluster_sync();  // the loading warpgroup's counterpart
#endif
}

// cuTensorMapEncodeTiled, from the driver the runtime loaded.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major [rows, K] bf16 matrix, read in boxes of box_rows x 64 with the 128-byte swizzle.
bool encode_rows(CUtensorMap* map, const bf16* base, int rows, int K, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(base) & 15) != 0) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K) * sizeof(bf16)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(base), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int BN, bool kSplit, bool kOutF32, int kCluster>
cudaError_t launch_tma_variant(const CUtensorMap& a_map, const CUtensorMap& w_map, void* out, float* partial, int M,
                               int N, int K, int splits, const LaunchConfig& launch) {
  auto* kernel = fixed_gemm_tma_kernel<BN, kSplit, kOutF32, kCluster>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(tma_smem_bytes<BN>()));
  if (attr != cudaSuccess) return attr;
  const long units =
      static_cast<long>(((M + 127) / 128 + kCluster - 1) / kCluster) * ((N + BN - 1) / BN) * splits;
  if (units > 0x7fffffffL) return cudaErrorInvalidValue;
  long most = sm_count() / kCluster;
  if constexpr (kCluster > 1) {
    // Clusters must fit in one GPC each: as many as can run at once, not SMs / 2.
    static const int active = [&] {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(static_cast<unsigned>(sm_count()));
      cfg.blockDim = dim3(384);
      cfg.dynamicSmemBytes = tma_smem_bytes<BN>();
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = kCluster;
      attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int n = 0;
      return cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess ? n : 0;
    }();
    if (active > 0) most = std::min<long>(most, active);
  }
  const unsigned clusters = static_cast<unsigned>(std::min<long>(units, most));
  return launch_kernel_cluster(kernel, dim3(clusters * kCluster), 384, tma_smem_bytes<BN>(), launch, kCluster, a_map,
                               w_map, out, partial, M, N, K, splits);
}

template <int BN, int kCluster>
cudaError_t launch_tma(const bf16* a, const bf16* w, void* out, bool out_f32, float* partial, int M, int N, int K,
                       int splits, const LaunchConfig& launch) {
  CUtensorMap a_map, w_map;
  if (!encode_rows(&a_map, a, M, K, 128) || !encode_rows(&w_map, w, N, K, BN / kCluster))
    return cudaErrorNotSupported;
  if (splits <= 1)
    return out_f32 ? launch_tma_variant<BN, false, true, kCluster>(a_map, w_map, out, nullptr, M, N, K, 1, launch)
                   : launch_tma_variant<BN, false, false, kCluster>(a_map, w_map, out, nullptr, M, N, K, 1, launch);
  const cudaError_t err =
      launch_tma_variant<BN, true, false, kCluster>(a_map, w_map, out, partial, M, N, K, splits, launch);
  return err != cudaSuccess ? err : launch_combine(partial, out, out_f32, M, N, launch);
}

template <int kWG, int BN, bool kSplit, bool kOutF32>
cudaError_t launch_variant(const bf16* a, const bf16* w, void* out, float* partial, int M, int N, int K, int splits,
                           const LaunchConfig& launch) {
  auto* kernel = fixed_gemm_wgmma_kernel<kWG, BN, kSplit, kOutF32>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(smem_bytes<kWG, BN>()));
  if (attr != cudaSuccess) return attr;
  const dim3 grid((N + BN - 1) / BN, (M + 64 * kWG - 1) / (64 * kWG), kSplit ? splits : 1);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  cudaError_t err =
      launch_kernel(kernel, grid, 128 * kWG, smem_bytes<kWG, BN>(), launch, a, w, out, partial, M, N, K);
  if (err != cudaSuccess || !kSplit) return err;
  return launch_combine(partial, out, kOutF32, M, N, launch);
}

template <int kWG, int BN>
cudaError_t launch_tile(const bf16* a, const bf16* w, void* out, bool out_f32, float* partial, int M, int N, int K,
                        int splits, const LaunchConfig& launch) {
  if (splits > 1)
    return out_f32 ? launch_variant<kWG, BN, true, true>(a, w, out, partial, M, N, K, splits, launch)
                   : launch_variant<kWG, BN, true, false>(a, w, out, partial, M, N, K, splits, launch);
  return out_f32 ? launch_variant<kWG, BN, false, true>(a, w, out, partial, M, N, K, 1, launch)
                 : launch_variant<kWG, BN, false, false>(a, w, out, partial, M, N, K, 1, launch);
}

}  // namespace

bool fixed_gemm_wgmma_supported(int N, int K) { return N > 0 && N % 8 == 0 && K > 0 && K % 512 == 0; }

cudaError_t launch_fixed_gemm_wgmma(const bf16* a, const bf16* w, void* out, bool out_f32, int M, int N, int K,
                                    LaunchConfig launch, const FixedGemmOptions& opt) {
  if (M <= 0) return cudaSuccess;
  if (!fixed_gemm_wgmma_supported(N, K)) return cudaErrorInvalidValue;
  const int sms = sm_count();
  auto tiles = [&](int bm, int bn) { return static_cast<long>((M + bm - 1) / bm) * ((N + bn - 1) / bn); };
  const size_t need = static_cast<size_t>(kProjectionSegments) * M * N * sizeof(float);
  const bool have_workspace = opt.workspace != nullptr && opt.workspace_bytes >= need;
  // The warp-specialized TMA kernel (cuda_gemm_bench on the H200:
  // bench/results/cuda_gemm_h200.json, 2026-12-03):
  //  - split by segments where its 128 x 128 tiles fill at most half the SMs
  //    and K is long enough to pay for the partial sums' round trip, unless
  //    (more than 64 rows) those partial sums, all 8 segments' in fp32, would
  //    be more than 16 MiB and half the weights' bytes;
  //  - unsplit, 128 x 64 tiles (more than 64 rows) where their waves take less
  //    time than the 128 x 128 tiles', a 128 x 64 tile costing kNarrowTileCost
  //    of a 128 x 128 one. At 64 rows or fewer a CTA's loads, not its
  //    products, set its pace, and a narrower tile is no faster.
  if (opt.kernel == 3 || opt.kernel == 4 || (opt.kernel == 0 && opt.tile_m == 0 && opt.tile_n == 0 && opt.splits == 0)) {
    constexpr double kNarrowTileCost = 0.75;
    int bn = opt.kernel >= 3 ? opt.tile_n : 0;
    int splits = opt.splits;
    if (splits == 0) {
      splits = 1;
      const double partial_bytes = static_cast<double>(kProjectionSegments) * M * N * sizeof(float) * 2;
      const double weight_bytes = 2.0 * N * K;
      const bool partials_cheap = M <= 64 || partial_bytes <= std::max(16.0 * 1048576.0, weight_bytes / 2);
      if (K >= 2048 && 2 * tiles(128, 128) <= sms && bn != 64 && partials_cheap)
        while (splits < kProjectionSegments && tiles(128, 128) * splits < sms) splits *= 2;
      if (!have_workspace) splits = 1;
    }
    if (bn == 0) {
      auto waves = [&](int n) { return static_cast<double>((tiles(128, n) * splits + sms - 1) / sms); };
      bn = splits == 1 && M > 64 && kNarrowTileCost * waves(64) < waves(128) ? 64 : 128;
    }
    if (kProjectionSegments % splits != 0 || (splits > 1 && !have_workspace) || (bn != 64 && bn != 128))
      return cudaErrorInvalidValue;
    float* const partial = static_cast<float*>(opt.workspace);
    cudaError_t err;
    if (opt.kernel == 4)  // clusters of two along M sharing the weight tiles (multicast)
      err = bn == 64 ? launch_tma<64, 2>(a, w, out, out_f32, partial, M, N, K, splits, launch)
                     : launch_tma<128, 2>(a, w, out, out_f32, partial, M, N, K, splits, launch);
    else
      err = bn == 64 ? launch_tma<64, 1>(a, w, out, out_f32, partial, M, N, K, splits, launch)
                     : launch_tma<128, 1>(a, w, out, out_f32, partial, M, N, K, splits, launch);
    if (err != cudaErrorNotSupported || opt.kernel >= 3) return err;
  }
  int bn = opt.tile_n, bm = opt.tile_m;
  // Two warpgroups per CTA (half the weight reads per row) where that still fills
  // the SMs; 128 columns where that does. Below, one warpgroup and, with too few
  // tiles, a split (cuda_gemm_bench on the H200: bench/results/cuda_gemm_h200.json).
  if (bm == 0) bm = M > 64 && tiles(128, 64) >= sms ? 128 : 64;
  if (bn == 0) bn = tiles(bm, 128) >= (bm == 128 ? 2L : 1L) * sms ? 128 : 64;
  if ((bn != 64 && bn != 128) || (bm != 64 && bm != 128)) return cudaErrorInvalidValue;
  int splits = opt.splits;
  if (splits == 0) {
    splits = 1;
    while (splits < kProjectionSegments && tiles(bm, bn) * splits < sms) splits *= 2;
    if (!have_workspace) splits = 1;
  }
  if (kProjectionSegments % splits != 0 || (splits > 1 && !have_workspace)) return cudaErrorInvalidValue;
  float* partial = static_cast<float*>(opt.workspace);
  if (bm == 128)
    return bn == 128 ? launch_tile<2, 128>(a, w, out, out_f32, partial, M, N, K, splits, launch)
                     : launch_tile<2, 64>(a, w, out, out_f32, partial, M, N, K, splits, launch);
  return bn == 128 ? launch_tile<1, 128>(a, w, out, out_f32, partial, M, N, K, splits, launch)
                   : launch_tile<1, 64>(a, w, out, out_f32, partial, M, N, K, splits, launch);
}

#else  // built without sm_90a: the mma.sync kernel only

bool fixed_gemm_wgmma_supported(int, int) { return false; }
cudaError_t launch_fixed_gemm_wgmma(const bf16*, const bf16*, void*, bool, int, int, int, LaunchConfig,
                                    const FixedGemmOptions&) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace siesta::cuda
