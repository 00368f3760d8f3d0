// RequestIdSource: the X-Request-Id a request's prefill and decode legs share.
// A client's own X-Request-Id is kept when it is 1-128 characters of
// [A-Za-z0-9._:-]; otherwise the source makes one ("pd-" + 32 hex digits).
//
// Threads: any; one mutex guards the generator.
#pragma once

#include <mutex>
#include <random>
#include <string>

namespace siesta::proxy {

class RequestIdSource {
 public:
  RequestIdSource();
  std::string next();
  // The client's id when usable, else next().
  std::string choose(const std::string& from_client);

 private:
  std::mutex mu_;
  std::mt19937_64 gen_;
};

}  // namespace siesta::proxy
