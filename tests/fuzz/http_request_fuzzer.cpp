// libFuzzer target: what a client sends to `siesta serve` or `siesta proxy`
// goes first through RequestFramer (common/http_request_framer.h). Fed in
// random pieces, it must never crash or leak, a refusal must say why, and
// every request it frames must frame again to the same bytes and be read by
// cpp-httplib (which parses it after the intake) to exactly its end: the two
// never disagree on where a request stops.
#include <httplib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "common/http_request_framer.h"

using namespace siesta;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

// The request as httplib reads it; answers are dropped.
class BytesStream : public httplib::Stream {
 public:
  explicit BytesStream(const std::string& bytes) : bytes_(bytes) {}
  bool is_readable() const override { return pos_ < bytes_.size(); }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, bytes_.size() - pos_);
    std::memcpy(ptr, bytes_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char*, size_t size) override { return static_cast<ssize_t>(size); }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 1;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 2;
  }
  socket_t socket() const override { return -1; }
  size_t consumed() const { return pos_; }

 private:
  const std::string& bytes_;
  size_t pos_ = 0;
};

// Routes that read the whole body, as siesta's handlers do.
class Reader : public httplib::Server {
 public:
  Reader() {
    Post(".*", [this](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& read) {
      read_ok = read([](const char*, size_t) { return true; });
      res.status = 200;
    });
    Get(".*", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  }
  // Whether httplib read exactly `request`.
  bool reads_to_the_end(const std::string& request) {
    BytesStream stream(request);
    bool closed = false;
    read_ok = false;  // set when a handler reads the body whole
    process_request(stream, true, closed, nullptr);
    return stream.consumed() == request.size();
  }
  bool read_ok = false;
};

Reader& reader() {
  static Reader* r = new Reader();  // lives as long as the fuzzer
  return *r;
}

void check_framed(const std::string& request, const FramerLimits& limits) {
  require(!request.empty() && request[0] >= 'A' && request[0] <= 'Z');
  require(request.find("\r\n\r\n") != std::string::npos);
  RequestFramer again(limits);
  again.append(request);
  require(again.advance() == FramerState::kComplete);
  require(again.take_request() == request);
  require(again.buffered() == 0);
  // httplib frames it the same way: a POST whose body it reads, it reads
  // exactly to the end (a body it refuses, a multipart one without a
  // boundary, or a GET's, it leaves; the intake drops the rest).
  if (request.rfind("POST ", 0) == 0) {
    const bool to_the_end = reader().reads_to_the_end(request);
    if (reader().read_ok) require(to_the_end);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  FramerLimits limits;
  limits.max_head_bytes = 64 + static_cast<size_t>(data[0]) * 8;
  limits.max_body_bytes = 16 + static_cast<size_t>(data[1]) * 16;
  limits.max_json_depth = data[0] % 9;
  const std::string_view in(reinterpret_cast<const char*>(data) + 2, size - 2);
  RequestFramer framer(limits);
  uint32_t seed = data[1];
  size_t pos = 0;
  while (pos < in.size()) {
    seed = seed * 1103515245u + 12345u;
    const size_t n = std::min<size_t>(1 + (seed >> 16) % 64, in.size() - pos);
    framer.append(in.substr(pos, n));
    pos += n;
    for (;;) {
      const FramerState state = framer.advance();
      if (state == FramerState::kComplete) {
        check_framed(framer.take_request(), limits);
        continue;
      }
      if (state == FramerState::kRefused) {
        const FramerRefusal& r = framer.refusal();
        require(!r.message.empty() && !r.code.empty() && r.status >= 400 && r.status < 600);
        require(framer.advance() == FramerState::kRefused);
        return 0;
      }
      break;
    }
  }
  return 0;
}
