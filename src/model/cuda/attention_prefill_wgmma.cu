// Prefill attention on Hopper's warpgroup MMA (wgmma, sm_90a), head_dim 128.
//
// The same work as attention_prefill.cu's kernel (causal, variable-length,
// GQA, over the paged KV cache; a CTA serves one work item of 64 query rows
// for one query head or a pair sharing a kv head), with both products on
// wgmma instead of mma.sync:
//  - one warpgroup (4 warps, 128 threads) per query head; warp w holds rows
//    16w..16w+15 of the tile, as in mma.sync's fragment layout (wgmma.cuh);
//  - S = Q K^T (64 x 64 keys, fp32) is one wgmma chain reading Q and K from
//    shared memory; O += P V (64 x 128) takes P from registers (the score
//    accumulators, rounded to bf16, are already A fragments) and V from
//    shared memory as an MN-major operand;
//  - Q, K and V tiles sit in shared memory 128-byte swizzled (two 64-column
//    blocks per 128-wide row), gathered from the cache blocks with cp.async,
//    K/V double-buffered, one barrier per key tile. No ldmatrix: the tensor
//    cores read shared memory themselves, which is what bounds the mma.sync
//    kernel (its header).
// The online softmax takes that kernel's steps: 64-key steps from key 0, fp32
// in the log2 domain, the same masks and rescaling (its row sums add as a
// tree here). So a row's output depends only on its position and its
// sequence's cache, as that header argues, and not on its tile, its CTA or
// its pass, so batch-invariant mode takes it too (and its decode kernel,
// attention_decode_invariant.cu, reproduces these chains on mma.sync). The two
// kernels differ by rounding (summation order), so a model takes one of them
// for every pass.
// Measured on the H200 (bench/results/cuda_notes.md): the kernel is bound by
// each warpgroup's latency (softmax chains, barriers, waits on its own MMAs),
// not by the tensor cores (~24% busy); two CTAs per SM beat one CTA with
// deeper buffering or 128-key tiles. FlashAttention-3's producer warp,
// ping-pong between warpgroups and softmax overlapped with the next tile's
// MMA are the known next steps.
#include <cuda_bf16.h>

#include <cmath>

#include "model/cuda/attention_prefill.cuh"
#include "model/cuda/device_util.cuh"
#include "model/cuda/kernels.h"
#include "model/cuda/mma.cuh"
#include "model/cuda/wgmma.cuh"

#if defined(SIESTA_CUDA_WGMMA)  // set by the build for sm_90a (src/CMakeLists.txt)

