"""Sleep x P/D under load: a prefill engine (P), a decode engine (D) and `siesta proxy`, with a dozen
clients streaming requests through the proxy while random lifecycle calls hit P, D or both.

For each backend/mode pair (ipc or ucx; WRITE with the proxy's --mode concurrent, READ with
--mode sequential) it runs a soak: 12+ client threads send a mix of requests (completions and chat,
streamed and not, greedy and seeded, prompts of many lengths, shared prefixes) while an operator
thread calls, on P, D or both at once: sleep level 1 or 2 (modes keep and abort), full and selective
wake (weights first, then kv_cache), reload_weights, pause keep/wait/abort with and without
clear_cache, release_kv_cache_memory, reset_prefix_cache of running requests. Every outcome is counted:
  ok       the tokens equal the same request sent alone to a colocated engine
  wrong    the request completed with other tokens
  errored  finish_reason "abort" (vLLM's answer to a request an abort ended, with what it generated) or
           an error answer; allowed only for requests in flight while an abort-mode call ran on an engine,
           and each must say so (the finish reason, or an error with a message)
  lost     no answer within the client's deadline
and the check asserts: 0 wrong, 0 lost, 0 errors outside abort calls, every admin call answered 200,
every sleep and release left the KV cache released (and on CUDA the device's used memory lower than
when everything was awake by 90% of what the call released, cuMemGetInfo through GET /memory),
both engines running at the end, within 2 s of the last request 0 blocks held for remote readers,
for loads or in use on either engine, each engine's pool resident again as when it was awake, and
its mapped shared memory (RssShmem: the KV cache and weights live in memfds on the CPU) within 1% of
its awake level. The invalidation metrics (sent, acked, handshakes, epoch) must have moved.

On the CPU two more pairs run P and D at different tensor-parallel sizes (ucx/read with P tp 2 -> D tp 1,
ipc/write with P tp 1 -> D tp 2: the CPU model sharded in one process), against the same TP=1 colocated
engine. CI runs every pair for a bounded time (--duration-s, default 22 s each). The same script is the
long form and the device form:
  python3 tests/integration/test_pd_soak.py --siesta build/bin/siesta --source . \
      --duration-s 300 --pairs ipc/write,ucx/read --device cuda --extra-serve-args=--batch-invariant \
      --json bench/results/pd_soak_cuda.json
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import (Checks, SiestaProcess, completion_outcome, http_request, metrics,  # noqa: E402
                               run_record)

ap = argparse.ArgumentParser()
ap.add_argument("--siesta", required=True)
ap.add_argument("--source", required=True)
ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny Qwen3)")
ap.add_argument("--pairs", default=None,
                help="backend/mode[/tpP-D] pairs, e.g. ipc/write,ucx/read/tp2-1 (P of tensor-parallel size 2, D of 1); "
                     "default: all four, and on the CPU ucx/read with P tp 2 -> D tp 1 and ipc/write with P tp 1 -> "
                     "D tp 2")
ap.add_argument("--duration-s", type=float, default=22.0, help="soak time per pair")
ap.add_argument("--clients", type=int, default=12)
ap.add_argument("--seed", type=int, default=None, help="operation and request mix (default: from the clock)")
ap.add_argument("--device", default="cpu")
ap.add_argument("--extra-serve-args", default="", help="more `siesta serve` flags for P, D and the reference")
ap.add_argument("--kv-bytes", default="96M")
ap.add_argument("--json", default=None, help="write the counts and timings here")
args = ap.parse_args()

SIESTA = args.siesta
MODEL = args.model or os.path.join(args.source, "models", "tiny-qwen3")
SEED = args.seed if args.seed is not None else int(time.time()) % 100000
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-soak-")
CLIENT_TIMEOUT_S = 90
ADMIN_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 4
ON_CUDA = args.device.startswith("cuda")
SERVE_ARGS = ["--kv-cache-memory-bytes", args.kv_bytes, "--max-model-len", "2048", "--seed", "0",
              "--max-num-seqs", "32", "--http-threads", "64", "--device", args.device]
if not ON_CUDA:
    SERVE_ARGS += ["--threads", "1"]
SERVE_ARGS += [a for a in args.extra_serve_args.split() if a]
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
print(f"soak seed {SEED} (pass --seed {SEED} to repeat the operation and request mix)", flush=True)


class Process(SiestaProcess):
    """A siesta subprocess, with what the soak reads of its memory."""

    def __init__(self, name, argv, env=None):
        super().__init__(SIESTA, name, argv, tmp, env=env, log_level=os.environ.get("SIESTA_SOAK_LOG_LEVEL", "info"),
                         start_timeout_s=120)

    def memfd_mapped(self):
        """Bytes of memfd mappings (its own pool's and the peer memory it imported) in the process."""
        total = 0
        with open(f"/proc/{self.proc.pid}/maps") as f:
            for line in f:
                if "/memfd:" not in line:
                    continue
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
        return total

    def rss_shmem(self):
        """(RssShmem, RssAnon) of the process in bytes."""
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssShmem", "RssAnon"):
                    out[k] = int(v.split()[0]) * 1024
        return out.get("RssShmem", 0), out.get("RssAnon", 0)


# The side channel's shared secret, in a file (as the demo passes it).
AUTH_KEY_FILE = os.path.join(tmp, "side_channel.key")
with open(os.open(AUTH_KEY_FILE, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(os.urandom(32).hex() + "\n")


def kv_config(role, backend, mode):
    return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role,
                       "kv_connector_extra_config": {
                           "backend": backend, "mode": mode, "load_timeout_s": LOAD_TIMEOUT_S,
                           "transfer_timeout_s": 3, "message_timeout_s": 2, "hold_timeout_s": 60,
                           "write_grace_s": 1, "worker_threads": 4, "auth_key_file": AUTH_KEY_FILE}})


def serve(name, *extra, env=None):
    return Process(name, ["serve", "--model", MODEL, "--port", "0", "--enable-sleep-mode", *SERVE_ARGS, *extra],
                   env=env)


HELD_KEYS = ("siesta:kv_blocks_in_use", "siesta:kv_blocks_held_for_remote", "siesta:kv_blocks_held_for_loads")


def held(port):
    m = metrics(port)
    return {k: m.get(k) for k in HELD_KEYS}


# ---- requests ------------------------------------------------------------------------------

WORDS = ("sleep mode lets an inference server give its memory back while a trainer uses the device and take it "
         "again later at the same addresses prefill and decode run on separate engines the keys and values of "
         "each prompt move between them block by block").split()
SHARED = [
    "You are a careful assistant. Answer briefly and precisely. ",
    " ".join(WORDS) + ". ",
    " ".join(WORDS * 4) + ". Summary of the discussion so far: ",
]


def make_specs(n, rng):
    specs = []
    for i in range(n):
        prefix = rng.choice(SHARED) if rng.random() < 0.6 else ""
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 4, 12, 30, 80])))
        prompt = f"{prefix}{tail} (soak question {i})"
        body = {"max_tokens": rng.choice([1, 4, 8, 16, 32]), "stream": rng.random() < 0.5,
                "return_token_ids": True, "ignore_eos": True}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update({"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)})
        if rng.random() < 0.25:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        specs.append((path, body))
    return specs


class Outcome:
    def __init__(self, kind, detail=""):
        self.kind = kind      # "done" | "error" | "lost"
        self.detail = detail
        self.tokens = None


def generate(port, path, body, headers, timeout=CLIENT_TIMEOUT_S):
    """What a client sees of choice 0: Outcome with tokens, or an error / lost outcome."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h = {"Content-Type": "application/json"}
        h.update(headers)
        conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
        r = conn.getresponse()
        kind, detail, tokens = completion_outcome(r.status, r.read(), body.get("stream"))
        o = Outcome(kind, detail)
        o.tokens = tokens
        return o
    except (socket.timeout, TimeoutError):
        return Outcome("lost", f"no answer within {timeout} s")
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Outcome("error", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


# ---- lifecycle operations ------------------------------------------------------------------

class Operator:
    """Runs random lifecycle scenarios on P, D or both; records every admin call and abort window."""

    def __init__(self, engines, rng):
        self.engines = engines  # {"P": Process, "D": Process}
        self.rng = rng
        self.calls = []         # (engine, path, status, seconds, body)
        self.abort_windows = []  # (engine, start, end)
        self.releases = []       # (engine, path, memory right after the call)
        self.scenarios = []
        self.lock = threading.Lock()

    def call(self, who, path, body=None):
        start = time.monotonic()
        # vLLM's answers by default (an empty /sleep, {"status": "paused"}, ...); siesta's whole status with
        # verbose=true: both are exercised.
        if self.rng.random() < 0.5:
            path += ("&" if "?" in path else "?") + "verbose=true"
        sep = "&" if "?" in path else "?"
        try:
            status, raw = http_request(self.engines[who].port, "POST", f"{path}{sep}timeout={ADMIN_TIMEOUT_S}", body,
                                       timeout=ADMIN_TIMEOUT_S + 30)
            try:
                j = json.loads(raw) if raw else None
            except ValueError:
                j = {"raw": raw[:300].decode(errors="replace")}
        except OSError as e:
            status, j = None, {"error": str(e)}
        end = time.monotonic()
        if status == 200 and path.startswith("/reset_prefix_cache") and "verbose=true" not in path:
            # vLLM's answer: 200 with {"success": false} when the cache could not be reset.
            if not (isinstance(j, dict) and j.get("success") is True):
                status = f"200 without success: {j}"
        releases = status == 200 and ("/sleep?level=1" in path or "/sleep?level=2" in path or "release_kv" in path)
        memory = None
        if releases:
            # What the engine holds right after it released: its KV cache none; on CUDA the device's
            # memory in use (cuMemGetInfo, device-wide) is what the call gave back lower than when all was awake.
            try:
                st, raw = http_request(self.engines[who].port, "GET", "/memory", timeout=20)
                m = json.loads(raw) if st == 200 else {}
                memory = {"kv_resident": m["tags"]["kv_cache"]["resident_bytes"],
                          "device_used": m["device"].get("used_bytes"),
                          "released": sum(t["released_bytes"] for t in m["tags"].values())}
            except (OSError, ValueError, KeyError) as e:
                memory = {"error": str(e)}
        with self.lock:
            self.calls.append((who, path, status, end - start, j))
            if memory is not None:
                self.releases.append((who, path, memory))
            if "mode=abort" in path:
                self.abort_windows.append((who, start, end))
        return status, j

    def pause_between(self):
        time.sleep(self.rng.uniform(0.1, 0.8))

    def scenario(self, who):
        """One lifecycle scenario on one engine; it ends with the engine running."""
        r = self.rng
        kind = r.choice(["sleep1", "sleep1", "sleep2", "sleep2", "pause", "pause", "release", "reload", "reset"])
        mode = r.choice(["keep", "abort", "keep"])
        if kind == "sleep1":
            self.call(who, f"/sleep?level=1&mode={mode}")
            self.pause_between()
            if r.random() < 0.5:
                self.call(who, "/wake_up")
            else:
                self.call(who, "/wake_up?tags=weights")
                self.pause_between()
                self.call(who, "/wake_up?tags=kv_cache")
        elif kind == "sleep2":
            self.call(who, f"/sleep?level=2&mode={mode}")
            self.pause_between()
            if r.random() < 0.4:
                self.call(who, "/wake_up")  # reads the checkpoint again
            else:
                self.call(who, "/wake_up?tags=weights")
                self.call(who, "/reload_weights")
                self.pause_between()
                self.call(who, "/wake_up?tags=kv_cache")
        elif kind == "pause":
            pmode = r.choice(["keep", "wait", "abort"])
            clear = r.choice(["true", "false"])
            self.call(who, f"/pause?mode={pmode}&clear_cache={clear}")
            self.pause_between()
            self.call(who, "/resume")
        elif kind == "release":
            clear = r.choice(["true", "false"])
            self.call(who, f"/pause?mode=keep&clear_cache={clear}")
            self.call(who, "/release_kv_cache_memory")
            self.pause_between()
            self.call(who, "/wake_up?tags=kv_cache")
            self.call(who, "/resume")
        elif kind == "reload":
            self.call(who, "/pause?mode=keep&clear_cache=false")
            self.call(who, "/reload_weights")
            self.call(who, "/resume")
        else:
            # While serving: running requests recompute, transfers end, the prefix cache empties.
            self.call(who, "/reset_prefix_cache?reset_running_requests=true")
        return kind

    def run(self, stop_at):
        while time.monotonic() < stop_at:
            target = self.rng.choice(["P", "D", "both"])
            if target == "both":
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    kinds = list(pool.map(self.scenario, ["P", "D"]))
                self.scenarios.append(("both", kinds))
            else:
                self.scenarios.append((target, [self.scenario(target)]))
            time.sleep(self.rng.uniform(0.2, 1.0))


# ---- one pair ------------------------------------------------------------------------------

def awake_memory(proc):
    status, raw = http_request(proc.port, "GET", "/memory", timeout=20)
    assert status == 200, (status, raw[:300])
    j = json.loads(raw)
    return {t: v["resident_bytes"] for t, v in j["tags"].items()}, j


def soak_pair(backend, mode, results, p_tp=1, d_tp=1):
    tag = f"{backend}-{mode}" + (f"-tp{p_tp}-{d_tp}" if (p_tp, d_tp) != (1, 1) else "")
    rng = random.Random(SEED ^ zlib.crc32(tag.encode()))
    env = UCX_ENV if backend == "ucx" else None
    p = serve(f"P-{tag}", "--kv-transfer-config", kv_config("kv_producer", backend, mode),
              "--tensor-parallel-size", str(p_tp), env=env)
    d = serve(f"D-{tag}", "--kv-transfer-config", kv_config("kv_consumer", backend, mode),
              "--tensor-parallel-size", str(d_tp), env=env)
    proxy = Process(f"proxy-{tag}", ["proxy", "--port", "0", "--prefill", p.url, "--decode", d.url,
                                     "--mode", "concurrent" if mode == "write" else "sequential",
                                     "--timeout-s", "60", "--health-interval-s", "1"])
    engines = {"P": p, "D": d}
    summary = {"pair": tag, "seed": SEED}
    try:
        specs = make_specs(48, rng)
        refs = [generate(colocated.port, path, body, {}).tokens for path, body in specs]
        assert all(r is not None for r in refs), "the colocated engine failed a reference request"
        # Warm both engines, then take their awake memory.
        for i in range(4):
            path, body = specs[i]
            o = generate(proxy.port, path, body, {"X-Request-Id": f"{tag}-warm-{i}-{time.monotonic_ns()}"})
            assert o.kind == "done" and o.tokens == refs[i], (o.kind, o.detail)
        awake = {who: awake_memory(e)[0] for who, e in engines.items()}
        device_used_awake = awake_memory(p)[1]["device"].get("used_bytes")
        mapped_awake = {who: e.memfd_mapped() for who, e in engines.items()}
        before = {who: metrics(e.port) for who, e in engines.items()}

        outcomes = []  # (spec index, start, end, Outcome)
        out_lock = threading.Lock()
        stop = threading.Event()

        def client(cid):
            crng = random.Random(SEED * 1000 + cid)
            n = 0
            while not stop.is_set():
                i = crng.randrange(len(specs))
                path, body = specs[i]
                start = time.monotonic()
                o = generate(proxy.port, path, body, {"X-Request-Id": f"{tag}-{cid}-{n}-{time.monotonic_ns()}"})
                end = time.monotonic()
                n += 1
                with out_lock:
                    outcomes.append((i, start, end, o))

        op_rng = random.Random(SEED * 7 + zlib.crc32(tag.encode()))
        operator = Operator(engines, op_rng)
        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
        for t in threads:
            t.start()
        operator.run(started + args.duration_s)
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S + 15)
        traffic_end = time.monotonic()
        stuck = sum(t.is_alive() for t in threads)

        counts = {"ok": 0, "wrong": 0, "errored_by_abort": 0, "errored_unexpected": 0, "lost": stuck}
        bad = []
        for i, start, end, o in outcomes:
            if o.kind == "lost":
                counts["lost"] += 1
                bad.append(("lost", specs[i], o.detail))
            elif o.kind == "error":
                in_abort = any(s - 0.05 <= end and start <= e + 0.5 for _, s, e in operator.abort_windows)
                # Clear: finish_reason "abort" (vLLM's), or an error answer with a message.
                clear = bool(o.detail) and "without a message" not in o.detail and "unreadable" not in o.detail
                if in_abort and clear:
                    counts["errored_by_abort"] += 1
                else:
                    counts["errored_unexpected"] += 1
                    bad.append(("error", specs[i], o.detail, round(start - started, 2), round(end - started, 2)))
            elif o.tokens == refs[i]:
                counts["ok"] += 1
            else:
                counts["wrong"] += 1
                bad.append(("wrong", specs[i], o.tokens, refs[i]))
        failed_calls = [(w, pth, st, round(sec, 2), j) for w, pth, st, sec, j in operator.calls if st != 200]
        summary.update({"counts": counts, "requests": len(outcomes), "admin_calls": len(operator.calls),
                        "admin_failed": len(failed_calls), "scenarios": operator.scenarios,
                        "duration_s": round(traffic_end - started, 1),
                        "admin_seconds_max": round(max((c[3] for c in operator.calls), default=0), 3)})
        print(f"  {tag}: {len(outcomes)} requests {counts}, {len(operator.calls)} admin calls "
              f"({len(failed_calls)} failed), {len(operator.scenarios)} scenarios", flush=True)

        def no_wrong_lost_or_unexpected():
            assert counts["wrong"] == 0 and counts["lost"] == 0 and counts["errored_unexpected"] == 0, bad[:5]
            assert counts["ok"] >= len(outcomes) // 2, counts
        checks.check(f"{tag}: 0 wrong, 0 lost, errors only from abort calls", no_wrong_lost_or_unexpected)

        def every_admin_call_200():
            assert not failed_calls, failed_calls[:5]
        checks.check(f"{tag}: every admin call answered 200", every_admin_call_200)

        def every_release_frees_the_memory():
            assert operator.releases, "no sleep or release_kv_cache_memory succeeded"
            freed = []
            for who, path, m in operator.releases:
                assert "error" not in m, (who, path, m)
                assert m["kv_resident"] == 0, (who, path, m)
                if ON_CUDA and device_used_awake is not None:
                    # The device (shared by P, D and the reference) uses less than when everything was awake
                    # by at least 90% of what this engine's pool has released now; the other is at most awake.
                    assert m["device_used"] <= device_used_awake - 0.9 * m["released"], (who, path, m,
                                                                                         device_used_awake)
                    freed.append(device_used_awake - m["device_used"])
            summary["releases"] = len(operator.releases)
            if freed:
                summary["device_freed_bytes_min_max"] = [min(freed), max(freed)]
        checks.check(f"{tag}: every sleep and release gave its memory back", every_release_frees_the_memory)

        def running_and_nothing_held():
            for who, e in engines.items():
                status, raw = http_request(e.port, "GET", "/is_sleeping")
                assert status == 200 and json.loads(raw) == {"is_sleeping": False}, (who, raw)
                status, raw = http_request(e.port, "GET", "/is_paused")
                assert status == 200 and json.loads(raw) == {"is_paused": False}, (who, raw)
            end = traffic_end + 2.0
            last = None
            while True:
                last = {who: held(e.port) for who, e in engines.items()}
                if all(v == 0 for h in last.values() for v in h.values()):
                    break
                assert time.monotonic() < end, f"blocks still held 2 s after the traffic stopped: {last}"
                time.sleep(0.05)
            summary["blocks_clear_after_s"] = round(time.monotonic() - traffic_end, 3)
        checks.check(f"{tag}: both engines running; 0 blocks held within 2 s", running_and_nothing_held)

        def memory_back():
            # A few requests as after the warm-up, so that each engine imported its peer's current memory again.
            for i in range(4):
                path, body = specs[i]
                o = generate(proxy.port, path, body, {"X-Request-Id": f"{tag}-after-{i}-{time.monotonic_ns()}"})
                assert o.kind == "done" and o.tokens == refs[i], (o.kind, o.detail)
            for who, e in engines.items():
                now, full = awake_memory(e)
                assert now == awake[who], (who, now, awake[who], full)
                mapped = e.memfd_mapped()
                shm, anon = e.rss_shmem()
                summary[f"memfd_mapped_{who}"] = [mapped_awake[who], mapped]
                summary[f"rss_shmem_{who}"] = shm
                summary[f"rss_anon_{who}"] = anon
                if not ON_CUDA:
                    # Its own pool and one import of the peer's KV cache, as when it was awake: no mapping of
                    # memory from before a sleep (its own or a peer's) survives.
                    assert abs(mapped - mapped_awake[who]) <= 0.01 * mapped_awake[who], \
                        (who, "memfd mappings", mapped, "awake", mapped_awake[who])
                    assert shm <= mapped, (who, "RssShmem", shm, "mapped", mapped)
        checks.check(f"{tag}: memory back to its awake level", memory_back)

        def invalidation_is_visible():
            after = {who: metrics(e.port) for who, e in engines.items()}
            slept = {w for w, pth, st, _, _ in operator.calls
                     if st == 200 and ("/sleep?level=1" in pth or "/sleep?level=2" in pth or "release_kv" in pth)}
            for who in slept:
                m, b = after[who], before[who]
                sent = m.get("siesta:kv_invalidations_sent_total", 0) - b.get("siesta:kv_invalidations_sent_total", 0)
                acked = m.get("siesta:kv_invalidation_acks_total", 0) - b.get("siesta:kv_invalidation_acks_total", 0)
                assert "siesta:kv_invalidations_unanswered_total" in m, sorted(m)
                assert m.get("siesta:kv_epoch", 0) > b.get("siesta:kv_epoch", 0), (who, "epoch did not move")
                # The peer that fetched our metadata was told, unless it had not handshaken since our last release.
                assert acked <= sent, (who, sent, acked)
                summary[f"invalidations_{who}"] = {"sent": sent, "acked": acked}
            handshakes = sum(after[w].get("siesta:kv_peer_handshakes_total", 0) for w in after)
            assert handshakes > 0, "no peer handshake was counted"
            # The answers of /sleep and /release_kv_cache_memory name the peers invalidated (beside vLLM's
            # answer, or in siesta's whole status with verbose=true).
            for w, pth, st, _, j in operator.calls:
                if st == 200 and ("/sleep?level=1" in pth or "/sleep?level=2" in pth or "release_kv" in pth):
                    kv = (j or {}).get("kv_transfer") or (j or {}).get("call", {}).get("kv_transfer")
                    assert kv is not None and {"invalidated", "acked", "unanswered"} <= set(kv), (w, pth, j)
        checks.check(f"{tag}: invalidations and handshakes are counted and answered", invalidation_is_visible)
    finally:
        for proc in (proxy, d, p):
            proc.stop()
        results.append(summary)


colocated = None
results = []
try:
    colocated = serve("colocated")
    started = time.monotonic()
    pairs = args.pairs or ("ipc/write,ipc/read,ucx/write,ucx/read" +
                           ("" if ON_CUDA else ",ucx/read/tp2-1,ipc/write/tp1-2"))
    for pair in pairs.split(","):
        backend, mode, *tp = pair.split("/")
        p_tp, d_tp = (int(x) for x in tp[0].removeprefix("tp").split("-")) if tp else (1, 1)
        checks.check(f"{pair}: soak runs",
                     lambda b=backend, m=mode, pt=p_tp, dt=d_tp: soak_pair(b, m, results, pt, dt))
    print(f"soak took {time.monotonic() - started:.1f} s", flush=True)
finally:
    if colocated:
        colocated.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_record(args.source, ON_CUDA),
                       "seed": SEED, "device": args.device, "extra_serve_args": args.extra_serve_args,
                       "duration_s_per_pair": args.duration_s, "clients": args.clients, "pairs": results}, f,
                      indent=1)
    if checks.failed == 0 and not os.environ.get("SIESTA_TEST_KEEP_LOGS"):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"logs kept in {tmp}")
checks.finish()
