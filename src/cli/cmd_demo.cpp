// siesta demo [--model DIR] [--device auto|cpu|cuda] [--backend ipc|ucx] [--mode write|read]
//             [--max-tokens N] [--json] [--logs DIR] [--startup-timeout S] [--request-timeout S] [--fleet]
//
// P/D disaggregation end to end on one machine: starts a prefill engine (P),
// a decode engine (D), `siesta proxy` in front of them, and one colocated
// `siesta serve` as the reference, all as child processes of this one; sends
// a handful of requests through the proxy (streamed, greedy and seeded
// sampling, a shared prefix, a chat request), sends each again to the
// colocated engine, and prints one table: per request the TTFT through the
// proxy, tokens generated, the KV bytes moved between P and D and the transfer
// time (P's and D's /metrics before and after; requests run one at a time), and whether
// the output equals the colocated engine's. Then sleep while serving: with a
// few requests streaming through the proxy, D and then P sleep (level 1,
// mode keep) and wake, and a second table prints per step the memory each
// gave back (its pool's bytes, and the device's free memory on CUDA), the
// peers it invalidated and that acknowledged, how long sleep and wake took,
// and whether every request that streamed across the sleep finished with
// the colocated engine's output. Exit code 0 only when every request
// succeeded with an identical output. On CUDA the engines run in
// batch-invariant mode, whose results do not depend on chunking or batching.
//
// --fleet: two P and two D engines behind one `siesta proxy --wake-on-demand`;
// the table names the engines that served each request (the proxy's
// x-siesta-prefill / x-siesta-decode headers) and the wake a request waited
// for (x-siesta-wake-wait-ms) after both P were put to sleep.
//
// The model defaults to the embedded tiny Qwen3 (models/tiny-qwen3 of the
// source tree when the binary is build/bin/siesta, or under the working
// directory); the
// device to CUDA when a GPU is usable, else the CPU. Child processes are
// stopped on exit and on Ctrl-C (and by the kernel if this process is killed);
// their logs are kept in --logs, or in a temporary folder that is removed
// unless something failed.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/child_process.h"
#include "cli/commands.h"
#include "cli/http_client.h"
#include "memory/cuda_backend.h"
#include "transfer/frame_auth.h"

namespace siesta::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr const char* kModelName = "siesta-demo";

struct DemoFlags {
  fs::path model;
  std::string device = "auto";
  std::string backend = "ipc";
  std::string mode = "write";
  int max_tokens = 32;
  bool json_output = false;
  fs::path logs;
  int startup_timeout_s = 120;
  int request_timeout_s = 120;
  bool fleet = false;
};

// One request of the demo: the same body goes through the proxy (streamed)
// and to the colocated engine (not streamed).
struct DemoRequest {
  std::string name;
  std::string path;  // /v1/completions or /v1/chat/completions
  json body;
};

struct DemoResult {
  std::string name;
  bool ok = false;
  std::string error;
  double ttft_ms = 0;
  double total_ms = 0;
  int tokens = 0;
  double kv_bytes = 0;
  double transfer_ms = 0;
  bool equal = false;
  std::string text;
  std::string prefill;  // the instances that served it (x-siesta-prefill / x-siesta-decode)
  std::string decode;
  double wake_wait_ms = 0;  // x-siesta-wake-wait-ms: held while an engine woke up
};

// One engine's sleep and wake while requests stream through the proxy.
struct SleepStep {
  std::string name;            // "D sleeps (level 1)"
  bool ok = false;
  std::string error;
  double released_bytes = 0;   // the pool's, from the sleep's answer
  std::optional<double> device_freed_bytes;  // CUDA: the device's free memory, asleep minus awake
  int invalidated = 0;
  int acked = 0;
  double sleep_ms = 0;
  double wake_ms = 0;
  int requests = 0;            // that streamed across the sleep
  int equal = 0;               // ... and finished with the colocated engine's output
  std::vector<std::string> request_errors;
};

// ---------------------------------------------------------------------------
// Children, and stopping them on Ctrl-C.

std::mutex g_children_mu;
std::vector<ChildProcess*> g_children;
std::atomic<bool> g_finished{false};

void stop_all_children() {
  std::lock_guard<std::mutex> lock(g_children_mu);
  for (ChildProcess* c : g_children) c->signal(SIGTERM);
  for (ChildProcess* c : g_children) c->stop(std::chrono::seconds(5));
}

struct ChildRegistration {
  explicit ChildRegistration(ChildProcess& c) : child(&c) {
    std::lock_guard<std::mutex> lock(g_children_mu);
    g_children.push_back(child);
  }
  ~ChildRegistration() {
    std::lock_guard<std::mutex> lock(g_children_mu);
    g_children.erase(std::remove(g_children.begin(), g_children.end(), child), g_children.end());
  }
  ChildProcess* child;
};