namespace siesta::cuda {
namespace {

constexpr int kHeadDim = 128;
constexpr int kBM = kPrefillTileRows;  // query rows per head per CTA (one warpgroup)
constexpr int kBN = 64;                // keys per tile
constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
static_assert(kBM == 64 && kBN == 64, "one m64 wgmma row block per head, 64-key tiles");
// A 64 x 128 bf16 tile: two 64 x 64 column blocks of 8 KB, each 128-byte swizzled.
constexpr uint32_t kBlockBytes = 64 * 128;
constexpr uint32_t kTileBytes = 2 * kBlockBytes;
using dev::fast_exp2;
using dev::kLog2e;

template <int kHeads>
constexpr size_t smem_bytes() {
  return (kHeads + 4) * kTileBytes + 1024;  // Q per head, K and V twice; +1 KB to align to 1024
}

// Byte offset of 16-byte chunk c (of kChunks) of row r in a swizzled tile.
__device__ __forceinline__ uint32_t tile_offset(int r, int c) {
  return (c >> 3) * kBlockBytes + dev::swizzle128(r, c);
}

// Two CTAs per SM (128 registers per thread, 97 KB of shared memory each). On
// the H200 the first version took 4.8 ms of attention for a 4096-token prompt
// of the 0.6B shape this way, against 6.4-6.6 ms as one CTA per SM with three
// K/V stages or with 128-key tiles.
template <int kHeads>
__global__ __launch_bounds__(128 * kHeads, 2) void prefill_attention_wgmma_kernel(AttentionArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kThreads = 128 * kHeads;
  dev::begin_dependent_kernel();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = dev::smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  unsigned char* Qs = smem;                      // [kHeads] tiles
  unsigned char* Ks = Qs + kHeads * kTileBytes;  // [2] tiles
  unsigned char* Vs = Ks + 2 * kTileBytes;       // [2] tiles

  const int h0 = blockIdx.x * kHeads;
  const dev::PrefillTile pt = dev::prefill_tile(a, blockIdx.y);
  if (pt.kv_len <= 0) {  // padding: defined output, no cache reads (whole CTA returns)
    dev::prefill_padding_zeros(a, pt, h0, kHeads);
    return;
  }
  const int kv_len = pt.kv_len, q_start = pt.q_start, start_pos = pt.start_pos;
  const int r0 = pt.r0, rows = pt.rows;
  const size_t out_stride = static_cast<size_t>(a.num_heads) * kHeadDim;
  const int kvh = h0 / (a.num_heads / a.num_kv_heads);
  const int ntiles = (pt.key_end + kBN - 1) / kBN;
  const int* table = pt.table;
  const int tid = threadIdx.x, lane = tid & 31;

  // Q tiles of every head; rows past the sequence are zero.
  for (int i = tid; i < kHeads * kBM * kChunks; i += kThreads) {
    const int hr = i / kChunks, c = i % kChunks;  // hr = head * kBM + row
    const int r = hr % kBM;
    const bool ok = r < rows;
    const bf16* src =
        ok ? a.q + (static_cast<size_t>(q_start + r0 + r) * a.num_heads + h0 + hr / kBM) * kHeadDim + c * 8 : a.q;
    dev::cp_async16(Qs + (hr / kBM) * kTileBytes + tile_offset(r, c), src, ok);
  }
  // K/V tile j into stage st; positions at or past kv_len are zero (the cache
  // there may hold anything, and 0 * NaN would poison the sums). Thread tid
  // copies chunk tid % 16 of rows r = tid / 16 + kThreads / 16 * n: key
  // 64 j + r, in cache block table[4 j + r / 16] at slot r % 16. Its shared
  // memory offsets are the same for every tile, and unsigned arithmetic keeps
  // the address math to a few instructions per row.
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kRowsPerThread = kBN / kRowStep;
  const uint32_t my_chunk = tid % kChunks, my_row = tid / kChunks;
  // Element strides of a cache block (every layer's K and V) and of a slot, in 32 bits (a
  // block is far below 2^32 elements); only the offset of a block needs 64.
  const uint32_t block_elems = static_cast<uint32_t>(a.kv.num_layers) * 2 * kKvBlockSize * a.kv.num_kv_heads * kHeadDim;
  const uint32_t slot_elems = static_cast<uint32_t>(a.kv.num_kv_heads) * kHeadDim;
  // K of (block 0, slot 0) for this layer, kv head and chunk; V is kKvBlockSize slots further.
  const bf16* k0 = a.kv.base + static_cast<size_t>(a.layer) * 2 * kKvBlockSize * slot_elems +
                   static_cast<size_t>(kvh) * kHeadDim + my_chunk * 8;
  const uint32_t v_delta = kKvBlockSize * slot_elems;
  const uint32_t kv_keys = static_cast<uint32_t>(kv_len);
  auto load_kv = [&](int j, int st) {
    const uint32_t key0 = static_cast<uint32_t>(j) * kBN;
    const int* tile_blocks = table + key0 / kKvBlockSize;
#pragma unroll 2  // fully unrolled, the 128-register budget spills
    for (int n = 0; n < kRowsPerThread; ++n) {
      const uint32_t r = my_row + kRowStep * n;
      const bool ok = key0 + r < kv_keys;
      const bf16* ksrc = a.kv.base;
      if (ok)
        ksrc = k0 + static_cast<size_t>(tile_blocks[r / kKvBlockSize]) * block_elems + (r % kKvBlockSize) * slot_elems;
      const uint32_t dst = st * kTileBytes + tile_offset(static_cast<int>(r), static_cast<int>(my_chunk));
      dev::cp_async16(Ks + dst, ksrc, ok);
      dev::cp_async16(Vs + dst, ok ? ksrc + v_delta : ksrc, ok);
    }
  };
  load_kv(0, 0);
  dev::cp_async_commit();

  const int head_local = tid >> 7;  // this warpgroup's head
  const int h = h0 + head_local;
  const int warp_row0 = ((tid >> 5) & 3) * 16;  // the warp's first row in the tile
  const int g = lane >> 2, t4 = lane & 3;
  // This thread's rows: warp_row0 + g and + 8 (positions pos0 and pos0 + 8).
  const int warp_pos0 = start_pos + r0 + warp_row0;
  const int pos0 = warp_pos0 + g;
  const float qscale = a.scale * kLog2e;
  const uint32_t q_smem = dev::smem_addr(Qs + head_local * kTileBytes);
  const uint32_t k_smem = dev::smem_addr(Ks), v_smem = dev::smem_addr(Vs);

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  for (int j = 0; j < ntiles; ++j) {
    const int st = j & 1;
    // Tile j has landed, for every thread; and every warpgroup is done with tile j - 1,
    // so its stage takes tile j + 1 (one barrier per tile), once S is on its way.
    dev::cp_async_wait<0>();
    dev::fence_async_shared();
    __syncthreads();

    // S = Q K^T: 8 k16 steps, 4 in each 64-column block (32 bytes apart in a swizzled row).
    float s[32];
    dev::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t at = (kk >> 2) * kBlockBytes + (kk & 3) * 32;
      const uint64_t qd = dev::smem_desc128(q_smem + at, 16, 1024);
      const uint64_t kd = dev::smem_desc128(k_smem + st * kTileBytes + at, 16, 1024);
      if (kk == 0) {
        dev::wgmma_m64n64k16_ss<false>(s, qd, kd);
      } else {
        dev::wgmma_m64n64k16_ss<true>(s, qd, kd);
      }
    }
    dev::wgmma_commit();
    // Tile j + 1's copies go out while the tensor cores compute S (their block-table reads
    // would otherwise delay it).
    if (j + 1 < ntiles) load_kv(j + 1, st ^ 1);
    dev::cp_async_commit();
    dev::wgmma_wait<0>();
    dev::wgmma_hold(s);

    // Mask the keys past each row's position (raw scores; the scale is folded into the
    // exponent). Those include every key at or past kv_len, as a row's position is below it.
    const int key0 = j * kBN;
    if (key0 + kBN - 1 > warp_pos0) {
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + nt * 8 + 2 * t4 + (e & 1);
          if (key > pos0 + (e < 2 ? 0 : 8)) s[4 * nt + e] = -INFINITY;
        }
    }

