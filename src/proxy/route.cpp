#include "proxy/route.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/log.h"
#include "common/http_server.h"
#include "common/json_depth.h"
#include "proxy/leg.h"
#include "proxy/openai_error.h"

namespace siesta::proxy {
namespace {

using nlohmann::json;

// What ends a wait besides its leg: the client hanging up, or the proxy
// stopping. Copyable, so the streaming provider keeps one after the handler
// has returned.
struct Watch {
  const std::atomic<bool>* stopping = nullptr;
  std::shared_ptr<std::atomic<bool>> client_gone = std::make_shared<std::atomic<bool>>(false);

  Interrupt interrupt() const {
    return [stopping = stopping, gone = client_gone]() -> std::optional<Status> {
      if (stopping->load()) return unavailable("the proxy is stopping");
      if (HttpServer::client_hung_up()) {
        gone->store(true);
        return unavailable("the client disconnected");
      }
      return std::nullopt;
    };
  }
};

std::string excerpt(const std::string& body) {
  constexpr size_t kMax = 200;
  return body.size() <= kMax ? body : body.substr(0, kMax) + "...";
}

std::string json_or(const std::string& content_type) {
  return content_type.empty() ? "application/json" : content_type;
}

// The decode leg's answer as a stream of SSE chunks, fed to httplib's chunked
// content provider one chunk per call.
struct DecodeStream {
  RouteContext ctx;
  Pick decode;
  Watch watch;
  std::unique_ptr<Leg> leg;

