// A fresh, empty directory under the system temp dir for one test, removed
// with everything in it when the object goes out of scope.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace siesta::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            (prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace siesta::testing