// ---------------------------------------------------------------------------

Result<fs::path> find_model(const DemoFlags& f) {
  if (!f.model.empty()) {
    if (!fs::exists(f.model / "config.json")) {
      return not_found(fmt::format("--model {}: no config.json there", f.model.string()));
    }
    return f.model;
  }
  std::vector<fs::path> candidates;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path().parent_path().parent_path() / "models/tiny-qwen3");
  candidates.push_back(fs::current_path() / "models/tiny-qwen3");
  for (const fs::path& c : candidates) {
    if (fs::exists(c / "config.json")) return fs::weakly_canonical(c);
  }
  std::string looked;
  for (const fs::path& c : candidates) looked += (looked.empty() ? "" : ", ") + c.string();
  return not_found("the embedded tiny model was not found (looked in " + looked + "); pass --model DIR");
}

Result<std::string> pick_device(const std::string& requested) {
  if (requested == "cpu") return std::string("cpu");
  auto cuda = memory::make_cuda_backend();
  if (cuda) return std::string("cuda");
  if (requested == "cuda") return unavailable("--device cuda: " + cuda.error().message);
  return std::string("cpu");
}

std::string connector_config(const std::string& role, const DemoFlags& f, const fs::path& auth_key_file) {
  json c = {{"kv_connector", "SiestaConnector"},
            {"kv_role", role},
            {"kv_connector_extra_config",
             {{"backend", f.backend}, {"mode", f.mode}, {"auth_key_file", auth_key_file.string()}}}};
  return c.dump();
}

// A new secret for P's and D's side channel (32 random bytes, hex), in a file
// only this user may read.
Result<void> write_auth_key(const fs::path& file) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string key;
  for (int i = 0; i < 2; ++i)
    for (unsigned char c : transfer::random_nonce()) key += {kHex[c >> 4], kHex[c & 15]};
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const bool ok = fd >= 0 && ::write(fd, key.data(), key.size()) == static_cast<ssize_t>(key.size());
  if (fd >= 0) ::close(fd);
  if (!ok) return io_error("cannot write the side channel's key to " + file.string());
  return {};
}

std::vector<std::string> engine_args(const fs::path& model, const std::string& device, int threads) {
  std::vector<std::string> a = {"serve",  "--model",           model.string(), "--host", "127.0.0.1",
                                "--port", "0", "--served-model-name", kModelName,     "--seed", "0"};
  if (device == "cpu") {
    // Four engines share the CPU: small caches, the cores split between them.
    a.insert(a.end(), {"--kv-cache-memory-bytes", "256M", "--threads", std::to_string(threads)});
  } else {
    // Batch-invariant mode: the CUDA model then gives bit-identical results
    // however a prompt is chunked, so D (which computes the prompt's last
    // token alone, after the KV of the others arrived) matches the colocated
    // engine bit for bit. The default mode is faster and not chunk-invariant.
    a.insert(a.end(), {"--device", "cuda", "--kv-cache-memory-bytes", "2G", "--batch-invariant"});
  }
  return a;
}

std::vector<DemoRequest> demo_requests(int max_tokens) {
  const std::string shared =
      "Sleep mode lets an inference server give its GPU memory back while a trainer uses the GPU, "
      "and take it back later at the same addresses. With prefill and decode on separate engines, ";
  auto completion = [&](std::string name, std::string prompt, json extra) {
    json body = {{"model", kModelName},      {"prompt", std::move(prompt)},
                 {"max_tokens", max_tokens}, {"temperature", 0},
                 {"stream", true},           {"stream_options", {{"include_usage", true}}}};
    body.update(extra);
    return DemoRequest{std::move(name), "/v1/completions", std::move(body)};
  };
  std::vector<DemoRequest> r;
  r.push_back(completion("short, greedy", "The quick brown fox", json::object()));
  r.push_back(completion("shared prefix 1", shared + "the KV cache must", json::object()));
  r.push_back(completion("shared prefix 2", shared + "a request whose KV was in flight", json::object()));
  r.push_back(completion("seeded sampling", "Once upon a time, in a small village,",
                         json{{"temperature", 0.8}, {"top_p", 0.95}, {"seed", 7}}));
  std::string long_prompt;
  for (int i = 0; i < 12; ++i) {
    long_prompt += fmt::format("Paragraph {}: the decode engine receives the prompt's keys and values. ", i + 1);
  }
  r.push_back(completion("long prompt", long_prompt + "In summary,", json::object()));
  json chat = {{"model", kModelName},
               {"messages", json::array({json{{"role", "user"}, {"content", "Say hello in three languages."}}})},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  r.push_back(DemoRequest{"chat", "/v1/chat/completions", chat});
  return r;
}

// Sums every series of a Prometheus metric (any labels).
double metric_sum(const std::string& text, const std::string& name) {
  double sum = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.compare(0, name.size(), name) != 0) continue;
    if (line.size() > name.size() && line[name.size()] != ' ' && line[name.size()] != '{') continue;
    size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    try {
      sum += std::stod(line.substr(sp + 1));
    } catch (const std::exception&) {
    }
  }
  return sum;
}

