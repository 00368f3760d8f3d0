"""Shared helpers for siesta's integration tests (Python standard library only).

Each test file is a script: `python3 test_x.py --siesta BIN --source REPO`.
It runs the real siesta binary as a subprocess and prints one line per check;
the script's exit code is 0 only if every check passed.
"""
import argparse
import array
import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import traceback


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--siesta", required=True)
    p.add_argument("--source", required=True)
    return p.parse_args()


def run(cmd, input=None, timeout=300):
    """Runs cmd; returns (returncode, stdout, stderr)."""
    r = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


class SiestaProcess:
    """A siesta subprocess logging to LOG_DIR/NAME.log; its 'listening on http://HOST:PORT' line gives the port."""

    def __init__(self, siesta, name, argv, log_dir, env=None, log_level="info", start_timeout_s=60):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen([siesta, "--log-level", log_level, *argv], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=full_env)
        self.port = None
        end = time.monotonic() + start_timeout_s
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

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=15)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.log.close()
        return self.proc.returncode


def http_exchange(host, port, method, path, body=None, headers=None, timeout=60):
    """(status, headers {lowercase name: value}, body bytes) of one request; a dict or list body is sent as
    JSON, bytes as they are."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def http_request(port, method, path, body=None, headers=None, timeout=60):
    """(status, body bytes) of one request to 127.0.0.1:port; body is sent as JSON."""
    status, _, raw = http_exchange("127.0.0.1", port, method, path, body, headers, timeout)
    return status, raw


def completion_outcome(status, raw, stream):
    """What a client makes of one completion answer, streamed or not, for choice 0:
    ("done", "", token ids) or ("error", what went wrong, None); an answer vLLM ended with
    finish_reason abort is an error."""
    if status != 200:
        try:
            err = json.loads(raw)["error"]
            return "error", f"HTTP {status} {err['code']}: {err['message']}", None
        except Exception:  # noqa: BLE001 - an unreadable error body is itself the finding
            return "error", f"HTTP {status}, unreadable error body {raw[:200]!r}", None
    if not stream:
        c = json.loads(raw)["choices"][0]
        if c["finish_reason"] == "abort":
            return "error", "finish_reason abort", None
        return "done", "", c.get("token_ids")
    ids, finish, error = [], None, None
    lines = raw.decode().splitlines()
    if "data: [DONE]" not in lines:
        return "error", "the stream ended without [DONE]", None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = chunk["error"].get("message") or "an error event without a message"
            continue
        for c in chunk.get("choices", []):
            if c.get("index", 0) != 0:
                continue
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    if error:
        return "error", f"stream error: {error}", None
    if finish == "abort":
        return "error", "finish_reason abort", None
    return "done", "", ids


def parse_metrics(raw):
    """{name or name{labels}: value} of a /metrics page's bytes (model_name label dropped)."""
    out = {}
    for line in raw.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "").replace("{,", "{")
        out[name] = float(value)
    return out


def metrics(port):
    """parse_metrics of 127.0.0.1:port's /metrics."""
    status, raw = http_request(port, "GET", "/metrics", timeout=10)
    assert status == 200, status
    return parse_metrics(raw)


def run_record(source, on_cuda):
    """What a soak's JSON records about its run: the commit (SIESTA_COMMIT, else git in `source`),
    the UTC date and the machine (the GPU's name and driver when on_cuda)."""
    commit = os.environ.get("SIESTA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = None
    gpu = None
    if on_cuda:
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            gpu = None
    return {"commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "gpu": gpu, "uname": " ".join(os.uname())}}


def post_without_length(port, path, headers=b"", timeout=60):
    """POSTs with neither a body nor Content-Length (what `curl -X POST URL` sends), on a raw
    socket; returns (response head, response body, seconds until the server closed)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        t0 = time.monotonic()
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"Connection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        elapsed = time.monotonic() - t0
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body, elapsed


def read_safetensors(path):
    """{name: (dtype, shape, array)} for F32 tensors; other dtypes as raw bytes."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[b:e]
        if info["dtype"] == "F32":
            a = array.array("f")
            a.frombytes(raw)
            out[name] = (info["dtype"], info["shape"], a)
        else:
            out[name] = (info["dtype"], info["shape"], raw)
    return out


class Checks:
    """Collects named checks; exit code 1 if any failed."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, name, fn):
        try:
            fn()
            self.passed += 1
            print(f"PASS {name}", flush=True)
        except Exception:  # a failed assertion or an unexpected error both fail the check
            self.failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()

    def finish(self):
        print(f"{self.passed} passed, {self.failed} failed")
        sys.exit(1 if self.failed else 0)


def expect_clean_error(rc, stderr, needle):
    """A bad-input run: non-zero exit (not a signal), one line on stderr naming the problem."""
    assert rc > 0, f"expected a non-zero exit code, got {rc}; stderr: {stderr!r}"
    assert rc < 128, f"process died with a signal-like code {rc}: {stderr!r}"
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
