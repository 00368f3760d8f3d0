// siesta tokenize --model DIR [--json] TEXT    (TEXT "-" reads stdin)
#include <nlohmann/json.hpp>

#include <iostream>
#include <iterator>

#include "cli/commands.h"
#include "model/tokenizer.h"

namespace siesta::cli {

void add_tokenize_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenize", "Print the token ids of a text");
  struct Options {
    std::string model;
    std::string text;
    bool json = false;
  };
  auto opt = std::make_shared<Options>();
  cmd->add_option("--model", opt->model, "Model directory (with tokenizer.json)")->required();
  cmd->add_flag("--json", opt->json, "Print {\"ids\": [...]}");
  cmd->add_option("text", opt->text, "Text to encode; - reads standard input")->required();
  cmd->callback([opt] {
    auto tok = Tokenizer::load(opt->model);
    if (!tok) {
      std::cerr << "siesta tokenize: " << tok.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
    std::string text = opt->text;
    if (text == "-") text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    const std::vector<int32_t> ids = tok->encode(text);
    if (opt->json) {
      std::cout << nlohmann::json{{"ids", ids}}.dump() << "\n";
    } else {
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
      std::cout << "\n";
    }
  });
}

}  // namespace siesta::cli
