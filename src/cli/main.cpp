// siesta: one executable, one subcommand per job.
#include <CLI/CLI.hpp>

#include <iostream>

#include "common/log.h"

int main(int argc, char** argv) {
  CLI::App app{"siesta: LLM serving with P/D disaggregation and sleep mode"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off");
  CLI11_PARSE(app, argc, argv);
  siesta::init_logging(log_level);
  return 0;
}
