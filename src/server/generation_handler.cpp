#include "server/generation_handler.h"

#include <chrono>
#include <ctime>
#include <memory>

#include "common/log.h"
#include "server/connection_probe.h"
#include "server/openai_request.h"
#include "server/openai_response.h"

namespace siesta::server {
namespace {

using Clock = std::chrono::steady_clock;

std::string sse(const nlohmann::json& j) { return "data: " + dump_json(j) + "\n\n"; }

// One streaming response: what the content provider needs between its calls.
struct StreamingSession {
  StreamingSession(GenerationJob j, OutputStream s, std::string id, const ServerContext& ctx, ConnectionProbe p)
      : job(std::move(j)),
        stream(std::move(s)),
        response(job, std::move(id), ctx.options.served_model_name, std::time(nullptr), ctx.engine.tokenizer()),
        probe(p) {}

  GenerationJob job;
  OutputStream stream;
  OpenAiResponse response;
  ConnectionProbe probe;
  bool started = false;
  bool done = false;
};

bool write(httplib::DataSink& sink, const std::string& s) {
  return sink.is_writable() && sink.write(s.data(), s.size());
}

void answer_streaming(ServerContext& ctx, std::shared_ptr<StreamingSession> session, httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [&ctx, session](size_t, httplib::DataSink& sink) -> bool {
        StreamingSession& s = *session;
        if (s.done) {
          sink.done();
          return true;
        }
        const std::vector<IndexedDelta> deltas = s.stream.next(Clock::now() + ctx.options.client_poll_interval);
        // The role chunk goes with the first token, as vLLM sends it (a client
        // timing its first chunk measures the first token).
        if (!s.started && (!deltas.empty() || s.stream.finished())) {
          s.started = true;
          for (const nlohmann::json& c : s.response.start_chunks())
            if (!write(sink, sse(c))) return false;
        }
        for (const IndexedDelta& d : deltas)
          for (const nlohmann::json& c : s.response.chunks(d))
            if (!write(sink, sse(c))) return false;
        if (s.stream.finished()) {
          if (const auto& err = s.response.error()) {
            if (!write(sink, sse(ApiError::from_status(*err).to_json()))) return false;
          }
          if (s.job.include_usage && !write(sink, sse(s.response.usage_chunk()))) return false;
          if (!write(sink, "data: [DONE]\n\n")) return false;
          s.done = true;
          sink.done();
          return true;
        }
        // Gone: returning false ends the response; the releaser aborts.
        return !ctx.stopping.load() && !s.probe.client_gone();
      },
      [session](bool success) {
        if (!success) session->stream.abort();
      });
}

void answer_whole(ServerContext& ctx, GenerationJob& job, OutputStream& stream, const std::string& id,
                  const ConnectionProbe& probe, httplib::Response& res) {
  OpenAiResponse response(job, id, ctx.options.served_model_name, std::time(nullptr), ctx.engine.tokenizer());
  while (!stream.finished()) {
    for (const IndexedDelta& d : stream.next(Clock::now() + ctx.options.client_poll_interval)) response.add(d);
    if (ctx.stopping.load()) {
      stream.abort();
      send_error(res, ApiError{503, "service_unavailable", "shutting_down", "the server is shutting down", {}});
      return;
    }
    if (probe.client_gone()) {
      stream.abort();
      SIESTA_LOG_INFO("server: client of {} disconnected; request aborted", id);
      res.status = 499;  // nobody reads it
      return;
    }
  }
  if (const auto& err = response.error()) {
    send_error(res, ApiError::from_status(*err));
    return;
  }
  send_json(res, 200, response.response());
}

}  // namespace

void handle_generation(ServerContext& ctx, ApiKind kind, const httplib::Request& req, const std::string& text,
                       httplib::Response& res) {
  nlohmann::json body;
  if (!parse_json_body(text, res, body) || !check_model(ctx, body, res)) return;
  const RequestContext rc = request_context(ctx);
  Result<GenerationJob> job = internal_error("unreachable");
  if (kind == ApiKind::kChat) {
    if (!ctx.chat_template)
      return send_error(res, ApiError{500, "server_error", "chat_template_unavailable", ctx.chat_template_error, {}});
    // Objects in the client's order: tools reach the template (and its tojson) as sent.
    const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    job = parse_chat_request(body, ordered, rc);
  } else {
    job = parse_completion_request(body, rc);
  }
  if (!job) {
    send_error(res, ApiError::from_status(job.error()));
    return;
  }
  // The response id, as vLLM names it: the X-Request-Id header, else the
  // body's request_id, else random. Engine request ids stay unique whatever
  // the client reuses.
  const char* prefix = kind == ApiKind::kChat ? "chatcmpl-" : "cmpl-";
  const std::string header_id = req.get_header_value("X-Request-Id");
  const std::string id = !header_id.empty() ? prefix + header_id
                         : job->request_id   ? prefix + *job->request_id
                                             : random_id(prefix);
  assign_request_ids(*job, random_id(prefix));
  // P/D: both legs of a disaggregated request carry the proxy's X-Request-Id;
  // the engines name the request's KV by it and the choice index.
  const std::string x_request_id = req.get_header_value("X-Request-Id");
  for (size_t i = 0; i < job->requests.size(); ++i) {
    job->requests[i].x_request_id = x_request_id;
    job->requests[i].choice_index = static_cast<int32_t>(i);
  }
  Result<OutputStream> stream = ctx.engine.submit(job->requests);
  if (!stream) {
    send_error(res, ApiError::from_status(stream.error()));
    return;
  }
  const ConnectionProbe probe = ConnectionProbe::find(req.local_port, req.remote_addr, req.remote_port);
  if (job->stream) {
    answer_streaming(ctx, std::make_shared<StreamingSession>(std::move(*job), std::move(*stream), id, ctx, probe), res);
    return;
  }
  answer_whole(ctx, *job, *stream, id, probe, res);
}

}  // namespace siesta::server
