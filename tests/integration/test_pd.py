"""P/D disaggregation end to end: real `siesta serve` prefill (P) and decode (D)
processes with --kv-transfer-config, `siesta proxy` in front of them, and one
colocated `siesta serve` as the reference, all on loopback on the tiny CPU model.

For each transfer backend and mode (ipc and ucx over tcp; WRITE with the
proxy's --mode concurrent, READ with --mode sequential): mixed requests
(completions and chat, streamed and not, greedy and seeded sampling, prompts
of various lengths, shared prefixes, concurrent) through the proxy give the
colocated engine's tokens and text, and D really loaded P's KV (its
kv_loads_total{outcome="loaded"} grows). Then:
  - D sleeps (level 1) and wakes between requests, then P does: outputs stay
    identical and the KV keeps moving (the engines handshake again under the
    new epoch);
  - client disconnect at D: a request held at a paused D whose client hangs
    up makes P free the blocks it held for it (long before its hold deadline);
  - READ: P's hold expires before D reads: D recomputes and the output is
    still identical;
  - WRITE: P too slow (paused past D's load deadline): D computes the prompt
    itself and the output is still identical;
  - WRITE: P killed while its request waits: the client gets an error within
    the proxy's deadline and D holds no blocks once the write deadline passed;
  - after each combination P and D, idle, hold no blocks for remote readers
    or loads and have no block in use (nothing leaked).
P and D of different tensor-parallel sizes (P 2 -> D 1 over ipc/write, P 1 -> D 4
over ucx/read; the CPU model sharded in one process): the same mixed requests
and sleeps, equal to the colocated TP=1 engine.
A bad --kv-transfer-config is refused at startup with one line naming it.
"""
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import (Checks, SiestaProcess, expect_clean_error, http_request, metrics,  # noqa: E402
                              parse_args, run)

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-pd-")
HTTP_TIMEOUT_S = 60
PROXY_TIMEOUT_S = 20
LOAD_TIMEOUT_S = 4
WRITE_GRACE_S = 1
READ_HOLD_S = 3      # READ mode: P's hold deadline (the expiry check waits it out)
WRITE_HOLD_S = 60    # WRITE mode: long, so that only a reader (or its cancel) frees the blocks
SERVE_ARGS = ["--threads", "1", "--kv-cache-memory-bytes", "64M", "--max-model-len", "2048", "--seed", "0",
              "--max-num-seqs", "16", "--http-threads", "32"]
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(port, path, body, timeout=HTTP_TIMEOUT_S):
    status, raw = http_request(port, "POST", path, body, timeout=timeout)
    return status, (json.loads(raw) if raw else None)


def Process(name, argv, env=None):
    return SiestaProcess(SIESTA, name, argv, tmp, env=env)


# The side channel's shared secret, in a file (as the demo passes it).
AUTH_KEY_FILE = os.path.join(tmp, "side_channel.key")
with open(os.open(AUTH_KEY_FILE, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(os.urandom(32).hex() + "\n")


def kv_config(role, backend, mode, hold_s):
    return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role,
                       "kv_connector_extra_config": {
                           "backend": backend, "mode": mode, "load_timeout_s": LOAD_TIMEOUT_S,
                           "transfer_timeout_s": 3, "message_timeout_s": 2, "hold_timeout_s": hold_s,
                           "write_grace_s": WRITE_GRACE_S, "worker_threads": 2, "auth_key_file": AUTH_KEY_FILE}})


def serve(name, *extra, env=None, port=0):
    return Process(name, ["serve", "--model", MODEL, "--port", str(port), "--enable-sleep-mode", *SERVE_ARGS, *extra],
                   env=env)


def wait_for(predicate, within_s, what):
    end = time.monotonic() + within_s
    last = None
    while time.monotonic() < end:
        last = predicate()
        if last is True:
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {what} (last: {last})")


def no_blocks_held(port):
    m = metrics(port)
    keys = ("siesta:kv_blocks_in_use", "siesta:kv_blocks_held_for_remote", "siesta:kv_blocks_held_for_loads")
    vals = {k: m.get(k) for k in keys}
    return True if all(v == 0 for v in vals.values()) else vals