struct TransferCounters {
  double bytes = 0;
  double seconds = 0;
};

// KV moved by transfers P and D started (P writes in write mode, D reads in
// read mode), from both engines' /metrics.
Result<TransferCounters> transfer_counters(const std::vector<std::string>& urls, std::chrono::seconds timeout) {
  TransferCounters total;
  for (const std::string& url : urls) {
    SIESTA_ASSIGN_OR_RETURN(HttpClient c, HttpClient::create(url, timeout));
    SIESTA_ASSIGN_OR_RETURN(HttpReply r, c.get("/metrics"));
    if (r.status != 200) return io_error(fmt::format("{}/metrics answered {}", url, r.status));
    total.bytes += metric_sum(r.body, "siesta:kv_transfer_bytes_total");
    total.seconds += metric_sum(r.body, "siesta:kv_transfer_seconds_sum");
  }
  return total;
}

std::string chunk_text(const json& chunk) {
  if (!chunk.contains("choices") || chunk["choices"].empty()) return {};
  const json& c = chunk["choices"][0];
  if (c.contains("text") && c["text"].is_string()) return c["text"].get<std::string>();
  if (c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string()) {
    return c["delta"]["content"].get<std::string>();
  }
  return {};
}

std::string reply_text(const json& reply) {
  if (!reply.contains("choices") || reply["choices"].empty()) return {};
  const json& c = reply["choices"][0];
  if (c.contains("text") && c["text"].is_string()) return c["text"].get<std::string>();
  if (c.contains("message") && c["message"].contains("content") && c["message"]["content"].is_string()) {
    return c["message"]["content"].get<std::string>();
  }
  return {};
}

std::string error_of(const HttpReply& r) {
  json j = json::parse(r.body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].contains("message")) {
    return fmt::format("HTTP {}: {}", r.status, j["error"]["message"].get<std::string>());
  }
  return fmt::format("HTTP {}: {}", r.status, r.body.substr(0, 200));
}

// The colocated engine's text for `req`, sent whole (not streamed).
Result<std::string> reference_text(const DemoRequest& req, const std::string& colocated, std::chrono::seconds timeout) {
  json plain = req.body;
  plain["stream"] = false;
  plain.erase("stream_options");
  SIESTA_ASSIGN_OR_RETURN(HttpClient client, HttpClient::create(colocated, timeout));
  SIESTA_ASSIGN_OR_RETURN(HttpReply ref, client.post_json(req.path, plain.dump()));
  if (ref.status != 200) return unavailable(error_of(ref));
  json ref_json = json::parse(ref.body, nullptr, false);
  if (!ref_json.is_object()) return corrupt("the answer is not JSON");
  return reply_text(ref_json);
}

DemoResult run_one(const DemoRequest& req, const std::string& proxy, const std::vector<std::string>& engines,
                   const std::string& colocated, std::chrono::seconds timeout) {
  DemoResult out;
  out.name = req.name;
  auto before = transfer_counters(engines, timeout);

  auto client = HttpClient::create(proxy, timeout);
  if (!client) {
    out.error = client.error().message;
    return out;
  }
  const auto t0 = Clock::now();
  std::optional<Clock::time_point> first;
  std::string stream_error;
  auto reply = client->post_events(req.path, req.body.dump(), [&](std::string_view data) {
    if (data == "[DONE]") return false;
    json chunk = json::parse(data, nullptr, false);
    if (!chunk.is_object()) return true;
    if (chunk.contains("error")) {
      stream_error = chunk["error"].value("message", chunk["error"].dump());
      return false;
    }
    std::string t = chunk_text(chunk);
    if (!t.empty() && !first) first = Clock::now();
    out.text += t;
    if (chunk.contains("usage") && chunk["usage"].is_object()) {
      out.tokens = chunk["usage"].value("completion_tokens", 0);
    }
    return true;
  });
  const auto t1 = Clock::now();
  if (!reply) {
    out.error = reply.error().message;
    return out;
  }
  out.prefill = reply->header("x-siesta-prefill");
  out.decode = reply->header("x-siesta-decode");
  if (std::string waited = reply->header("x-siesta-wake-wait-ms"); !waited.empty()) {
    try {
      out.wake_wait_ms = std::stod(waited);
    } catch (const std::exception&) {
    }
  }
  if (reply->status != 200) {
    out.error = error_of(*reply);
    return out;
  }
  if (!stream_error.empty()) {
    out.error = "stream error: " + stream_error;
    return out;
  }
  out.ttft_ms = std::chrono::duration<double, std::milli>((first ? *first : t1) - t0).count();
  out.total_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();

  auto after = transfer_counters(engines, timeout);
  if (before && after) {
    out.kv_bytes = after->bytes - before->bytes;
    out.transfer_ms = (after->seconds - before->seconds) * 1e3;
  }

  auto ref = reference_text(req, colocated, timeout);
  if (!ref) {
    out.error = "colocated: " + ref.error().message;
    return out;
  }
  out.equal = *ref == out.text;
  out.ok = true;
  return out;
}