    // Online softmax (the 4 lanes of a quad share a row), both of the thread's rows at
    // once and with tree-shaped max and sum, so that few dependent chains wait on each
    // other: a warp's latency is what bounds this kernel. p packs into the A fragments
    // of P (pk[kc]: keys 16 kc ..).
    float mx[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float m4[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        m4[q] = fmaxf(fmaxf(s[8 * q + 2 * rh], s[8 * q + 2 * rh + 1]),
                      fmaxf(s[8 * q + 4 + 2 * rh], s[8 * q + 5 + 2 * rh]));
      mx[rh] = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
    }
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 1));
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 2));
    float alpha[2], offset[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      // The first tile always holds position 0, visible to every row: m_new is finite.
      const float m_new = fmaxf(m_run[rh], mx[rh]);
      // Exactly 1 when the max did not move, so tiles past a row's position change nothing.
      alpha[rh] = m_new == m_run[rh] ? 1.0f : fast_exp2((m_run[rh] - m_new) * qscale);
      m_run[rh] = m_new;
      offset[rh] = -m_new * qscale;
    }
    // Rescale o where a row's max moved. Once the max settles (in attention, within a few
    // tiles) no row of the warp needs it and the warp skips the multiplications; a row with
    // alpha 1 in a warp that does them is multiplied by exactly 1, which changes no bit.
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int d = 0; d < kHeadDim / 8; ++d) {
        o[4 * d] *= alpha[0];
        o[4 * d + 1] *= alpha[0];
        o[4 * d + 2] *= alpha[1];
        o[4 * d + 3] *= alpha[1];
      }
    }
    uint32_t pk[kBN / 16][4];
    float rs[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // [row][even or odd n8 block]
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const float p0 = fast_exp2(fmaf(s[4 * nt + 2 * rh], qscale, offset[rh]));
        const float p1 = fast_exp2(fmaf(s[4 * nt + 2 * rh + 1], qscale, offset[rh]));
        rs[rh][nt & 1] += p0 + p1;
        pk[nt / 2][(nt & 1) * 2 + rh] = dev::pack_bf16(p0, p1);
      }
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) l_run[rh] = fmaf(l_run[rh], alpha[rh], rs[rh][0] + rs[rh][1]);  // one rounding

    // O += P V: 4 k16 steps over the tile's keys, 16 rows (2 KB of each column block) apart.
    dev::wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < kBN / 16; ++kc) {
      const uint64_t vd = dev::smem_desc128(v_smem + st * kTileBytes + kc * 16 * 128, kBlockBytes, 1024);
      dev::wgmma_m64n128k16_rs_mn(o, pk[kc], vd);
    }
    dev::wgmma_commit();
    dev::wgmma_wait<0>();
    dev::wgmma_hold(o);
  }

