// What an exception that reached an HTTP handler's edge says, for the log
// line and the 500 answer (the server's and the proxy's exception handlers).
#pragma once

#include <exception>
#include <string>

namespace siesta {

// e.what() of a std::exception, else "unknown exception" (also for null).
inline std::string exception_text(std::exception_ptr ep) {
  try {
    if (ep) std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  return "unknown exception";
}

}  // namespace siesta