// The text of one request streamed through the proxy, or an error.
Result<std::string> stream_text(const DemoRequest& req, const std::string& proxy, std::chrono::seconds timeout) {
  SIESTA_ASSIGN_OR_RETURN(HttpClient client, HttpClient::create(proxy, timeout));
  std::string text;
  std::string stream_error;
  SIESTA_ASSIGN_OR_RETURN(HttpReply reply, client.post_events(req.path, req.body.dump(), [&](std::string_view data) {
    if (data == "[DONE]") return false;
    json chunk = json::parse(data, nullptr, false);
    if (!chunk.is_object()) return true;
    if (chunk.contains("error")) {
      stream_error = chunk["error"].value("message", chunk["error"].dump());
      return false;
    }
    text += chunk_text(chunk);
    return true;
  }));
  if (reply.status != 200) return unavailable(error_of(reply));
  if (!stream_error.empty()) return unavailable("stream error: " + stream_error);
  return text;
}

Result<json> admin_post(const std::string& url, const std::string& path, std::chrono::seconds timeout) {
  SIESTA_ASSIGN_OR_RETURN(HttpClient c, HttpClient::create(url, timeout));
  SIESTA_ASSIGN_OR_RETURN(HttpReply r, c.post_json(path, ""));
  if (r.status != 200) return unavailable(fmt::format("POST {}{}: {}", url, path, error_of(r)));
  json j = json::parse(r.body, nullptr, false);
  if (!j.is_object()) return corrupt(fmt::format("POST {}{}: the answer is not JSON", url, path));
  return j;
}

// Free bytes of the device the engine allocates from (CUDA), from GET /memory.
std::optional<double> device_free_bytes(const std::string& url, std::chrono::seconds timeout) {
  auto c = HttpClient::create(url, timeout);
  if (!c) return std::nullopt;
  auto r = c->get("/memory");
  if (!r || r->status != 200) return std::nullopt;
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("device") || j["device"].value("kind", "") != "cuda" ||
      !j["device"].contains("free_bytes"))
    return std::nullopt;
  return j["device"]["free_bytes"].get<double>();
}

double sum_bytes(const json& per_tag) {
  double sum = 0;
  if (per_tag.is_object())
    for (const auto& [tag, v] : per_tag.items())
      if (v.is_number()) sum += v.get<double>();
  return sum;
}

// `engine` sleeps (level 1, mode keep) and wakes while `requests` stream
// through the proxy; each must finish with `reference`'s text.
SleepStep sleep_while_serving(const std::string& name, const std::string& engine, const std::string& proxy,
                              const std::vector<DemoRequest>& requests, const std::vector<std::string>& reference,
                              std::chrono::seconds timeout) {
  SleepStep step;
  step.name = name;
  step.requests = static_cast<int>(requests.size());
  const std::optional<double> free_awake = device_free_bytes(engine, timeout);
  std::vector<Result<std::string>> texts(requests.size(), Result<std::string>(unavailable("not sent")));
  std::vector<std::thread> clients;
  for (size_t i = 0; i < requests.size(); ++i)
    clients.emplace_back([&, i] { texts[i] = stream_text(requests[i], proxy, timeout); });
  // Let the requests reach the engines (prefill, transfer, decode) before the sleep.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  auto slept = admin_post(engine, "/sleep?level=1&mode=keep&verbose=true", timeout);
  if (slept) {
    const json& call = (*slept)["call"];
    step.released_bytes = sum_bytes(call["released_bytes"]);
    step.sleep_ms = call.value("seconds", 0.0) * 1e3;
    if (call.contains("kv_transfer")) {
      step.invalidated = static_cast<int>(call["kv_transfer"]["invalidated"].size());
      step.acked = static_cast<int>(call["kv_transfer"]["acked"].size());
    }
    if (const std::optional<double> free_asleep = device_free_bytes(engine, timeout); free_asleep && free_awake)
      step.device_freed_bytes = *free_asleep - *free_awake;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // asleep while requests wait
  }
  auto woken = admin_post(engine, "/wake_up?verbose=true", timeout);
  if (woken) step.wake_ms = (*woken)["call"].value("seconds", 0.0) * 1e3;
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!texts[i]) {
      step.request_errors.push_back(requests[i].name + ": " + texts[i].error().message);
      continue;
    }
    if (*texts[i] == reference[i]) ++step.equal;
  }
  if (!slept) step.error = slept.error().message;
  else if (!woken) step.error = woken.error().message;
  step.ok = slept && woken && step.request_errors.empty();
  return step;
}

