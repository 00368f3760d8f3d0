// The gather-copy kernel (gather_copy.h says what it does and what it needs).
#include "transfer/ipc/gather_copy.h"

#include <cstdint>

namespace siesta::transfer::ipc {
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

__global__ __launch_bounds__(kGatherThreads) void gather_copy_kernel(const GatherPiece* __restrict__ pieces,
                                                                     const uint32_t* __restrict__ chunk_piece,
                                                                     uint32_t chunks, uint64_t chunk_bytes) {
  for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const GatherPiece p = pieces[chunk_piece[c]];
    const uint64_t begin = static_cast<uint64_t>(c - p.first_chunk) * chunk_bytes;
    const uint64_t rest = p.bytes - begin;
    const uint64_t n = rest < chunk_bytes ? rest : chunk_bytes;
    char* d = p.dst + begin;
    const char* s = p.src + begin;
    // The same branch for the whole CTA: it depends on the chunk only.
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
}

}  // namespace

cudaError_t gather_copy_ctas_per_sm(int* ctas) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, gather_copy_kernel, kGatherThreads, 0);
}

cudaError_t launch_gather_copy(const GatherPiece* pieces, const uint32_t* chunk_piece, uint32_t chunks,
                               uint64_t chunk_bytes, int ctas, cudaStream_t stream) {
  if (chunks == 0) return cudaSuccess;
  if (ctas <= 0) return cudaErrorInvalidConfiguration;
  void* args[] = {&pieces, &chunk_piece, &chunks, &chunk_bytes};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&gather_copy_kernel), dim3(static_cast<unsigned>(ctas)),
                          dim3(kGatherThreads), args, 0, stream);
}

}  // namespace siesta::transfer::ipc
