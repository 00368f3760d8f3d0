#include "common/http_request_framer.h"

#include <strings.h>

#include <algorithm>

namespace siesta {
namespace {

constexpr size_t kMaxMethodBytes = 16;
constexpr size_t kMaxChunkLineBytes = 1024;

bool is_tchar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+':
    case '-': case '.': case '^': case '_': case '`': case '|': case '~':
      return true;
    default:
      return false;
  }
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && strncasecmp(a.data(), b.data(), a.size()) == 0;
}

std::string_view trim(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return v;
}

// What a client sent, quoted for a message: printable ASCII, at most 40 bytes.
std::string quoted(std::string_view v) {
  std::string out = "'";
  for (char c : v.substr(0, 40)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (v.size() > 40) out += "...";
  return out + "'";
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

FramerState RequestFramer::refuse(int status, std::string code, std::string message) {
  stage_ = Stage::kRefused;
  refusal_ = FramerRefusal{status, std::move(code), std::move(message)};
  return FramerState::kRefused;
}

FramerState RequestFramer::advance() {
  if (stage_ == Stage::kRefused) return FramerState::kRefused;
  if (stage_ == Stage::kHead) {
    const FramerState s = parse_head();
    if (stage_ == Stage::kHead || s == FramerState::kRefused) return s;
  }
  if (stage_ != Stage::kDone) {
    const FramerState s = parse_body();
    if (s != FramerState::kComplete) return s;
  }
  return FramerState::kComplete;
}

FramerState RequestFramer::parse_head() {
  for (;;) {
    if (!method_checked_) {
      // Refuse what is not HTTP/1.x (a TLS ClientHello, HTTP/2's preface is
      // caught at the version) without waiting for a line end.
      const size_t avail = buf_.size();
      size_t i = 0;
      for (; i < avail && i <= kMaxMethodBytes; ++i) {
        const char c = buf_[i];
        if (c == ' ' && i > 0) break;
        if (c < 'A' || c > 'Z') return refuse(400, "bad_request", "not an HTTP/1.1 request (it does not start with a method such as GET or POST)");
      }
      if (i > kMaxMethodBytes) return refuse(400, "bad_request", "not an HTTP/1.1 request (no method)");
      if (i == avail) return FramerState::kNeedMore;
      method_checked_ = true;
    }
    const size_t nl = buf_.find('\n', pos_);
    if (nl == std::string::npos) {
      if (buf_.size() > limits_.max_head_bytes)
        return refuse(431, "headers_too_large",
                      "the request line and headers are larger than the limit of " +
                          std::to_string(limits_.max_head_bytes) + " bytes");
      return FramerState::kNeedMore;
    }
    const size_t line_begin = pos_;
    pos_ = nl + 1;
    if (pos_ > limits_.max_head_bytes)
      return refuse(431, "headers_too_large",
                    "the request line and headers are larger than the limit of " +
                        std::to_string(limits_.max_head_bytes) + " bytes");
    const std::string_view line(buf_.data() + line_begin, pos_ - line_begin);
    if (line.size() < 2 || line[line.size() - 2] != '\r')
      return refuse(400, "bad_request", "a line of the request head does not end in CRLF");
    if (line.find('\0') != std::string_view::npos)
      return refuse(400, "bad_request", "the request head holds a NUL byte");
    if (lines_++ == 0) {
      // METHOD SP target SP HTTP/1.x
      const std::string_view text = line.substr(0, line.size() - 2);
      const size_t sp1 = text.find(' ');
      const size_t sp2 = sp1 == std::string_view::npos ? sp1 : text.find(' ', sp1 + 1);
      if (sp2 == std::string_view::npos || sp2 == sp1 + 1 || text.find(' ', sp2 + 1) != std::string_view::npos)
        return refuse(400, "bad_request", "the request line is not 'METHOD TARGET HTTP/1.1'");
      const std::string_view target = text.substr(sp1 + 1, sp2 - sp1 - 1);
      for (char c : target)
        if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f)
          return refuse(400, "bad_request", "the request target holds a control character");
      const std::string_view version = text.substr(sp2 + 1);
      if (version != "HTTP/1.1" && version != "HTTP/1.0")
        return refuse(version.rfind("HTTP/", 0) == 0 ? 505 : 400, "unsupported_http_version",
                      "this server speaks HTTP/1.1 and 1.0, not " + quoted(version));
      continue;
    }
    if (line.size() == 2) return end_of_head();
    if (const FramerState s = head_line(line); s == FramerState::kRefused) return s;
  }
}

FramerState RequestFramer::head_line(std::string_view line) {
  const std::string_view text = line.substr(0, line.size() - 2);
  if (text.front() == ' ' || text.front() == '\t')
    return refuse(400, "bad_request", "a header field is folded over lines (obsolete line folding is refused)");
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos || colon == 0)
    return refuse(400, "bad_request", "a header line has no 'name: value' form: " + quoted(text));
  const std::string_view name = text.substr(0, colon);
  for (char c : name)
    if (!is_tchar(c)) return refuse(400, "bad_request", "a header name holds a character a name may not: " + quoted(name));
  const std::string_view value = trim(text.substr(colon + 1));
  for (char c : value)
    if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f)
      return refuse(400, "bad_request", "the value of header " + std::string(name) + " holds a control character");
  if (iequals(name, "Content-Length")) {
    if (++content_lengths_ > 1)
      return refuse(400, "invalid_content_length", "the request has more than one Content-Length header");
    if (value.empty() || value.size() > 19 || !std::all_of(value.begin(), value.end(), [](char c) {
          return c >= '0' && c <= '9';
        }))
      return refuse(400, "invalid_content_length",
                    "Content-Length must be a non-negative decimal number of bytes, got " + quoted(value));
    uint64_t n = 0;
    for (char c : value) n = n * 10 + static_cast<uint64_t>(c - '0');
    content_length_ = n;
  } else if (iequals(name, "Transfer-Encoding")) {
    if (++transfer_encodings_ > 1)
      return refuse(400, "invalid_transfer_encoding", "the request has more than one Transfer-Encoding header");
    if (!iequals(value, "chunked"))
      return refuse(400, "invalid_transfer_encoding",
                    "Transfer-Encoding " + quoted(value) + " is not supported; send chunked, or a Content-Length");
    chunked_ = true;
  } else if (iequals(name, "Expect")) {
    if (expect_end_ != 0) return refuse(400, "bad_request", "the request has more than one Expect header");
    if (!iequals(value, "100-continue"))
      return refuse(417, "expectation_failed", "Expect " + quoted(value) + " is not supported (only 100-continue)");
    expect_begin_ = static_cast<size_t>(line.data() - buf_.data());
    expect_end_ = expect_begin_ + line.size();
  }
  return FramerState::kNeedMore;
}

