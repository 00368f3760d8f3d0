#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace siesta {

void init_logging(std::string_view level) {
  static bool configured = false;  // the default logger is process-wide by spdlog's design
  if (!configured) {
    auto logger = spdlog::stderr_color_mt("siesta");
    spdlog::set_default_logger(logger);
    spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
    configured = true;
  }
  spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") lvl = spdlog::level::info;
  spdlog::set_level(lvl);
}

}  // namespace siesta
