// siesta: one executable, one subcommand per job (src/cli/cmd_*.cpp).
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/device_flags.h"
#include "common/log.h"

int main(int argc, char** argv) {
  CLI::App app{"siesta: Qwen3 serving with prefill/decode disaggregation and sleep mode"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")->capture_default_str();
  app.parse_complete_callback([&] { siesta::init_logging(log_level); });

  siesta::cli::add_tokenize_command(app);
  siesta::cli::add_generate_command(app);
  siesta::cli::add_make_model_command(app);
  siesta::cli::add_serve_command(app);
  {
    auto* bench = app.add_subcommand("bench", "Benchmarks (serve: an OpenAI server under load; transfer: the transfer engine)");
    bench->require_subcommand(1);
    siesta::cli::add_bench_serve_command(*bench);
    siesta::cli::add_bench_transfer_command(*bench);
  }
  siesta::cli::add_proxy_command(app);
  siesta::cli::add_demo_command(app);

  // vLLM's -tp for --tensor-parallel-size (cli/device_flags.h).
  const std::vector<std::string> args = siesta::cli::expand_short_tensor_parallel(argc, argv);
  std::vector<const char*> arg_ptrs;
  for (const std::string& a : args) arg_ptrs.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  } catch (const CLI::ParseError& e) {
    // Usage errors print one line and exit 2; RuntimeError carries a command's own exit code.
    if (e.get_exit_code() != 0 && dynamic_cast<const CLI::RuntimeError*>(&e) == nullptr) {
      std::cerr << "siesta: " << e.what() << "\n";
      return siesta::cli::kExitUsage;
    }
    return app.exit(e);
  }
  return 0;
}
