// tokenizer_bench [TOKENIZER_JSON]: load time and single-core encode/decode
// throughput of the Qwen3 tokenizer on mixed text, with and without the word
// cache, against the PCRE2 pre-tokenizer split alone over the same corpus
// (the floor of the split stage, measured in the same run).
//
// The corpus (~8 MB) is built from the golden texts of
// tests/data/golden/qwen3_tokenizer_golden.json (licence prose, code, CJK,
// Arabic, emoji, numbers) plus a few longer mixed passages, repeated; one copy
// in four has its ASCII letters shifted so that rare, never-seen words keep
// reaching BPE, as in real traffic. Each document is encoded by its own call.
//
// Throughput is bytes over the CPU time of the measuring thread (best of 3):
// that is the single-core cost even on a shared machine, where wall time also
// counts waiting for a core. Wall times are recorded beside it.
//
// Writes bench/results/tokenizer.json (the repository is found from the
// current directory or the executable's location).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model/tokenizer.h"
#include "model/tokenizer_text.h"

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

constexpr size_t kCorpusBytes = 8'000'000;
constexpr int kRuns = 3;  // best of; the machine may be shared

fs::path default_tokenizer_path() {
  const char* assets = std::getenv("SIESTA_ASSETS");
  const char* home = std::getenv("HOME");
  const fs::path base = assets != nullptr && *assets != '\0'
                            ? fs::path(assets)
                            : fs::path(home != nullptr ? home : "/") / ".cache" / "siesta" / "assets";
  return base / "qwen3-tokenizer" / "tokenizer.json";
}

