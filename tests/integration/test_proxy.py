"""`siesta proxy` in front of fake prefill and decode engines (fake_pd_engine.py).

Checks the HTTP contract of the P/D router: the bodies each leg gets (vLLM's
kv_transfer_params), round robin and health, failures of either leg (the client
gets an error within the deadline and the other leg's connection is closed),
streaming passthrough, client disconnects, admin forwarding, the API key, and
the proxy's own /health and /metrics.
"""
import http.client
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_pd_engine import FakeEngine  # noqa: E402
from siesta_test_util import (Checks, expect_clean_error, http_exchange, parse_args,  # noqa: E402
                              post_without_length, run)

args = parse_args()
SIESTA = args.siesta
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-proxy-")
HTTP_TIMEOUT_S = 15

PROMPT = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class ProxyProcess:
    """A `siesta proxy` subprocess on a free port; stop() kills it (bounded)."""

    def __init__(self, prefill, decode, *extra):
        cmd = [SIESTA, "--log-level", "info", "proxy", "--port", "0", "--prefill", *[e.url for e in prefill],
               "--decode", *[e.url for e in decode], *extra]
        self.log_path = os.path.join(tmp, f"proxy-{time.monotonic_ns()}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on http://" not in line:
            self.stop()
            raise RuntimeError(f"proxy did not start: {line!r}; log: {open(self.log_path).read()}")
        self.port = int(line.strip().rsplit(":", 1)[1])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode


def request(port, method, path, body=None, headers=None, timeout=HTTP_TIMEOUT_S):
    """(status, headers dict, body bytes) of one request to the proxy."""
    return http_exchange("127.0.0.1", port, method, path, body, headers, timeout)


def post_json(port, path, body, headers=None, timeout=HTTP_TIMEOUT_S):
    status, h, data = request(port, "POST", path, body, headers, timeout)
    return status, h, json.loads(data) if data else None


def get_json(port, path, headers=None):
    status, h, data = request(port, "GET", path, None, headers)
    return status, json.loads(data)


def wait_for(predicate, within_s, what):
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {what}")


def wait_all_up(proxy, prefill, decode):
    def up():
        _, h = get_json(proxy.port, "/health")
        return h["prefill"]["up"] == prefill and h["decode"]["up"] == decode
    wait_for(up, 10, f"{prefill} prefill and {decode} decode instances up")


def raw_request(port, path, body, request_id):
    """Sends a request on a plain socket and returns the socket (to close it early)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def is_openai_error(body, status, needle, code=None):
    """OpenAI's error shape, as `siesta serve` answers it too."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    kind = ("authentication_error" if status == 401 else "permission_error" if status == 403
            else "server_error" if status >= 500 else "invalid_request_error")
    assert e["type"] == kind, (status, e)
    if code is not None:
        assert e["code"] == code, (code, e)
    assert needle in e["message"], (needle, e["message"])


P = [FakeEngine("P0", "prefill"), FakeEngine("P1", "prefill")]
D = [FakeEngine("D0", "decode"), FakeEngine("D1", "decode")]
ALL = P + D
procs = []


def fresh():
    for e in ALL:
        e.reset()


def start(prefill, decode, *extra):
    proxy = ProxyProcess(prefill, decode, *extra)
    procs.append(proxy)
    return proxy


