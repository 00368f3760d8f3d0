#include "transfer/ucx/ucx_worker.h"

#include <fmt/format.h>

#include <sched.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "common/log.h"

namespace siesta::transfer::ucx {

namespace {
constexpr auto kSpinAfterActivity = std::chrono::microseconds(200);
}  // namespace

Status ucx_error(const char* what, ucs_status_t status) {
  return unavailable(fmt::format("{}: {}", what, ucs_status_string(status)));
}

bool rma_in_software(ucp_ep_h ep) {
  char* text = nullptr;
  size_t length = 0;
  FILE* out = open_memstream(&text, &length);
  if (out == nullptr) return false;
  ucp_ep_print_info(ep, out);
  fclose(out);
  // Lines like "lane[0]:  0:tcp/lo.0 md[0]  -> md[0]/tcp/sysdev[255] am am_bw#0 keepalive wireup";
  // what a lane is used for follows the "->". Puts and gets go to "rma#N"
  // lanes; without one UCX sends them as active messages that the target's
  // progress applies ("rma_bw#N" lanes serve rendezvous only).
  bool lanes = false, rma = false;
  std::istringstream in(std::string(text, length));
  free(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("lane[") == std::string::npos) continue;
    size_t arrow = line.find("->");
    if (arrow == std::string::npos) continue;
    lanes = true;
    std::istringstream uses(line.substr(arrow + 2));
    std::string use;
    while (uses >> use)
      if (use.rfind("rma#", 0) == 0) rma = true;
  }
  return lanes && !rma;
}

Result<MappedMemory> map_memory(ucp_context_h context, void* base, size_t bytes, ucs_memory_type_t type,
                                bool pack_rkey) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = base;
  mp.length = bytes;
  mp.memory_type = type;
  MappedMemory m;
  ucs_status_t st = ucp_mem_map(context, &mp, &m.memh);
  if (st != UCS_OK) return ucx_error("ucp_mem_map", st);
  if (!pack_rkey) return m;
  void* rkey = nullptr;
  size_t rkey_bytes = 0;
  st = ucp_rkey_pack(context, m.memh, &rkey, &rkey_bytes);
  if (st != UCS_OK) {
    ucp_mem_unmap(context, m.memh);
    return ucx_error("ucp_rkey_pack", st);
  }
  m.rkey.assign(static_cast<const char*>(rkey), rkey_bytes);
  ucp_rkey_buffer_release(rkey);
  return m;
}

Result<std::unique_ptr<UcxWorker>> UcxWorker::create(const UcxOptions& options) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  w->peer_error_handling_ = options.peer_error_handling;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return ucx_error("reading the UCX configuration", st);
  if (!options.transports.empty()) st = ucp_config_modify(config, "TLS", options.transports.c_str());
  if (st == UCS_OK && !options.net_devices.empty()) st = ucp_config_modify(config, "NET_DEVICES", options.net_devices.c_str());
  if (st != UCS_OK) {
    ucp_config_release(config);
    return invalid_argument(fmt::format("UCX rejected transports '{}' / devices '{}': {}; see `ucx_info -d` for what "
                                        "this machine has",
                                        options.transports, options.net_devices, ucs_status_string(st)));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  params.mt_workers_shared = 1;
  params.name = "siesta";
  st = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (st != UCS_OK)
    return ucx_error("ucp_init (are the requested UCX transports available? check `ucx_info -d`)", st);

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(w->context_, &attr) == UCS_OK)
    w->supports_cuda_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(w->context_, &wp, &w->worker_);
  if (st != UCS_OK) return ucx_error("ucp_worker_create", st);

  ucp_worker_attr_t wattr{};
  wattr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  if (ucp_worker_query(w->worker_, &wattr) == UCS_OK) w->max_am_header_ = wattr.max_am_header;

  ucp_address_t* addr = nullptr;
  size_t len = 0;
  st = ucp_worker_get_address(w->worker_, &addr, &len);
  if (st != UCS_OK) return ucx_error("ucp_worker_get_address", st);
  w->address_.assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(w->worker_, addr);
  return w;
}

UcxWorker::~UcxWorker() {
  stop();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

void UcxWorker::start(std::function<bool()> tick) {
  tick_ = std::move(tick);
  thread_ = std::thread([this] { loop(); });
}

void UcxWorker::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void UcxWorker::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void UcxWorker::loop() {
  using std::chrono::microseconds;
  microseconds backoff{0};
  std::chrono::steady_clock::time_point stop_asked{};
  std::chrono::steady_clock::time_point last_activity = std::chrono::steady_clock::now();
  for (;;) {
    std::deque<std::function<void()>> tasks;
    bool stopping = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks.swap(tasks_);
      stopping = stopping_;
    }
    for (auto& t : tasks) t();
    unsigned progressed = 0;
    while (ucp_worker_progress(worker_) != 0 && progressed < 1024) ++progressed;
    bool busy = tick_ ? tick_() : false;
    if (stopping) {
      if (stop_asked == std::chrono::steady_clock::time_point{}) stop_asked = std::chrono::steady_clock::now();
      if (tasks.empty() && !busy) return;
      if (std::chrono::steady_clock::now() - stop_asked > std::chrono::seconds(2)) {
        SIESTA_LOG_WARN("ucx: stopping with transfers still in flight after 2 s; UCX cancels them");
        return;
      }
    }
    auto now = std::chrono::steady_clock::now();
    if (progressed > 0 || busy || !tasks.empty()) {
      last_activity = now;
      backoff = microseconds{0};
      if (progressed == 0 && tasks.empty()) sched_yield();  // waiting on the network: let others run
      continue;
    }
    // Right after activity a peer's next message usually follows within
    // microseconds (the next stage of its transfer): keep polling a while.
    if (now - last_activity < kSpinAfterActivity) {
      sched_yield();
      continue;
    }
    backoff = backoff.count() == 0 ? microseconds{20} : std::min(backoff * 2, microseconds{1000});
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, backoff, [&] { return !tasks_.empty() || stopping_; });
  }
}

}  // namespace siesta::transfer::ucx