# ---- requests -----------------------------------------------------------------------

WORDS = ("sleep mode lets an inference server give its memory back while a trainer uses the device and take it "
         "again later at the same addresses prefill and decode run on separate engines the keys and values of "
         "each prompt move between them block by block").split()
SHARED = [
    "You are a careful assistant. Answer briefly and precisely. ",
    " ".join(WORDS) + ". ",
    " ".join(WORDS * 4) + ". Summary of the discussion so far: ",
]


def make_specs(n, seed):
    """n request specs: (path, body), mixed as the issue asks."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prefix = rng.choice(SHARED) if rng.random() < 0.7 else ""
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 60])))
        prompt = f"{prefix}{tail} (question {i % 7})"
        body = {"max_tokens": rng.choice([1, 2, 5, 8, 16, 24]), "stream": rng.random() < 0.5,
                "return_token_ids": True}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update({"temperature": 0.9, "top_p": 0.95, "seed": rng.randrange(1 << 30)})
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


def generate(port, path, body, headers=None):
    """What a client sees: (text, token ids, finish reason) of choice 0, or raises on an error."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
        r = conn.getresponse()
        if not body.get("stream"):
            raw = r.read()
            assert r.status == 200, (r.status, raw[:500])
            c = json.loads(raw)["choices"][0]
            text = c["message"]["content"] if "message" in c else c["text"]
            return text, c.get("token_ids"), c["finish_reason"]
        assert r.status == 200, (r.status, r.read()[:500])
        text, ids, finish = "", [], None
        for line in r.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk.get("choices", []):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                ids += c.get("token_ids") or []
                finish = c.get("finish_reason") or finish
        return text, ids, finish
    finally:
        conn.close()


reference_cache = {}


def reference(spec_key, path, body):
    if spec_key not in reference_cache:
        reference_cache[spec_key] = generate(colocated.port, path, body)
    return reference_cache[spec_key]


def run_and_compare(proxy, specs, tag, concurrency=4):
    """Sends every spec through the proxy (concurrently) and compares with the colocated engine."""
    def one(i):
        path, body = specs[i]
        got = generate(proxy.port, path, body, headers={"X-Request-Id": f"{tag}-{i}-{time.monotonic_ns()}"})
        want = reference(json.dumps([path, body], sort_keys=True), path, body)
        return i, got, want
    mismatches = []
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for i, got, want in pool.map(one, range(len(specs))):
            if got != want:
                mismatches.append((i, specs[i], got, want))
    assert not mismatches, f"{len(mismatches)} of {len(specs)} differ; first: {mismatches[0]}"


def loads(port, outcome):
    return metrics(port).get(f'siesta:kv_loads_total{{outcome="{outcome}"}}', 0)


def loads_with_logits(port):
    return metrics(port).get("siesta:kv_loads_with_logits_total", 0)


# ---- one backend x mode ---------------------------------------------------------------

class Pair:
    def __init__(self, backend, mode, p_tp=1, d_tp=1):
        self.backend, self.mode = backend, mode
        env = UCX_ENV if backend == "ucx" else None
        hold = READ_HOLD_S if mode == "read" else WRITE_HOLD_S
        tag = f"{backend}-{mode}-tp{p_tp}-{d_tp}"
        self.p = serve(f"P-{tag}", "--kv-transfer-config", kv_config("kv_producer", backend, mode, hold),
                       "--tensor-parallel-size", str(p_tp), env=env)
        self.d = serve(f"D-{tag}", "--kv-transfer-config", kv_config("kv_consumer", backend, mode, hold),
                       "--tensor-parallel-size", str(d_tp), env=env)
        self.proxy = Process(f"proxy-{tag}", ["proxy", "--port", "0", "--prefill", self.p.url, "--decode", self.d.url,
                                              "--mode", "concurrent" if mode == "write" else "sequential",
                                              "--timeout-s", str(PROXY_TIMEOUT_S), "--health-interval-s", "1"])

    def stop(self):
        for proc in (self.proxy, self.d, self.p):
            proc.stop()