std::string human_bytes(double b) {
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{:.0f} B", b);
}

void print_table(const std::vector<DemoResult>& results, const std::string& device, const DemoFlags& f) {
  std::cout << fmt::format("siesta demo: P/D on {} ({} backend, {} mode{}), through siesta proxy\n\n", device,
                           f.backend, f.mode, device == "cuda" ? ", batch-invariant" : "");
  std::cout << fmt::format("{:<18} {:>9} {:>7} {:>12} {:>12}  {}\n", "request", "TTFT ms", "tokens", "KV moved",
                           "transfer ms", "output = colocated");
  for (const DemoResult& r : results) {
    if (!r.ok) {
      std::cout << fmt::format("{:<18} {:>9} {:>7} {:>12} {:>12}  FAILED: {}\n", r.name, "-", "-", "-", "-",
                               r.error);
      continue;
    }
    std::cout << fmt::format("{:<18} {:>9.1f} {:>7} {:>12} {:>12.2f}  {}\n", r.name, r.ttft_ms, r.tokens,
                             human_bytes(r.kv_bytes), r.transfer_ms, r.equal ? "yes" : "NO");
  }
}

void print_sleep_table(const std::vector<SleepStep>& steps, const std::string& device) {
  std::cout << fmt::format("\nsleep while serving: each engine sleeps (level 1, mode keep) and wakes while {} "
                           "requests stream through the proxy\n\n",
                           steps.empty() ? 0 : steps.front().requests);
  std::cout << fmt::format("{:<20} {:>12} {:>14} {:>19} {:>9} {:>8}  {}\n", "step", "pool freed",
                           device == "cuda" ? "device freed" : "", "peers inval/acked", "sleep ms", "wake ms",
                           "requests = colocated");
  for (const SleepStep& st : steps) {
    if (!st.error.empty()) {
      std::cout << fmt::format("{:<20} FAILED: {}\n", st.name, st.error);
      continue;
    }
    std::cout << fmt::format("{:<20} {:>12} {:>14} {:>19} {:>9.1f} {:>8.1f}  {}/{}{}\n", st.name,
                             human_bytes(st.released_bytes),
                             st.device_freed_bytes ? human_bytes(*st.device_freed_bytes) : std::string(),
                             fmt::format("{}/{}", st.invalidated, st.acked), st.sleep_ms, st.wake_ms, st.equal,
                             st.requests, st.request_errors.empty() ? "" : " (" + st.request_errors.front() + ")");
  }
}

// The fleet table: which instances served each request, and any wake it waited for.
void print_fleet_table(const std::vector<DemoResult>& results, const std::string& device, const DemoFlags& f,
                       const std::vector<std::string>& names_by_url) {
  auto name_of = [&](const std::string& url) {
    for (size_t i = 0; i + 1 < names_by_url.size(); i += 2)
      if (names_by_url[i] == url) return names_by_url[i + 1];
    return url.empty() ? std::string("-") : url;
  };
  std::cout << fmt::format("siesta demo --fleet: 2 P + 2 D on {} ({} backend, {} mode), through siesta proxy "
                           "--wake-on-demand\n\n",
                           device, f.backend, f.mode);
  std::cout << fmt::format("{:<32} {:<7} {:<7} {:>8} {:>9} {:>7}  {}\n", "request", "prefill", "decode", "wake ms",
                           "TTFT ms", "tokens", "output = colocated");
  for (const DemoResult& r : results) {
    const std::string wake = r.wake_wait_ms > 0 ? fmt::format("{:.0f}", r.wake_wait_ms) : "-";
    if (!r.ok) {
      std::cout << fmt::format("{:<32} {:<7} {:<7} {:>8} {:>9} {:>7}  FAILED: {}\n", r.name, name_of(r.prefill),
                               name_of(r.decode), wake, "-", "-", r.error);
      continue;
    }
    std::cout << fmt::format("{:<32} {:<7} {:<7} {:>8} {:>9.1f} {:>7}  {}\n", r.name, name_of(r.prefill),
                             name_of(r.decode), wake, r.ttft_ms, r.tokens, r.equal ? "yes" : "NO");
  }
}

