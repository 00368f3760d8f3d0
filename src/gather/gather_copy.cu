// The gather-copy kernel (gather_copy.h says what it does and what it needs).
#include "gather/gather_copy.h"

#include <algorithm>
#include <cstdint>

namespace siesta::gather {
namespace {

// Streaming (evict-first) loads and stores for 4-, 8- and 16-byte words;
// plain ones for the bytes of unaligned heads and tails.
template <class V>
__device__ __forceinline__ V load_word(const V* p) {
  if constexpr (sizeof(V) >= 4) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

template <class V>
__device__ __forceinline__ void store_word(V* p, V v) {
  if constexpr (sizeof(V) >= 4) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// The CTA copies n bytes from s to d, which are equally aligned modulo
// sizeof(V): bytes up to the first aligned address, words of V, bytes after
// the last whole word.
template <class V>
__device__ __forceinline__ void copy_words(char* d, const char* s, uint64_t n) {
  constexpr uint64_t kWord = sizeof(V);
  const uint64_t misaligned = reinterpret_cast<uintptr_t>(s) & (kWord - 1);
  const uint64_t to_aligned = (kWord - misaligned) & (kWord - 1);
  const uint64_t head = to_aligned < n ? to_aligned : n;
  const uint64_t words = (n - head) / kWord;
  const uint64_t tail = head + words * kWord;
  const uint64_t t = threadIdx.x;
  const uint64_t stride = blockDim.x;

  for (uint64_t i = t; i < head; i += stride) d[i] = s[i];
  const V* ws = reinterpret_cast<const V*>(s + head);
  V* wd = reinterpret_cast<V*>(d + head);
  uint64_t i = t;
  // Four loads in flight per thread before its stores.
  for (; i + 3 * stride < words; i += 4 * stride) {
    const V a = load_word(ws + i);
    const V b = load_word(ws + i + stride);
    const V c = load_word(ws + i + 2 * stride);
    const V e = load_word(ws + i + 3 * stride);
    store_word(wd + i, a);
    store_word(wd + i + stride, b);
    store_word(wd + i + 2 * stride, c);
    store_word(wd + i + 3 * stride, e);
  }
  for (; i < words; i += stride) store_word(wd + i, load_word(ws + i));
  for (uint64_t j = tail + t; j < n; j += stride) d[j] = s[j];
}

// The CTA copies n bytes of piece p from byte `offset` of it.
__device__ __forceinline__ void copy_segment(const GatherPiece& p, uint64_t offset, uint64_t n) {
  char* d = p.dst + offset;
  const char* s = p.src + offset;
  // The same branch for the whole CTA: it depends on the segment only.
  const uintptr_t apart = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s);
  if ((apart & 15) == 0) {
    copy_words<uint4>(d, s, n);
  } else if ((apart & 7) == 0) {
    copy_words<uint2>(d, s, n);
  } else if ((apart & 3) == 0) {
    copy_words<unsigned int>(d, s, n);
  } else {
    copy_words<unsigned char>(d, s, n);
  }
}

// The CTA's share of the whole, piece after piece, from the piece it starts
// in: the last one whose `begin` is at most the share's first byte.
template <class Pieces>
__device__ __forceinline__ void copy_share(const Pieces& pieces, uint32_t count, uint64_t total, uint64_t per_cta) {
  uint64_t lo = static_cast<uint64_t>(blockIdx.x) * per_cta;
  if (lo >= total) return;
  const uint64_t hi = lo + per_cta < total ? lo + per_cta : total;
  uint32_t first = 0, last = count - 1;
  while (first < last) {
    const uint32_t mid = (first + last + 1) / 2;
    if (pieces[mid].begin <= lo) {
      first = mid;
    } else {
      last = mid - 1;
    }
  }
  for (uint32_t k = first; lo < hi && k < count; ++k) {
    const GatherPiece p = pieces[k];
    const uint64_t end = p.begin + p.bytes < hi ? p.begin + p.bytes : hi;
    copy_segment(p, lo - p.begin, end - lo);
    lo = end;
  }
}

__global__ __launch_bounds__(kGatherThreads) void gather_copy_kernel(const GatherPiece* __restrict__ pieces,
                                                                     uint32_t count, uint64_t total,
                                                                     uint64_t per_cta) {
  copy_share(pieces, count, total, per_cta);
}

template <int N>
__global__ __launch_bounds__(kGatherThreads) void gather_copy_param_kernel(const __grid_constant__ GatherParams<N> t) {
  copy_share(t.piece, t.pieces, t.total, t.per_cta);
}

template <int N>
cudaError_t launch_with_params(const GatherParams<N>& params, int ctas, cudaStream_t stream) {
  if (params.total == 0) return cudaSuccess;
  if (ctas <= 0 || params.pieces == 0 || params.pieces > static_cast<uint32_t>(N) || params.per_cta == 0)
    return cudaErrorInvalidConfiguration;
  void* args[] = {const_cast<GatherParams<N>*>(&params)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&gather_copy_param_kernel<N>),
                          dim3(static_cast<unsigned>(ctas)), dim3(kGatherThreads), args, 0, stream);
}

}  // namespace

cudaError_t gather_copy_ctas_per_sm(int* ctas) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, gather_copy_kernel, kGatherThreads, 0);
}

