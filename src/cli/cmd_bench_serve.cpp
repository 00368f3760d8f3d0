// siesta bench serve --url URL --num-prompts N --concurrency C --input-len I --output-len O
//                    [--result-file F] [--seed S] [--model NAME] [--api-key K] [--vocab-size V]
//                    [--notes TEXT]
//
// Load on an OpenAI-compatible server, as `vllm bench serve` with the random
// dataset: N prompts of I random token ids (from [0, V)), each asking for O
// tokens with ignore_eos, greedy, streamed, C requests in flight at a time.
// Before the run, one request alone gives the single-stream reference in the
// same conditions. Measures TTFT (first streamed chunk), ITL (gaps between
// chunks), TPOT ((e2e - TTFT) / (tokens - 1)) and e2e latency: mean, p50, p90,
// p99; request and token throughput. Prints one table on stdout, a progress
// bar on stderr, and with --result-file writes JSON (machine, date, commit,
// configuration, results).
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "cli/commands.h"
#include "cli/http_client.h"

namespace siesta::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchFlags {
  std::string url;
  int num_prompts = 100;
  int concurrency = 8;
  int input_len = 128;
  int output_len = 64;
  std::string result_file;
  uint64_t seed = 0;
  std::string model;
  std::string api_key;
  int vocab_size = 4000;
  int timeout_s = 600;
  std::string notes;
};

struct RequestResult {
  bool ok = false;
  std::string error;
  double ttft = 0;          // seconds
  double e2e = 0;
  int output_tokens = 0;
  std::vector<double> itl;  // seconds between chunks
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

RequestResult send_one(HttpClient& client, const std::string& model, const std::vector<int32_t>& prompt, int max_tokens) {
  const nlohmann::json body{{"model", model},
                            {"prompt", prompt},
                            {"max_tokens", max_tokens},
                            {"temperature", 0},
                            {"ignore_eos", true},
                            {"stream", true},
                            {"stream_options", {{"include_usage", true}}}};
  RequestResult r;
  bool done = false;
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  auto reply = client.post_events("/v1/completions", body.dump(), [&](std::string_view data) {
    const Clock::time_point now = Clock::now();
    if (data == "[DONE]") {
      done = true;
      return true;
    }
    const nlohmann::json chunk = nlohmann::json::parse(data, nullptr, false);
    if (chunk.is_discarded()) return true;
    if (chunk.contains("error")) {
      r.error = chunk["error"].value("message", "error event");
      return true;
    }
    if (chunk.contains("choices") && chunk["choices"].is_array() && !chunk["choices"].empty()) {
      if (r.ttft == 0)
        r.ttft = std::chrono::duration<double>(now - start).count();
      else
        r.itl.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
    } else if (chunk.contains("usage") && chunk["usage"].is_object()) {
      r.output_tokens = chunk["usage"].value("completion_tokens", 0);
    }
    return true;
  });
  r.e2e = seconds_since(start);
  if (!reply) {
    r.error = reply.error().message;
  } else if (reply->status != 200) {
    r.error = "HTTP " + std::to_string(reply->status) + ": " + reply->body;
  } else if (!done && r.error.empty()) {
    r.error = "the stream ended without [DONE]";
  }
  r.ok = r.error.empty();
  return r;
}

struct Summary {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
};

// numpy's default (linear) percentile.
double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

Summary summarize(const std::vector<double>& seconds) {
  Summary s;
  if (seconds.empty()) return s;
  double sum = 0;
  for (double x : seconds) sum += x;
  s.mean = sum / static_cast<double>(seconds.size()) * 1000;
  s.p50 = percentile(seconds, 50) * 1000;
  s.p90 = percentile(seconds, 90) * 1000;
  s.p99 = percentile(seconds, 99) * 1000;
  return s;
}

nlohmann::json to_json(const Summary& s) {
  auto r = [](double v) { return std::round(v * 1000) / 1000; };
  return nlohmann::json{{"mean", r(s.mean)}, {"p50", r(s.p50)}, {"p90", r(s.p90)}, {"p99", r(s.p99)}};
}

std::string command_output(const char* cmd) {
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char buf[256];
    while (fgets(buf, sizeof(buf), p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

nlohmann::json machine() {
  std::string cpu;
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  utsname u{};
  uname(&u);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  // The load when the run started: other work on the machine shows here.
  std::string load;
  std::ifstream loadavg("/proc/loadavg");
  std::getline(loadavg, load);
  return nlohmann::json{{"hostname", host},
                        {"cpu", cpu},
                        {"cores", std::thread::hardware_concurrency()},
                        {"os", std::string(u.sysname) + " " + u.release},
                        {"loadavg_at_start", load}};
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

void progress(int done, int total, double elapsed) {
  constexpr int kWidth = 40;
  const int filled = total > 0 ? done * kWidth / total : kWidth;
  std::cerr << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] " << done << "/" << total
            << " requests  " << fmt::format("{:.1f}", elapsed) << " s" << std::flush;
}

Result<std::string> served_model(HttpClient& client) {
  SIESTA_ASSIGN_OR_RETURN(HttpReply r, client.get("/v1/models"));
  if (r.status != 200) return unavailable("GET /v1/models answered " + std::to_string(r.status) + ": " + r.body);
  const nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
    return unavailable("GET /v1/models gave no model: " + r.body);
  return j["data"][0]["id"].get<std::string>();
}

Result<void> run_bench(const BenchFlags& f) {
  const auto timeout = std::chrono::seconds(f.timeout_s);
  const nlohmann::json machine_info = machine();
  SIESTA_ASSIGN_OR_RETURN(HttpClient probe, HttpClient::create(f.url, timeout, f.api_key));
  std::string model = f.model;
  if (model.empty()) {
    SIESTA_ASSIGN_OR_RETURN(model, served_model(probe));
  }

  std::mt19937_64 rng(f.seed);
  std::uniform_int_distribution<int32_t> token(0, f.vocab_size - 1);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(f.num_prompts));
  for (auto& p : prompts)
    for (int i = 0; i < f.input_len; ++i) p.push_back(token(rng));
  std::vector<int32_t> reference_prompt;
  for (int i = 0; i < f.input_len; ++i) reference_prompt.push_back(token(rng));

  // The single-stream reference, measured in the same run.
  const RequestResult alone = send_one(probe, model, reference_prompt, f.output_len);
  if (!alone.ok) return unavailable("the reference request failed: " + alone.error);

  std::vector<RequestResult> results(prompts.size());
  std::atomic<size_t> next{0};
  int done = 0;  // under progress_mu
  std::mutex progress_mu;
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  const int threads = std::max(1, std::min(f.concurrency, f.num_prompts));
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&] {
      auto client = HttpClient::create(f.url, timeout, f.api_key);
      for (size_t i; (i = next.fetch_add(1)) < prompts.size();) {
        results[i] = client ? send_one(*client, model, prompts[i], f.output_len)
                            : RequestResult{false, client.error().message, 0, 0, 0, {}};
        std::lock_guard<std::mutex> lock(progress_mu);
        progress(++done, f.num_prompts, seconds_since(start));
      }
    });
  }
  for (std::thread& t : workers) t.join();
  const double duration = seconds_since(start);
  std::cerr << "\n";