// --fleet: two P and two D behind one proxy that wakes on demand; the demo's
// requests, then both P put to sleep and two more requests (the first waits
// for a wake, the second is served at once).
Result<bool> run_fleet(const DemoFlags& f, const fs::path& model, const std::string& device, const fs::path& exe,
                       const fs::path& logs) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = static_cast<int>(std::max(1u, cores / 5));
  const auto startup_deadline = Clock::now() + std::chrono::seconds(f.startup_timeout_s);
  const auto timeout = std::chrono::seconds(f.request_timeout_s);
  auto start = [&](const std::string& name, std::vector<std::string> args) {
    return ChildProcess::start(name, exe, args, logs / (name + ".log"));
  };
  const fs::path key_file = logs / "side_channel.key";
  SIESTA_TRY(write_auth_key(key_file));
  auto engine = [&](const std::string& role) {
    std::vector<std::string> a = engine_args(model, device, threads);
    a.insert(a.end(), {"--kv-transfer-config", connector_config(role, f, key_file), "--enable-sleep-mode"});
    return a;
  };
  SIESTA_ASSIGN_OR_RETURN(ChildProcess colocated, start("colocated", engine_args(model, device, threads)));
  ChildRegistration reg_c(colocated);
  SIESTA_ASSIGN_OR_RETURN(ChildProcess p0, start("prefill-0", engine("kv_producer")));
  ChildRegistration reg_p0(p0);
  SIESTA_ASSIGN_OR_RETURN(ChildProcess p1, start("prefill-1", engine("kv_producer")));
  ChildRegistration reg_p1(p1);
  SIESTA_ASSIGN_OR_RETURN(ChildProcess d0, start("decode-0", engine("kv_consumer")));
  ChildRegistration reg_d0(d0);
  SIESTA_ASSIGN_OR_RETURN(ChildProcess d1, start("decode-1", engine("kv_consumer")));
  ChildRegistration reg_d1(d1);

  SIESTA_ASSIGN_OR_RETURN(std::string c_url, colocated.wait_for_listening(startup_deadline));
  SIESTA_ASSIGN_OR_RETURN(std::string p0_url, p0.wait_for_listening(startup_deadline));
  SIESTA_ASSIGN_OR_RETURN(std::string p1_url, p1.wait_for_listening(startup_deadline));
  SIESTA_ASSIGN_OR_RETURN(std::string d0_url, d0.wait_for_listening(startup_deadline));
  SIESTA_ASSIGN_OR_RETURN(std::string d1_url, d1.wait_for_listening(startup_deadline));
  SIESTA_ASSIGN_OR_RETURN(
      ChildProcess proxy,
      start("proxy", {"proxy", "--prefill", p0_url + "," + p1_url, "--decode", d0_url + "," + d1_url, "--mode",
                      f.mode == "read" ? "sequential" : "concurrent", "--host", "127.0.0.1", "--port", "0",
                      "--wake-on-demand", "--health-interval-s", "0.5"}));
  ChildRegistration reg_x(proxy);
  SIESTA_ASSIGN_OR_RETURN(std::string x_url, proxy.wait_for_listening(startup_deadline));
  const std::vector<std::string> names = {p0_url, "P0", p1_url, "P1", d0_url, "D0", d1_url, "D1"};
  if (!f.json_output) {
    std::cerr << fmt::format("siesta demo --fleet: model {} on {}; P0 {}, P1 {}, D0 {}, D1 {}, proxy {}, colocated "
                             "{}; logs in {}\n",
                             model.string(), device, p0_url, p1_url, d0_url, d1_url, x_url, c_url, logs.string());
  }
  const std::vector<std::string> all = {p0_url, p1_url, d0_url, d1_url};
  std::vector<DemoResult> results;
  for (const DemoRequest& req : demo_requests(f.max_tokens)) results.push_back(run_one(req, x_url, all, c_url, timeout));

  // Every P asleep: the next request makes the proxy wake one and waits for it.
  for (const std::string& p : {p0_url, p1_url}) {
    Result<json> slept = admin_post(p, "/sleep?level=1", timeout);
    if (!slept) return slept.error().with_context("putting " + p + " to sleep");
  }
  // The proxy learns of the sleeps at its next health round.
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  std::vector<DemoRequest> after = demo_requests(f.max_tokens);
  after.resize(2);
  after[0].name = "both P asleep: " + after[0].name;
  after[1].name = "after the wake: " + after[1].name;
  for (const DemoRequest& req : after) results.push_back(run_one(req, x_url, all, c_url, timeout));

  const bool all_good = std::all_of(results.begin(), results.end(), [](const DemoResult& r) { return r.ok && r.equal; });
  const bool woke = results.size() >= 2 && results[results.size() - 2].wake_wait_ms > 0;
  if (f.json_output) {
    json out = json::array();
    for (const DemoResult& r : results) {
      out.push_back({{"request", r.name},      {"ok", r.ok},           {"error", r.error},
                     {"prefill", r.prefill},   {"decode", r.decode},   {"wake_wait_ms", r.wake_wait_ms},
                     {"ttft_ms", r.ttft_ms},   {"tokens", r.tokens},   {"equal_colocated", r.equal},
                     {"text", r.text}});
    }
    std::cout << json{{"device", device}, {"backend", f.backend}, {"mode", f.mode}, {"fleet", true},
                      {"requests", out}}
                     .dump(2)
              << std::endl;
  } else {
    print_fleet_table(results, device, f, names);
    std::cout << "\n"
              << (all_good && woke ? "every output equals the colocated engine's; the first request after both P "
                                     "slept waited for a wake"
                                   : "SOME REQUESTS FAILED OR DIFFER, OR NO WAKE WAS WAITED FOR (logs: " +
                                         logs.string() + ")")
              << std::endl;
  }
  return all_good && woke;
}