def check_pair(backend, mode, num_requests, faults, p_tp=1, d_tp=1):
    """P and D of tensor-parallel sizes p_tp and d_tp (CPU: sharded in-process, TP=1's bits)."""
    tag = f"{backend}/{mode}" + (f", P tp {p_tp} -> D tp {d_tp}" if (p_tp, d_tp) != (1, 1) else "")
    pair = Pair(backend, mode, p_tp, d_tp)
    try:
        specs = make_specs(num_requests, seed=zlib.crc32(f"{backend}/{mode}".encode()))

        def mixed():
            before = loads(pair.d.port, "loaded")
            with_logits_before = loads_with_logits(pair.d.port)
            run_and_compare(pair.proxy, specs, f"{backend}-{mode}")
            moved = loads(pair.d.port, "loaded") - before
            assert moved >= len(specs) // 2, f"D loaded the KV of only {moved} of {len(specs)} requests"
            # Every load that moved KV brought P's logits too: D computed no
            # prompt token of those requests (the prefix cache may serve whole
            # prompts without P's logits; none of these share a whole prompt).
            with_logits = loads_with_logits(pair.d.port) - with_logits_before
            assert with_logits == moved, f"{with_logits} of {moved} loads brought P's logits"
        checks.check(f"{tag}: {num_requests} mixed requests through the proxy equal the colocated engine's", mixed)

        def sleeps():
            few = specs[:6]
            for who, name in ((pair.d, "D"), (pair.p, "P")):
                status, body = post_json(who.port, "/sleep?level=1&mode=keep", {})
                assert status == 200, (name, status, body)
                status, body = post_json(who.port, "/wake_up", {})
                assert status == 200, (name, status, body)
                before = loads(pair.d.port, "loaded")
                run_and_compare(pair.proxy, few, f"{backend}-{mode}-after-{name}-sleep", concurrency=2)
                assert loads(pair.d.port, "loaded") > before, f"no KV moved after {name} slept and woke"
        checks.check(f"{tag}: D sleeps (level 1) and wakes, then P: outputs identical, KV still moves", sleeps)

        if "disconnect" in faults:
            checks.check(f"{tag}: client disconnect at D frees P's blocks", lambda: disconnect_at_d(pair))
        if "late" in faults:
            checks.check(f"{tag}: P too slow (paused past D's load deadline): D recomputes, output identical",
                         lambda: late_load(pair))
        if "expiry" in faults:
            checks.check(f"{tag}: P's hold expires before D reads: D recomputes, output identical",
                         lambda: hold_expires(pair, specs))

        def clean():
            wait_for(lambda: no_blocks_held(pair.p.port), 10, "P holds no blocks")
            wait_for(lambda: no_blocks_held(pair.d.port), LOAD_TIMEOUT_S + WRITE_GRACE_S + 5, "D holds no blocks")
            pm = metrics(pair.p.port)
            assert pm.get('siesta:kv_sends_total{outcome="sent"}', 0) > 0, pm
        checks.check(f"{tag}: afterwards neither engine holds or leaks a block", clean)

        if "kill_p" in faults:
            checks.check(f"{tag}: P killed mid-request: the client gets an error in time, D frees the blocks",
                         lambda: kill_p(pair))
    finally:
        pair.stop()