cudaError_t gather_copy_full_grid(int* ctas) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = gather_copy_ctas_per_sm(&per_sm);
  if (e != cudaSuccess) return e;
  *ctas = std::max(sms, 1) * std::max(per_sm, 1);
  return cudaSuccess;
}

GatherShare gather_share(uint64_t total, uint64_t pieces, int ctas_max) {
  constexpr uint64_t kMinShare = uint64_t{16} << 10;
  constexpr uint64_t kPiecesPerCta = 8;
  constexpr uint64_t kAlign = 256;
  GatherShare share;
  share.total = total;
  if (total == 0 || ctas_max <= 0) return share;
  // 16 KiB or more each, but no CTA walks through many more than 8 pieces
  // where the device has CTAs to spare (thousands of tiny pieces).
  uint64_t ctas = std::max((total + kMinShare - 1) / kMinShare, (pieces + kPiecesPerCta - 1) / kPiecesPerCta);
  if (ctas > static_cast<uint64_t>(ctas_max)) ctas = static_cast<uint64_t>(ctas_max);
  share.per_cta = ((total + ctas - 1) / ctas + kAlign - 1) / kAlign * kAlign;
  share.ctas = static_cast<int>((total + share.per_cta - 1) / share.per_cta);
  return share;
}

cudaError_t launch_gather_copy(const GatherPiece* pieces, uint32_t count, const GatherShare& share,
                               cudaStream_t stream) {
  if (share.total == 0) return cudaSuccess;
  if (share.ctas <= 0 || count == 0 || share.per_cta == 0) return cudaErrorInvalidConfiguration;
  uint64_t total = share.total, per_cta = share.per_cta;
  void* args[] = {&pieces, &count, &total, &per_cta};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&gather_copy_kernel), dim3(static_cast<unsigned>(share.ctas)),
                          dim3(kGatherThreads), args, 0, stream);
}

cudaError_t launch_gather_copy(const GatherParams<kGatherFewPieces>& params, int ctas, cudaStream_t stream) {
  return launch_with_params(params, ctas, stream);
}

cudaError_t launch_gather_copy(const GatherParams<kGatherManyPieces>& params, int ctas, cudaStream_t stream) {
  return launch_with_params(params, ctas, stream);
}

cudaError_t launch_gather_copy_pieces(const GatherPiece* pieces, size_t count, int ctas_max, cudaStream_t stream) {
  size_t k = 0;
  while (k < count) {
    GatherParams<kGatherFewPieces> params;
    uint32_t n = 0;
    uint64_t total = 0;
    for (; k < count && n < static_cast<uint32_t>(kGatherFewPieces); ++k) {
      if (pieces[k].bytes == 0) continue;
      params.piece[n] = pieces[k];
      params.piece[n].begin = total;
      total += pieces[k].bytes;
      ++n;
    }
    if (n == 0) break;
    const GatherShare share = gather_share(total, n, ctas_max);
    params.pieces = n;
    params.total = total;
    params.per_cta = share.per_cta;
    const cudaError_t e = launch_with_params(params, share.ctas, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace siesta::gather
