// siesta bench serve [--base-url URL | --host H --port P] [--endpoint /v1/completions]
//                    [--backend openai|vllm|openai-chat] [--model NAME] [--tokenizer DIR]
//                    [--num-prompts N] [--random-input-len I] [--random-output-len O]
//                    [--random-range-ratio R] [--random-prefix-len P]
//                    [--request-rate RPS] [--burstiness B] [--max-concurrency C]
//                    [--save-result] [--save-detailed] [--result-dir D] [--result-filename F]
//                    [--metadata K=V ...] [--label L] [--percentile-metrics ttft,tpot,itl,e2el]
//                    [--metric-percentiles 99] [--goodput ttft:MS ...] [--api-key K] [--seed S]
//                    [--temperature T] [--top-p P] [--top-k K] [--ignore-eos]
//
// `vllm bench serve` with its random dataset, for any OpenAI-compatible server
// (the same command measures siesta and vLLM): num-prompts requests of
// random-input-len random tokens (each length drawn in [len * (1 - ratio),
// len * (1 + ratio)], after a shared random prefix), each asking for
// random-output-len tokens with ignore_eos, streamed with usage. Without
// --tokenizer the prompts are token ids from [0, --vocab-size) (the
// completions endpoints of vLLM and siesta take them); with a model directory's
// tokenizer they are the text of those ids, as vLLM's random dataset sends
// (openai-chat needs it). Requests arrive as vLLM schedules them (all at once
// for an infinite rate, else gamma intervals of the given burstiness, scaled
// so the last one leaves at num-prompts / rate), at most max-concurrency at a
// time. One test request first checks the endpoint, as vLLM does. Every
// connection sets TCP_NODELAY.
//
// Prints vLLM's summary (the same lines and layout) on stdout, a progress bar
// on stderr, and with --save-result (or --result-file PATH) writes vLLM's
// result JSON: date, backend, label, model_id, num_prompts, request_rate,
// burstiness, max_concurrency, duration, completed, failed, total_input_tokens,
// total_output_tokens, request_throughput, output_throughput,
// total_token_throughput, max_output_tokens_per_s, max_concurrent_requests,
// mean_/median_/std_/pNN_ of each selected metric in ms, and the per-request
// input_lens, output_lens, ttfts, itls, latencies, errors (--save-detailed adds
// start_times and generated_texts), plus "siesta": the machine, commit and notes.
#include <fmt/format.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "cli/commands.h"
#include "cli/http_client.h"
#include "model/tokenizer.h"

namespace siesta::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchFlags {
  std::string base_url;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string endpoint;
  std::string backend = "openai";
  std::string model;
  std::string tokenizer;
  int vocab_size = 4000;
  int num_prompts = 1000;
  int input_len = 1024;
  int output_len = 128;
  double range_ratio = 0.0;
  int prefix_len = 0;
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  int max_concurrency = 0;  // 0: none
  bool save_result = false;
  bool save_detailed = false;
  std::string result_dir;
  std::string result_filename;
  std::string result_file;  // siesta's: the whole path (implies --save-result)
  std::vector<std::string> metadata;
  std::string label;
  std::string percentile_metrics = "ttft,tpot,itl,e2el";
  std::string metric_percentiles = "99";
  std::vector<std::string> goodput;
  std::string api_key;
  uint64_t seed = 0;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int> top_k;
  bool ignore_eos = true;  // vLLM: the random dataset always ignores eos
  int timeout_s = 600;
  bool disable_tqdm = false;
  std::string notes;
};

struct Prompt {
  std::vector<int32_t> ids;
  std::string text;  // with --tokenizer
  int output_len = 0;
};

struct RequestResult {
  bool ok = false;
  std::string error;
  int prompt_len = 0;
  double start = 0;  // seconds since the benchmark started
  double ttft = 0;
  double latency = 0;
  int output_tokens = 0;
  std::vector<double> itl;
  std::string text;
};

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool chat_backend(const BenchFlags& f) { return f.backend == "openai-chat"; }