// The repository root: the first directory, from the current one or the
// executable's upwards, that holds the golden tokenizer texts.
std::optional<fs::path> find_repo() {
  const fs::path marker = fs::path("tests") / "data" / "golden" / "qwen3_tokenizer_golden.json";
  std::error_code ec;
  for (fs::path start : {fs::current_path(ec), fs::read_symlink("/proc/self/exe", ec).parent_path()}) {
    for (fs::path dir = start; !dir.empty(); dir = dir.parent_path()) {
      if (fs::exists(dir / marker, ec)) return dir;
      if (dir == dir.root_path()) break;
    }
  }
  return std::nullopt;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string command_output(const char* command) {
  std::string out;
  if (FILE* pipe = popen(command, "r")) {
    char buf[256];
    while (fgets(buf, sizeof(buf), pipe) != nullptr) out += buf;
    pclose(pipe);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

// Shifts ASCII letters by `shift`: the words become unseen ones of the same shape.
std::string shift_letters(std::string text, int shift) {
  for (char& c : text) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>('a' + (c - 'a' + shift) % 26);
    if (c >= 'A' && c <= 'Z') c = static_cast<char>('A' + (c - 'A' + shift) % 26);
  }
  return text;
}

std::vector<std::string> build_corpus(const Json& golden) {
  std::vector<std::string> sources;
  for (const Json& c : golden["cases"]) {
    std::string text = c["text"].get<std::string>();
    if (!text.empty()) sources.push_back(std::move(text));
  }
  sources.push_back(
      "東京は日本の首都であり、世界有数の大都市です。人口は約一千四百万人で、政治・経済・文化の中心地として"
      "発展してきました。春には桜が咲き、多くの観光客が訪れます。\n北京是中华人民共和国的首都，也是全国的政治、"
      "文化、国际交往和科技创新中心。서울은 대한민국의 수도이며 최대 도시이다.\n");
  sources.push_back(
      "Great job! 🎉🎉 Let's ship it 🚀🚀🚀 — the build is green ✅ and the tests pass 👍🏽. "
      "Weekend plans: 🏔️ hiking, 🍕 pizza, 🎮 games. Family: 👨‍👩‍👧‍👦 Flags: 🇯🇵 🇫🇷 🏳️‍🌈\n");
  sources.push_back(
      "template <class T>\nstd::vector<T> merge_sorted(const std::vector<T>& a, const std::vector<T>& b) {\n"
      "  std::vector<T> out;\n  out.reserve(a.size() + b.size());\n  std::merge(a.begin(), a.end(), b.begin(), "
      "b.end(), std::back_inserter(out));\n  return out;  // O(n + m)\n}\n\nfor i in range(10):\n    print(f\"{i:>4}"
      " -> {i ** 2:#x}\")\n");
  std::mt19937 rng(12345);
  std::vector<std::string> corpus;
  size_t bytes = 0;
  for (int copy = 0; bytes < kCorpusBytes; ++copy) {
    std::vector<size_t> order(sources.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) {
      std::string doc = copy % 4 == 3 ? shift_letters(sources[i], 1 + copy % 25) : sources[i];
      bytes += doc.size();
      corpus.push_back(std::move(doc));
    }
  }
  return corpus;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

struct Timing {
  double cpu = 1e30;   // seconds of this thread on a core
  double wall = 1e30;  // seconds on the clock
};

// Best of kRuns runs of fn() (each figure on its own).
template <class Fn>
Timing best_time(Fn&& fn) {
  Timing best;
  for (int r = 0; r < kRuns; ++r) {
    const double wall = wall_seconds();
    const double cpu = thread_cpu_seconds();
    fn();
    best.cpu = std::min(best.cpu, thread_cpu_seconds() - cpu);
    best.wall = std::min(best.wall, wall_seconds() - wall);
  }
  return best;
}

Json timing_json(const Timing& t, double mb) {
  Json j = {{"cpu_seconds", t.cpu}, {"wall_seconds", t.wall}};
  if (mb > 0) j["mb_per_s"] = mb / t.cpu;
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2 || (argc == 2 && (std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help"))) {
    std::cerr << "usage: tokenizer_bench [TOKENIZER_JSON]  (default: " << default_tokenizer_path().string() << ")\n";
    return 2;
  }
  const fs::path tokenizer_path = argc == 2 ? fs::path(argv[1]) : default_tokenizer_path();
  const std::optional<fs::path> repo = find_repo();
  if (!repo) {
    std::cerr << "tokenizer_bench: run it from the siesta source tree (tests/data/golden/ not found)\n";
    return 1;
  }

  // Load: the first load may read the file from disk; the best of the rest is the steady figure.
  const double first_wall = wall_seconds();
  siesta::Result<siesta::Tokenizer> cached = siesta::Tokenizer::load_file(tokenizer_path);
  const double load_first_wall = wall_seconds() - first_wall;
  if (!cached) {
    std::cerr << "tokenizer_bench: " << cached.error().message << " (run scripts/setup to fetch it)\n";
    return 1;
  }
  const Timing load = best_time([&] { (void)siesta::Tokenizer::load_file(tokenizer_path); });
  siesta::Result<siesta::Tokenizer> uncached =
      siesta::Tokenizer::load_file(tokenizer_path, siesta::TokenizerOptions{.word_cache_words = 0});
  if (!uncached) return 1;

  const std::vector<std::string> corpus =
      build_corpus(Json::parse(read_file(*repo / "tests/data/golden/qwen3_tokenizer_golden.json")));
  size_t corpus_bytes = 0;
  for (const std::string& doc : corpus) corpus_bytes += doc.size();
  const double mb = static_cast<double>(corpus_bytes) / 1e6;

  std::vector<std::vector<int32_t>> ids(corpus.size());
  auto encode_all = [&](const siesta::Tokenizer& tok) {
    for (size_t i = 0; i < corpus.size(); ++i) ids[i] = tok.encode(corpus[i]);
  };
  encode_all(*uncached);
  const std::vector<std::vector<int32_t>> reference = ids;
  const Timing encode_uncached = best_time([&] { encode_all(*uncached); });
  encode_all(*cached);  // warms the word cache
  const Timing encode_cached = best_time([&] { encode_all(*cached); });
  size_t tokens = 0;
  for (const auto& v : ids) tokens += v.size();
  if (ids != reference) {
    std::cerr << "tokenizer_bench: cached and uncached encodings differ\n";
    return 1;
  }

  size_t decoded_bytes = 0;
  const Timing decode = best_time([&] {
    decoded_bytes = 0;
    for (const auto& v : ids) decoded_bytes += cached->decode(v).size();
  });

  // The floor: the tokenizer's own Split regex over the same documents, nothing else.
  const Json doc = Json::parse(read_file(tokenizer_path));
  const std::string pattern = doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].get<std::string>();
  siesta::Result<siesta::tokenizer_internal::SplitRegex> split =
      siesta::tokenizer_internal::SplitRegex::compile(pattern, false);
  if (!split) {
    std::cerr << "tokenizer_bench: " << split.error().message << "\n";
    return 1;
  }
  size_t pieces = 0;
  const Timing split_only = best_time([&] {
    pieces = 0;
    for (const std::string& d : corpus) split->split(d, [&](std::string_view) { ++pieces; });
  });

  const double decoded_mb = static_cast<double>(decoded_bytes) / 1e6;
  std::printf("tokenizer bench: %s, vocab %d, corpus %.1f MB in %zu documents, %zu tokens, 1 thread\n",
              tokenizer_path.filename().string().c_str(), cached->vocab_size(), mb, corpus.size(), tokens);
  std::printf("%-32s %9s %9s %9s\n", "stage", "cpu s", "wall s", "MB/s");
  auto row = [](const char* stage, const Timing& t, double megabytes) {
    if (megabytes > 0) {
      std::printf("%-32s %9.3f %9.3f %9.1f\n", stage, t.cpu, t.wall, megabytes / t.cpu);
    } else {
      std::printf("%-32s %9.3f %9.3f %9s\n", stage, t.cpu, t.wall, "-");
    }
  };
  row("load tokenizer.json", load, 0);
  row("encode, word cache warm", encode_cached, mb);
  row("encode, no word cache", encode_uncached, mb);
  row("decode", decode, decoded_mb);
  row("floor: PCRE2 split only", split_only, mb);

  Json result = {
      {"benchmark", "tokenizer"},
      {"machine", {{"cpu", cpu_model()}, {"cores", std::thread::hardware_concurrency()}}},
      {"date", utc_now()},
      {"commit", command_output("git rev-parse --short HEAD 2>/dev/null")},
      {"tokenizer", tokenizer_path.filename().string()},
      {"vocab_size", cached->vocab_size()},
      {"threads", 1},
      {"corpus", {{"bytes", corpus_bytes}, {"documents", corpus.size()}, {"tokens", tokens}, {"pieces", pieces}}},
      {"load", {{"first_wall_seconds", load_first_wall}, {"cpu_seconds", load.cpu}, {"wall_seconds", load.wall}}},
      {"encode_word_cache", timing_json(encode_cached, mb)},
      {"encode_no_word_cache", timing_json(encode_uncached, mb)},
      {"decode", timing_json(decode, decoded_mb)},
      {"peer",
       {{"what", "PCRE2 JIT split with the tokenizer's own pre-tokenizer regex over the same corpus: the floor of "
                 "the split stage"},
        {"timing", timing_json(split_only, mb)}}},
      {"units", "MB = 1e6 bytes of UTF-8 input; MB/s over the measuring thread's CPU time; best of 3 runs"},
  };
  const fs::path out = *repo / "bench" / "results" / "tokenizer.json";
  std::ofstream(out) << result.dump(2) << "\n";
  std::printf("wrote %s\n", out.string().c_str());
  return 0;
}
