#include "model/cuda/activation_scratch.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "model/cuda/cuda_check.h"
#include "model/cuda/step_plan.h"

namespace siesta::cuda {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

Result<ActivationScratch> ActivationScratch::allocate(const ModelConfig& cfg, const ScratchSizes& sizes,
                                                      DeviceAllocator& alloc) {
  ActivationScratch s;
  const size_t T = sizes.max_batch_tokens, S = sizes.max_seqs;
  const size_t H = cfg.hidden_size, QD = cfg.q_dim(), I = cfg.intermediate_size, V = cfg.vocab_size;
  const size_t qkv_cols = cfg.q_dim() + 2 * cfg.kv_dim();
  s.logits_rows_cap = std::max<int>(sizes.max_seqs, 64);
  const size_t max_blocks_per_seq = (sizes.max_model_len + kBlockSize - 1) / kBlockSize;
  // Every section of the step image at its largest, plus alignment.
  const size_t ints = 3 * T + 5 * S + 2 * (T / kPrefillTileRows + S) + T + S * max_blocks_per_seq + kStepSyncWords;
  s.meta_capacity = align_up(ints * 4 + S * (sizeof(SamplingRecord) + kMaxBannedPerRow * 4) + 16 * 16, kAlign);

  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t off = at;
    at = align_up(at + bytes, kAlign);
    return off;
  };
  const size_t x_off = take(T * H * 2), h_off = take(T * H * 2), proj_off = take(T * H * 2);
  const size_t qkv_off = take(T * qkv_cols * 2);
  const size_t q_off = take(T * QD * 2), attn_off = take(T * QD * 2);
  const size_t gu_off = take(T * 2 * I * 2), act_off = take(T * I * 2);
  const size_t hn_off = take(static_cast<size_t>(s.logits_rows_cap) * H * 2);
  const size_t logits_off = take(static_cast<size_t>(s.logits_rows_cap) * V * 4);
  // Room for S sequences' partitions.
  const size_t part_elems = cfg.num_heads * S * static_cast<size_t>(sizes.partial_parts);
  const size_t partial_off = take(part_elems * cfg.head_dim * 4), ml_off = take(part_elems * 2 * 4);
  const size_t ws_off = take(sizes.gemm_workspace_bytes);
  const size_t meta_off = take(s.meta_capacity);
  const size_t trace_off = take(sizes.trace_bytes);
  SIESTA_ASSIGN_OR_RETURN(s.buffer_, DeviceBuffer::allocate(alloc, at, DeviceMemoryTag::kScratch));
  std::byte* b = s.buffer_.as<std::byte>();
  s.x = reinterpret_cast<bf16*>(b + x_off);
  s.h = reinterpret_cast<bf16*>(b + h_off);
  s.proj = reinterpret_cast<bf16*>(b + proj_off);
  s.qkv = reinterpret_cast<bf16*>(b + qkv_off);
  s.q = reinterpret_cast<bf16*>(b + q_off);
  s.attn = reinterpret_cast<bf16*>(b + attn_off);
  s.gu = reinterpret_cast<bf16*>(b + gu_off);
  s.act = reinterpret_cast<bf16*>(b + act_off);
  s.hn = reinterpret_cast<bf16*>(b + hn_off);
  s.logits = reinterpret_cast<float*>(b + logits_off);
  s.partial_out = reinterpret_cast<float*>(b + partial_off);
  s.partial_ml = reinterpret_cast<float*>(b + ml_off);
  s.gemm_ws = b + ws_off;
  s.meta = b + meta_off;
  if (sizes.trace_bytes > 0) s.trace = reinterpret_cast<unsigned long long*>(b + trace_off);

  SIESTA_CUDA_TRY(cudaMallocHost(&s.host_meta, s.meta_capacity), "allocating pinned host memory for step metadata");
  SIESTA_CUDA_TRY(cudaHostAlloc(&s.host_chosen, S * 4, cudaHostAllocMapped),
                  "allocating pinned host memory for sampled tokens");
  SIESTA_CUDA_TRY(cudaHostGetDevicePointer(&s.chosen, s.host_chosen, 0), "mapping the sampled tokens' host memory");
  return s;
}

ActivationScratch::ActivationScratch(ActivationScratch&& other) noexcept { *this = std::move(other); }

ActivationScratch& ActivationScratch::operator=(ActivationScratch&& other) noexcept {
  if (this == &other) return *this;
  release();
  x = other.x, h = other.h, qkv = other.qkv, q = other.q, attn = other.attn, proj = other.proj;
  gu = other.gu, act = other.act, hn = other.hn;
  logits = other.logits, partial_out = other.partial_out, partial_ml = other.partial_ml;
  gemm_ws = other.gemm_ws, meta = other.meta, trace = other.trace;
  meta_capacity = other.meta_capacity, logits_rows_cap = other.logits_rows_cap;
  host_meta = std::exchange(other.host_meta, nullptr);
  host_chosen = std::exchange(other.host_chosen, nullptr);
  chosen = std::exchange(other.chosen, nullptr);
  buffer_ = std::move(other.buffer_);
  return *this;
}

ActivationScratch::~ActivationScratch() { release(); }

void ActivationScratch::release() {
  if (host_meta) cudaFreeHost(host_meta);
  if (host_chosen) cudaFreeHost(host_chosen);
  host_meta = nullptr;
  host_chosen = nullptr;
  chosen = nullptr;
}

}  // namespace siesta::cuda
