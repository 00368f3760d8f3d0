// cuda::DecodeGraphs: the decode steps' CUDA graphs, one per (padded batch
// size, partition count, whether the step chooses tokens, KV cache base),
// captured on a shape's first step and replayed after. The graphs bake in
// every address a step reads (weights, scratch, KV cache), which stay fixed
// for the model's life, across sleeps too; so nothing is ever re-captured.
//
// Host code of src/model/cuda only (not part of the model's interface).
#pragma once

#include <cuda_runtime.h>

#include <compare>
#include <cstddef>
#include <map>

namespace siesta::cuda {

struct GraphKey {
  int seqs = 0;
  int partitions = 0;
  bool choose = false;  // the step ends in the sampling kernel
  const void* kv_base = nullptr;
  auto operator<=>(const GraphKey&) const = default;
};

class DecodeGraphs {
 public:
  DecodeGraphs() = default;
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;
  ~DecodeGraphs() {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  }

  // The graph of `key`, or null before its capture.
  cudaGraphExec_t find(const GraphKey& key) const {
    auto it = graphs_.find(key);
    return it == graphs_.end() ? nullptr : it->second;
  }
  void add(const GraphKey& key, cudaGraphExec_t exec) { graphs_.emplace(key, exec); }
  size_t size() const { return graphs_.size(); }

 private:
  std::map<GraphKey, cudaGraphExec_t> graphs_;
};

}  // namespace siesta::cuda
