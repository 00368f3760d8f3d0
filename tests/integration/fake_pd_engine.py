"""A fake vLLM-compatible engine for testing `siesta proxy` (standard library only).

FakeEngine plays a prefill (P) or decode (D) instance on 127.0.0.1 in the test's
own process: it records every request it receives and answers like vLLM with
kv_transfer_params. Its behaviour is switched by attributes:

  behavior     "ok" | "fail" (HTTP 500) | "bad_request" (HTTP 400) | "hang" (never
               answers, until the client disconnects) | "garbage" (200, not JSON) |
               "no_params" (200 JSON without kv_transfer_params) | "cut_stream" (D: streams
               two chunks, then closes the connection mid-stream)
  healthy      /health answers 200 when True, 503 otherwise
  delay_s      wait this long before answering (or failing); a client that
               disconnects meanwhile is recorded in `disconnects`
  stream_chunks, chunk_gap_s, stream_gate
               D streaming: how many SSE data chunks, the pause between them, and
               an optional threading.Event that the first chunk waits for (to
               prove the proxy passes chunks on before the stream ends)

Every wait in here is bounded (MAX_WAIT_S).
"""
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

MAX_WAIT_S = 30.0
ADMIN_PATHS = {"/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache", "/release_kv_cache_memory",
               "/reload_weights", "/is_sleeping", "/is_paused", "/memory"}