  bool provide(httplib::DataSink& sink) {
    Result<std::optional<std::string>> piece = leg->next_chunk(watch.interrupt());
    if (!piece) {
      leg->cancel();
      if (watch.client_gone->load()) {
        ctx.metrics->count_client_disconnect();
        return false;
      }
      if (!ctx.stopping->load()) {
        ctx.decode->record_failure(decode.index, piece.error().message);
        ctx.metrics->count_decode_failure();
      }
      SIESTA_LOG_WARN("proxy: decode instance {} failed mid-stream: {}", decode.url.text, piece.error().message);
      const std::string event =
          "data: " +
          openai_error_body(502, error_code::kDecodeFailed,
                            "decode instance " + decode.url.text + " failed mid-stream: " + piece.error().message) +
          "\n\ndata: [DONE]\n\n";
      sink.write(event.data(), event.size());
      sink.done();
      return true;
    }
    if (!piece->has_value()) {
      sink.done();
      return true;
    }
    const std::string& data = **piece;
    if (!sink.write(data.data(), data.size())) {
      leg->cancel();
      ctx.metrics->count_client_disconnect();
      return false;
    }
    return true;
  }
};

struct Acquired {
  std::optional<Pick> pick;
  double waited_s = 0;  // for a wake
  int status = 503;     // when no pick
  std::string_view code;
  std::string message;
};

// An instance of `set` that can serve, waking one when every instance up is
// asleep and the proxy wakes on demand.
Acquired acquire(const RouteContext& ctx, InstanceSet& set, std::optional<uint64_t> affinity,
                 const Interrupt& interrupt) {
  Acquired a;
  const ProxyConfig& cfg = *ctx.config;
  std::optional<Clock::time_point> started;
  for (;;) {
    if ((a.pick = set.pick(affinity))) {
      if (started) {
        a.waited_s = std::chrono::duration<double>(Clock::now() - *started).count();
        ctx.metrics->record_wake_wait(set.role(), a.waited_s);
      }
      return a;
    }
    if (!cfg.wake_on_demand) {
      // Nothing serves: an engine asleep or paused holds the request until
      // whoever put it to sleep wakes it (or its own deadline answers 503).
      if ((a.pick = set.pick_holding())) return a;
    }
    if (!cfg.wake_on_demand || !set.can_wake()) {
      a.code = error_code::kNoInstanceUp;
      a.message = set.describe_none_up();
      return a;
    }
    const Clock::time_point now = Clock::now();
    if (!started) started = now;
    if (now - *started >= cfg.wake_timeout) {
      ctx.metrics->count_wake_timeout(set.role());
      a.code = error_code::kWakeTimeout;
      a.message = fmt::format("no {} instance woke up within --wake-timeout-s ({:.1f} s): {}", role_name(set.role()),
                              std::chrono::duration<double>(cfg.wake_timeout).count(), set.describe_none_up());
      return a;
    }
    if (std::optional<Status> stop = interrupt()) {
      a.status = 0;  // the caller's watch answers
      return a;
    }
    ctx.sleep->wake_one(set);
    set.wait_for_change(std::min(now + std::chrono::milliseconds(50), *started + cfg.wake_timeout));
  }
}

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::optional<uint64_t> prefix_affinity(const json& body, size_t chars) {
  if (chars == 0) return std::nullopt;
  std::string text;
  if (auto p = body.find("prompt"); p != body.end()) {
    text = p->is_string() ? p->get<std::string>() : p->dump();
  } else if (auto m = body.find("messages"); m != body.end()) {
    text = m->dump();
  }
  if (text.size() < chars) return std::nullopt;
  return fnv1a64(std::string_view(text).substr(0, chars));
}

void reply_error(httplib::Response& res, int status, std::string_view code, const std::string& message,
                 const std::string& param) {
  res.status = status;
  res.set_content(openai_error_body(status, code, message, param), "application/json");
}

namespace {

// One try of a request through one prefill and one decode instance. Returns
// true when it failed before anything reached the client, at an instance
// that is now marked down (a broken connection, no answer in time, HTTP 5xx,
// bad kv_transfer_params): another pair may serve it. `res` holds the answer
// either way.
bool route_once(const RouteContext& ctx, Endpoint endpoint, const json& body, bool stream,
                const std::string& request_id, const Watch& watch, httplib::Response& res) {
  const ProxyConfig& cfg = *ctx.config;
  const Interrupt interrupt = watch.interrupt();
  // Ends a request that lost its client or its proxy; true when it did.
  auto ended_by_watch = [&]() {
    if (watch.client_gone->load()) {
      ctx.metrics->count_client_disconnect();
      SIESTA_LOG_INFO("proxy: request {}: the client disconnected; legs closed", request_id);
      res.status = 499;
      return true;
    }
    if (ctx.stopping->load()) {
      reply_error(res, 503, error_code::kProxyStopping, "the proxy is stopping");
      return true;
    }
    return false;
  };

  // 2. The instances.
  Acquired p_got = acquire(ctx, *ctx.prefill, prefix_affinity(body, cfg.prefix_affinity_chars), interrupt);
  if (!p_got.pick) {
    if (p_got.status == 0 && ended_by_watch()) return false;
    reply_error(res, 503, p_got.code.empty() ? error_code::kNoInstanceUp : p_got.code, p_got.message);
    return false;
  }
  const std::optional<Pick> p = std::move(p_got.pick);
  res.set_header("x-siesta-prefill", p->url.text);
  Acquired d_got = acquire(ctx, *ctx.decode, std::nullopt, interrupt);
  if (!d_got.pick) {
    if (d_got.status == 0 && ended_by_watch()) return false;
    reply_error(res, 503, d_got.code.empty() ? error_code::kNoInstanceUp : d_got.code, d_got.message);
    return false;
  }
  const std::optional<Pick> d = std::move(d_got.pick);
  res.set_header("x-siesta-decode", d->url.text);
  const double waited_s = p_got.waited_s + d_got.waited_s;
  if (waited_s > 0) res.set_header("x-siesta-wake-wait-ms", std::to_string(static_cast<int64_t>(waited_s * 1000)));

  std::vector<std::pair<std::string, std::string>> headers = {{"X-Request-Id", request_id}};
  if (!cfg.api_key.empty()) headers.emplace_back("Authorization", "Bearer " + cfg.api_key);
  const std::string path = endpoint_path(endpoint);
  const bool sequential = cfg.mode == ProxyMode::kSequential;
  const LegLimits prefill_limits{cfg.connect_timeout, cfg.timeout, cfg.timeout};
  // In concurrent mode decode hears nothing before prefill answered: it may
  // wait for prefill's deadline, then for its own.
  const LegLimits decode_limits{cfg.connect_timeout, cfg.timeout, std::nullopt,
                                sequential ? std::chrono::milliseconds(0) : cfg.timeout};

  // 3. The legs.
  std::unique_ptr<Leg> prefill_leg = Leg::start(
      p->url, {"POST", path, prefill_request_body(body, endpoint).dump(), "application/json", headers}, prefill_limits);
  std::unique_ptr<Leg> decode_leg;
  if (!sequential) {
    decode_leg = Leg::start(d->url,
                            {"POST", path, decode_request_body_concurrent(body, request_id, p->url.text).dump(),
                             "application/json", headers},
                            decode_limits);
  }

  auto decode_failed = [&](const Status& why) {
    ctx.decode->record_failure(d->index, why.message);
    ctx.metrics->count_decode_failure();
    SIESTA_LOG_WARN("proxy: request {}: decode instance {} failed: {}", request_id, d->url.text, why.message);
    reply_error(res, 502, error_code::kDecodeFailed, "decode instance " + d->url.text + " failed: " + why.message);
    return true;
  };
  auto prefill_failed = [&](const std::string& why) {
    if (decode_leg) decode_leg->cancel();
    ctx.prefill->record_failure(p->index, why);
    ctx.metrics->count_prefill_failure();
    SIESTA_LOG_WARN("proxy: request {}: prefill instance {} failed: {}", request_id, p->url.text, why);
    reply_error(res, 502, error_code::kPrefillFailed, "prefill instance " + p->url.text + " failed: " + why);
    return true;
  };

  // 4. Prefill's answer; in concurrent mode a decode leg that fails first ends the wait.
  Leg* concurrent_decode = decode_leg.get();
  const Interrupt prefill_interrupt = [&]() -> std::optional<Status> {
    if (std::optional<Status> stop = interrupt()) return stop;
    if (concurrent_decode && concurrent_decode->failed()) return unavailable("the decode leg failed");
    return std::nullopt;
  };
  Result<LegHead> p_head = prefill_leg->wait_head(prefill_interrupt);
  Result<std::string> p_body = p_head ? prefill_leg->wait_body(prefill_interrupt) : Result<std::string>(p_head.error());
  if (!p_head || !p_body) {
    // Whether decode failed first, read before cancelling it (which fails it too).
    const bool decode_failed_first = decode_leg && decode_leg->failed();
    prefill_leg->cancel();
    if (decode_leg) decode_leg->cancel();
    if (ended_by_watch()) return false;
    if (decode_failed_first) {
      Result<LegHead> why = decode_leg->wait_head(nullptr);
      return decode_failed(why ? unavailable("the decode leg failed") : why.error());
    }
    return prefill_failed(p_head ? p_body.error().message : p_head.error().message);
  }
  if ((p_head->status >= 400 && p_head->status < 500) || p_head->status == 503) {
    // The instance refused the request itself (bad input), or said it cannot
    // serve it now (503: aborted by a pause, held too long while asleep): its
    // answer, passed on; the instance stays up.
    if (decode_leg) decode_leg->cancel();
    ctx.metrics->count_prefill_failure();
    res.status = p_head->status;
    res.set_content(*p_body, json_or(p_head->content_type));
    return false;
  }
  if (p_head->status != 200)
    return prefill_failed("answered HTTP " + std::to_string(p_head->status) + ": " + excerpt(*p_body));
  if (prefill_answer_aborted(*p_body)) {
    // P aborted the request (paused or put to sleep with mode=abort): an
    // answer, not a failure of P; nothing was generated yet.
    if (decode_leg) decode_leg->cancel();
    ctx.metrics->count_prefill_failure();
    SIESTA_LOG_INFO("proxy: request {}: prefill instance {} aborted it", request_id, p->url.text);
    reply_error(res, 503, error_code::kPrefillAborted,
                "prefill instance " + p->url.text + " aborted the request (it was paused or put to sleep with "
                "mode=abort); send it again");
    return false;
  }
  Result<json> params = prefill_kv_transfer_params(*p_body, sequential);
  if (!params) return prefill_failed(params.error().message);
  prefill_leg.reset();

  // 5. The decode leg in sequential mode; in concurrent mode its own time to answer starts now.
  if (sequential) {
    decode_leg = Leg::start(
        d->url, {"POST", path, decode_request_body_sequential(body, *params).dump(), "application/json", headers},
        decode_limits);
  } else {
    decode_leg->upstream_done();
  }

  // 6. Decode's answer.
  Result<LegHead> d_head = decode_leg->wait_head(interrupt);
  if (!d_head) {
    decode_leg->cancel();
    if (ended_by_watch()) return false;
    return decode_failed(d_head.error());
  }
  if (!stream || d_head->status != 200) {
    Result<std::string> d_body = decode_leg->wait_body(interrupt);
    if (!d_body) {
      decode_leg->cancel();
      if (ended_by_watch()) return false;
      return decode_failed(d_body.error());
    }
    res.status = d_head->status;
    res.set_content(*d_body, json_or(d_head->content_type));
    if (d_head->status >= 500 && d_head->status != 503) {
      ctx.decode->record_failure(d->index, "answered HTTP " + std::to_string(d_head->status));
      ctx.metrics->count_decode_failure();
      return true;
    }
    return false;
  }
  auto decode_stream = std::make_shared<DecodeStream>(DecodeStream{ctx, *d, watch, std::move(decode_leg)});
  // Exactly text/event-stream: httplib never compresses that type, so chunks
  // leave as they arrive.
  res.set_chunked_content_provider(
      "text/event-stream",
      [decode_stream](size_t /*offset*/, httplib::DataSink& sink) { return decode_stream->provide(sink); },
      [decode_stream](bool success) {
        if (!success) decode_stream->leg->cancel();
      });
  return false;
}

}  // namespace

void serve_generate(const RouteContext& ctx, Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
  ctx.metrics->count_request(endpoint);

  // 1. The client's body.
  // The intake refused bodies nested deeper than the configured depth; this holds where it did not.
  Result<json> parsed = parse_json(req.body, kMaxJsonDepthLimit);
  if (!parsed && parsed.error().code == ErrorCode::kInvalidArgument)
    return reply_error(res, 400, error_code::kJsonTooDeep, "the request body: " + parsed.error().message);
  if (!parsed || !parsed->is_object())
    return reply_error(res, 400, error_code::kInvalidJson, "the request body is not a JSON object");
  const json body = std::move(*parsed);
  bool stream = false;
  if (auto it = body.find("stream"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean())
      return reply_error(res, 400, error_code::kInvalidValue, "\"stream\" must be true or false", "stream");
    stream = it->get<bool>();
  }
  const std::string request_id = ctx.ids->choose(req.get_header_value("X-Request-Id"));
  res.set_header("X-Request-Id", request_id);

  // Steps 2-6, once more on other instances when the first try failed before
  // anything reached the client at an instance now marked down. The retry
  // names the request between the engines by a fresh id: the failed pair
  // may still hold state under the first.
  const Watch watch{ctx.stopping};
  std::string leg_id = request_id;
  for (int attempt = 0;; ++attempt) {
    const bool retry = route_once(ctx, endpoint, body, stream, leg_id, watch, res);
    if (!retry || attempt >= ctx.config->retries) return;
    SIESTA_LOG_INFO("proxy: request {}: trying again on other instances ({})", request_id, res.body.substr(0, 200));
    ctx.metrics->count_retry();
    res.status = -1;
    res.headers.clear();
    res.body.clear();
    res.set_header("X-Request-Id", request_id);
    leg_id = ctx.ids->next();
  }
}

}  // namespace siesta::proxy
