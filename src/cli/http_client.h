// HttpClient: a blocking HTTP/1.1 client of one server (cpp-httplib), for
// the CLI's benchmarks. Keeps its connection alive between calls.
//
//   SIESTA_ASSIGN_OR_RETURN(HttpClient c, HttpClient::create("http://127.0.0.1:8000", timeout));
//   Result<HttpReply> r = c.get("/v1/models");
//   Result<HttpReply> s = c.post_events("/v1/completions", body, [](std::string_view data) { ...; return true; });
//
// post_events reads a server-sent-event stream: on_data gets the payload of
// every `data:` line as it arrives (return false to stop reading). Every
// call is bounded by the timeout given at creation (connect, and each read
// or write). Connections set TCP_NODELAY. One instance per thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace httplib {
class Client;
}

namespace siesta::cli {

struct HttpReply {
  int status = 0;
  std::string body;   // for post_events: what was not part of an event (an error body)
  std::vector<std::pair<std::string, std::string>> headers;  // post_events: the answer's headers
  // The value of header `name` (case-insensitive), or empty.
  std::string header(std::string_view name) const;
};

class HttpClient {
 public:
  // base_url: "http://HOST:PORT" (or https). api_key: sent as a bearer token when not empty.
  static Result<HttpClient> create(const std::string& base_url, std::chrono::seconds timeout,
                                   const std::string& api_key = {});
  HttpClient(HttpClient&&) noexcept;
  HttpClient& operator=(HttpClient&&) noexcept;
  ~HttpClient();

  Result<HttpReply> get(const std::string& path);
  Result<HttpReply> post_json(const std::string& path, const std::string& body);
  Result<HttpReply> post_events(const std::string& path, const std::string& body,
                                const std::function<bool(std::string_view data)>& on_data);

 private:
  HttpClient(std::unique_ptr<httplib::Client> client, std::string base_url);
  std::unique_ptr<httplib::Client> client_;
  std::string base_url_;
};

}  // namespace siesta::cli
