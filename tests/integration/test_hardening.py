"""What a hostile client or peer on loopback can do to `siesta serve`, `siesta
proxy` and the side channel of a P/D pair, on raw sockets:

1. bodies nesting JSON 100,000 deep (three shapes) get 400 naming the limit,
   and every process stays up;
2. a chunked body past --max-request-body-bytes gets 413 before much more of
   it is sent (and the server's memory does not grow by the body), duplicate
   or negative Content-Length gets 400;
3. hundreds of connections trickling a byte at a time hold no thread: a
   normal client is served within a second, and the tricklers are answered
   408 and closed at the header deadline; a slow body likewise; more
   connections from one address than allowed make the oldest waiting ones
   give way;
4. the side channel of P refuses an INVALIDATE from a peer without the key
   (one naming D with epoch 2^64-1), a partial frame of 4 MiB before the
   handshake, and garbage, and P/D still moves KV afterwards;
5. the proxy refuses admin calls without --api-key, a keyed proxy and serve
   need the key (/kv_transfer_info included), and a decode engine with the
   key still finds its prefill engine.
"""
import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, parse_args  # noqa: E402

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-hardening-")
KEY = "hardening-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
HEAD_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
PER_ADDRESS = 400
HTTP_LIMITS = ["--max-request-body-bytes", str(BODY_LIMIT), "--request-header-timeout-s", str(HEAD_TIMEOUT_S),
               "--request-body-timeout-s", str(BODY_TIMEOUT_S), "--max-connections-per-address", str(PER_ADDRESS)]
SERVE_ARGS = ["--threads", "1", "--kv-cache-memory-bytes", "64M", "--max-model-len", "1024", "--seed", "0",
              "--max-num-seqs", "8", "--http-threads", "16", *HTTP_LIMITS]