nlohmann::json request_body(const BenchFlags& f, const std::string& model, const Prompt& p) {
  nlohmann::json body{{"model", model}, {"stream", true}, {"stream_options", {{"include_usage", true}}}};
  if (chat_backend(f)) {
    body["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", p.text}}});
    body["max_completion_tokens"] = p.output_len;
  } else {
    if (p.text.empty())
      body["prompt"] = p.ids;
    else
      body["prompt"] = p.text;
    body["max_tokens"] = p.output_len;
  }
  if (f.ignore_eos) body["ignore_eos"] = true;
  if (f.temperature) body["temperature"] = *f.temperature;
  if (f.top_p) body["top_p"] = *f.top_p;
  if (f.top_k) body["top_k"] = *f.top_k;
  return body;
}

RequestResult send_one(HttpClient& client, const BenchFlags& f, const std::string& path, const std::string& model,
                       const Prompt& p, Clock::time_point bench_start) {
  RequestResult r;
  r.prompt_len = static_cast<int>(p.ids.size());
  bool done = false, first = true;
  const Clock::time_point start = Clock::now();
  r.start = std::chrono::duration<double>(start - bench_start).count();
  Clock::time_point last = start;
  auto reply = client.post_events(path, request_body(f, model, p).dump(), [&](std::string_view data) {
    const Clock::time_point now = Clock::now();
    if (data == "[DONE]") {
      done = true;
      return true;
    }
    const nlohmann::json chunk = nlohmann::json::parse(data, nullptr, false);
    if (chunk.is_discarded()) return true;
    if (chunk.contains("error")) {
      r.error = chunk["error"].is_object() ? chunk["error"].value("message", "error event") : chunk["error"].dump();
      return true;
    }
    if (chunk.contains("choices") && chunk["choices"].is_array() && !chunk["choices"].empty()) {
      // As vLLM: the first chunk with a choice is the first token, its text empty or not.
      if (first) {
        r.ttft = std::chrono::duration<double>(now - start).count();
        first = false;
      } else {
        r.itl.push_back(std::chrono::duration<double>(now - last).count());
      }
      last = now;
      const nlohmann::json& c = chunk["choices"][0];
      if (chat_backend(f) && c.contains("delta") && c["delta"].is_object()) {
        for (const char* k : {"content", "reasoning_content", "reasoning"})
          if (c["delta"].contains(k) && c["delta"][k].is_string()) r.text += c["delta"][k].get<std::string>();
      } else if (c.contains("text") && c["text"].is_string()) {
        r.text += c["text"].get<std::string>();
      }
    }
    if (chunk.contains("usage") && chunk["usage"].is_object()) {
      r.output_tokens = chunk["usage"].value("completion_tokens", 0);
      if (chunk["usage"].contains("prompt_tokens")) r.prompt_len = chunk["usage"].value("prompt_tokens", r.prompt_len);
    }
    return true;
  });
  r.latency = since(start);
  if (!reply) {
    r.error = reply.error().message;
  } else if (reply->status != 200) {
    r.error = "HTTP " + std::to_string(reply->status) + ": " + reply->body;
  } else if (!done && r.error.empty()) {
    r.error = "the stream ended without [DONE]";
  }
  if (r.output_tokens == 0 && r.error.empty()) r.output_tokens = static_cast<int>(r.itl.size()) + (first ? 0 : 1);
  r.ok = r.error.empty();
  return r;
}

// ---- statistics as numpy computes them ----------------------------------------------------------------------

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

