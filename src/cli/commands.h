// Subcommands of the siesta executable. Each cmd_*.cpp adds one to the app;
// main.cpp calls them in order. A command reports bad input as a one-line
// message on stderr and a non-zero exit code.
#pragma once

#include <CLI/CLI.hpp>

namespace siesta::cli {

// Exit codes: 0 success, 1 runtime failure (bad file, bad model), 2 usage error.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

void add_tokenize_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_make_model_command(CLI::App& app);
void add_serve_command(CLI::App& app);
// `siesta bench <what>`: each adds itself under the bench subcommand.
void add_bench_serve_command(CLI::App& bench);
void add_bench_transfer_command(CLI::App& bench);
void add_proxy_command(CLI::App& app);
void add_demo_command(CLI::App& app);

}  // namespace siesta::cli
