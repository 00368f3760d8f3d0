// RequestFramer: finds where one HTTP/1.x request ends in the bytes a client
// sent, before any of it reaches a handler, and refuses what siesta's servers
// will not read: a head that is not HTTP/1.0 or 1.1, a head or a body over its
// limit, Content-Length given twice or not as a decimal number, a
// Transfer-Encoding other than chunked, both framings at once, malformed
// chunks, and (optionally) a body whose JSON nests too deeply. It refuses as
// soon as the bytes received show the request cannot be accepted: a chunked
// body past the limit at the chunk size that passes it, a body announced over
// the limit at the end of the head, JSON too deep at the bracket that is one
// too many.
//
//   RequestFramer framer(limits);
//   framer.append(bytes_from_socket);
//   switch (framer.advance()) {
//     case FramerState::kNeedMore: ...                      // read more (framer.expects_continue(): send 100)
//     case FramerState::kComplete: serve(framer.take_request()); ... // pipelined bytes stay, for the next request
//     case FramerState::kRefused: answer(framer.refusal());  // then close the connection
//   }
//
// Stricter than cpp-httplib (the parser behind it, which reads the request
// again from take_request()'s bytes): whatever the framer accepts, httplib
// frames the same way, so the two can never disagree on where a request ends
// (no request smuggling). Header lines must end in CRLF and name a token; a
// chunked body takes no trailer fields. An `Expect: 100-continue` line is
// taken out of the head (the intake answers it), so the handler never sees it.
//
// A value; not thread-safe. Pure: unit-tested and fuzzed (tests/fuzz).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/json_depth.h"

namespace siesta {

struct FramerLimits {
  size_t max_head_bytes = 64u << 10;   // request line and header fields (431 beyond)
  size_t max_body_bytes = 32u << 20;   // decoded body (413 beyond)
  size_t max_json_depth = kDefaultMaxJsonDepth;  // 0: the body is not scanned
};

enum class FramerState { kNeedMore, kComplete, kRefused };

// Why a request is refused, as the intake answers it.
struct FramerRefusal {
  int status = 400;
  std::string code;     // bad_request, invalid_content_length, request_too_large, json_too_deep, ...
  std::string message;  // one line for the client
};

class RequestFramer {
 public:
  explicit RequestFramer(FramerLimits limits) : limits_(limits), depth_(limits.max_json_depth) {}

  void append(std::string_view bytes) { buf_.append(bytes); }
  // Looks at the bytes appended since the last call; kRefused stays refused.
  FramerState advance();

  // Any byte of the current request (kNeedMore: a request is under way).
  bool started() const { return buf_.size() > 0; }
  bool head_complete() const { return stage_ >= Stage::kBody; }
  // The head is complete, the client asked `Expect: 100-continue`, and the
  // body has not all arrived: the client waits for a 100 before it sends it.
  bool expects_continue() const { return expect_continue_ && stage_ != Stage::kDone; }
  const FramerRefusal& refusal() const { return refusal_; }
  // Bytes held: the current request's and any that followed it.
  size_t buffered() const { return buf_.size(); }

  // After kComplete: the request's bytes, head (without Expect) and body as
  // received; the framer then frames the bytes after it as the next request.
  std::string take_request();

 private:
  enum class Stage { kHead, kBody, kChunkSize, kChunkData, kChunkDataEnd, kChunkTrailer, kDone, kRefused };

  FramerState refuse(int status, std::string code, std::string message);
  FramerState parse_head();
  FramerState head_line(std::string_view line);  // a header field line, CRLF included
  FramerState end_of_head();
  FramerState parse_body();
  FramerState body_bytes(std::string_view bytes);

  FramerLimits limits_;
  std::string buf_;
  Stage stage_ = Stage::kHead;
  size_t pos_ = 0;           // bytes of buf_ looked at
  size_t lines_ = 0;         // lines of the head so far
  bool method_checked_ = false;
  // From the head.
  int content_lengths_ = 0;
  std::optional<uint64_t> content_length_;
  int transfer_encodings_ = 0;
  bool chunked_ = false;
  bool expect_continue_ = false;
  size_t expect_begin_ = 0, expect_end_ = 0;  // the Expect line, removed at the end of the head
  size_t head_end_ = 0;
  // The body.
  uint64_t body_bytes_ = 0;     // decoded so far
  uint64_t chunk_left_ = 0;
  size_t request_end_ = 0;
  JsonDepthScanner depth_;
  FramerRefusal refusal_;
};

}  // namespace siesta
