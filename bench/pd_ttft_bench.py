#!/usr/bin/env python3
"""P/D disaggregation, measured: a prefill engine (P), a decode engine (D) and
`siesta proxy` as processes, and a colocated `siesta serve` as the peer
measured in the same run. Each request has its own random prompt of
--prompt-tokens token ids (no prefix-cache hits), greedy, streamed.

Per request: TTFT through the proxy and on the colocated engine (first
streamed token), the KV bytes D loaded and the transfer time (the engine that
moves the bytes: P's writes in WRITE mode, D's reads in READ mode; from their
/metrics before and after, requests one at a time), D's load time (the load's
start to its KV in place: in WRITE mode it includes P's prefill), and whether
the tokens equal the colocated engine's. Prints one table; writes JSON with
the machine, date and commit to --out.

  bench/pd_ttft_bench.py --siesta build/bin/siesta --model DIR [--device cuda] [--backend ipc] [--mode write]
                    [--prompt-tokens 4096] [--requests 5] [--max-tokens 16] [--kv-cache-memory-bytes 8G]
                    [--out bench/results/pd_<case>.json]
SIESTA_COMMIT overrides the commit recorded (for runs outside a git checkout).
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Process:
    log_level = "info"

    def __init__(self, siesta, name, argv, logs, env=None):
        self.log_path = os.path.join(logs, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([siesta, "--log-level", Process.log_level, *argv], stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.port = None
        end = time.monotonic() + 600
        while time.monotonic() < end and self.port is None and self.proc.poll() is None:
            m = re.search(r"listening on http://[0-9.]+:(\d+)", open(self.log_path).read())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.2)
        if self.port is None:
            self.stop()
            sys.exit(f"{name} did not start: {open(self.log_path).read()[-3000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "").replace("{,", "{")
            out[name] = float(value)
    return out


def stream(port, body, timeout):
    """(ttft seconds, token ids) of one streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.monotonic()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        sys.exit(f"HTTP {r.status}: {r.read()[:500]}")
    ttft, ids = None, []
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            sys.exit(f"stream error: {chunk}")
        for c in chunk.get("choices", []):
            if c.get("token_ids"):
                if ttft is None:
                    ttft = time.monotonic() - start
                ids += c["token_ids"]
    conn.close()
    return ttft, ids


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--siesta", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--p-device", default="", help="P's (and the colocated engine's) --device; default --device")
    p.add_argument("--d-device", default="", help="D's --device; default --device (e.g. cuda:1 for another GPU)")
    p.add_argument("--golden", default="",
                   help="golden prompts JSON (tests/data/golden/...): each, greedy, 24 tokens, through P/D and "
                        "colocated; the token ids must be equal")
    p.add_argument("--backend", default="ipc")
    p.add_argument("--mode", default="write")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", default="8G")
    p.add_argument("--extra", default="", help="more siesta serve flags, space separated")
    p.add_argument("--ipc-copy", default="", help="the ipc backend's ipc_copy (auto, kernel, copy_engine)")
    p.add_argument("--keep-logs", default="", help="copy the processes' logs into this folder")
    p.add_argument("--log-level", default="", help="siesta's --log-level for P, D and the colocated engine")
    p.add_argument("--out", default="")
    a = p.parse_args()

    logs = tempfile.mkdtemp(prefix="siesta-pd-bench-")
    if a.log_level:
        Process.log_level = a.log_level
    serve = ["serve", "--model", a.model, "--port", "0", "--kv-cache-memory-bytes",
             a.kv_cache_memory_bytes, "--max-model-len", str(a.prompt_tokens + a.max_tokens + 16), "--seed", "0",
             *a.extra.split()]
    p_device = ["--device", a.p_device or a.device]
    d_device = ["--device", a.d_device or a.device]

    # The side channel's shared secret (P and D must hold the same).
    key_file = os.path.join(logs, "side_channel.key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(32).hex())

    def cfg(role):
        extra = {"backend": a.backend, "mode": a.mode, "auth_key_file": key_file}
        if a.ipc_copy:
            extra["ipc_copy"] = a.ipc_copy
        return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role, "kv_connector_extra_config": extra})

    procs = []
    try:
        colocated = Process(a.siesta, "colocated", serve + p_device, logs)
        procs.append(colocated)
        prefill = Process(a.siesta, "prefill", serve + p_device + ["--kv-transfer-config", cfg("kv_producer")], logs)
        procs.append(prefill)
        decode = Process(a.siesta, "decode", serve + d_device + ["--kv-transfer-config", cfg("kv_consumer")], logs)
        procs.append(decode)
        proxy = Process(a.siesta, "proxy", ["proxy", "--port", "0", "--prefill", f"http://127.0.0.1:{prefill.port}",
                                            "--decode", f"http://127.0.0.1:{decode.port}", "--mode",
                                            "concurrent" if a.mode == "write" else "sequential"], logs)
        procs.append(proxy)
        mover = prefill if a.mode == "write" else decode
        golden = []
        if a.golden:
            for g in json.load(open(a.golden))["prompts"]:
                body = {"prompt": g["text"], "max_tokens": 24, "temperature": 0, "stream": True,
                        "return_token_ids": True, "ignore_eos": True}
                _, ids_pd = stream(proxy.port, body, 600)
                _, ids_c = stream(colocated.port, body, 600)
                golden.append({"prompt": g["text"][:40], "same_tokens": ids_pd == ids_c, "tokens": len(ids_pd)})
            same = sum(g["same_tokens"] for g in golden)
            print(f"golden prompts: {same} of {len(golden)} give the colocated engine's tokens through P/D")
        rng = random.Random(1)
        vocab = json.load(open(os.path.join(a.model, "config.json")))["vocab_size"]
        rows = []
        for i in range(a.requests + 1):  # the first warms up
            prompt = [rng.randrange(vocab // 8, vocab - 1000) for _ in range(a.prompt_tokens)]
            body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
                    "return_token_ids": True, "ignore_eos": True}
            before_m, before_d = metrics(mover.port), metrics(decode.port)
            ttft_pd, ids_pd = stream(proxy.port, body, 600)
            after_m, after_d = metrics(mover.port), metrics(decode.port)
            ttft_c, ids_c = stream(colocated.port, body, 600)
            if i == 0:
                continue
            d = lambda after, before, k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
            rows.append({
                "request": i,
                "prompt_tokens": a.prompt_tokens,
                "ttft_pd_s": ttft_pd,
                "ttft_colocated_s": ttft_c,
                "kv_bytes": d(after_d, before_d, "siesta:kv_load_bytes_total"),
                "transfer_s": d(after_m, before_m, "siesta:kv_transfer_seconds_sum"),
                "transfer_data_s": d(after_m, before_m, "siesta:kv_transfer_data_seconds_sum"),
                "load_s": d(after_d, before_d, "siesta:kv_load_seconds_sum"),
                "loaded": d(after_d, before_d, 'siesta:kv_loads_total{outcome="loaded"}'),
                "same_tokens": ids_pd == ids_c,
                "first_difference": next((j for j, (x, y) in enumerate(zip(ids_pd, ids_c)) if x != y), None),
            })
        print(f"{'req':>3} {'prompt':>6} {'TTFT P/D ms':>11} {'TTFT coloc ms':>13} {'KV MiB':>8} "
              f"{'xfer ms':>8} {'xfer/TTFT':>9} {'data ms':>8} {'data/TTFT':>9} {'load ms':>8} {'same':>5}")
        for r in rows:
            share = r["transfer_s"] / r["ttft_pd_s"] if r["ttft_pd_s"] else 0
            data_share = r["transfer_data_s"] / r["ttft_pd_s"] if r["ttft_pd_s"] else 0
            print(f"{r['request']:>3} {r['prompt_tokens']:>6} {r['ttft_pd_s'] * 1e3:>11.2f} "
                  f"{r['ttft_colocated_s'] * 1e3:>13.2f} {r['kv_bytes'] / 2**20:>8.1f} {r['transfer_s'] * 1e3:>8.3f} "
                  f"{share * 100:>8.2f}% {r['transfer_data_s'] * 1e3:>8.3f} {data_share * 100:>8.2f}% "
                  f"{r['load_s'] * 1e3:>8.2f} {str(r['same_tokens']):>5}")
        commit = os.environ.get("SIESTA_COMMIT") or subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip() if a.device.startswith("cuda") else ""
        result = {"bench": "pd", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit, "machine": {"host": platform.node(), "cpu": platform.processor(), "gpu": gpu},
                  "config": vars(a), "peer": "colocated siesta serve, same flags, same prompts, same run",
                  "golden": golden, "requests": rows}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {a.out}")
    except SystemExit:
        # A failed request: show why, from each process's log.
        for proc in procs:
            tail = open(proc.log_path).read().splitlines()[-25:]
            print(f"--- {os.path.basename(proc.log_path)} (last lines)\n" + "\n".join(tail), file=sys.stderr)
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
        if a.keep_logs:
            os.makedirs(a.keep_logs, exist_ok=True)
            for name in os.listdir(logs):
                shutil.copy(os.path.join(logs, name), a.keep_logs)


if __name__ == "__main__":
    main()