Result<bool> run_demo(const DemoFlags& f) {
  SIESTA_ASSIGN_OR_RETURN(fs::path model, find_model(f));
  SIESTA_ASSIGN_OR_RETURN(std::string device, pick_device(f.device));
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return io_error("cannot find the siesta executable (/proc/self/exe): " + ec.message());

  fs::path logs = f.logs;
  const bool temporary_logs = logs.empty();
  if (temporary_logs) {
    char tmpl[] = "/tmp/siesta-demo-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return io_error("cannot create a temporary folder for the logs");
    logs = tmpl;
  } else {
    fs::create_directories(logs, ec);
    if (ec) return io_error(fmt::format("--logs {}: {}", logs.string(), ec.message()));
  }

  if (f.fleet) {
    Result<bool> outcome = run_fleet(f, model, device, exe, logs);
    stop_all_children();
    std::error_code rm;
    if (!outcome) {
      std::cerr << "siesta demo: logs kept in " << logs.string() << "\n";
      return outcome;
    }
    if (temporary_logs && *outcome) fs::remove_all(logs, rm);
    return outcome;
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = static_cast<int>(std::max(1u, cores / 3));
  const auto startup_deadline = Clock::now() + std::chrono::seconds(f.startup_timeout_s);
  const auto timeout = std::chrono::seconds(f.request_timeout_s);

  auto start = [&](const std::string& name, std::vector<std::string> args) {
    return ChildProcess::start(name, exe, args, logs / (name + ".log"));
  };
  const fs::path key_file = logs / "side_channel.key";
  SIESTA_TRY(write_auth_key(key_file));
  std::vector<std::string> p_args = engine_args(model, device, threads);
  p_args.insert(p_args.end(),
                {"--kv-transfer-config", connector_config("kv_producer", f, key_file), "--enable-sleep-mode"});
  std::vector<std::string> d_args = engine_args(model, device, threads);
  d_args.insert(d_args.end(),
                {"--kv-transfer-config", connector_config("kv_consumer", f, key_file), "--enable-sleep-mode"});

  SIESTA_ASSIGN_OR_RETURN(ChildProcess colocated, start("colocated", engine_args(model, device, threads)));
  ChildRegistration reg_c(colocated);
  SIESTA_ASSIGN_OR_RETURN(ChildProcess prefill, start("prefill", p_args));
  ChildRegistration reg_p(prefill);
  SIESTA_ASSIGN_OR_RETURN(ChildProcess decode, start("decode", d_args));
  ChildRegistration reg_d(decode);

  bool all_good = false;
  Result<bool> outcome = [&]() -> Result<bool> {
    SIESTA_ASSIGN_OR_RETURN(std::string c_url, colocated.wait_for_listening(startup_deadline));
    SIESTA_ASSIGN_OR_RETURN(std::string p_url, prefill.wait_for_listening(startup_deadline));
    SIESTA_ASSIGN_OR_RETURN(std::string d_url, decode.wait_for_listening(startup_deadline));
    // The proxy's mode matches the engines': concurrent legs for WRITE, P's answer first for READ.
    SIESTA_ASSIGN_OR_RETURN(ChildProcess proxy,
                            start("proxy", {"proxy", "--prefill", p_url, "--decode", d_url, "--mode",
                                            f.mode == "read" ? "sequential" : "concurrent", "--host", "127.0.0.1",
                                            "--port", "0"}));
    ChildRegistration reg_x(proxy);
    SIESTA_ASSIGN_OR_RETURN(std::string x_url, proxy.wait_for_listening(startup_deadline));
    if (!f.json_output) {
      std::cerr << fmt::format("siesta demo: model {} on {}; P {}, D {}, proxy {}, colocated {}; logs in {}\n",
                               model.string(), device, p_url, d_url, x_url, c_url, logs.string());
    }

    std::vector<DemoResult> results;
    for (const DemoRequest& req : demo_requests(f.max_tokens)) {
      results.push_back(run_one(req, x_url, {p_url, d_url}, c_url, timeout));
    }
    all_good = std::all_of(results.begin(), results.end(), [](const DemoResult& r) { return r.ok && r.equal; });

    // Sleep while serving: D, then P, sleep and wake under a few streaming requests.
    std::vector<DemoRequest> during = demo_requests(f.max_tokens);
    during.resize(std::min<size_t>(during.size(), 4));
    std::vector<std::string> reference;
    for (const DemoRequest& req : during) {
      auto ref = reference_text(req, c_url, timeout);
      if (!ref) return ref.error().with_context("the colocated engine did not answer " + req.name);
      reference.push_back(std::move(*ref));
    }
    std::vector<SleepStep> steps;
    steps.push_back(sleep_while_serving("D sleeps (level 1)", d_url, x_url, during, reference, timeout));
    steps.push_back(sleep_while_serving("P sleeps (level 1)", p_url, x_url, during, reference, timeout));
    for (const SleepStep& st : steps) all_good = all_good && st.ok && st.equal == st.requests;

    if (f.json_output) {
      json out = json::array();
      for (const DemoResult& r : results) {
        out.push_back({{"request", r.name},        {"ok", r.ok},
                       {"error", r.error},         {"ttft_ms", r.ttft_ms},
                       {"total_ms", r.total_ms},   {"tokens", r.tokens},
                       {"kv_bytes", r.kv_bytes},   {"transfer_ms", r.transfer_ms},
                       {"equal_colocated", r.equal}, {"text", r.text}});
      }
      json sleeps = json::array();
      for (const SleepStep& st : steps) {
        sleeps.push_back({{"step", st.name},
                          {"ok", st.ok},
                          {"error", st.error},
                          {"pool_released_bytes", st.released_bytes},
                          {"device_freed_bytes", st.device_freed_bytes ? json(*st.device_freed_bytes) : json()},
                          {"peers_invalidated", st.invalidated},
                          {"peers_acked", st.acked},
                          {"sleep_ms", st.sleep_ms},
                          {"wake_ms", st.wake_ms},
                          {"requests", st.requests},
                          {"equal_colocated", st.equal},
                          {"request_errors", st.request_errors}});
      }
      std::cout << json{{"device", device},  {"backend", f.backend}, {"mode", f.mode},
                        {"requests", out},   {"sleep_while_serving", sleeps}}
                       .dump(2)
                << std::endl;
    } else {
      print_table(results, device, f);
      print_sleep_table(steps, device);
      std::cout << "\n"
                << (all_good ? "every output equals the colocated engine's"
                             : "SOME REQUESTS FAILED OR DIFFER (logs: " + logs.string() + ")")
                << std::endl;
    }
    return all_good;
  }();

  stop_all_children();
  if (!outcome) {
    std::cerr << "siesta demo: logs kept in " << logs.string() << "\n";
    return outcome;
  }
  if (temporary_logs && all_good) fs::remove_all(logs, ec);
  return all_good;
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "demo", "P/D disaggregation end to end: P, D, the proxy and a colocated reference on the tiny model, "
             "then each engine sleeps and wakes while requests stream");
  auto f = std::make_shared<DemoFlags>();
  cmd->add_option("--model", f->model, "Model directory (default: the embedded tiny Qwen3, models/tiny-qwen3)");
  cmd->add_option("--device", f->device, "auto (CUDA when a GPU is usable), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--backend", f->backend, "KV transfer backend")
      ->check(CLI::IsMember({"ipc", "ucx"}))
      ->capture_default_str();
  cmd->add_option("--mode", f->mode, "KV transfer mode: write (P writes into D) or read (D reads from P)")
      ->check(CLI::IsMember({"write", "read"}))
      ->capture_default_str();
  cmd->add_option("--max-tokens", f->max_tokens, "Tokens generated per request")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_flag("--json", f->json_output, "Print the results as JSON");
  cmd->add_flag("--fleet", f->fleet,
                "Two prefill and two decode engines behind one proxy (--wake-on-demand): which engines served each "
                "request, and the wake a request waited for after both prefill engines slept");
  cmd->add_option("--logs", f->logs, "Keep the child processes' logs in this folder");
  cmd->add_option("--startup-timeout", f->startup_timeout_s, "Seconds for the engines and the proxy to start")
      ->check(CLI::Range(1, 3600))
      ->capture_default_str();
  cmd->add_option("--request-timeout", f->request_timeout_s, "Seconds per request")
      ->check(CLI::Range(1, 3600))
      ->capture_default_str();
  cmd->callback([f] {
    // Ctrl-C / SIGTERM: one thread waits for them, stops the children and exits.
    signal(SIGPIPE, SIG_IGN);
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    std::thread waiter([stop_signals] {
      int sig = 0;
      sigwait(&stop_signals, &sig);
      if (g_finished.load()) return;
      std::cerr << "\nsiesta demo: interrupted, stopping P, D, the proxy and the reference\n";
      stop_all_children();
      std::_Exit(130);
    });
    auto r = run_demo(*f);
    g_finished.store(true);
    pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
    if (!r) {
      std::cerr << "siesta demo: " << r.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
    if (!*r) throw CLI::RuntimeError(kExitFailure);
  });
}

}  // namespace siesta::cli
