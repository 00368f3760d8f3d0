#include "cli/http_client.h"

#include <cctype>

#include <httplib.h>

namespace siesta::cli {
namespace {

Status transport_error(const std::string& base, const std::string& path, httplib::Error e) {
  return unavailable(base + path + ": " + httplib::to_string(e));
}

}  // namespace

Result<HttpClient> HttpClient::create(const std::string& base_url, std::chrono::seconds timeout,
                                      const std::string& api_key) {
  if (base_url.rfind("http://", 0) != 0 && base_url.rfind("https://", 0) != 0)
    return invalid_argument("the server URL must start with http:// or https:// (got '" + base_url + "')");
  std::string base = base_url;
  while (!base.empty() && base.back() == '/') base.pop_back();
  auto client = std::make_unique<httplib::Client>(base);
  if (!client->is_valid()) return invalid_argument("cannot use '" + base_url + "' as a server address");
  client->set_connection_timeout(timeout);
  client->set_read_timeout(timeout);
  client->set_write_timeout(timeout);
  client->set_keep_alive(true);
  // Without it a small request body waits for the previous segment's ACK
  // (Nagle with delayed ACKs): ~40 ms on every request's TTFT.
  client->set_tcp_nodelay(true);
  if (!api_key.empty()) client->set_bearer_token_auth(api_key);
  return HttpClient(std::move(client), base);
}

HttpClient::HttpClient(std::unique_ptr<httplib::Client> client, std::string base_url)
    : client_(std::move(client)), base_url_(std::move(base_url)) {}
HttpClient::HttpClient(HttpClient&&) noexcept = default;
HttpClient& HttpClient::operator=(HttpClient&&) noexcept = default;
HttpClient::~HttpClient() = default;

Result<HttpReply> HttpClient::get(const std::string& path) {
  httplib::Result r = client_->Get(path);
  if (!r) return transport_error(base_url_, path, r.error());
  return HttpReply{r->status, r->body};
}

Result<HttpReply> HttpClient::post_json(const std::string& path, const std::string& body) {
  httplib::Result r = client_->Post(path, body, "application/json");
  if (!r) return transport_error(base_url_, path, r.error());
  return HttpReply{r->status, r->body};
}

Result<HttpReply> HttpClient::post_events(const std::string& path, const std::string& body,
                                          const std::function<bool(std::string_view)>& on_data) {
  std::string pending;
  std::string other;
  bool stopped = false;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.set_header("Accept", "text/event-stream");
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    pending.append(data, len);
    size_t start = 0;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::string_view line(pending.data() + start, nl - start);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.rfind("data:", 0) == 0) {
        line.remove_prefix(5);
        if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
        if (!on_data(line)) {
          stopped = true;
          return false;
        }
      } else if (!line.empty() && line.front() != ':') {
        other.append(line).push_back('\n');
      }
    }
    pending.erase(0, start);
    return true;
  };
  std::vector<std::pair<std::string, std::string>> headers;
  req.response_handler = [&](const httplib::Response& res) {
    for (const auto& [k, v] : res.headers) headers.emplace_back(k, v);
    return true;
  };
  httplib::Result r = client_->send(req);
  if (!r && !(stopped && r.error() == httplib::Error::Canceled)) return transport_error(base_url_, path, r.error());
  HttpReply reply;
  reply.status = r ? r->status : 200;
  reply.body = other + pending;
  reply.headers = std::move(headers);
  return reply;
}

std::string HttpReply::header(std::string_view name) const {
  auto lower = [](std::string_view t) {
    std::string out(t);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  };
  const std::string want = lower(name);
  for (const auto& [k, v] : headers)
    if (lower(k) == want) return v;
  return {};
}

}  // namespace siesta::cli