  std::vector<double> ttft, itl, tpot, e2e;
  int completed = 0;
  int64_t output_tokens = 0;
  std::string first_error;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      if (first_error.empty()) first_error = r.error;
      continue;
    }
    ++completed;
    output_tokens += r.output_tokens;
    ttft.push_back(r.ttft);
    e2e.push_back(r.e2e);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
    if (r.output_tokens > 1) tpot.push_back((r.e2e - r.ttft) / (r.output_tokens - 1));
  }
  const int64_t input_tokens = static_cast<int64_t>(completed) * f.input_len;
  const Summary s_ttft = summarize(ttft), s_itl = summarize(itl), s_tpot = summarize(tpot), s_e2e = summarize(e2e);
  const Summary a_itl = summarize(alone.itl);

  std::cout << fmt::format("{:=^64}\n", " siesta bench serve ");
  std::cout << fmt::format("{:<40}{:>24}\n", "Model:", model);
  std::cout << fmt::format("{:<40}{:>24}\n", "Prompts x (input, output) tokens:",
                           fmt::format("{} x ({}, {})", f.num_prompts, f.input_len, f.output_len));
  std::cout << fmt::format("{:<40}{:>24}\n", "Concurrency:", f.concurrency);
  std::cout << fmt::format("{:<40}{:>24}\n", "Successful / failed requests:",
                           fmt::format("{} / {}", completed, f.num_prompts - completed));
  std::cout << fmt::format("{:<40}{:>24.2f}\n", "Duration (s):", duration);
  std::cout << fmt::format("{:<40}{:>24.2f}\n", "Request throughput (req/s):", completed / duration);
  std::cout << fmt::format("{:<40}{:>24.1f}\n", "Output token throughput (tok/s):", output_tokens / duration);
  std::cout << fmt::format("{:<40}{:>24.1f}\n", "Total token throughput (tok/s):",
                           (input_tokens + output_tokens) / duration);
  std::cout << fmt::format("{:-^64}\n", " latency (ms): mean / p50 / p90 / p99 ");
  auto row = [](const char* name, const Summary& s) {
    std::cout << fmt::format("{:<16}{:>12.2f}{:>12.2f}{:>12.2f}{:>12.2f}\n", name, s.mean, s.p50, s.p90, s.p99);
  };
  row("TTFT", s_ttft);
  row("TPOT", s_tpot);
  row("ITL", s_itl);
  row("E2E", s_e2e);
  std::cout << fmt::format("{:-^64}\n", " one request alone (same run) ");
  std::cout << fmt::format("{:<40}{:>24.2f}\n", "TTFT (ms):", alone.ttft * 1000);
  std::cout << fmt::format("{:<40}{:>24.2f}\n", "ITL mean (ms):", a_itl.mean);
  std::cout << fmt::format("{:<40}{:>24.2f}\n", "E2E (ms):", alone.e2e * 1000);
  std::cout << fmt::format("{:=^64}\n", "");
  if (!first_error.empty()) std::cerr << "siesta bench serve: first failure: " << first_error << "\n";

  if (!f.result_file.empty()) {
    nlohmann::json j{
        {"benchmark", "serve"},
        {"notes", f.notes},
        {"date", utc_now()},
        {"commit", command_output("git rev-parse --short HEAD 2>/dev/null")},
        {"machine", machine_info},
        {"config",
         {{"url", f.url},
          {"model", model},
          {"num_prompts", f.num_prompts},
          {"concurrency", f.concurrency},
          {"input_len", f.input_len},
          {"output_len", f.output_len},
          {"seed", f.seed},
          {"vocab_size", f.vocab_size},
          {"sampling", "greedy, ignore_eos, streamed"}}},
        {"completed", completed},
        {"failed", f.num_prompts - completed},
        {"duration_s", duration},
        {"total_input_tokens", input_tokens},
        {"total_output_tokens", output_tokens},
        {"request_throughput", completed / duration},
        {"output_throughput", output_tokens / duration},
        {"total_token_throughput", (input_tokens + output_tokens) / duration},
        {"ttft_ms", to_json(s_ttft)},
        {"tpot_ms", to_json(s_tpot)},
        {"itl_ms", to_json(s_itl)},
        {"e2el_ms", to_json(s_e2e)},
        {"single_request",
         {{"ttft_ms", alone.ttft * 1000}, {"itl_ms", to_json(a_itl)}, {"e2el_ms", alone.e2e * 1000},
          {"output_tokens", alone.output_tokens}}}};
    std::ofstream out(f.result_file);
    out << j.dump(2) << "\n";
    if (!out) return io_error("cannot write " + f.result_file);
  }
  if (completed == 0) return unavailable("every request failed; first failure: " + first_error);
  return {};
}

}  // namespace