double stddev(const std::vector<double>& v) {
  if (v.empty()) return 0;
  const double m = mean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

// "99" and "99.9" as vLLM words them in keys: p99, p99.9.
std::string percent_word(double p) {
  if (p == std::floor(p)) return std::to_string(static_cast<int64_t>(p));
  std::string s = fmt::format("{}", p);
  return s;
}

// Python's str() of a float, as vLLM prints it and names its files: "inf", "10.0", "0.5".
std::string rate_word(double rate) {
  if (std::isinf(rate)) return rate > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", rate);
  if (s.find('.') == std::string::npos && s.find('e') == std::string::npos) s += ".0";
  return s;
}

// ---- environment ---------------------------------------------------------------------------------------------

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
  std::string load;
  std::ifstream loadavg("/proc/loadavg");
  std::getline(loadavg, load);
  return nlohmann::json{{"hostname", host},
                        {"cpu", cpu},
                        {"cores", std::thread::hardware_concurrency()},
                        {"os", std::string(u.sysname) + " " + u.release},
                        {"loadavg_at_start", load}};
}

std::string local_time(const char* format) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), format, &tm);
  return buf;
}

void progress(int done, int total, double elapsed) {
  constexpr int kWidth = 40;
  const int filled = total > 0 ? done * kWidth / total : kWidth;
  std::cerr << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] " << done << "/" << total
            << " requests  " << fmt::format("{:.1f}", elapsed) << " s" << std::flush;
}

Result<std::pair<std::string, std::string>> served_model(HttpClient& client) {
  SIESTA_ASSIGN_OR_RETURN(HttpReply r, client.get("/v1/models"));
  if (r.status != 200) return unavailable("GET /v1/models answered " + std::to_string(r.status) + ": " + r.body);
  const nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
    return unavailable("No models found on the server: " + r.body);
  const std::string id = j["data"][0]["id"];
  const std::string root =
      j["data"][0].contains("root") && j["data"][0]["root"].is_string() ? j["data"][0]["root"].get<std::string>() : id;
  return std::make_pair(id, root);
}

// ---- the run -------------------------------------------------------------------------------------------------

std::vector<Prompt> make_prompts(const BenchFlags& f, const Tokenizer* tok, int vocab) {
  std::mt19937_64 rng(f.seed);
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  auto draw_len = [&](int len) {
    const int lo = static_cast<int>(std::floor(len * (1.0 - f.range_ratio)));
    const int hi = static_cast<int>(std::ceil(len * (1.0 + f.range_ratio)));
    if (hi <= lo) return std::max(lo, 1);
    return std::max(std::uniform_int_distribution<int>(lo, hi)(rng), 1);
  };
  std::vector<int32_t> prefix;
  for (int i = 0; i < f.prefix_len; ++i) prefix.push_back(token(rng));
  std::vector<Prompt> out(static_cast<size_t>(f.num_prompts));
  for (Prompt& p : out) {
    p.ids = prefix;
    const int n = draw_len(f.input_len);
    for (int i = 0; i < n; ++i) p.ids.push_back(token(rng));
    p.output_len = draw_len(f.output_len);
    if (tok) p.text = tok->decode(p.ids, /*skip_special_tokens=*/true);
  }
  return out;
}

// When request i may leave, in seconds after the start (vLLM's get_request).
std::vector<double> arrival_times(const BenchFlags& f) {
  std::vector<double> t(static_cast<size_t>(f.num_prompts), 0.0);
  if (std::isinf(f.request_rate)) return t;
  std::mt19937_64 rng(f.seed ^ 0x5bd1e995ULL);
  double sum = 0;
  for (double& x : t) {
    if (std::isinf(f.burstiness)) {
      sum += 1.0 / f.request_rate;
    } else {
      std::gamma_distribution<double> gamma(f.burstiness, 1.0 / (f.request_rate * f.burstiness));
      sum += gamma(rng);
    }
    x = sum;
  }
  // Scaled so that the last leaves at num_prompts / rate, as vLLM does.
  if (sum > 0) {
    const double scale = (static_cast<double>(f.num_prompts) / f.request_rate) / sum;
    for (double& x : t) x *= scale;
  }
  return t;
}

