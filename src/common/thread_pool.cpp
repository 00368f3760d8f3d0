#include "common/thread_pool.h"

#include <algorithm>

namespace siesta {

ThreadPool::ThreadPool(size_t num_threads) {
  if (num_threads == 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  for (size_t i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

static void run_chunk(const std::function<void(size_t, size_t)>& fn, size_t n, size_t chunks, size_t index) {
  if (index >= chunks) return;
  size_t begin = n * index / chunks;
  size_t end = n * (index + 1) / chunks;
  if (begin < end) fn(begin, end);
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk) {
  if (n == 0) return;
  size_t chunks = std::min(size(), std::max<size_t>(1, n / std::max<size_t>(1, min_chunk)));
  if (chunks <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunks_ = chunks;
    pending_ = workers_.size();
    ++generation_;
  }
  cv_start_.notify_all();
  run_chunk(fn, n, chunks, 0);
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(size_t index) {
  size_t seen = 0;
  for (;;) {
    const std::function<void(size_t, size_t)>* job;
    size_t n, chunks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      chunks = job_chunks_;
    }
    run_chunk(*job, n, chunks, index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
  }
}

}  // namespace siesta
