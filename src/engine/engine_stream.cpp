#include "engine/engine_stream.h"

namespace siesta {

StreamState::StreamState(std::vector<RequestId> ids)
    : ids_(std::move(ids)), pending_(ids_.size()), has_pending_(ids_.size(), false), finished_(ids_.size(), false) {}

void StreamState::push(size_t index, RequestDelta delta, bool notify) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (index >= ids_.size() || finished_[index]) return;
    if (delta.finish) {
      finished_[index] = true;
      ++num_finished_;
    }
    pending_[index].append(std::move(delta));
    has_pending_[index] = true;
  }
  if (notify) cv_.notify_all();
}

bool StreamState::anything_pending() const {
  for (bool p : has_pending_)
    if (p) return true;
  return false;
}

std::vector<IndexedDelta> StreamState::next(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return anything_pending() || num_delivered_final_ == ids_.size(); });
  std::vector<IndexedDelta> out;
  for (size_t i = 0; i < ids_.size(); ++i) {
    if (!has_pending_[i]) continue;
    if (pending_[i].finish) ++num_delivered_final_;
    out.push_back({i, std::move(pending_[i])});
    pending_[i] = RequestDelta{};
    has_pending_[i] = false;
  }
  return out;
}

bool StreamState::finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_delivered_final_ == ids_.size();
}

std::vector<RequestId> StreamState::unfinished_ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RequestId> out;
  for (size_t i = 0; i < ids_.size(); ++i)
    if (!finished_[i]) out.push_back(ids_[i]);
  return out;
}

OutputStream::OutputStream(std::shared_ptr<StreamState> state, std::weak_ptr<StreamAborter> aborter)
    : state_(std::move(state)), aborter_(std::move(aborter)) {}

OutputStream& OutputStream::operator=(OutputStream&& other) noexcept {
  if (this != &other) {
    abort();
    state_ = std::move(other.state_);
    aborter_ = std::move(other.aborter_);
  }
  return *this;
}

OutputStream::~OutputStream() { abort(); }

void OutputStream::abort() {
  if (!state_) return;
  std::vector<RequestId> ids = state_->unfinished_ids();
  if (ids.empty()) return;
  if (std::shared_ptr<StreamAborter> a = aborter_.lock()) a->abort(ids);
}

}  // namespace siesta