#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 1);
    l_run[rh] += __shfl_xor_sync(0xffffffffu, l_run[rh], 2);
  }
  const int local_a = warp_row0 + g;  // this thread's rows local_a and local_a + 8
  const float inv_a = 1.0f / l_run[0], inv_b = 1.0f / l_run[1];
#pragma unroll
  for (int d = 0; d < kHeadDim / 8; ++d) {
    const int col = h * kHeadDim + d * 8 + 2 * t4;
    if (local_a < rows)
      *reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<size_t>(q_start + r0 + local_a) * out_stride + col) =
          __floats2bfloat162_rn(o[4 * d] * inv_a, o[4 * d + 1] * inv_a);
    if (local_a + 8 < rows)
      *reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<size_t>(q_start + r0 + local_a + 8) * out_stride + col) =
          __floats2bfloat162_rn(o[4 * d + 2] * inv_b, o[4 * d + 3] * inv_b);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <int kHeads>
cudaError_t launch_for(const AttentionArgs& a, int num_items, const LaunchConfig& launch) {
  constexpr size_t bytes = smem_bytes<kHeads>();
  auto* kernel = prefill_attention_wgmma_kernel<kHeads>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (attr != cudaSuccess) return attr;
  return launch_kernel(kernel, dim3(a.num_heads / kHeads, num_items), 128 * kHeads, bytes, launch, a);
}

}  // namespace

bool prefill_wgmma_supported(int num_heads, int num_kv_heads, int head_dim) {
  return head_dim == kHeadDim && attention_supported(num_heads, num_kv_heads, head_dim);
}

cudaError_t launch_prefill_attention_wgmma(const AttentionArgs& args, int num_items, LaunchConfig launch) {
  if (num_items <= 0) return cudaSuccess;
  if (!prefill_wgmma_supported(args.num_heads, args.num_kv_heads, args.head_dim) || num_items > 65535)
    return cudaErrorInvalidValue;
  if (prefill_heads_per_cta(args.num_heads, args.num_kv_heads, args.prefill_heads_per_cta) == 2)
    return launch_for<2>(args, num_items, launch);
  return launch_for<1>(args, num_items, launch);
}

}  // namespace siesta::cuda

#else  // built for another architecture: the mma.sync kernel serves

namespace siesta::cuda {

bool prefill_wgmma_supported(int, int, int) { return false; }

cudaError_t launch_prefill_attention_wgmma(const AttentionArgs&, int, LaunchConfig) { return cudaErrorInvalidValue; }

}  // namespace siesta::cuda

#endif  // SIESTA_CUDA_WGMMA
