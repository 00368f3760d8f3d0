// Where the unit tests find their fixtures (models/tiny-qwen3, tests/data) and the siesta
// executable, wherever the test binary runs from: the root is $SIESTA_TEST_DATA when set, else
// the nearest directory above the test binary that holds models/tiny-qwen3 (the repository for a
// build folder inside it, the unpacked bundle for scripts/device-bundle's bin/), else the working
// directory (ctest runs the tests in the source tree, so a build folder anywhere works too).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace siesta::testing {

// The directory of the running test binary (/proc/self/exe).
inline std::filesystem::path test_binary_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path(".") : exe.parent_path();
}

inline std::filesystem::path find_test_data_root() {
  if (const char* env = std::getenv("SIESTA_TEST_DATA"); env != nullptr && *env != '\0') return env;
  for (auto dir = test_binary_dir(); !dir.empty(); dir = dir.parent_path()) {
    if (std::filesystem::exists(dir / "models" / "tiny-qwen3" / "config.json")) return dir;
    if (dir == dir.parent_path()) break;
  }
  std::error_code ec;
  const auto cwd = std::filesystem::current_path(ec);
  return ec ? std::filesystem::path(".") : cwd;
}

// The fixture root: models/ and tests/data/ lie under it.
inline const std::filesystem::path& test_data_root() {
  static const std::filesystem::path root = find_test_data_root();
  return root;
}

inline std::filesystem::path tiny_model_dir() { return test_data_root() / "models" / "tiny-qwen3"; }

// The siesta executable the build puts beside the test binaries (bin/).
inline std::filesystem::path siesta_binary() { return test_binary_dir() / "siesta"; }

}  // namespace siesta::testing
