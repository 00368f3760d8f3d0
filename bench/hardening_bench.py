#!/usr/bin/env python3
"""What hostile clients and peers on loopback cost `siesta serve`, `siesta
proxy` and the side channel of a P/D pair, measured against one or more
siesta binaries in the same run (e.g. before and after a change):

  slow clients   the worst time a normal client waits for GET /health while N
                 connections each send one byte of a request head per second
                 (serve with its default workers, max-num-seqs 256 + 64, and
                 the proxy with --max-connections 128), and how many of those
                 connections are still open after 15 s
  chunked body   a 200 MiB chunked POST to serve and to the proxy: the answer,
                 the bytes sent before it, the peak RSS it added
  partial frames 60 connections to a prefill engine's side channel, each
                 sending a MESSAGE header of 4 MiB and 4 MiB - 1 bytes of it:
                 the RSS they added while open and after they closed
  spoofed INVALIDATE  one INVALIDATE naming the decode engine with epoch
                 2^64-1, sent to the prefill engine without any key: whether
                 the next requests through the proxy still load their KV

  python3 bench/hardening_bench.py --binary before@COMMIT=/path/siesta --binary after=build/bin/siesta

(LABEL@COMMIT records the commit a binary was built from; the default is this checkout's.)

Writes --out (bench/results/hardening.json): machine, date, commit, and per
binary every figure; prints one table.
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import re
import socket
import struct
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "tiny-qwen3")
SERVE = ["--threads", "1", "--kv-cache-memory-bytes", "64M", "--max-model-len", "1024", "--seed", "0"]


class Proc:
    def __init__(self, binary, argv, log):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([binary, "--log-level", "warn", *argv], stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = log
        self.port = None
        end = time.monotonic() + 120
        while time.monotonic() < end and self.proc.poll() is None:
            m = re.search(r"listening on http://[0-9.]+:(\d+)", open(log).read())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.05)
        if self.port is None:
            raise RuntimeError(f"did not start: {open(log).read()[-2000:]}")

    def status(self, field):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def get(port, path, timeout=60, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def slow_clients(port, n, seconds=15):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        socks.append(s)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nX-Slow: "
    worst = 0.0
    blocked = 0
    t_end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < t_end:
        for s in socks:
            try:
                s.send(head[i:i + 1] if i < len(head) else b"x")
            except OSError:
                pass
        i += 1
        t0 = time.monotonic()
        try:
            get(port, "/health", timeout=30)
        except OSError:
            blocked += 1
        worst = max(worst, time.monotonic() - t0)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    still_open = 0  # neither answered (408) nor closed by the server
    for s in socks:
        try:
            s.recv(65536)
        except BlockingIOError:
            still_open += 1
        except OSError:
            pass
        s.close()
    return {"connections": n, "worst_normal_request_s": round(worst, 3), "normal_requests_failed": blocked,
            "slow_connections_open_at_end": still_open}


def chunked_body(proc, total=200 << 20):
    before = proc.status("VmHWM")
    s = socket.create_connection(("127.0.0.1", proc.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n"
    sent = 0
    t0 = time.monotonic()
    try:
        while sent < total:
            s.sendall(chunk)
            sent += 1 << 20
        s.sendall(b"0\r\n\r\n")
    except OSError:
        pass
    s.settimeout(60)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            more = s.recv(65536)
            if not more:
                break
            data += more
    except OSError:
        pass
    s.close()
    m = re.match(rb"HTTP/1\.1 (\d+)", data)
    return {"status": int(m.group(1)) if m else None, "bytes_sent": sent, "seconds": round(time.monotonic() - t0, 2),
            "peak_rss_added_mb": round((proc.status("VmHWM") - before) / 2**20, 1)}


def frame(ftype, payload):
    return struct.pack("<IHHI", 0x53454953, 1, ftype, len(payload)) + payload


def side_channel_of(port, headers):
    status, body = get(port, "/kv_transfer_info", headers=headers)
    info = json.loads(body)
    host, p = info["side_channel_address"].rsplit(":", 1)
    return info["engine_id"], (host, int(p))


def partial_frames(p, address, n=60):
    before = p.status("VmRSS")
    socks = []
    part = frame(7, b"")[:8] + struct.pack("<I", (4 << 20) - 1)
    for _ in range(n):
        s = socket.create_connection(address, timeout=10)
        try:
            s.sendall(part)
            s.sendall(b"m" * ((4 << 20) - 2))
        except OSError:
            pass
        socks.append(s)
    time.sleep(1.0)
    held = p.status("VmRSS") - before
    open_count = 0
    for s in socks:
        s.setblocking(False)
        try:
            open_count += s.recv(1) != b""
        except BlockingIOError:
            open_count += 1
        except OSError:
            pass
        s.close()
    time.sleep(1.0)
    return {"connections": n, "rss_added_while_open_mb": round(held / 2**20, 1),
            "connections_still_open": open_count,
            "rss_added_after_close_mb": round((p.status("VmRSS") - before) / 2**20, 1)}


def loads(port, headers):
    _, text = get(port, "/metrics", headers=headers)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith("siesta:kv_loads_total{") and 'outcome="loaded"' in line)


def complete(port, headers):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = json.dumps({"model": MODEL, "prompt": "A prompt long enough for one block of sixteen tokens or more",
                           "max_tokens": 2, "temperature": 0})
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json", **headers})
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def spoofed_invalidate(p, d, proxy, headers):
    d_id, _ = side_channel_of(d.port, headers)
    _, address = side_channel_of(p.port, headers)
    before = loads(d.port, headers)
    ok = [complete(proxy.port, headers) for _ in range(3)]
    loaded_before = loads(d.port, headers) - before
    s = socket.create_connection(address, timeout=5)
    s.sendall(frame(3, struct.pack("<I", len(d_id)) + d_id.encode() + struct.pack("<Q", 2**64 - 1)))
    s.settimeout(5)
    try:
        answer = s.recv(65536)
    except OSError:
        answer = b""
    s.close()
    kinds = {4: "ACK", 6: "ERROR"}
    answered = kinds.get(struct.unpack("<H", answer[6:8])[0], "?") if len(answer) >= 8 else "closed"
    mid = loads(d.port, headers)
    ok += [complete(proxy.port, headers) for _ in range(3)]
    return {"answer_to_spoof": answered, "loads_of_3_before": loaded_before,
            "loads_of_3_after": loads(d.port, headers) - mid, "requests_ok": all(x == 200 for x in ok)}


def measure(label, binary, logs):
    out = {"label": label, "binary": binary}
    help_text = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True).stdout
    keyed = "--max-json-depth" in help_text  # a build with the side channel's key
    key_file = os.path.join(logs, "key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(32).hex())

    def kv(role):
        extra = {"backend": "ipc", "mode": "write"}
        if keyed:
            extra["auth_key_file"] = key_file
        return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role, "kv_connector_extra_config": extra})

    procs = []
    try:
        serve = Proc(binary, ["serve", "--model", MODEL, "--port", "0", *SERVE], f"{logs}/{label}-serve.log")
        procs.append(serve)
        p = Proc(binary, ["serve", "--model", MODEL, "--port", "0", *SERVE, "--kv-transfer-config", kv("kv_producer")],
                 f"{logs}/{label}-p.log")
        procs.append(p)
        d = Proc(binary, ["serve", "--model", MODEL, "--port", "0", *SERVE, "--kv-transfer-config", kv("kv_consumer")],
                 f"{logs}/{label}-d.log")
        procs.append(d)
        proxy = Proc(binary, ["proxy", "--port", "0", "--prefill", f"http://127.0.0.1:{p.port}", "--decode",
                              f"http://127.0.0.1:{d.port}"], f"{logs}/{label}-proxy.log")
        procs.append(proxy)
        out["slow_clients"] = {"serve": [slow_clients(serve.port, n) for n in (0, 129, 321, 600)],
                               "proxy": [slow_clients(proxy.port, n) for n in (0, 129, 321, 600)]}
        out["chunked_200mib"] = {"serve": chunked_body(serve), "proxy": chunked_body(proxy)}
        out["spoofed_invalidate"] = spoofed_invalidate(p, d, proxy, {})
        _, address = side_channel_of(p.port, {})
        out["partial_frames"] = partial_frames(p, address)
        out["alive_at_end"] = {"serve": serve.alive(), "prefill": p.alive(), "decode": d.alive(), "proxy": proxy.alive()}
    finally:
        for x in procs:
            x.stop()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", action="append", required=True, help="LABEL[@COMMIT]=PATH, repeatable")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "hardening.json"))
    a = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="siesta-hardening-bench-")
    with open("/proc/cpuinfo") as f:
        cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "unknown")
    commit = os.environ.get("SIESTA_COMMIT") or subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"],
                                                                capture_output=True, text=True).stdout.strip()
    result = {"machine": {"hostname": platform.node(), "cpu": cpu, "cpus": os.cpu_count(),
                          "load_average_at_start": list(os.getloadavg())},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit, "runs": []}
    for spec in a.binary:
        label, path = spec.split("=", 1)
        label, _, built_from = label.partition("@")
        run = measure(label, os.path.abspath(path), logs)
        run["built_from"] = built_from or commit
        result["runs"].append(run)
    print(f"{'':10} {'what':46} " + " ".join(f"{r['label']:>16}" for r in result["runs"]))

    def row(what, get_value):
        print(f"{'':10} {what:46} " + " ".join(f"{str(get_value(r)):>16}" for r in result["runs"]))

    for who in ("serve", "proxy"):
        for i, n in enumerate((0, 129, 321, 600)):
            row(f"{who}: worst /health wait, {n} slow conns (s)", lambda r: r["slow_clients"][who][i]["worst_normal_request_s"])
        row(f"{who}: slow conns open after 15 s (of 600)", lambda r: r["slow_clients"][who][3]["slow_connections_open_at_end"])
        row(f"{who}: 200 MiB chunked: status", lambda r: r["chunked_200mib"][who]["status"])
        row(f"{who}: 200 MiB chunked: MiB sent", lambda r: r["chunked_200mib"][who]["bytes_sent"] >> 20)
        row(f"{who}: 200 MiB chunked: peak RSS added (MiB)", lambda r: r["chunked_200mib"][who]["peak_rss_added_mb"])
    row("P: 60 partial 4 MiB frames: RSS added (MiB)", lambda r: r["partial_frames"]["rss_added_while_open_mb"])
    row("P: ... still open after 1 s", lambda r: r["partial_frames"]["connections_still_open"])
    row("P: ... RSS added after close (MiB)", lambda r: r["partial_frames"]["rss_added_after_close_mb"])
    row("spoofed INVALIDATE: answer", lambda r: r["spoofed_invalidate"]["answer_to_spoof"])
    row("spoofed INVALIDATE: loads of 3 after", lambda r: r["spoofed_invalidate"]["loads_of_3_after"])
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
