"""Prefix-aware choice of the prefill engine: does it pay?

Two prefill engines and one decode engine (CPU, loopback, ipc) behind `siesta proxy`, once with
the prefill choice by prompt prefix (--prefix-affinity-chars 256, the default) and once by load
only (--prefix-affinity-chars 0). The workload: G groups of prompts, each group sharing a long
leading text (a system prompt, a document) and differing in its question, sent by C clients in a
shuffled order. Measured per run: the prefill engines' prefix-cache hit rate (hits / queried
tokens, siesta:prefix_cache_*), the prompt tokens they computed, the mean and p90 latency of a
request through the proxy and the requests per second; and, as the limit, the same workload on
ONE prefill engine (every shared prefix meets one cache: the best hit rate the fleet can reach).

  python3 bench/prefix_routing_bench.py --siesta build/bin/siesta --source . \
      --json bench/results/prefix_routing.json
"""
import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from siesta_test_util import SiestaProcess, metrics  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--siesta", required=True)
ap.add_argument("--source", required=True)
ap.add_argument("--groups", type=int, default=8)
ap.add_argument("--per-group", type=int, default=8)
ap.add_argument("--clients", type=int, default=4)
ap.add_argument("--prefix-words", type=int, default=300)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--json", default=None)
args = ap.parse_args()

MODEL = os.path.join(args.source, "models", "tiny-qwen3")
tmp = tempfile.mkdtemp(prefix="siesta-prefix-bench-")
KEY = os.path.join(tmp, "key")
with open(os.open(KEY, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(os.urandom(32).hex() + "\n")
SERVE = ["serve", "--model", MODEL, "--port", "0", "--kv-cache-memory-bytes", "96M", "--max-model-len", "4096",
         "--threads", "1", "--seed", "0"]


def kv(role):
    return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role,
                       "kv_connector_extra_config": {"backend": "ipc", "mode": "write", "auth_key_file": KEY}})


def workload():
    rng = random.Random(args.seed)
    words = ("prefill engines keep the keys and values of prompts they computed in a prefix cache so that a "
             "later prompt with the same leading text computes only its own tail").split()
    reqs = []
    for g in range(args.groups):
        prefix = f"Document {g}: " + " ".join(rng.choice(words) for _ in range(args.prefix_words)) + "\n"
        for q in range(args.per_group):
            reqs.append({"prompt": prefix + f"Question {q} about document {g}: what does it say?",
                         "max_tokens": 2, "temperature": 0})
    rng.shuffle(reqs)
    return reqs


def post(port, body):
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        return time.monotonic() - t0, r.getheader("x-siesta-prefill")
    finally:
        conn.close()


def run(label, n_prefill, affinity_chars):
    ps = [SiestaProcess(args.siesta, f"{label}-P{i}", [*SERVE, "--kv-transfer-config", kv("kv_producer")], tmp)
          for i in range(n_prefill)]
    d = SiestaProcess(args.siesta, f"{label}-D", [*SERVE, "--kv-transfer-config", kv("kv_consumer")], tmp)
    proxy = SiestaProcess(args.siesta, f"{label}-proxy",
                          ["proxy", "--port", "0", "--prefill", ",".join(p.url for p in ps), "--decode", d.url,
                           "--prefix-affinity-chars", str(affinity_chars), "--health-interval-s", "0.5"], tmp)
    try:
        reqs = workload()
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            out = list(pool.map(lambda b: post(proxy.port, b), reqs))
        wall = time.monotonic() - t0
        lat = sorted(x[0] for x in out)
        hits = queries = computed = 0.0
        for p in ps:
            m = metrics(p.port)
            hits += m.get("siesta:prefix_cache_hits_total", 0)
            queries += m.get("siesta:prefix_cache_queries_total", 0)
            computed += m.get("siesta:prompt_tokens_total", 0)
        return {"run": label, "prefill_engines": n_prefill, "prefix_affinity_chars": affinity_chars,
                "requests": len(reqs), "hit_rate": round(hits / queries, 4) if queries else 0,
                "prompt_tokens_queried": queries, "prefix_cache_hit_tokens": hits,
                "mean_latency_s": round(statistics.mean(lat), 4), "p90_latency_s": round(lat[int(0.9 * len(lat))], 4),
                "requests_per_s": round(len(reqs) / wall, 3),
                "served_by": {u: sum(1 for _, h in out if h == u) for u in {h for _, h in out}}}
    finally:
        for p in (proxy, d, *ps):
            p.stop()


rows = [run("affinity", 2, 256), run("load-only", 2, 0), run("one-P", 1, 0)]
print(f"{'run':<10} {'P':>2} {'hit rate':>9} {'mean s':>8} {'p90 s':>8} {'req/s':>7}")
for r in rows:
    print(f"{r['run']:<10} {r['prefill_engines']:>2} {r['hit_rate']:>9.3f} {r['mean_latency_s']:>8.3f} "
          f"{r['p90_latency_s']:>8.3f} {r['requests_per_s']:>7.2f}")
if args.json:
    commit = subprocess.run(["git", "-C", args.source, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(args.json, "w") as f:
        json.dump({"bench": "prefix_routing", "machine": f"{platform.node()} ({os.cpu_count()} CPUs, shared)",
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "commit": commit, "workload": {"groups": args.groups, "per_group": args.per_group,
                                                  "clients": args.clients, "prefix_words": args.prefix_words,
                                                  "max_tokens": 2},
                   "limit": "one-P: every shared prefix meets one prefix cache", "runs": rows}, f, indent=1)
        f.write("\n")
