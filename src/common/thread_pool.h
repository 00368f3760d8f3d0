// ThreadPool: a fixed set of worker threads for data-parallel loops.
//
//   ThreadPool pool(2);                       // 0 = std::thread::hardware_concurrency()
//   pool.parallel_for(n, [&](size_t begin, size_t end) { ... });
//
// parallel_for splits [0, n) into contiguous ranges, runs them on the workers
// and the calling thread, and returns when all are done. The split never
// changes what a single index computes, so results do not depend on the number
// of threads. Calls from one thread at a time (the owner of the pool).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace siesta {

class ThreadPool {
 public:
  explicit ThreadPool(size_t num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }  // workers + the caller

  // fn(begin, end) for contiguous pieces of [0, n); pieces are at least min_chunk long.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk = 1);

 private:
  void worker_loop(size_t index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  std::condition_variable cv_done_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0;
  size_t job_chunks_ = 0;
  size_t generation_ = 0;
  size_t pending_ = 0;
  bool stop_ = false;
};

}  // namespace siesta