Result<std::map<std::string, double>> parse_goodput(const std::vector<std::string>& pairs) {
  std::map<std::string, double> out;
  for (const std::string& p : pairs) {
    const size_t colon = p.find(':');
    if (colon == std::string::npos)
      return invalid_argument("--goodput takes KEY:VALUE pairs (ttft, tpot or e2el, in ms), got '" + p + "'");
    const std::string key = p.substr(0, colon);
    if (key != "ttft" && key != "tpot" && key != "e2el")
      return invalid_argument("--goodput: " + key + " is not ttft, tpot or e2el");
    out[key] = std::stod(p.substr(colon + 1));
  }
  return out;
}

Result<void> run_bench(BenchFlags f) {
  const auto timeout = std::chrono::seconds(f.timeout_s);
  if (f.base_url.empty()) f.base_url = "http://" + f.host + ":" + std::to_string(f.port);
  while (!f.base_url.empty() && f.base_url.back() == '/') f.base_url.pop_back();
  if (f.backend != "openai" && f.backend != "vllm" && f.backend != "openai-chat")
    return invalid_argument("--backend " + f.backend +
                            ": this benchmark speaks openai, vllm (completions) and openai-chat");
  if (f.endpoint.empty()) f.endpoint = chat_backend(f) ? "/v1/chat/completions" : "/v1/completions";
  if (chat_backend(f) && f.tokenizer.empty())
    return invalid_argument("--backend openai-chat sends text prompts: give --tokenizer (a model directory)");
  if (!(f.request_rate > 0)) return invalid_argument("--request-rate must be > 0 (inf: all at once)");
  if (!(f.burstiness > 0)) return invalid_argument("--burstiness must be > 0");
  if (f.range_ratio < 0 || f.range_ratio >= 1) return invalid_argument("--random-range-ratio must be in [0, 1)");
  if (!f.result_file.empty()) f.save_result = true;
  if (f.api_key.empty())
    if (const char* env = std::getenv("OPENAI_API_KEY"); env && *env) f.api_key = env;
  std::vector<double> percentiles;
  for (const std::string& p : split(f.metric_percentiles, ',')) percentiles.push_back(std::stod(p));
  const std::vector<std::string> selected = split(f.percentile_metrics, ',');
  for (const std::string& m : selected)
    if (m != "ttft" && m != "tpot" && m != "itl" && m != "e2el")
      return invalid_argument("--percentile-metrics: " + m + " is not ttft, tpot, itl or e2el");
  SIESTA_ASSIGN_OR_RETURN(auto goodput, parse_goodput(f.goodput));

  const nlohmann::json machine_info = machine();
  SIESTA_ASSIGN_OR_RETURN(HttpClient probe, HttpClient::create(f.base_url, timeout, f.api_key));
  std::string model = f.model, model_root = f.model;
  if (model.empty()) {
    std::cout << "Model not specified, fetching first model from server..." << std::endl;
    SIESTA_ASSIGN_OR_RETURN(auto m, served_model(probe));
    model = m.first;
    model_root = m.second;
    std::cout << "First model name: " << model << ", first model id: " << model_root << std::endl;
  }
  std::optional<Tokenizer> tok;
  if (!f.tokenizer.empty()) {
    auto t = Tokenizer::load(f.tokenizer);
    if (!t) return t.error().with_context("--tokenizer");
    tok = std::move(*t);
  }
  const int vocab = tok ? tok->vocab_size() : f.vocab_size;
  const std::vector<Prompt> prompts = make_prompts(f, tok ? &*tok : nullptr, vocab);
  const std::vector<double> arrivals = arrival_times(f);

  std::cout << "Starting initial single prompt test run..." << std::endl;
  const RequestResult test = send_one(probe, f, f.endpoint, model, prompts[0], Clock::now());
  if (!test.ok)
    return unavailable(
        "Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: " + test.error);
  std::cout << "Initial test run completed." << std::endl;
  std::cout << "Starting main benchmark run..." << std::endl;
  std::cout << "Traffic request rate: " << rate_word(f.request_rate) << std::endl;
  std::cout << "Burstiness factor: " << rate_word(f.burstiness)
            << (f.burstiness == 1.0 ? " (Poisson process)" : " (Gamma distribution)") << std::endl;
  std::cout << "Maximum request concurrency: " << (f.max_concurrency > 0 ? std::to_string(f.max_concurrency) : "None")
            << std::endl;

  std::vector<RequestResult> results(prompts.size());
  std::atomic<size_t> next{0};
  int done = 0;
  std::mutex progress_mu;
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  // One worker (and connection) per request in flight: max_concurrency of
  // them, or enough that none waits when there is no limit.
  const int limit = f.max_concurrency > 0 ? f.max_concurrency : 1024;
  const int threads = std::max(1, std::min(limit, f.num_prompts));
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&] {
      auto client = HttpClient::create(f.base_url, timeout, f.api_key);
      for (size_t i; (i = next.fetch_add(1)) < prompts.size();) {
        const auto due =
            start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrivals[i]));
        std::this_thread::sleep_until(due);
        if (client) {
          results[i] = send_one(*client, f, f.endpoint, model, prompts[i], start);
        } else {
          results[i].error = client.error().message;
          results[i].prompt_len = static_cast<int>(prompts[i].ids.size());
        }
        std::lock_guard<std::mutex> lock(progress_mu);
        ++done;
        if (!f.disable_tqdm) progress(done, f.num_prompts, since(start));
      }
    });
  }
  for (std::thread& t : workers) t.join();
  const double duration = since(start);
  if (!f.disable_tqdm) std::cerr << "\n";

  // vLLM's calculate_metrics.
  std::vector<double> ttfts, itls, tpots, all_tpots, e2els;
  std::vector<int> output_lens;
  int completed = 0, failed = 0, good = 0;
  int64_t total_input = 0, total_output = 0;
  std::vector<std::string> errors_seen;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      ++failed;
      output_lens.push_back(0);
      if (errors_seen.size() < 10) errors_seen.push_back(r.error);
      continue;
    }
    ++completed;
    output_lens.push_back(r.output_tokens);
    total_input += r.prompt_len;
    total_output += r.output_tokens;
    double tpot = 0;
    if (r.output_tokens > 1) {
      tpot = (r.latency - r.ttft) / (r.output_tokens - 1);
      tpots.push_back(tpot);
    }
    all_tpots.push_back(tpot);
    itls.insert(itls.end(), r.itl.begin(), r.itl.end());
    ttfts.push_back(r.ttft);
    e2els.push_back(r.latency);
    bool ok = true;
    if (goodput.count("ttft")) ok = ok && r.ttft * 1000 <= goodput["ttft"];
    if (goodput.count("tpot")) ok = ok && tpot * 1000 <= goodput["tpot"];
    if (goodput.count("e2el")) ok = ok && r.latency * 1000 <= goodput["e2el"];
    good += ok;
  }
  if (!errors_seen.empty()) {
    std::cout << "Failed requests during benchmark run detected (capping to 10):" << std::endl;
    for (size_t i = 0; i < errors_seen.size(); ++i) std::cout << "Error " << i << ": " << errors_seen[i] << std::endl;
  }
  // Peak output tokens per second (one-second buckets) and peak concurrency (sweep line).
  double max_tokens_per_s = 0;
  int max_concurrent = 0;
  if (completed > 0) {
    double first_start = std::numeric_limits<double>::infinity(), last_end = 0;
    for (const RequestResult& r : results)
      if (r.ok) {
        first_start = std::min(first_start, r.start);
        last_end = std::max(last_end, r.start + r.latency);
      }
    const size_t buckets = static_cast<size_t>(std::ceil(last_end - first_start)) + 1;
    std::vector<double> per_second(buckets, 0.0);
    std::vector<std::pair<double, int>> events;
    for (const RequestResult& r : results) {
      if (!r.ok) continue;
      double t = r.start + r.ttft;
      auto put = [&](double at) {
        const auto b = static_cast<int64_t>(at - first_start);
        if (b >= 0 && static_cast<size_t>(b) < buckets) per_second[static_cast<size_t>(b)] += 1;
      };
      put(t);
      for (double d : r.itl) put(t += d);
      events.emplace_back(r.start, 1);
      events.emplace_back(r.start + r.latency, -1);
    }
    max_tokens_per_s = *std::max_element(per_second.begin(), per_second.end());
    std::sort(events.begin(), events.end());
    int now = 0;
    for (const auto& [t, d] : events) max_concurrent = std::max(max_concurrent, now += d);
  }

  const double req_tput = completed / duration, out_tput = static_cast<double>(total_output) / duration;
  const double total_tput = static_cast<double>(total_input + total_output) / duration;
  std::cout << fmt::format("{:=^50}\n", " Serving Benchmark Result ");
  std::cout << fmt::format("{:<40} {:<10}\n", "Successful requests:", completed);
  std::cout << fmt::format("{:<40} {:<10}\n", "Failed requests:", failed);
  if (f.max_concurrency > 0)
    std::cout << fmt::format("{:<40} {:<10}\n", "Maximum request concurrency:", f.max_concurrency);
  if (!std::isinf(f.request_rate))
    std::cout << fmt::format("{:<40} {:<10.2f}\n", "Request rate configured (RPS):", f.request_rate);
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Benchmark duration (s):", duration);
  std::cout << fmt::format("{:<40} {:<10}\n", "Total input tokens:", total_input);
  std::cout << fmt::format("{:<40} {:<10}\n", "Total generated tokens:", total_output);
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Request throughput (req/s):", req_tput);
  if (!goodput.empty()) std::cout << fmt::format("{:<40} {:<10.2f}\n", "Request goodput (req/s):", good / duration);
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Output token throughput (tok/s):", out_tput);
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Peak output token throughput (tok/s):", max_tokens_per_s);
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Peak concurrent requests:", static_cast<double>(max_concurrent));
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Total token throughput (tok/s):", total_tput);

  nlohmann::ordered_json result;
  const std::string label = f.label.empty() ? f.backend : f.label;
  const std::string date = local_time("%Y%m%d-%H%M%S");
  result["date"] = date;
  result["endpoint_type"] = f.backend;
  result["backend"] = f.backend;
  result["label"] = f.label.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(f.label);
  result["model_id"] = model_root;
  result["tokenizer_id"] = f.tokenizer.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(f.tokenizer);
  result["num_prompts"] = f.num_prompts;
  for (const std::string& kv : f.metadata) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) return invalid_argument("--metadata takes KEY=VALUE, got '" + kv + "'");
    result[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  result["request_rate"] =
      std::isinf(f.request_rate) ? nlohmann::ordered_json("inf") : nlohmann::ordered_json(f.request_rate);
  result["burstiness"] = f.burstiness;
  result["max_concurrency"] =
      f.max_concurrency > 0 ? nlohmann::ordered_json(f.max_concurrency) : nlohmann::ordered_json();
  result["duration"] = duration;
  result["completed"] = completed;
  result["failed"] = failed;
  result["total_input_tokens"] = total_input;
  result["total_output_tokens"] = total_output;
  result["request_throughput"] = req_tput;
  result["request_goodput"] = goodput.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(good / duration);
  result["output_throughput"] = out_tput;
  result["total_token_throughput"] = total_tput;
  nlohmann::ordered_json input_lens = nlohmann::ordered_json::array(), ttft_list = nlohmann::ordered_json::array(),
                         itl_list = nlohmann::ordered_json::array(), latencies = nlohmann::ordered_json::array(),
                         errors = nlohmann::ordered_json::array(), starts = nlohmann::ordered_json::array(),
                         texts = nlohmann::ordered_json::array();
  for (const RequestResult& r : results) {
    input_lens.push_back(r.prompt_len);
    ttft_list.push_back(r.ttft);
    itl_list.push_back(r.itl);
    latencies.push_back(r.latency);
    errors.push_back(r.error);
    starts.push_back(r.start);
    texts.push_back(r.text);
  }
  result["input_lens"] = std::move(input_lens);
  result["output_lens"] = output_lens;
  result["ttfts"] = std::move(ttft_list);
  result["itls"] = std::move(itl_list);
  result["latencies"] = std::move(latencies);
  result["errors"] = std::move(errors);
  if (f.save_detailed) {
    result["start_times"] = std::move(starts);
    result["generated_texts"] = std::move(texts);
  }
  result["max_output_tokens_per_s"] = max_tokens_per_s;
  result["max_concurrent_requests"] = max_concurrent;

  auto metric = [&](const char* key, const char* name, const char* header, const std::vector<double>& v) {
    if (std::find(selected.begin(), selected.end(), key) == selected.end()) return;
    const double m = mean(v) * 1000, med = percentile(v, 50) * 1000, sd = stddev(v) * 1000;
    std::cout << fmt::format("{:-^50}\n", header);
    std::cout << fmt::format("{:<40} {:<10.2f}\n", fmt::format("Mean {} (ms):", name), m);
    std::cout << fmt::format("{:<40} {:<10.2f}\n", fmt::format("Median {} (ms):", name), med);
    result[fmt::format("mean_{}_ms", key)] = m;
    result[fmt::format("median_{}_ms", key)] = med;
    result[fmt::format("std_{}_ms", key)] = sd;
    for (double p : percentiles) {
      const double value = percentile(v, p) * 1000;
      const std::string word = percent_word(p);
      std::cout << fmt::format("{:<40} {:<10.2f}\n", fmt::format("P{} {} (ms):", word, name), value);
      result[fmt::format("p{}_{}_ms", word, key)] = value;
    }
  };
  metric("ttft", "TTFT", "Time to First Token", ttfts);
  metric("tpot", "TPOT", "Time per Output Token (excl. 1st token)", tpots);
  metric("itl", "ITL", "Inter-token Latency", itls);
  metric("e2el", "E2EL", "End-to-end Latency", e2els);
  std::cout << std::string(50, '=') << std::endl;

  result["siesta"] = {{"machine", machine_info},
                      {"commit", command_output("git rev-parse --short HEAD 2>/dev/null")},
                      {"notes", f.notes},
                      {"base_url", f.base_url},
                      {"endpoint", f.endpoint},
                      {"random_input_len", f.input_len},
                      {"random_output_len", f.output_len},
                      {"random_range_ratio", f.range_ratio},
                      {"random_prefix_len", f.prefix_len},
                      {"prompts", f.tokenizer.empty() ? "token ids" : "text"}};

  if (f.save_result) {
    std::filesystem::path file = f.result_file;
    if (file.empty()) {
      std::string base_model =
          model_root.substr(model_root.find_last_of('/') == std::string::npos ? 0 : model_root.find_last_of('/') + 1);
      std::string name =
          f.result_filename.empty()
              ? fmt::format("{}-{}qps{}-{}-{}.json", label, rate_word(f.request_rate),
                            f.max_concurrency > 0 ? "-concurrency" + std::to_string(f.max_concurrency) : "", base_model,
                            date)
              : f.result_filename;
      file = name;
      if (!f.result_dir.empty()) {
        std::filesystem::create_directories(f.result_dir);
        file = std::filesystem::path(f.result_dir) / name;
      }
    }
    std::ofstream out(file);
    out << result.dump() << "\n";
    if (!out) return io_error("cannot write " + file.string());
  }
  if (completed == 0)
    return unavailable("All requests failed. This is likely due to a misconfiguration on the benchmark arguments.");
  return {};
}

}  // namespace

