// Errors as values. A fallible function returns Result<T>; the error side is a
// Status: a code and a one-line message that names the problem for an operator.
//
//   Result<Config> cfg = load_config(dir);
//   if (!cfg) return cfg.error();          // propagate
//   use(*cfg);
//
// Exceptions do not cross module borders: code that calls a throwing library
// catches at its edge and returns a Status.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace siesta {

enum class ErrorCode {
  kInvalidArgument,  // bad input from a user or a peer
  kNotFound,         // a file, tensor, request or peer that does not exist
  kCorrupt,          // data that exists but cannot be parsed (truncated, malformed)
  kIo,               // the OS refused (open, mmap, read, socket)
  kConflict,         // the call is not allowed in the current state
  kUnavailable,      // cannot serve now (asleep, overloaded, peer down)
  kTimeout,          // a deadline passed
  kOutOfMemory,      // an allocation failed
  kInternal,         // a bug: an invariant did not hold
};

const char* error_code_name(ErrorCode code);

struct Status {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;

  // Prefixes the message with context: "loading model: " + message.
  Status with_context(const std::string& context) const {
    return Status{code, context + ": " + message};
  }
};

inline Status invalid_argument(std::string msg) { return {ErrorCode::kInvalidArgument, std::move(msg)}; }
inline Status not_found(std::string msg) { return {ErrorCode::kNotFound, std::move(msg)}; }
inline Status corrupt(std::string msg) { return {ErrorCode::kCorrupt, std::move(msg)}; }
inline Status io_error(std::string msg) { return {ErrorCode::kIo, std::move(msg)}; }
inline Status conflict(std::string msg) { return {ErrorCode::kConflict, std::move(msg)}; }
inline Status unavailable(std::string msg) { return {ErrorCode::kUnavailable, std::move(msg)}; }
inline Status timeout(std::string msg) { return {ErrorCode::kTimeout, std::move(msg)}; }
inline Status out_of_memory(std::string msg) { return {ErrorCode::kOutOfMemory, std::move(msg)}; }
inline Status internal_error(std::string msg) { return {ErrorCode::kInternal, std::move(msg)}; }

// Result<T>: either a T or a Status. Implicitly constructible from both, so a
// function can `return value;` or `return not_found("...");`.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::in_place_index<1>, std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }

  T& value() & { assert(has_value()); return std::get<0>(v_); }
  const T& value() const& { assert(has_value()); return std::get<0>(v_); }
  T&& value() && { assert(has_value()); return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  const Status& error() const { assert(!has_value()); return std::get<1>(v_); }

 private:
  std::variant<T, Status> v_;
};

// Result<void>: success, or a Status.
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Status status) : err_(std::move(status)), ok_(false) {}  // NOLINT(google-explicit-constructor)

  bool has_value() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Status& error() const { assert(!ok_); return err_; }

 private:
  Status err_;
  bool ok_ = true;
};

using Ok = Result<void>;

}  // namespace siesta

// Propagates an error from a Result-returning expression; evaluates to nothing.
#define SIESTA_TRY(expr)                                  \
  do {                                                    \
    auto siesta_try_result_ = (expr);                     \
    if (!siesta_try_result_) return siesta_try_result_.error(); \
  } while (0)

#define SIESTA_CONCAT_INNER_(a, b) a##b
#define SIESTA_CONCAT_(a, b) SIESTA_CONCAT_INNER_(a, b)

// SIESTA_ASSIGN_OR_RETURN(auto x, f()): declares x from f()'s value or returns its error.
#define SIESTA_ASSIGN_OR_RETURN(decl, expr) \
  SIESTA_ASSIGN_OR_RETURN_IMPL_(SIESTA_CONCAT_(siesta_result_, __LINE__), decl, expr)
#define SIESTA_ASSIGN_OR_RETURN_IMPL_(tmp, decl, expr) \
  auto tmp = (expr);                                   \
  if (!tmp) return tmp.error();                        \
  decl = std::move(tmp).value()