FramerState RequestFramer::end_of_head() {
  if (chunked_ && content_length_)
    return refuse(400, "invalid_content_length",
                  "the request has both Content-Length and Transfer-Encoding: chunked; send one of them");
  if (content_length_ && *content_length_ > limits_.max_body_bytes)
    return refuse(413, "request_too_large",
                  "the request body (" + std::to_string(*content_length_) + " bytes) is larger than the limit of " +
                      std::to_string(limits_.max_body_bytes) + " bytes");
  head_end_ = pos_;
  if (expect_end_ != 0) {
    buf_.erase(expect_begin_, expect_end_ - expect_begin_);
    head_end_ -= expect_end_ - expect_begin_;
    pos_ = head_end_;
  }
  const bool has_body = chunked_ || (content_length_ && *content_length_ > 0);
  expect_continue_ = expect_end_ != 0 && has_body;
  if (chunked_) {
    stage_ = Stage::kChunkSize;
  } else if (has_body) {
    stage_ = Stage::kBody;
  } else {
    stage_ = Stage::kDone;
    request_end_ = head_end_;
  }
  return FramerState::kNeedMore;
}

FramerState RequestFramer::body_bytes(std::string_view bytes) {
  body_bytes_ += bytes.size();
  if (limits_.max_json_depth > 0 && !depth_.feed(bytes))
    return refuse(400, "json_too_deep", "the request body: " + json_too_deep_message(limits_.max_json_depth));
  return FramerState::kNeedMore;
}