try:
    seq = start(P, D, "--mode", "sequential", "--timeout-s", "2", "--health-interval-s", "0.3",
                "--allow-unauthenticated-admin")
    con = start(P, D, "--mode", "concurrent", "--timeout-s", "2", "--health-interval-s", "0.3")

    # ---- sequential (READ) mode: what each leg receives -----------------------
    def sequential_prefill_body():
        fresh()
        body = dict(PROMPT, stream_options={"include_usage": True}, min_tokens=4)
        status, h, out = post_json(seq.port, "/v1/completions", body, {"X-Request-Id": "seq-1"})
        assert status == 200, (status, out)
        assert h.get("x-request-id") == "seq-1"
        (pr,) = [r for e in P for r in e.generate_requests("seq-1")]
        b = pr["body"]
        assert b["max_tokens"] == 1 and b["stream"] is False, b
        assert "stream_options" not in b and "min_tokens" not in b, b
        assert b["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_host": None, "remote_port": None}, b
        assert b["prompt"] == PROMPT["prompt"] and b["temperature"] == 0

    def sequential_decode_body_has_prefill_params():
        fresh()
        status, _, out = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": "seq-2"})
        assert status == 200, (status, out)
        (pe,) = [e for e in P if e.generate_requests("seq-2")]
        (de,) = [e for e in D if e.generate_requests("seq-2")]
        (dr,) = de.generate_requests("seq-2")
        assert dr["body"]["kv_transfer_params"] == pe.kv_params("seq-2"), dr["body"]
        for k, v in PROMPT.items():
            assert dr["body"][k] == v, (k, dr["body"])
        assert dr["headers"]["x-request-id"] == "seq-2"
        assert out["choices"][0]["text"] == de.completion_text(PROMPT), out

    def chat_prefill_sets_max_completion_tokens():
        fresh()
        status, _, out = post_json(seq.port, "/v1/chat/completions", CHAT, {"X-Request-Id": "chat-1"})
        assert status == 200, (status, out)
        (pr,) = [r for e in P for r in e.generate_requests("chat-1")]
        assert pr["path"] == "/v1/chat/completions"
        assert pr["body"]["max_tokens"] == 1 and pr["body"]["max_completion_tokens"] == 1, pr["body"]
        (dr,) = [r for e in D for r in e.generate_requests("chat-1")]
        assert dr["path"] == "/v1/chat/completions" and dr["body"]["max_tokens"] == 8

    def proxy_makes_a_request_id_when_none_given():
        fresh()
        status, h, _ = post_json(seq.port, "/v1/completions", PROMPT)
        assert status == 200
        rid = h.get("x-request-id", "")
        assert rid.startswith("pd-") and len(rid) == 35, rid
        assert sum(len(e.generate_requests(rid)) for e in ALL) == 2

    def round_robin_over_two_prefill_and_two_decode():
        fresh()
        for i in range(8):
            status, _, _ = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": f"rr-{i}"})
            assert status == 200
        counts = [len(e.generate_requests()) for e in ALL]
        assert counts == [4, 4, 4, 4], counts
        # Alternating, not merely balanced.
        firsts = [next(e.name for e in P if e.generate_requests(f"rr-{i}")) for i in range(4)]
        assert firsts[0] != firsts[1] and firsts[0] == firsts[2] and firsts[1] == firsts[3], firsts

    def streaming_passes_chunks_through_as_they_come():
        fresh()
        gate = threading.Event()
        for d in D:
            d.stream_gate = gate
            d.stream_chunks = 5
        conn = http.client.HTTPConnection("127.0.0.1", seq.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(dict(PROMPT, stream=True)),
                         headers={"Content-Type": "application/json", "X-Request-Id": "stream-1"})
            r = conn.getresponse()
            assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
            # The first event arrives while D still holds back the rest: no buffering.
            first = r.readline() + r.readline()
            assert first.startswith(b"data: {"), first
            gate.set()
            got = first + r.read()
        finally:
            gate.set()
            conn.close()
        (de,) = [e for e in D if e.generate_requests("stream-1")]
        with de.lock:
            sent = de.sent_streams["stream-1"]
        assert got == sent, (got, sent)
        assert got.endswith(b"data: [DONE]\n\n") and got.count(b"data: ") == 6

    def prefill_http_error_gives_502_naming_it_and_skips_decode():
        fresh()
        for p in P:
            p.behavior = "fail"
        status, _, out = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": "pfail-1"})
        assert status == 502, (status, out)
        (pe,) = [e for e in P if e.generate_requests("pfail-1")]
        is_openai_error(out, 502, f"prefill instance {pe.url}", "prefill_failed")
        assert "HTTP 500" in out["error"]["message"], out
        assert not any(d.generate_requests("pfail-1") for d in D)

    def prefill_garbage_or_missing_params_gives_502():
        for behavior, needle in (("garbage", "not JSON"), ("no_params", "no kv_transfer_params")):
            fresh()
            wait_all_up(seq, 2, 2)
            for p in P:
                p.behavior = behavior
            status, _, out = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": f"p-{behavior}"})
            assert status == 502, (behavior, status, out)
            is_openai_error(out, 502, needle)
            assert not any(d.generate_requests(f"p-{behavior}") for d in D)

    def prefill_bad_request_is_passed_on():
        fresh()
        wait_all_up(seq, 2, 2)
        for p in P:
            p.behavior = "bad_request"
        status, _, out = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": "p-400"})
        assert status == 400 and out["error"]["message"] == "prompt too long", (status, out)
        assert not any(d.generate_requests("p-400") for d in D)

    def prefill_hang_ends_within_timeout():
        fresh()
        wait_all_up(seq, 2, 2)
        for p in P:
            p.behavior = "hang"
        t0 = time.monotonic()
        status, _, out = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": "p-hang"})
        took = time.monotonic() - t0
        assert status == 502, (status, out)
        is_openai_error(out, 502, "no complete answer within 2.0 s")
        assert 1.5 <= took <= 6, took
        (pe,) = [e for e in P if e.generate_requests("p-hang")]
        assert pe.saw_disconnect("p-hang", 3), "the hanging prefill instance never saw its connection close"

    def decode_error_status_is_passed_on():
        fresh()
        wait_all_up(seq, 2, 2)
        for d in D:
            d.behavior = "fail"
        status, _, out = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": "d-500"})
        assert status == 500 and "broke" in out["error"]["message"], (status, out)

    def decode_dying_mid_stream_ends_the_stream_with_an_error():
        fresh()
        for d in D:
            d.behavior = "cut_stream"
        status, h, data = request(seq.port, "POST", "/v1/completions", dict(PROMPT, stream=True),
                                  {"X-Request-Id": "d-cut"})
        assert status == 200, (status, data)
        events = [e for e in data.decode().split("\n\n") if e]
        assert len(events) == 4 and all(e.startswith("data: ") for e in events), events
        (de,) = [e for e in D if e.generate_requests("d-cut")]
        error = json.loads(events[2][len("data: "):])
        is_openai_error(error, 502, f"decode instance {de.url} failed mid-stream", "decode_failed")
        assert events[3] == "data: [DONE]", events

    def decode_unreachable_gives_502_naming_it():
        ps = [FakeEngine("S0", "prefill")]
        ds = [FakeEngine("G0", "decode")]
        proxy = start(ps, ds, "--mode", "sequential", "--health-interval-s", "60")
        try:
            ds[0].stop()
            status, _, out = post_json(proxy.port, "/v1/completions", PROMPT)
            assert status == 502, out
            is_openai_error(out, 502, f"decode instance {ds[0].url} failed: cannot connect", "decode_failed")
            _, h = get_json(proxy.port, "/health")
            assert h["decode"]["up"] == 0, h
        finally:
            proxy.stop()
            for e in ps + ds:
                e.stop()

    # ---- concurrent (WRITE) mode -------------------------------------------
    def concurrent_sends_both_legs_at_once():
        fresh()
        wait_all_up(con, 2, 2)
        status, _, out = post_json(con.port, "/v1/completions", PROMPT, {"X-Request-Id": "con-1"})
        assert status == 200, (status, out)
        (pe,) = [e for e in P if e.generate_requests("con-1")]
        (dr,) = [r for e in D for r in e.generate_requests("con-1")]
        kv = dr["body"]["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False, kv
        assert kv["remote_request_id"] == "con-1" and kv["remote_prefill_url"] == pe.url, kv
        assert dr["body"]["max_tokens"] == 16

    def concurrent_decode_really_starts_before_prefill_answers():
        fresh()
        for p in P:
            p.behavior = "hang"
        for d in D:
            d.delay_s = 10
        sock = raw_request(con.port, "/v1/completions", PROMPT, "con-early")
        try:
            wait_for(lambda: any(d.generate_requests("con-early") for d in D), 3, "decode leg started")
        finally:
            sock.close()

    def prefill_failure_cancels_decode():
        fresh()
        wait_all_up(con, 2, 2)
        for p in P:
            p.behavior = "fail"
            p.delay_s = 0.3  # decode has the request by then
        for d in D:
            d.delay_s = 20  # a decode waiting for KV that will never come
        t0 = time.monotonic()
        status, _, out = post_json(con.port, "/v1/completions", PROMPT, {"X-Request-Id": "con-pfail"})
        assert status == 502 and time.monotonic() - t0 < 3, (status, out)
        is_openai_error(out, 502, "prefill instance http://127.0.0.1:")
        (de,) = [e for e in D if e.generate_requests("con-pfail")]
        assert de.saw_disconnect("con-pfail", 3), "decode never saw its request cancelled"

    def prefill_hang_times_out_and_cancels_decode():
        fresh()
        wait_all_up(con, 2, 2)
        for p in P:
            p.behavior = "hang"
        for d in D:
            d.delay_s = 20
        t0 = time.monotonic()
        status, _, out = post_json(con.port, "/v1/completions", PROMPT, {"X-Request-Id": "con-hang"})
        took = time.monotonic() - t0
        assert status == 502 and 1.5 <= took <= 6, (status, took, out)
        is_openai_error(out, 502, "within 2.0 s")
        (pe,) = [e for e in P if e.generate_requests("con-hang")]
        (de,) = [e for e in D if e.generate_requests("con-hang")]
        assert pe.saw_disconnect("con-hang", 3) and de.saw_disconnect("con-hang", 3)

    def client_disconnect_mid_stream_closes_decode():
        fresh()
        wait_all_up(con, 2, 2)
        for d in D:
            d.stream_chunks = 200
            d.chunk_gap_s = 0.05
        sock = raw_request(con.port, "/v1/completions", dict(PROMPT, stream=True), "con-gone")
        sock.settimeout(5)
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(4096)
            assert chunk, "the proxy closed before the first event"
            got += chunk
        sock.close()
        (de,) = [e for e in D if e.generate_requests("con-gone")]
        assert de.saw_disconnect("con-gone", 5), "decode kept streaming to a client that left"

    def client_disconnect_while_waiting_closes_decode():
        fresh()
        wait_all_up(con, 2, 2)
        for d in D:
            d.delay_s = 20
        sock = raw_request(con.port, "/v1/completions", PROMPT, "con-wait-gone")
        wait_for(lambda: any(d.generate_requests("con-wait-gone") for d in D), 3, "decode leg started")
        time.sleep(0.2)
        sock.close()
        (de,) = [e for e in D if e.generate_requests("con-wait-gone")]
        assert de.saw_disconnect("con-wait-gone", 3), "decode kept a request whose client left"

    def concurrent_streaming_works():
        fresh()
        wait_all_up(con, 2, 2)
        status, h, data = request(con.port, "POST", "/v1/completions", dict(PROMPT, stream=True),
                                  {"X-Request-Id": "con-stream"})
        assert status == 200 and h["content-type"].startswith("text/event-stream"), (status, h)
        (de,) = [e for e in D if e.generate_requests("con-stream")]
        with de.lock:
            assert data == de.sent_streams["con-stream"]

    def many_concurrent_requests_all_answered():
        fresh()
        for d in D:
            d.chunk_gap_s = 0.02
        results = {}

        def one(i, proxy):
            stream = i % 2 == 0
            try:
                status, _, data = request(proxy.port, "POST", "/v1/completions", dict(PROMPT, stream=stream),
                                          {"X-Request-Id": f"many-{proxy.port}-{i}"}, timeout=30)
                ok = status == 200 and (data.endswith(b"data: [DONE]\n\n") if stream else b"decoded" in data)
            except OSError as e:
                ok = e
            results[(proxy.port, i)] = ok

        threads = [threading.Thread(target=one, args=(i, proxy)) for proxy in (seq, con) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        bad = {k: v for k, v in results.items() if v is not True}
        assert len(results) == 80 and not bad, bad
        assert sum(len(e.generate_requests()) for e in ALL) == 160

    # ---- health, skipping, recovery ------------------------------------------
    def dead_instance_is_skipped_and_comes_back():
        fresh()
        wait_all_up(seq, 2, 2)
        P[0].stop()
        try:
            wait_all_up(seq, 1, 2)
            _, h = get_json(seq.port, "/health")
            down = [i for i in h["instances"] if not i["up"]]
            assert [i["url"] for i in down] == [P[0].url] and down[0]["why_down"], h
            for i in range(4):
                status, _, _ = post_json(seq.port, "/v1/completions", PROMPT, {"X-Request-Id": f"skip-{i}"})
                assert status == 200
            assert len(P[1].generate_requests()) == 4
        finally:
            P[0].start()
        wait_all_up(seq, 2, 2)

    def failed_request_marks_instance_down_until_health_check():
        ps = [FakeEngine("Q0", "prefill"), FakeEngine("Q1", "prefill")]
        ds = [FakeEngine("E0", "decode")]
        proxy = start(ps, ds, "--mode", "sequential", "--timeout-s", "2", "--health-interval-s", "60")
        try:
            ps[0].behavior = "fail"   # still healthy on /health
            status, _, _ = post_json(proxy.port, "/v1/completions", PROMPT, {"X-Request-Id": "mark-0"})
            assert status == 502 and ps[0].generate_requests("mark-0")
            _, h = get_json(proxy.port, "/health")
            assert h["prefill"]["up"] == 1, h
            (q0,) = [i for i in h["instances"] if i["url"] == ps[0].url]
            assert q0["why_down"].startswith("request failed"), q0
            for i in range(1, 4):
                status, _, _ = post_json(proxy.port, "/v1/completions", PROMPT, {"X-Request-Id": f"mark-{i}"})
                assert status == 200
            assert len(ps[0].generate_requests()) == 1 and len(ps[1].generate_requests()) == 3
            status, _, metrics = request(proxy.port, "GET", "/metrics")
            text = metrics.decode()
            assert "siesta_proxy_prefill_failures_total 1\n" in text, text
            assert f'siesta_proxy_instance_failures_total{{role="prefill",instance="{ps[0].url}"}} 1\n' in text
            assert f'siesta_proxy_instance_up{{role="prefill",instance="{ps[0].url}"}} 0\n' in text
        finally:
            proxy.stop()
            for e in ps + ds:
                e.stop()

    def no_decode_up_gives_503_and_unhealthy():
        ps = [FakeEngine("R0", "prefill")]
        ds = [FakeEngine("F0", "decode")]
        ds[0].healthy = False
        proxy = start(ps, ds, "--health-interval-s", "0.3")
        try:
            status, h = get_json(proxy.port, "/health")
            assert status == 503 and h["decode"] == {"up": 0, "total": 1}, h
            status, _, out = post_json(proxy.port, "/v1/completions", PROMPT)
            assert status == 503, out
            is_openai_error(out, 503, f"no decode instance is up: {ds[0].url} (GET /health answered HTTP 503)",
                            "no_instance_up")
            assert not ps[0].generate_requests(), "prefill was sent a request that could not be decoded"
            ds[0].healthy = True
            wait_all_up(proxy, 1, 1)
            assert get_json(proxy.port, "/health")[0] == 200
        finally:
            proxy.stop()
            for e in ps + ds:
                e.stop()

    def health_metrics_models():
        fresh()
        wait_all_up(seq, 2, 2)
        status, h = get_json(seq.port, "/health")
        assert status == 200 and h["prefill"] == {"up": 2, "total": 2} and h["decode"] == {"up": 2, "total": 2}, h
        status, models = get_json(seq.port, "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "fake-model", models
        status, _, metrics = request(seq.port, "GET", "/metrics")
        text = metrics.decode()
        assert status == 200 and "# TYPE siesta_proxy_requests_total counter" in text
        assert f'siesta_proxy_instance_up{{role="decode",instance="{D[1].url}"}} 1' in text, text
        n = [l for l in text.splitlines() if l.startswith('siesta_proxy_requests_total{endpoint="/v1/completions"}')]
        assert n and int(n[0].split()[-1]) > 10, n

    def bad_input_and_unknown_routes():
        status, _, out = post_json(seq.port, "/v1/completions", b"{not json")
        assert status == 400, out
        is_openai_error(out, 400, "not a JSON object")
        status, _, out = post_json(seq.port, "/v1/completions", dict(PROMPT, stream="yes"))
        assert status == 400, out
        status, _, out = request(seq.port, "GET", "/nowhere")
        assert status == 404, out
        is_openai_error(json.loads(out), 404, "no route for GET /nowhere", "not_found")

    # ---- admin forwarding ---------------------------------------------------
    def admin_to_all():
        fresh()
        status, out = post_json(seq.port, "/sleep?level=1", None)[0::2]
        assert status == 200, out
        assert set(out) == {e.url for e in ALL}, out
        for e in ALL:
            entry = out[e.url]
            assert entry["status"] == 200 and entry["role"] == e.role, entry
            assert entry["body"]["instance"] == e.name and entry["body"]["query"] == {"level": ["1"]}, entry
            (r,) = e.admin_requests()
            assert r["path"] == "/sleep" and r["method"] == "POST"
        status, out = get_json(seq.port, "/is_sleeping")
        assert status == 200 and len(out) == 4 and all(v["body"]["path"] == "/is_sleeping" for v in out.values())

    def admin_post_without_body_or_length():
        # `curl -X POST host/sleep?level=2` sends neither a body nor Content-Length.
        fresh()
        head, body, elapsed = post_without_length(seq.port, "/sleep?level=2&role=decode", timeout=HTTP_TIMEOUT_S)
        assert head.startswith(b"HTTP/1.1 200"), (head, body)
        assert elapsed < 2, "the proxy waited for a body that was never announced"
        out = json.loads(body)
        assert set(out) == {D[0].url, D[1].url} and all(v["body"]["query"] == {"level": ["2"]} for v in out.values())

    def admin_to_one_or_a_role():
        fresh()
        status, _, out = post_json(seq.port, f"/wake_up?instance={D[1].url}&tags=weights", None)
        assert status == 200 and list(out) == [D[1].url], out
        assert [len(e.admin_requests()) for e in ALL] == [0, 0, 0, 1]
        assert D[1].admin_requests()[0]["query"] == {"tags": ["weights"]}
        status, _, out = post_json(seq.port, "/reset_prefix_cache?role=prefill", None)
        assert status == 200 and set(out) == {P[0].url, P[1].url}, out
        status, _, out = post_json(seq.port, "/pause?instance=http://127.0.0.1:1", None)
        assert status == 404, out
        is_openai_error(out, 404, "no configured instance is http://127.0.0.1:1")
        status, _, out = post_json(seq.port, "/pause?role=middle", None)
        assert status == 400, out

    def admin_with_one_instance_down_reports_it():
        fresh()
        D[0].stop()
        try:
            status, _, out = post_json(seq.port, "/resume", None)
            assert status == 502, out
            assert out[D[0].url]["status"] is None and out[D[0].url]["error"] == "cannot connect", out
            assert out[P[0].url]["status"] == 200
        finally:
            D[0].start()
        wait_all_up(seq, 2, 2)

    # ---- API key ------------------------------------------------------------
    def admin_needs_a_key_or_an_explicit_opt_out():
        fresh()
        # con has neither --api-key nor --allow-unauthenticated-admin.
        for method, path in (("POST", "/sleep?level=1"), ("POST", "/pause"), ("GET", "/memory")):
            status, _, out = request(con.port, method, path, b"" if method == "POST" else None)
            assert status == 403, (path, status, out)
            is_openai_error(json.loads(out), 403, "--allow-unauthenticated-admin", "admin_not_allowed")
        assert all(e.admin_requests() == [] for e in ALL)
        # A client's own Authorization header never reaches the instances.
        status, _, out = post_json(con.port, "/v1/completions", PROMPT,
                                   {"Authorization": "Bearer client-secret", "X-Request-Id": "nokey-1"})
        assert status == 200, out
        legs = [r for e in ALL for r in e.generate_requests("nokey-1")]
        assert len(legs) == 2 and all("authorization" not in r["headers"] for r in legs), legs

    def api_key_is_required_and_forwarded():
        fresh()
        proxy = start(P, D, "--api-key", "sesame", "--health-interval-s", "0.3")
        try:
            status, _, out = post_json(proxy.port, "/v1/completions", PROMPT)
            assert status == 401, out
            is_openai_error(out, 401, "API key", "invalid_api_key")
            status, _, _ = post_json(proxy.port, "/v1/completions", PROMPT, {"Authorization": "Bearer wrong"})
            assert status == 401
            status, _, _ = post_json(proxy.port, "/sleep", None)
            assert status == 401
            assert get_json(proxy.port, "/health")[0] == 200
            status, _, out = post_json(proxy.port, "/v1/completions", PROMPT,
                                       {"Authorization": "Bearer sesame", "X-Request-Id": "key-1"})
            assert status == 200, out
            legs = [r for e in ALL for r in e.generate_requests("key-1")]
            assert len(legs) == 2 and all(r["headers"].get("authorization") == "Bearer sesame" for r in legs)
            status, _, out = post_json(proxy.port, "/pause", None, {"Authorization": "Bearer sesame"})
            assert status == 200 and all(e.admin_requests()[0]["headers"]["authorization"] == "Bearer sesame"
                                         for e in ALL), out
            # The scheme's case does not matter; /metrics is open by default.
            status, _, out = request(proxy.port, "GET", "/is_paused", None, {"Authorization": "bearer sesame"})
            assert status == 200, out
            assert request(proxy.port, "GET", "/metrics", None)[0] == 200
        finally:
            proxy.stop()
        locked = start(P, D, "--api-key", "sesame", "--metrics-require-key", "--health-interval-s", "0.3")
        try:
            assert request(locked.port, "GET", "/metrics", None)[0] == 401
            assert request(locked.port, "GET", "/metrics", None, {"Authorization": "Bearer sesame"})[0] == 200
            assert get_json(locked.port, "/health")[0] == 200
        finally:
            locked.stop()

    # ---- the command line ---------------------------------------------------
    def cli_refuses_bad_options():
        rc, _, err = run([SIESTA, "proxy", "--decode", D[0].url], timeout=20)
        expect_clean_error(rc, err, "--prefill")
        rc, _, err = run([SIESTA, "proxy", "--prefill", "ftp://h:1", "--decode", D[0].url], timeout=20)
        expect_clean_error(rc, err, "only http")
        rc, _, err = run([SIESTA, "proxy", "--prefill", P[0].url, "--decode", D[0].url, "--mode", "both"],
                         timeout=20)
        expect_clean_error(rc, err, "--mode")
        rc, _, err = run([SIESTA, "proxy", "--prefill", P[0].url, "--decode", D[0].url, "--port", str(seq.port)],
                         timeout=20)
        expect_clean_error(rc, err, "cannot listen")
        rc, _, err = run([SIESTA, "proxy", "--prefill", P[0].url, "--decode", D[0].url, "--park-idle-after", "5"],
                         timeout=20)
        expect_clean_error(rc, err, "--park-idle-after: needs --wake-on-demand")
        rc, _, err = run([SIESTA, "proxy", "--prefill", P[0].url, "--decode", D[0].url, "--wake-on-demand",
                          "--wake-timeout-s", "0"], timeout=20)
        expect_clean_error(rc, err, "--wake-timeout-s")
        rc, _, err = run([SIESTA, "proxy", "--prefill", P[0].url, "--decode", D[0].url, "--retries", "9"],
                         timeout=20)
        expect_clean_error(rc, err, "--retries")

    def proxy_stops_cleanly_on_sigterm():
        proxy = ProxyProcess(P, D)
        assert proxy.stop() == 0

    for fn in (sequential_prefill_body, sequential_decode_body_has_prefill_params,
               chat_prefill_sets_max_completion_tokens, proxy_makes_a_request_id_when_none_given,
               round_robin_over_two_prefill_and_two_decode, streaming_passes_chunks_through_as_they_come,
               prefill_http_error_gives_502_naming_it_and_skips_decode, prefill_garbage_or_missing_params_gives_502,
               prefill_bad_request_is_passed_on, prefill_hang_ends_within_timeout, decode_error_status_is_passed_on,
               decode_dying_mid_stream_ends_the_stream_with_an_error, decode_unreachable_gives_502_naming_it,
               concurrent_sends_both_legs_at_once, concurrent_decode_really_starts_before_prefill_answers,
               prefill_failure_cancels_decode, prefill_hang_times_out_and_cancels_decode,
               client_disconnect_mid_stream_closes_decode, client_disconnect_while_waiting_closes_decode,
               concurrent_streaming_works, many_concurrent_requests_all_answered,
               dead_instance_is_skipped_and_comes_back,
               failed_request_marks_instance_down_until_health_check, no_decode_up_gives_503_and_unhealthy,
               health_metrics_models, bad_input_and_unknown_routes, admin_to_all, admin_post_without_body_or_length,
               admin_to_one_or_a_role,
               admin_with_one_instance_down_reports_it, admin_needs_a_key_or_an_explicit_opt_out,
               api_key_is_required_and_forwarded,
               cli_refuses_bad_options, proxy_stops_cleanly_on_sigterm):
        def settled_then(fn=fn):
            # Instances a previous check failed on come back with the next health round.
            wait_all_up(seq, 2, 2)
            wait_all_up(con, 2, 2)
            fn()
        checks.check(fn.__name__, settled_then)
finally:
    for proxy in procs:
        proxy.stop()
    for e in ALL:
        e.stop()

if checks.failed:
    print(f"proxy logs are in {tmp}")
else:
    shutil.rmtree(tmp, ignore_errors=True)
checks.finish()
