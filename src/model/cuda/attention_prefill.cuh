// Device code shared by the two prefill attention kernels, attention_prefill.cu
// (mma.sync) and attention_prefill_wgmma.cu (.cu files only): what a work item
// covers, the output of padding items, and the SFU exp2 of the softmax.
#pragma once

#include <cuda_bf16.h>

#include "model/cuda/kernels.h"

namespace siesta::cuda::dev {

inline constexpr float kLog2e = 1.4426950408889634f;

// 2^x with the SFU's approximation (relative error ~2^-22); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Work item `item` (AttentionArgs::prefill_items: a sequence and a tile of
// kPrefillTileRows of its query rows) as a CTA sees it.
struct PrefillTile {
  int q_len, kv_len, q_start;  // the sequence's (kv_len 0: padding)
  int start_pos;               // position of the chunk's first row: kv_len - q_len
  int r0, rows;                // the tile's first row in the chunk, and its rows
  int key_end;                 // keys [0, key_end) are visible to some row of the tile
  const int* table;            // the sequence's block table
};

__device__ __forceinline__ PrefillTile prefill_tile(const AttentionArgs& a, int item) {
  const int seq = a.prefill_items[2 * item], tile = a.prefill_items[2 * item + 1];
  PrefillTile t;
  t.q_len = a.seq_q_len[seq];
  t.kv_len = a.seq_kv_len[seq];
  t.q_start = a.seq_q_start[seq];
  t.start_pos = t.kv_len - t.q_len;
  t.r0 = tile * kPrefillTileRows;
  t.rows = min(kPrefillTileRows, t.q_len - t.r0);
  t.key_end = t.start_pos + t.r0 + t.rows;
  t.table = a.block_tables + a.seq_table_start[seq];
  return t;
}

// A padding item (kv_len 0, from a decode graph's padded batch): zeros for the
// tile's rows of query heads [h0, h0 + heads), written by the whole CTA; no
// cache reads.
__device__ __forceinline__ void prefill_padding_zeros(const AttentionArgs& a, const PrefillTile& t, int h0,
                                                      int heads) {
  const int width = heads * a.head_dim;
  const size_t stride = static_cast<size_t>(a.num_heads) * a.head_dim;
  for (int i = threadIdx.x; i < t.rows * width; i += blockDim.x) {
    const int r = i / width, c = i % width;
    a.out[static_cast<size_t>(t.q_start + t.r0 + r) * stride + h0 * a.head_dim + c] = __float2bfloat16(0.0f);
  }
}

}  // namespace siesta::cuda::dev
