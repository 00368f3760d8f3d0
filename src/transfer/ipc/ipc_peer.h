// IpcPeer: what the ipc backend imported from one remote engine on this host:
// its regions mapped into this process (mmap of memfds, cuMemMap of CUDA
// FDs), its region table mapped read-only, and the Unix socket that stays
// open as a liveness signal (it closes when the peer process exits).
//
// post() queues a copy on the backend's copy thread (host copies up to 256 KiB
// and CUDA copies up to 64 MiB run on the caller's thread when the copy thread
// is idle, which saves two thread hand-offs): check the peer is alive
// and every remote region is live at our descriptor's epoch, copy, check
// again. Pieces between host memory are memcpy'd; pieces that touch CUDA
// memory go to the gather kernel or to cudaMemcpyAsync as the backend's
// ipc_copy says for where their two ends are (piece_copy.h), all in one call.
// release() waits for queued copies, then unmaps and closes everything.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "transfer/engine_meta.h"
#include "transfer/ipc/cuda_import.h"
#include "transfer/ipc/piece_copy.h"
#include "transfer/transfer_backend.h"

namespace siesta::transfer::ipc {

class IpcBackend;

// One remote region mapped here.
struct ImportedRegion {
  void* map_base = nullptr;  // host: what munmap takes
  size_t map_bytes = 0;
  char* data = nullptr;      // the region's first byte in our address space
  MemoryKind kind = MemoryKind::kHost;
  CudaImport cuda;           // kCuda only
};

class IpcPeer final : public BackendPeer, public std::enable_shared_from_this<IpcPeer> {
 public:
  // Takes ownership of `sock`, the table mapping and every import.
  IpcPeer(IpcBackend& backend, EngineMeta meta, int sock, const uint64_t* table, size_t table_bytes,
          std::vector<ImportedRegion> regions, int cuda_device);
  ~IpcPeer() override;

  void post(XferPlan plan, XferDone done) override;
  Ok release(Deadline deadline) override;

 private:
  Ok execute(const XferPlan& plan);
  // Where a piece between our memory (on `local_device`, -1: host) and `remote` is.
  PieceEnds piece_ends(int local_device, const ImportedRegion& remote) const;
  // That every remote region of `plan` is live at the epoch we mapped, and
  // with `alive`, that the peer's socket is still open.
  Ok check_peer(const XferPlan& plan, bool alive) const;
  void unmap_locked();

  IpcBackend& backend_;
  const EngineMeta meta_;
  int sock_;
  const uint64_t* table_;
  size_t table_bytes_;
  std::vector<ImportedRegion> regions_;  // parallel to meta_.regions
  int cuda_device_;

  std::mutex mu_;
  std::condition_variable idle_cv_;
  size_t in_flight_ = 0;
  bool released_ = false;
  bool unmapped_ = false;
};

}  // namespace siesta::transfer::ipc