FramerState RequestFramer::parse_body() {
  for (;;) {
    switch (stage_) {
      case Stage::kBody: {
        const size_t end = head_end_ + static_cast<size_t>(*content_length_);
        const size_t upto = std::min(end, buf_.size());
        if (upto > pos_) {
          if (body_bytes(std::string_view(buf_).substr(pos_, upto - pos_)) == FramerState::kRefused)
            return FramerState::kRefused;
          pos_ = upto;
        }
        if (pos_ < end) return FramerState::kNeedMore;
        request_end_ = end;
        stage_ = Stage::kDone;
        break;
      }
      case Stage::kChunkSize: {
        const size_t nl = buf_.find('\n', pos_);
        if (nl == std::string::npos) {
          if (buf_.size() - pos_ > kMaxChunkLineBytes)
            return refuse(400, "bad_request", "a chunk-size line of the chunked body is too long");
          return FramerState::kNeedMore;
        }
        const std::string_view line(buf_.data() + pos_, nl + 1 - pos_);
        if (line.size() > kMaxChunkLineBytes)
          return refuse(400, "bad_request", "a chunk-size line of the chunked body is too long");
        if (line.size() < 3 || line[line.size() - 2] != '\r')
          return refuse(400, "bad_request", "a chunk-size line of the chunked body does not end in CRLF");
        const std::string_view text = line.substr(0, line.size() - 2);
        size_t digits = 0;
        uint64_t size = 0;
        for (; digits < text.size() && hex_value(text[digits]) >= 0; ++digits) {
          if (digits == 15) return refuse(400, "bad_request", "a chunk size of the chunked body has too many digits");
          size = size * 16 + static_cast<uint64_t>(hex_value(text[digits]));
        }
        if (digits == 0) return refuse(400, "bad_request", "a chunk of the chunked body has no hexadecimal size");
        if (digits < text.size()) {
          // Only a chunk extension may follow: ";name[=value]", printable.
          if (text[digits] != ';')
            return refuse(400, "bad_request", "a chunk size of the chunked body is not hexadecimal: " + quoted(text));
          for (char c : text.substr(digits))
            if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
              return refuse(400, "bad_request", "a chunk extension holds a control character");
        }
        if (size > limits_.max_body_bytes - std::min<uint64_t>(body_bytes_, limits_.max_body_bytes))
          return refuse(413, "request_too_large",
                        "the chunked request body is larger than the limit of " +
                            std::to_string(limits_.max_body_bytes) + " bytes");
        pos_ = nl + 1;
        chunk_left_ = size;
        stage_ = size == 0 ? Stage::kChunkTrailer : Stage::kChunkData;
        break;
      }
      case Stage::kChunkData: {
        const size_t avail = buf_.size() - pos_;
        const size_t take = static_cast<size_t>(std::min<uint64_t>(chunk_left_, avail));
        if (take > 0) {
          if (body_bytes(std::string_view(buf_).substr(pos_, take)) == FramerState::kRefused)
            return FramerState::kRefused;
          pos_ += take;
          chunk_left_ -= take;
        }
        if (chunk_left_ > 0) return FramerState::kNeedMore;
        stage_ = Stage::kChunkDataEnd;
        break;
      }
      case Stage::kChunkDataEnd:
      case Stage::kChunkTrailer: {
        if (buf_.size() - pos_ < 2) return FramerState::kNeedMore;
        if (buf_[pos_] != '\r' || buf_[pos_ + 1] != '\n')
          return refuse(400, "bad_request",
                        stage_ == Stage::kChunkTrailer
                            ? "the chunked body has trailer fields after its last chunk, which are not supported"
                            : "a chunk of the chunked body is longer than its size says");
        pos_ += 2;
        if (stage_ == Stage::kChunkTrailer) {
          request_end_ = pos_;
          stage_ = Stage::kDone;
        } else {
          stage_ = Stage::kChunkSize;
        }
        break;
      }
      case Stage::kDone:
        return FramerState::kComplete;
      case Stage::kHead:
      case Stage::kRefused:
        return FramerState::kRefused;
    }
  }
}

std::string RequestFramer::take_request() {
  if (stage_ != Stage::kDone) return {};
  std::string request = buf_.substr(0, request_end_);
  buf_.erase(0, request_end_);
  const FramerLimits limits = limits_;
  std::string rest = std::move(buf_);
  *this = RequestFramer(limits);
  buf_ = std::move(rest);
  return request;
}

}  // namespace siesta
