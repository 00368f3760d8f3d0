#include "transfer/transfer_config.h"

#include <string>

namespace siesta::transfer {

Result<BackendKind> parse_backend_kind(std::string_view text) {
  if (text == "ipc") return BackendKind::kIpc;
  if (text == "ucx") return BackendKind::kUcx;
  return invalid_argument("transfer backend '" + std::string(text) + "' is not one of ipc, ucx");
}

const char* backend_kind_name(BackendKind kind) { return kind == BackendKind::kIpc ? "ipc" : "ucx"; }

Result<IpcCopy> parse_ipc_copy(std::string_view text) {
  if (text == "auto") return IpcCopy::kAuto;
  if (text == "kernel") return IpcCopy::kKernel;
  if (text == "copy_engine") return IpcCopy::kCopyEngine;
  return invalid_argument("ipc_copy must be auto, kernel or copy_engine, not '" + std::string(text) + "'");
}

const char* ipc_copy_name(IpcCopy copy) {
  switch (copy) {
    case IpcCopy::kAuto: return "auto";
    case IpcCopy::kKernel: return "kernel";
    case IpcCopy::kCopyEngine: return "copy_engine";
  }
  return "?";
}

Result<UcxStaging> parse_ucx_staging(std::string_view text) {
  if (text.empty() || text == "auto") return UcxStaging::kAuto;
  if (text == "always") return UcxStaging::kAlways;
  if (text == "never") return UcxStaging::kNever;
  return invalid_argument("ucx_staging '" + std::string(text) + "' is not one of auto, always, never");
}

const char* ucx_staging_name(UcxStaging staging) {
  switch (staging) {
    case UcxStaging::kAuto: return "auto";
    case UcxStaging::kAlways: return "always";
    case UcxStaging::kNever: return "never";
  }
  return "?";
}

}  // namespace siesta::transfer
