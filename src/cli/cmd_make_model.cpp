// siesta make-model --shape tiny|qwen3-0.6b|qwen3-1.7b|qwen3-4b|qwen3-8b|qwen3-14b|qwen3-32b --out DIR
//                   [--seed S] [--layers N] [--tokenizer FILE]
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "model/make_model.h"

namespace siesta::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kHelp = R"(Write a random-weight Qwen3 checkpoint in the Hugging Face layout (bf16).

Shapes: tiny (the shape of models/tiny-qwen3, 8 MB), and the Qwen/Qwen3 dense models':
qwen3-0.6b (1.2 GB), qwen3-1.7b (3.4 GB), qwen3-4b (8.0 GB), qwen3-8b (16.4 GB),
qwen3-14b (29.5 GB; GQA group 5), qwen3-32b (65.5 GB); past 4 GiB in shards with
model.safetensors.index.json. --layers N keeps the shape's widths with N decoder layers.
The same --seed always gives the same weights.

Tokenizer, unless --tokenizer FILE names a tokenizer.json:
  qwen3-*: $SIESTA_ASSETS/qwen3-tokenizer/tokenizer.json
           ($SIESTA_ASSETS defaults to ~/.cache/siesta/assets)
  tiny: models/tiny-qwen3/tokenizer.json of the source tree, found by looking in
        the directories above the siesta executable, then above the current directory.
A tokenizer_config.json next to the tokenizer.json is copied too.)";

fs::path assets_dir() {
  if (const char* a = std::getenv("SIESTA_ASSETS"); a && *a) return a;
  const char* home = std::getenv("HOME");
  return fs::path(home ? home : "/") / ".cache" / "siesta" / "assets";
}

// The source tree's tiny tokenizer: the executable normally lives in BUILD/bin under it.
std::vector<fs::path> tiny_tokenizer_candidates() {
  const fs::path rel = fs::path("models") / "tiny-qwen3" / "tokenizer.json";
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::path start : {fs::read_symlink("/proc/self/exe", ec).parent_path(), fs::current_path(ec)}) {
    for (fs::path dir = start; !dir.empty(); dir = dir.parent_path()) {
      out.push_back(dir / rel);
      if (dir == dir.root_path()) break;
    }
  }
  return out;
}

// The tokenizer to copy, or a one-line reason there is none.
std::optional<fs::path> default_tokenizer(const std::string& shape, std::string& why) {
  std::error_code ec;
  if (shape != "tiny") {
    fs::path p = assets_dir() / "qwen3-tokenizer" / "tokenizer.json";
    if (fs::exists(p, ec)) return p;
    why = "no Qwen3 tokenizer at " + p.string() + "; set SIESTA_ASSETS or pass --tokenizer FILE";
    return std::nullopt;
  }
  for (const fs::path& p : tiny_tokenizer_candidates())
    if (fs::exists(p, ec)) return p;
  why = "models/tiny-qwen3/tokenizer.json not found above the siesta executable or the current directory; "
        "pass --tokenizer FILE";
  return std::nullopt;
}

}  // namespace

void add_make_model_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("make-model", "Write a random-weight Qwen3 checkpoint");
  cmd->footer(kHelp);
  struct Options {
    std::string shape;
    std::string out;
    uint64_t seed = 0;
    int layers = 0;
    std::string tokenizer;
  };
  auto opt = std::make_shared<Options>();
  cmd->add_option("--shape", opt->shape, "Model shape")->required()->check(CLI::IsMember(model_shape_names()));
  cmd->add_option("--out", opt->out, "Output directory (must not exist, or be empty)")->required();
  cmd->add_option("--seed", opt->seed, "Seed of the weights")->capture_default_str();
  cmd->add_option("--layers", opt->layers, "Decoder layers (default: the shape's)")
      ->check([](const std::string& text) -> std::string {
        try {
          size_t used = 0;
          if (std::stoi(text, &used) > 0 && used == text.size()) return {};
        } catch (const std::exception&) {
        }
        return "expected a positive number of layers, got '" + text + "'";
      });
  cmd->add_option("--tokenizer", opt->tokenizer, "tokenizer.json to copy (default: see below)");
  cmd->callback([opt] {
    MakeModelOptions o;
    o.shape = opt->shape;
    o.out_dir = opt->out;
    o.seed = opt->seed;
    o.layers = opt->layers;
    if (!opt->tokenizer.empty()) {
      o.tokenizer = opt->tokenizer;
    } else {
      std::string why;
      auto found = default_tokenizer(opt->shape, why);
      if (!found) {
        std::cerr << "siesta make-model: " << why << "\n";
        throw CLI::RuntimeError(kExitFailure);
      }
      o.tokenizer = *found;
    }
    o.progress = [](std::string_view line) { std::cerr << "siesta make-model: " << line << "\n"; };
    auto r = make_model(o);
    if (!r) {
      std::cerr << "siesta make-model: " << r.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
    std::cout << "wrote " << opt->shape << " checkpoint (seed " << opt->seed << ") to " << opt->out << "\n";
  });
}

}  // namespace siesta::cli
