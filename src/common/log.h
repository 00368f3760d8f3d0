// Logging through spdlog. One call at startup sets the level; modules log with
// SIESTA_LOG_INFO(...) etc. (fmt format strings). Logs go to stderr so that
// stdout stays clean for command output (token ids, JSON).
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace siesta {

// level: "trace", "debug", "info", "warn", "error", "off". Unknown names mean "info".
void init_logging(std::string_view level);

}  // namespace siesta

#define SIESTA_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define SIESTA_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define SIESTA_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define SIESTA_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