def disconnect_at_d(pair):
    """A paused D holds the request; its client hangs up; P lets go of the blocks it held for it."""
    wait_for(lambda: no_blocks_held(pair.p.port), 10, "P holds no blocks before the check")
    status, _ = post_json(pair.d.port, "/pause?mode=keep", {})
    assert status == 200
    try:
        held_before = 0
        body = {"prompt": "A request whose client leaves before decode starts: " + " ".join(WORDS), "max_tokens": 8,
                "temperature": 0}
        data = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", pair.proxy.port), timeout=HTTP_TIMEOUT_S)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"X-Request-Id: disconnect-{time.monotonic_ns()}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                  + data)
        wait_for(lambda: metrics(pair.p.port).get("siesta:kv_blocks_held_for_remote", 0) > held_before, 20,
                 "P holds the blocks for D")
        if pair.mode == "read":
            # The proxy gave D the request: it waits at the paused D.
            wait_for(lambda: metrics(pair.d.port).get("siesta:num_requests_waiting", 0) >= 1, 20,
                     "the request waits at D")
        aborted_before = metrics(pair.p.port).get('siesta:kv_sends_total{outcome="aborted"}', 0)
        expired_before = metrics(pair.p.port).get('siesta:kv_sends_total{outcome="expired"}', 0)
        time.sleep(0.3)
        s.close()
        wait_for(lambda: metrics(pair.p.port).get("siesta:kv_blocks_held_for_remote", 0) == held_before, 5,
                 "P frees the blocks after the client left D")
        # Freed because D told P, not because P's hold ran out.
        m = metrics(pair.p.port)
        assert m.get('siesta:kv_sends_total{outcome="aborted"}', 0) == aborted_before + 1, m
        assert m.get('siesta:kv_sends_total{outcome="expired"}', 0) == expired_before, m
    finally:
        status, _ = post_json(pair.d.port, "/resume", {})
        assert status == 200


def hold_expires(pair, specs):
    """READ: D is paused past P's hold deadline; its read is refused, it recomputes; same output."""
    path, body = "/v1/completions", {"prompt": "An expired hold: " + " ".join(WORDS * 2), "max_tokens": 12,
                                     "temperature": 0, "return_token_ids": True}
    wait_for(lambda: no_blocks_held(pair.p.port), 10, "P holds no blocks before the check")
    failed_before = loads(pair.d.port, "failed")
    expired_before = metrics(pair.p.port).get('siesta:kv_sends_total{outcome="expired"}', 0)
    status, _ = post_json(pair.d.port, "/pause?mode=keep", {})
    assert status == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(generate, pair.proxy.port, path, body, {"X-Request-Id": f"expiry-{time.monotonic_ns()}"})
        try:
            wait_for(lambda: metrics(pair.d.port).get("siesta:num_requests_waiting", 0) >= 1, 20,
                     "the request waits at the paused D")
            wait_for(lambda: metrics(pair.p.port).get('siesta:kv_sends_total{outcome="expired"}', 0) > expired_before,
                     READ_HOLD_S + 5, "P's hold expires")
        finally:
            status, _ = post_json(pair.d.port, "/resume", {})
            assert status == 200
        got = fut.result(timeout=HTTP_TIMEOUT_S)
    assert got == reference(json.dumps([path, body], sort_keys=True), path, body), got
    assert loads(pair.d.port, "failed") == failed_before + 1, "D did not count the failed load"


def late_load(pair):
    """WRITE: P is paused, so D's load outlives load_timeout_s; D computes the prompt itself and its answer
    (passed on once P, resumed, answers) equals the colocated one; neither engine keeps a block."""
    path, body = "/v1/completions", {"prompt": "A late prefill: " + " ".join(WORDS * 3), "max_tokens": 10,
                                     "temperature": 0, "return_token_ids": True, "stream": True}
    failed_before = loads(pair.d.port, "failed")
    status, _ = post_json(pair.p.port, "/pause?mode=keep", {})
    assert status == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(generate, pair.proxy.port, path, body, {"X-Request-Id": f"late-{time.monotonic_ns()}"})
        try:
            wait_for(lambda: loads(pair.d.port, "failed") > failed_before, LOAD_TIMEOUT_S + 10,
                     "D gives up on the load")
        finally:
            status, _ = post_json(pair.p.port, "/resume", {})
            assert status == 200
        got = fut.result(timeout=HTTP_TIMEOUT_S)
    assert got == reference(json.dumps([path, body], sort_keys=True), path, body), got
    wait_for(lambda: no_blocks_held(pair.p.port), 10, "P holds no blocks")
    wait_for(lambda: no_blocks_held(pair.d.port), LOAD_TIMEOUT_S + WRITE_GRACE_S + 5, "D holds no blocks")