void add_bench_serve_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("serve", "Load an OpenAI-compatible server with random prompts (like vllm bench serve)");
  auto f = std::make_shared<BenchFlags>();
  cmd->add_option("--url", f->url, "Server base URL, e.g. http://127.0.0.1:8000")->required();
  cmd->add_option("--num-prompts", f->num_prompts, "Requests to send")->check(CLI::Range(1, 1 << 24))->capture_default_str();
  cmd->add_option("--concurrency", f->concurrency, "Requests in flight at once")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--input-len", f->input_len, "Prompt tokens per request")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--output-len", f->output_len, "Generated tokens per request")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--result-file", f->result_file, "Write the results as JSON here");
  cmd->add_option("--seed", f->seed, "Seed of the random prompts")->capture_default_str();
  cmd->add_option("--model", f->model, "Model name in the requests (default: the server's first model)");
  cmd->add_option("--api-key", f->api_key, "Bearer token for the server");
  cmd->add_option("--vocab-size", f->vocab_size, "Prompt token ids are drawn from [0, this)")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--notes", f->notes, "Free text kept in the result file (how the server was started)");
  cmd->add_option("--timeout", f->timeout_s, "Seconds a connect or read may take")->check(CLI::Range(1, 86400))->capture_default_str();
  cmd->callback([f] {
    auto r = run_bench(*f);
    if (!r) {
      std::cerr << "siesta bench serve: " << r.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
  });
}

}  // namespace siesta::cli
