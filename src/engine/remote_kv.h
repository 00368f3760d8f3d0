// RemoteKvTarget: where a P/D load puts a request's prompt KV — what the
// scheduler hands the connector when it parks a request to wait for it
// (Scheduler::await_remote_kv, KvConnector::start_load).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/block_pool.h"  // BlockId

namespace siesta {

struct RemoteKvTarget {
  std::vector<BlockId> block_table;  // where the prompt's KV goes (all of it)
  int32_t num_cached_tokens = 0;     // leading tokens already present (prefix cache): no transfer needed
};

}  // namespace siesta