def kill_p(pair):
    """WRITE: P is paused (its request waits), D waits for the write; P is killed."""
    status, _ = post_json(pair.p.port, "/pause?mode=keep", {})
    assert status == 200
    body = {"prompt": "A prefill engine that dies: " + " ".join(WORDS), "max_tokens": 8, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http_request, pair.proxy.port, "POST", "/v1/completions", body,
                          {"X-Request-Id": f"kill-{time.monotonic_ns()}"}, PROXY_TIMEOUT_S + 10)
        wait_for(lambda: metrics(pair.d.port).get("siesta:num_requests_waiting", 0) >= 1, 20,
                 "D waits for P's write")
        start = time.monotonic()
        pair.p.kill()
        status, raw = fut.result(timeout=PROXY_TIMEOUT_S + 15)
        elapsed = time.monotonic() - start
    assert status >= 500, (status, raw[:300])
    err = json.loads(raw)["error"]
    assert err["code"] == "prefill_failed", err
    assert elapsed < PROXY_TIMEOUT_S, f"the error took {elapsed:.1f} s"
    # D's request was aborted (the proxy closed its leg); its blocks come back
    # once nothing can write them: at the latest the write deadline plus the grace.
    wait_for(lambda: no_blocks_held(pair.d.port), LOAD_TIMEOUT_S + WRITE_GRACE_S + 5, "D holds no blocks")


# ---- startup refusals -----------------------------------------------------------------

def bad_configs():
    cases = [
        ('{"kv_connector": "SiestaConnector", "kv_role": "kv_producer", "kv_bufer_size": 1}', "unknown key 'kv_bufer_size'"),
        ('{"kv_connector": "SiestaConnector", "kv_role": "decoder"}', "kv_role 'decoder'"),
        ('{"kv_connector": "SiestaConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
         '{"backend": "ipc", "ucx_transports": "tcp"}}', "ucx_transports applies to the ucx backend"),
        ('{"kv_connector": "SiestaConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
         '{"load_timeout_s": 1, "transfer_timeout_s": 5}}', "transfer_timeout_s (5) is longer than load_timeout_s (1)"),
        # No key, and no explicit opt-out: the side channel would trust anyone.
        ('{"kv_connector": "SiestaConnector", "kv_role": "kv_producer"}', "needs auth_key"),
        ('{"kv_connector": "SiestaConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
         '{"auth_key": "short"}}', "auth_key has 5 bytes"),
        ('{"kv_connector": "SiestaConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
         '{"auth_key_file": "/nonexistent/key"}}', "cannot be read"),
    ]
    for cfg, needle in cases:
        rc, _, err = run([SIESTA, "serve", "--model", MODEL, "--port", "0", "--kv-transfer-config", cfg], timeout=60)
        expect_clean_error(rc, err, needle)


def transfer_info():
    status, raw = http_request(colocated.port, "GET", "/kv_transfer_info", timeout=10)
    assert status == 404, status


colocated = None
try:
    checks.check("a bad --kv-transfer-config is refused at startup, naming the key", bad_configs)
    colocated = serve("colocated")
    checks.check("a server without a connector has no /kv_transfer_info", transfer_info)
    started = time.monotonic()
    check_pair("ipc", "write", 50, faults={"disconnect", "late", "kill_p"})
    check_pair("ipc", "read", 16, faults={"disconnect", "expiry"})
    check_pair("ucx", "write", 16, faults=set())
    check_pair("ucx", "read", 16, faults={"expiry"})
    # Between tensor-parallel groups of different sizes, both ways (the colocated reference is TP=1).
    check_pair("ipc", "write", 16, faults=set(), p_tp=2, d_tp=1)
    check_pair("ucx", "read", 16, faults=set(), p_tp=1, d_tp=4)
    print(f"P/D checks took {time.monotonic() - started:.1f} s")
finally:
    if colocated:
        colocated.stop()
    if checks.failed == 0 and not os.environ.get("SIESTA_TEST_KEEP_LOGS"):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"logs kept in {tmp}")
checks.finish()
