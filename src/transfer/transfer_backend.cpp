#include "transfer/transfer_backend.h"

#include <fmt/format.h>

#include "transfer/ipc/ipc_backend.h"
#include "transfer/transfer_config.h"
#include "transfer/ucx/ucx_backend.h"

namespace siesta::transfer {

Result<std::unique_ptr<TransferBackend>> make_transfer_backend(const TransferConfig& config, RegionTable& table) {
  if (config.backend == BackendKind::kIpc) {
    SIESTA_ASSIGN_OR_RETURN(auto b, ipc::IpcBackend::create(config, table));
    return std::unique_ptr<TransferBackend>(std::move(b));
  }
  if (config.backend == BackendKind::kUcx) {
    SIESTA_ASSIGN_OR_RETURN(auto b, ucx::UcxBackend::create(config, table));
    return std::unique_ptr<TransferBackend>(std::move(b));
  }
  return invalid_argument(
      fmt::format("unknown transfer backend {}; known: ipc, ucx", static_cast<int>(config.backend)));
}

}  // namespace siesta::transfer