class FakeEngine:
    def __init__(self, name, role, port=0):
        self.name = name
        self.role = role
        self.behavior = "ok"
        self.healthy = True
        self.delay_s = 0.0
        self.stream_chunks = 4
        self.chunk_gap_s = 0.0
        self.stream_gate = None
        self.lock = threading.Lock()
        self.requests = []      # {"method", "path", "query", "headers", "body"}
        self.disconnects = []   # X-Request-Id of requests whose client went away
        self.sent_streams = {}  # X-Request-Id -> the SSE bytes this engine sent
        self.health_checks = 0
        self._port = port
        self._server = None
        self.start()

    # -- lifecycle -------------------------------------------------------
    def start(self):
        engine = self

        class Handler(_Handler):
            pass

        Handler.engine = engine
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self):
        """Stops listening: new connections are refused (the instance is dead)."""
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self._port}"

    # -- records ---------------------------------------------------------
    def record(self, entry):
        with self.lock:
            self.requests.append(entry)

    def generate_requests(self, request_id=None):
        with self.lock:
            return [r for r in self.requests if r["path"].startswith("/v1/") and r["method"] == "POST"
                    and (request_id is None or r["headers"].get("x-request-id") == request_id)]

    def admin_requests(self):
        with self.lock:
            return [r for r in self.requests if r["path"] in ADMIN_PATHS]

    def saw_disconnect(self, request_id, within_s):
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            with self.lock:
                if request_id in self.disconnects:
                    return True
            time.sleep(0.02)
        return False

    def reset(self):
        with self.lock:
            self.requests.clear()
            self.disconnects.clear()
            self.sent_streams.clear()
        self.behavior = "ok"
        self.healthy = True
        self.delay_s = 0.0
        self.stream_chunks = 4
        self.chunk_gap_s = 0.0
        self.stream_gate = None

    # -- answers ---------------------------------------------------------
    def kv_params(self, request_id):
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{self.name}",
                "remote_block_ids": [3, 1, 4], "remote_host": "127.0.0.1", "remote_port": 7000 + self._port % 1000,
                "remote_request_id": f"p-{request_id}"}

    def completion_text(self, body):
        prompt = body.get("prompt")
        if prompt is None:
            prompt = " | ".join(m.get("content", "") for m in body.get("messages", []))
        return f"{self.name} decoded: {prompt}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine = None

    def log_message(self, *args):
        pass

    # -- plumbing --------------------------------------------------------
    def _client_gone(self):
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _wait_or_gone(self, seconds):
        """Sleeps up to `seconds`; True (and recorded) when the client disconnects first."""
        end = time.monotonic() + min(seconds, MAX_WAIT_S)
        while time.monotonic() < end:
            if self._client_gone():
                self._gone()
                return True
            time.sleep(0.01)
        return False

    def _gone(self):
        with self.engine.lock:
            self.engine.disconnects.append(self.headers.get("X-Request-Id"))
        self.close_connection = True

    def _send(self, status, payload, content_type="application/json"):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode(errors="replace")

    def _record(self, method, body):
        parts = urlsplit(self.path)
        self.engine.record({"method": method, "path": parts.path, "query": parse_qs(parts.query),
                            "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        return parts.path, parse_qs(parts.query)

    # -- routes ----------------------------------------------------------
    def do_GET(self):
        path = urlsplit(self.path).path
        if path == "/health":
            self.engine.health_checks += 1
            return self._send(200 if self.engine.healthy else 503, {} if self.engine.healthy else {"error": "down"})
        self._record("GET", None)
        if path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "fake-model", "owned_by": self.engine.name}]})
        if path in ADMIN_PATHS:
            return self._admin(path, parse_qs(urlsplit(self.path).query))
        self._send(404, {"error": {"message": "no route", "type": "NotFoundError", "code": 404}})

    def do_POST(self):
        body = self._read_body()
        path, query = self._record("POST", body)
        if path in ADMIN_PATHS:
            return self._admin(path, query)
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self._send(404, {"error": {"message": "no route", "type": "NotFoundError", "code": 404}})
        if self.engine.role == "prefill":
            return self._prefill(body)
        return self._decode(body)

    def _admin(self, path, query):
        self._send(200, {"instance": self.engine.name, "path": path, "query": query})

    def _failure_modes(self):
        """Answers for the failure behaviours; True when one answered."""
        b = self.engine.behavior
        if b == "fail":
            self._send(500, {"error": {"message": f"{self.engine.name} broke", "type": "InternalServerError",
                                       "code": 500}})
        elif b == "bad_request":
            self._send(400, {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}})
        elif b == "hang":
            self._wait_or_gone(MAX_WAIT_S)
        elif b == "garbage":
            self._send(200, b"<html>this is not json</html>", "text/html")
        elif b == "no_params":
            self._send(200, {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]})
        else:
            return False
        return True

    def _prefill(self, body):
        rid = self.headers.get("X-Request-Id")
        if self.engine.delay_s and self._wait_or_gone(self.engine.delay_s):
            return
        if self._failure_modes():
            return
        self._send(200, {"id": f"cmpl-{rid}", "object": "text_completion", "model": "fake-model",
                         "choices": [{"index": 0, "text": "P", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                         "kv_transfer_params": self.engine.kv_params(rid)})

    def _decode(self, body):
        rid = self.headers.get("X-Request-Id")
        if self.engine.delay_s and self._wait_or_gone(self.engine.delay_s):
            return
        if self.engine.behavior != "cut_stream" and self._failure_modes():
            return
        text = self.engine.completion_text(body)
        if not body.get("stream"):
            return self._send(200, {"id": f"cmpl-{rid}", "object": "text_completion", "model": "fake-model",
                                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                    "kv_transfer_params": None})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i in range(self.engine.stream_chunks):
                if i == 2 and self.engine.behavior == "cut_stream":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                event = {"id": f"cmpl-{rid}", "object": "text_completion",
                         "choices": [{"index": 0, "text": f" {text}#{i}", "finish_reason": None}]}
                self._chunk(rid, f"data: {json.dumps(event)}\n\n".encode())
                if i == 0 and self.engine.stream_gate is not None:
                    self.engine.stream_gate.wait(MAX_WAIT_S)
                if self.engine.chunk_gap_s and self._wait_or_gone(self.engine.chunk_gap_s):
                    return
                if self._client_gone():
                    return self._gone()
            self._chunk(rid, b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            return self._gone()

    def _chunk(self, rid, data):
        """Records, then sends, one chunk (recorded first: the client may finish reading before we return)."""
        with self.engine.lock:
            self.engine.sent_streams[rid] = self.engine.sent_streams.get(rid, b"") + data
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
