// RequestFramer (common/http_request_framer.h): where a request ends, and the
// requests refused before a handler sees them.
#include "common/http_request_framer.h"

#include <gtest/gtest.h>

#include <string>

namespace siesta {
namespace {

FramerLimits limits(size_t body = 1000, size_t depth = 8) {
  FramerLimits l;
  l.max_head_bytes = 512;
  l.max_body_bytes = body;
  l.max_json_depth = depth;
  return l;
}

// Feeds `bytes` one byte at a time (the worst split) and returns the final state.
FramerState feed_bytewise(RequestFramer& f, const std::string& bytes) {
  FramerState s = FramerState::kNeedMore;
  for (char c : bytes) {
    f.append(std::string_view(&c, 1));
    s = f.advance();
    if (s != FramerState::kNeedMore) break;
  }
  return s;
}

TEST(RequestFramerTest, FramesContentLengthAndKeepsPipelinedBytes) {
  const std::string first = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
  const std::string second = "GET /health HTTP/1.1\r\n\r\n";
  RequestFramer f(limits());
  f.append(first + second);
  ASSERT_EQ(f.advance(), FramerState::kComplete);
  EXPECT_EQ(f.take_request(), first);
  ASSERT_EQ(f.advance(), FramerState::kComplete);
  EXPECT_EQ(f.take_request(), second);
  EXPECT_EQ(f.buffered(), 0u);
  EXPECT_EQ(f.advance(), FramerState::kNeedMore);
}

TEST(RequestFramerTest, FramesChunkedBodiesByteByByte) {
  const std::string req =
      "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n";
  RequestFramer f(limits());
  ASSERT_EQ(feed_bytewise(f, req), FramerState::kComplete);
  EXPECT_EQ(f.take_request(), req);
}

TEST(RequestFramerTest, AnswersExpectContinueAndTakesTheLineOut) {
  RequestFramer f(limits());
  f.append("POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n");
  ASSERT_EQ(f.advance(), FramerState::kNeedMore);
  EXPECT_TRUE(f.expects_continue());
  f.append("{}");
  ASSERT_EQ(f.advance(), FramerState::kComplete);
  EXPECT_FALSE(f.expects_continue());
  EXPECT_EQ(f.take_request(), "POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}");
}

struct Refused {
  std::string request;
  int status;
  std::string code;
};

class RequestFramerRefusalTest : public ::testing::TestWithParam<Refused> {};

TEST_P(RequestFramerRefusalTest, RefusesWithStatusAndCode) {
  const Refused& r = GetParam();
  RequestFramer f(limits());
  ASSERT_EQ(feed_bytewise(f, r.request), FramerState::kRefused) << r.request;
  EXPECT_EQ(f.refusal().status, r.status) << f.refusal().message;
  EXPECT_EQ(f.refusal().code, r.code) << f.refusal().message;
  EXPECT_FALSE(f.refusal().message.empty());
  EXPECT_EQ(f.advance(), FramerState::kRefused);  // stays refused
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, RequestFramerRefusalTest,
    ::testing::Values(
        // Not HTTP/1.x: refused at the first byte that shows it.
        Refused{"\x16\x03\x01\x02\x00", 400, "bad_request"},
        Refused{"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "unsupported_http_version"},
        Refused{"GET /\r\n", 400, "bad_request"},  // HTTP/0.9
        Refused{"GET / HTTP/1.1\nHost: x\n\n", 400, "bad_request"},
        Refused{"GET / HTTP/1.1\r\nHost x\r\n\r\n", 400, "bad_request"},
        Refused{"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400, "bad_request"},
        Refused{"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", 400, "bad_request"},
        Refused{std::string("GET / HTTP/1.1\r\nA: b\0c\r\n\r\n", 26), 400, "bad_request"},
        // Content-Length given twice, negative, not decimal.
        Refused{"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", 400, "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n", 400, "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nContent-Length: 1, 1\r\n\r\n", 400, "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nContent-Length: \r\n\r\n", 400, "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
                "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400, "invalid_transfer_encoding"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
                "invalid_transfer_encoding"},
        Refused{"POST / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n", 417, "expectation_failed"},
        // Sizes: announced or passed.
        Refused{"POST / HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", 413, "request_too_large"},
        Refused{"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400, "invalid_content_length"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" + std::string(1000, 'x') +
                    "\r\n1\r\n",
                413, "request_too_large"},
        Refused{"GET / HTTP/1.1\r\nX: " + std::string(600, 'a') + "\r\n\r\n", 431, "headers_too_large"},
        // Chunk framing.
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "bad_request"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", 400, "bad_request"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1 \r\nx\r\n", 400, "bad_request"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxy\r\n", 400, "bad_request"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n", 400, "bad_request"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nTrailer: x\r\n\r\n", 400, "bad_request"},
        // JSON nested past the limit, in either framing.
        Refused{"POST / HTTP/1.1\r\nContent-Length: 20\r\n\r\n{\"a\":[[[[[[[[[]]]]]]]]]", 400, "json_too_deep"},
        Refused{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n9\r\n[[[[[[[[[\r\n", 400, "json_too_deep"}));

TEST(RequestFramerTest, DepthCheckCanBeOff) {
  RequestFramer f(limits(1000, 0));
  f.append("POST / HTTP/1.1\r\nContent-Length: 20\r\n\r\n[[[[[[[[[[]]]]]]]]]]");
  EXPECT_EQ(f.advance(), FramerState::kComplete);
}

TEST(RequestFramerTest, StartedOnlyOnceBytesCome) {
  RequestFramer f(limits());
  EXPECT_FALSE(f.started());
  f.append("G");
  EXPECT_EQ(f.advance(), FramerState::kNeedMore);
  EXPECT_TRUE(f.started());
  EXPECT_FALSE(f.head_complete());
}

}  // namespace
}  // namespace siesta