SIDE_KEY_FILE = os.path.join(tmp, "side_channel.key")
with open(os.open(SIDE_KEY_FILE, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(os.urandom(32).hex())


class Process:
    """A siesta subprocess; its 'listening on http://HOST:PORT' line gives the port."""

    def __init__(self, name, argv):
        self.name = name
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([SIESTA, "--log-level", "info", *argv], stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        end = time.monotonic() + 90
        while time.monotonic() < end and self.port is None and self.proc.poll() is None:
            m = re.search(r"listening on http://[0-9.]+:(\d+)", open(self.log_path).read())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.05)
        if self.port is None:
            self.stop()
            raise RuntimeError(f"{name} did not start: {open(self.log_path).read()[-3000:]}")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def alive(self):
        return self.proc.poll() is None

    def rss(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.log.close()


def request(port, method, path, body=None, headers=None, timeout=30):
    """(status, body bytes) over http.client."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def raw(port, data, timeout=10):
    """Sends bytes on a fresh socket; returns (status, parsed JSON body or None)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server answered and closed before all of it went out
        return read_answer(s)
    finally:
        s.close()


def read_answer(s):
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            head, sep, rest = out.partition(b"\r\n\r\n")
            m = re.search(rb"Content-Length: (\d+)", head, re.I)
            if sep and m and len(rest) >= int(m.group(1)):
                break
    except OSError:
        pass
    head, _, rest = out.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.1 (\d+)", head)
    if not m:
        return None, None
    try:
        return int(m.group(1)), json.loads(rest)
    except ValueError:
        return int(m.group(1)), None


def post_raw(port, path, body, extra_headers=b""):
    return raw(port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + extra_headers +
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def error_code(answer):
    status, body = answer
    return status, (body or {}).get("error", {}).get("code")


def metric(port, name, labels=""):
    status, text = request(port, "GET", "/metrics", headers=AUTH)
    assert status == 200
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(port, headers=None, prompt="The capital of France is", timeout=60):
    status, out = request(port, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0},
                          headers=headers, timeout=timeout)
    return status, json.loads(out) if out else None


def kv_config(role):
    return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role, "kv_connector_extra_config": {
        "backend": "ipc", "mode": "write", "load_timeout_s": 10, "transfer_timeout_s": 5, "message_timeout_s": 3,
        "auth_key_file": SIDE_KEY_FILE}})


procs = []


def start(name, argv):
    p = Process(name, argv)
    procs.append(p)
    return p


try:
    serve = start("serve", ["serve", "--model", MODEL, "--port", "0", "--api-key", KEY, *SERVE_ARGS])
    prefill = start("prefill", ["serve", "--model", MODEL, "--port", "0", "--api-key", KEY, *SERVE_ARGS,
                                "--kv-transfer-config", kv_config("kv_producer")])
    decode = start("decode", ["serve", "--model", MODEL, "--port", "0", "--api-key", KEY, *SERVE_ARGS,
                              "--kv-transfer-config", kv_config("kv_consumer")])
    proxy = start("proxy", ["proxy", "--port", "0", "--prefill", prefill.url, "--decode", decode.url, "--api-key", KEY,
                            "--timeout-s", "30", *HTTP_LIMITS])
    open_proxy = start("open-proxy", ["proxy", "--port", "0", "--prefill", prefill.url, "--decode", decode.url])
    HTTP = {"serve": (serve, AUTH), "proxy": (proxy, AUTH)}

    # ---- 1. nested JSON ------------------------------------------------------
    def nested_json_is_refused_naming_the_limit():
        n = 100000
        shapes = {
            "array in a field": b'{"prompt":"hi","x":' + b"[" * n + b"]" * n + b"}",
            "objects": b'{"a":' * n + b"1" + b"}" * n,
            "array prompt": b'{"prompt":' + b"[" * n + b"]" * n + b"}",
        }
        for name, (proc, auth) in HTTP.items():
            for shape, body in shapes.items():
                status, code = error_code(post_raw(proc.port, "/v1/completions", body,
                                                   f"Authorization: Bearer {KEY}\r\n".encode()))
                assert (status, code) == (400, "json_too_deep"), (name, shape, status, code)
            _, answer = post_raw(proc.port, "/v1/chat/completions", shapes["objects"])
            assert "64" in answer["error"]["message"], answer
            assert proc.alive(), name
            # 64 levels are within the limit.
            ok = b'{"model":"' + MODEL.encode() + b'","prompt":"hi","max_tokens":1,"user":' + b"[" * 63 + b"]" * 63 + b"}"
            status, code = error_code(post_raw(proc.port, "/v1/completions", ok, f"Authorization: Bearer {KEY}\r\n".encode()))
            assert code != "json_too_deep", (name, status, code)

    # ---- 2. body limits -------------------------------------------------------
    def chunked_body_past_the_limit_is_refused_at_once():
        for name, (proc, _) in HTTP.items():
            before = proc.rss()
            s = socket.create_connection(("127.0.0.1", proc.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n" % (64 << 10) + b"a" * (64 << 10) + b"\r\n"
            sent = 0
            try:
                for _ in range(200 * 16):  # up to 200 MiB
                    s.sendall(chunk)
                    sent += 64 << 10
            except OSError:
                pass
            status, body = read_answer(s)
            s.close()
            assert (status, body["error"]["code"]) == (413, "request_too_large"), (name, status, body)
            # Refused at the chunk that passed the limit (what the socket buffers took on top).
            assert sent < BODY_LIMIT + (32 << 20), (name, sent)
            assert proc.rss() - before < (64 << 20), (name, before, proc.rss())

    def content_length_must_be_one_decimal_number():
        for name, (proc, _) in HTTP.items():
            for cl, needle in ((b"Content-Length: 2\r\nContent-Length: 2\r\n", "more than one"),
                               (b"Content-Length: -2\r\n", "non-negative"), (b"Content-Length: 2x\r\n", "decimal"),
                               (b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n", "both")):
                status, body = raw(proc.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + cl + b"\r\n{}")
                assert status == 400 and needle in body["error"]["message"], (name, cl, status, body)
            status, body = raw(proc.port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" %
                               (BODY_LIMIT + 1))
            assert status == 413, (name, status, body)

    # ---- 3. slow clients ------------------------------------------------------
    def trickling_connections_do_not_starve_a_normal_client():
        for name, (proc, auth) in HTTP.items():
            socks = []
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", proc.port), timeout=5)
                s.setblocking(False)
                socks.append(s)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nX-Slow: "
            worst = 0.0
            t_start = time.monotonic()
            for i in range(int(HEAD_TIMEOUT_S * 4) + 4):
                for s in socks:
                    try:
                        s.send(head[i:i + 1] if i < len(head) else b"x")
                    except OSError:
                        pass
                t0 = time.monotonic()
                status, _ = request(proc.port, "GET", "/health", timeout=10)
                worst = max(worst, time.monotonic() - t0)
                assert status == 200, (name, status)
                time.sleep(0.25)
            # Normal requests while they trickle, and the tricklers' fate.
            t0 = time.monotonic()
            status, out = complete(proc.port, auth)
            assert status == 200, (name, out)
            worst = max(worst, time.monotonic() - t0)
            answered_408 = 0
            for s in socks:
                s.setblocking(True)
                s.settimeout(2)
                status, _ = read_answer(s)
                answered_408 += status == 408
                s.close()
            assert worst < 1.0, (name, worst)
            assert answered_408 >= 290, (name, answered_408)
            assert time.monotonic() - t_start < HEAD_TIMEOUT_S * 4 + 10

    def a_slow_body_is_cut_at_its_deadline():
        for name, (proc, _) in HTTP.items():
            s = socket.create_connection(("127.0.0.1", proc.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < BODY_TIMEOUT_S + 3:
                    s.sendall(b" ")
                    time.sleep(0.2)
            except OSError:
                pass
            s.settimeout(5)
            status, body = read_answer(s)
            s.close()
            assert status == 408 and "body" in body["error"]["message"], (name, status, body)
            assert time.monotonic() - t0 < BODY_TIMEOUT_S + 2, name

    def one_address_cannot_hold_every_connection():
        # More idle connections than one address may open: the oldest give way.
        socks = [socket.create_connection(("127.0.0.1", serve.port), timeout=5) for _ in range(PER_ADDRESS + 100)]
        t0 = time.monotonic()
        status, _ = request(serve.port, "GET", "/health", timeout=10)
        assert status == 200 and time.monotonic() - t0 < 1.0
        for s in socks:
            s.close()

    # ---- 4. the side channel --------------------------------------------------
    def side_channel_address():
        status, raw_info = request(prefill.port, "GET", "/kv_transfer_info", headers=AUTH)
        assert status == 200, status
        host, port = json.loads(raw_info)["side_channel_address"].rsplit(":", 1)
        return host, int(port)

    def frame(ftype, payload):
        return struct.pack("<IHHI", 0x53454953, 1, ftype, len(payload)) + payload

    def pd_request_loads_kv():
        loads = metric(decode.port, "siesta:kv_loads_total", 'outcome="loaded"')
        status, out = complete(proxy.port, AUTH, prompt="A long enough prompt to fill one block of sixteen tokens at least")
        assert status == 200, out
        assert metric(decode.port, "siesta:kv_loads_total", 'outcome="loaded"') == loads + 1

    def spoofed_invalidate_and_hostile_frames_are_refused():
        pd_request_loads_kv()
        addr = side_channel_address()
        # INVALIDATE{D, 2^64-1} without the key.
        status, info = request(decode.port, "GET", "/kv_transfer_info", headers=AUTH)
        d_id = json.loads(info)["engine_id"].encode()
        inv = frame(3, struct.pack("<I", len(d_id)) + d_id + struct.pack("<Q", 2 ** 64 - 1))
        s = socket.create_connection(addr, timeout=5)
        s.sendall(inv)
        answer = s.recv(65536)
        assert answer[6:8] == struct.pack("<H", 6) and b"requires authentication" in answer, answer
        assert s.recv(1) == b""  # and closed
        s.close()
        # A HELLO then a forged AUTH.
        hello = frame(8, struct.pack("<I", 7) + b"mallory" + struct.pack("<I", 16) + os.urandom(16))
        s = socket.create_connection(addr, timeout=5)
        s.sendall(hello)
        challenge = s.recv(65536)
        assert challenge[6:8] == struct.pack("<H", 9), challenge
        s.sendall(frame(10, struct.pack("<I", 32) + os.urandom(32)) + inv)
        rest = s.recv(65536)
        assert b"did not prove" in rest, rest
        s.close()
        # Garbage, truncated frames, an answer type as a request.
        for junk in (os.urandom(4096), frame(3, b"\x01")[:9], frame(2, b"x" * 100), b"GET / HTTP/1.1\r\n\r\n"):
            s = socket.create_connection(addr, timeout=5)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
            s.close()
        assert prefill.alive() and decode.alive()
        pd_request_loads_kv()

    def partial_frames_cost_the_side_channel_little():
        addr = side_channel_address()
        before = prefill.rss()
        socks = []
        for _ in range(60):
            s = socket.create_connection(addr, timeout=5)
            try:
                s.sendall(frame(7, b"")[:8] + struct.pack("<I", (4 << 20) - 1) + b"m" * (1 << 20))
            except OSError:
                pass
            socks.append(s)
        # Each is closed at its header: a MESSAGE before the handshake has a few KiB at most.
        for s in socks:
            s.settimeout(5)
            try:
                assert s.recv(65536) == b""
            except ConnectionResetError:
                pass
            s.close()
        assert prefill.rss() - before < (32 << 20), (before, prefill.rss())
        pd_request_loads_kv()

    # ---- 5. admin and keys ----------------------------------------------------
    def admin_and_keys():
        for method, path in (("POST", "/sleep?level=1"), ("POST", "/pause"), ("GET", "/is_sleeping")):
            status, out = request(open_proxy.port, method, path, b"" if method == "POST" else None)
            assert status == 403 and b"--allow-unauthenticated-admin" in out, (path, status, out)
            assert request(proxy.port, method, path, b"" if method == "POST" else None)[0] == 401, path
        # With the key the calls go through (the engines, without sleep mode, refuse them themselves).
        status, out = request(proxy.port, "GET", "/is_sleeping", headers=AUTH)
        assert status == 400 and b"sleep_mode_disabled" in out, (status, out)
        assert request(prefill.port, "GET", "/kv_transfer_info")[0] == 401
        assert request(prefill.port, "GET", "/kv_transfer_info", headers=AUTH)[0] == 200
        assert request(serve.port, "GET", "/health")[0] == 200
        pd_request_loads_kv()  # the decode engine looked P up with its key

    def every_process_is_still_up():
        for p in procs:
            assert p.alive(), p.name
        status, out = complete(serve.port, AUTH)
        assert status == 200, out

    for fn in (nested_json_is_refused_naming_the_limit, chunked_body_past_the_limit_is_refused_at_once,
               content_length_must_be_one_decimal_number, trickling_connections_do_not_starve_a_normal_client,
               a_slow_body_is_cut_at_its_deadline, one_address_cannot_hold_every_connection,
               spoofed_invalidate_and_hostile_frames_are_refused, partial_frames_cost_the_side_channel_little,
               admin_and_keys, every_process_is_still_up):
        checks.check(fn.__name__, fn)
finally:
    for p in procs:
        p.stop()
print(f"logs are in {tmp}")
checks.finish()
