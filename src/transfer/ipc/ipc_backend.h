// IpcBackend: moves bytes between engines on one host by sharing memory.
//
// Exporter side: every registered region's file descriptor (a memfd for host
// memory, a cuMem POSIX FD for CUDA memory) is dup()ed at registration. A
// peer that fetched our metadata connects to our abstract Unix socket (named
// in EngineMeta::backend_blob), names the epoch it saw, and receives the
// region table's memfd and every region's FD as SCM_RIGHTS. Its connection
// stays open: when we exit, it sees the socket close.
//
// Importer side: connect() builds an IpcPeer (ipc_peer.h) that maps what it
// received; transfers are memcpy, or for CUDA memory the gather kernel and
// cudaMemcpyAsync as TransferConfig::ipc_copy says (piece_copy.h), on one
// copy thread.
//
// supports_sleep(): yes. Deregistering closes our dup; after peers released
// their mappings (INVALIDATE → release → ACK) nothing holds the memory.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transfer/ipc/piece_copy.h"
#include "transfer/process_identity.h"
#include "transfer/transfer_backend.h"

namespace siesta::transfer {
class RegionTable;
struct TransferConfig;
}  // namespace siesta::transfer

namespace siesta::transfer::ipc {

class IpcBackend final : public TransferBackend {
 public:
  static Result<std::unique_ptr<IpcBackend>> create(const TransferConfig& config, RegionTable& table);
  ~IpcBackend() override;

  std::string_view name() const override { return "ipc"; }
  bool supports_sleep() const override { return true; }
  std::string engine_blob() const override;
  Result<std::string> register_region(const LocalRegion& region) override;
  void deregister_region(RegionId id) override;
  Result<std::shared_ptr<BackendPeer>> connect(const EngineMeta& meta, Deadline deadline) override;

  // Runs `copy` on the copy thread; `stopping` is true when the backend is
  // being destroyed and the copy must only report failure. A `small` copy
  // runs on the caller's thread instead when the copy thread is idle: two
  // thread hand-offs cost more than copying a few pages.
  void enqueue_copy(std::function<void(bool stopping)> copy, bool small);

  // How CUDA pieces are copied (TransferConfig::ipc_copy) by the copying
  // device (TransferConfig::cuda_device).
  IpcCopy cuda_copy_path() const { return cuda_copy_path_; }
  // The CUDA device of a region registered here; -1 for host memory or a
  // region that is no longer registered.
  int local_cuda_device(RegionId id);
  // Logs, the first time only, how CUDA pieces are copied and how the first
  // transfer's pieces were split. Any thread.
  void log_cuda_copy_once(size_t by_kernel, size_t by_copy_engine);

 private:
  struct Export {
    LocalRegion region;
    int fd = -1;  // our dup of the owner's descriptor
    uint64_t export_bytes = 0;
  };

  IpcBackend(const TransferConfig& config, RegionTable& table);
  void serve();
  void answer(int conn);
  void copy_loop();

  RegionTable& table_;
  std::string engine_id_;
  std::string socket_name_;
  ProcessIdentity identity_;
  int cuda_device_ = 0;
  IpcCopy cuda_copy_path_ = IpcCopy::kAuto;
  std::atomic<bool> cuda_copy_logged_{false};
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd that wakes serve() for shutdown

  std::mutex mu_;
  std::map<RegionId, Export> exports_;

  std::thread serve_thread_;
  std::vector<int> importers_;  // serve() thread only

  std::mutex copy_mu_;
  std::condition_variable copy_cv_;
  std::deque<std::function<void(bool)>> copies_;
  bool stopping_ = false;
  bool copying_ = false;  // the copy thread is running a copy
  // Whether copies_ or stopping_ has news for the copy thread, readable
  // without the lock: the thread polls it for a while after each copy
  // (kCopySpin) before it sleeps on copy_cv_.
  std::atomic<bool> copy_news_{false};
  std::thread copy_thread_;
};

}  // namespace siesta::transfer::ipc