void add_bench_serve_command(CLI::App& bench) {
  auto* cmd =
      bench.add_subcommand("serve", "Load an OpenAI-compatible server with random prompts, as `vllm bench serve` does");
  auto f = std::make_shared<BenchFlags>();
  cmd->add_option("--base-url,--url", f->base_url, "Server base URL, e.g. http://127.0.0.1:8000 (else --host/--port)");
  cmd->add_option("--host", f->host, "Server host, with --port")->capture_default_str();
  cmd->add_option("--port", f->port, "Server port")->capture_default_str();
  cmd->add_option("--endpoint", f->endpoint,
                  "API path (default /v1/completions, or /v1/chat/completions for openai-chat)");
  cmd->add_option("--backend", f->backend, "openai or vllm (completions), openai-chat")->capture_default_str();
  cmd->add_option("--model", f->model, "Model name in the requests (default: the server's first model)");
  cmd->add_option("--tokenizer", f->tokenizer,
                  "A model directory whose tokenizer turns the random tokens into text prompts (vLLM's random "
                  "dataset); without it the prompts are token ids");
  cmd->add_option("--vocab-size", f->vocab_size, "Without --tokenizer: token ids are drawn from [0, this)")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--num-prompts", f->num_prompts, "Requests to send")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--random-input-len,--input-len", f->input_len, "Prompt tokens per request")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--random-output-len,--output-len", f->output_len, "Generated tokens per request")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--random-range-ratio", f->range_ratio, "Lengths drawn in [len * (1 - r), len * (1 + r)]")
      ->capture_default_str();
  cmd->add_option("--random-prefix-len", f->prefix_len, "Random tokens every prompt starts with")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--request-rate", f->request_rate, "Requests per second (inf: all at once)")->capture_default_str();
  cmd->add_option("--burstiness", f->burstiness, "Gamma shape of the arrival intervals (1: Poisson)")
      ->capture_default_str();
  cmd->add_option("--max-concurrency,--concurrency", f->max_concurrency,
                  "Requests in flight at most (default: no limit)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_flag("--save-result", f->save_result, "Write the result JSON");
  cmd->add_flag("--save-detailed", f->save_detailed, "The result JSON also holds start times and generated texts");
  cmd->add_option("--result-dir", f->result_dir, "Directory of the result JSON (default: here)");
  cmd->add_option("--result-filename", f->result_filename,
                  "File name of the result JSON (default: {label}-{rate}qps[-concurrency{C}]-{model}-{date}.json)");
  cmd->add_option("--result-file", f->result_file, "Write the result JSON to this path (implies --save-result)");
  cmd->add_option("--metadata", f->metadata, "KEY=VALUE pairs kept in the result JSON");
  cmd->add_option("--label", f->label, "Prefix of the result file name (default: the backend)");
  cmd->add_option("--percentile-metrics", f->percentile_metrics, "Metrics to report: ttft,tpot,itl,e2el")
      ->capture_default_str();
  cmd->add_option("--metric-percentiles", f->metric_percentiles, "Percentiles to report, e.g. 50,90,99")
      ->capture_default_str();
  cmd->add_option("--goodput", f->goodput, "Service levels KEY:MS (ttft, tpot, e2el) for the goodput");
  cmd->add_option("--api-key", f->api_key, "Bearer token for the server (default: $OPENAI_API_KEY)");
  cmd->add_option("--seed", f->seed, "Seed of the prompts and the arrivals")->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "Sampling temperature (default: the server's)");
  cmd->add_option("--top-p", f->top_p, "top_p (default: the server's)");
  cmd->add_option("--top-k", f->top_k, "top_k (default: the server's)");
  cmd->add_flag("--ignore-eos,!--no-ignore-eos", f->ignore_eos,
                "Generate every requested token (the random dataset's default)");
  cmd->add_flag("--disable-tqdm", f->disable_tqdm, "No progress bar");
  cmd->add_option("--notes", f->notes, "Free text kept in the result file (how the server was started)");
  cmd->add_option("--timeout", f->timeout_s, "Seconds a connect or read may take")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
  cmd->callback([f] {
    auto r = run_bench(*f);
    if (!r) {
      std::cerr << "siesta bench serve: " << r.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
  });
}

}  // namespace siesta::cli
