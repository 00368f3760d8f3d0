#include "model/cuda/instrumentation.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <iterator>

#include "model/cuda/cuda_check.h"
#include "model/cuda/kernels.h"

namespace siesta::cuda {
namespace {

constexpr size_t kTraceLaunchWords = static_cast<size_t>(kTraceCtas) * kTraceCtaWords;

}  // namespace

Instrumentation::Instrumentation(const InstrumentationOptions& options, int num_layers)
    : opt_(options), num_layers_(num_layers) {}

Instrumentation::~Instrumentation() {
  for (cudaEvent_t e : event_pool_) cudaEventDestroy(e);
  for (cudaEvent_t e : graph_events_)
    if (e) cudaEventDestroy(e);
}

void Instrumentation::reset() {
  profile_ms_.clear();
  graph_ms_total_ = 0;
  graph_steps_ = 0;
}

void Instrumentation::mark(const char* label) {
  if (!opt_.profile) return;
  if (marks_.size() == event_pool_.size()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return;
    event_pool_.push_back(e);
  }
  cudaEvent_t e = event_pool_[marks_.size()];
  cudaEventRecord(e, stream_);
  marks_.emplace_back(label, e);
}

void Instrumentation::collect_profile() {
  if (!opt_.profile) return;
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second) != cudaSuccess) continue;
    auto it =
        std::find_if(profile_ms_.begin(), profile_ms_.end(), [&](const auto& p) { return p.first == marks_[i].first; });
    if (it == profile_ms_.end()) profile_ms_.emplace_back(marks_[i].first, ms);
    else it->second += ms;
  }
  marks_.clear();
}

size_t Instrumentation::trace_bytes() const { return opt_.trace ? trace_slots() * kTraceLaunchWords * 8 : 0; }

Result<void> Instrumentation::clear_trace() {
  if (!trace_buf_) return {};
  SIESTA_CUDA_TRY(cudaMemsetAsync(trace_buf_, 0, trace_slots() * kTraceLaunchWords * 8, stream_), "clearing the trace");
  return {};
}

unsigned long long* Instrumentation::trace_slot(int slot) const {
  return trace_buf_ ? trace_buf_ + slot * kTraceLaunchWords : nullptr;
}

Result<void> Instrumentation::open_graph() {
  if (!opt_.time_graphs) return {};
  if (!graph_events_[0])
    for (cudaEvent_t& e : graph_events_) SIESTA_CUDA_TRY(cudaEventCreate(&e), "creating the graph timing events");
  // External records: nodes of the graph that take the time when it runs.
  SIESTA_CUDA_TRY(cudaEventRecordWithFlags(graph_events_[0], stream_, cudaEventRecordExternal),
                  "recording the graph's first event");
  return {};
}

Result<void> Instrumentation::close_graph() {
  if (!opt_.time_graphs) return {};
  SIESTA_CUDA_TRY(cudaEventRecordWithFlags(graph_events_[1], stream_, cudaEventRecordExternal),
                  "recording the graph's last event");
  return {};
}

Result<void> Instrumentation::time_graph_replay() {
  if (!opt_.time_graphs) return {};
  float ms = 0;
  SIESTA_CUDA_TRY(cudaEventElapsedTime(&ms, graph_events_[0], graph_events_[1]), "timing a decode graph");
  graph_ms_total_ += ms;
  ++graph_steps_;
  return {};
}

std::vector<KernelTrace> Instrumentation::trace() const {
  std::vector<KernelTrace> out;
  if (!trace_buf_ || cudaStreamSynchronize(stream_) != cudaSuccess) return out;
  std::vector<unsigned long long> w(trace_slots() * kTraceLaunchWords);
  if (cudaMemcpy(w.data(), trace_buf_, w.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) return out;
  static const char* const kKernels[] = {"qkv", "attention", "o", "gate_up", "down"};
  // Per launch: first and last start, first and last wait, and the last warp at each mark.
  constexpr int kWords = 4 + kTraceMarks;
  static_assert(kWords == KernelTrace::kMarks);
  using CtaWords = std::array<unsigned long long, 2 + kTraceMarks>;  // start, wait, last warp at each mark
  static_assert(std::tuple_size_v<CtaWords> == std::size(KernelTrace::Cta{}.ns));
  std::vector<std::array<unsigned long long, kWords>> r(trace_slots());
  std::vector<std::vector<std::pair<int, CtaWords>>> ctas(trace_slots());
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < trace_slots(); ++i) {
    std::array<unsigned long long, kWords> v{};
    v[0] = v[2] = ~0ull;
    for (int c = 0; c < kTraceCtas; ++c) {
      const unsigned long long* cw = &w[i * kTraceLaunchWords + static_cast<size_t>(c) * kTraceCtaWords];
      if (!cw[0]) continue;  // no such CTA
      CtaWords cta{cw[0], cw[1]};
      v[0] = std::min(v[0], cw[0]);
      v[1] = std::max(v[1], cw[0]);
      if (cw[1]) {
        v[2] = std::min(v[2], cw[1]);
        v[3] = std::max(v[3], cw[1]);
      }
      for (int k = 0; k < kTraceMarks; ++k)
        for (int warp = 0; warp < 8; ++warp) cta[2 + k] = std::max(cta[2 + k], cw[8 + 8 * k + warp]);
      for (int k = 0; k < kTraceMarks; ++k) v[4 + k] = std::max(v[4 + k], cta[2 + k]);
      ctas[i].emplace_back(static_cast<int>(cw[2]) - 1, cta);
    }
    if (v[0] != ~0ull) t0 = std::min(t0, v[0]);
    r[i] = v;
  }
  auto rel = [&](unsigned long long v) {
    return v != 0 && v != ~0ull ? static_cast<double>(static_cast<long long>(v - t0)) : -1.0;
  };
  for (int i = 0; i < trace_slots(); ++i) {
    KernelTrace k;
    k.kernel = kKernels[i % 5];
    k.layer = i / 5;
    for (int j = 0; j < kWords; ++j) k.marks[j] = rel(r[i][j]);
    for (const auto& [sm, words] : ctas[i]) {
      KernelTrace::Cta c;
      c.sm = sm;
      for (size_t j = 0; j < words.size(); ++j) c.ns[j] = rel(words[j]);
      k.ctas.push_back(c);
    }
    out.push_back(std::move(k));
  }
  return out;
}

}  // namespace siesta::cuda
