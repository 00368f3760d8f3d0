"""Shared helpers for siesta's integration tests (Python standard library only).

Each test file is a script: `python3 test_x.py --siesta BIN --source REPO`.
It runs the real siesta binary as a subprocess and prints one line per check;
the script's exit code is 0 only if every check passed.
"""
import argparse
import array
import json
import os
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
