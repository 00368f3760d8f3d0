"""Sleep mode over HTTP: one `siesta serve --enable-sleep-mode` on the tiny CPU model.

Checks, through the admin API with vLLM's paths: 12 sleep/wake cycles mixing
level 1 and level 2 (with reload_weights), full and selective wake (weights
first, then kv_cache) and release_kv_cache_memory, each followed by greedy
outputs of a fixed prompt set identical to the awake baseline; GET /memory
shows the KV cache (and at level 2 the weights) released, and the process RSS
falls by at least 90% of the released bytes; 100 cycles come back to the awake
RSS and pool accounting; 32 streaming requests survive a sleep with mode keep
with the same tokens; a request sent while asleep is served after wake (and
the queue of such requests is bounded); repeated calls answer 200 with the
unchanged state; wrong calls get 4xx and the engine keeps serving; the API
key; a server without --enable-sleep-mode answers 400; reload_weights from
another checkpoint of the same shape gives that checkpoint's outputs
(`siesta generate`), and back; vLLM's dev-router answers (empty 200 for
/sleep and /wake_up, {"status": "paused"}, {"success": ...}, {"results":
[null]}) and its default sleep mode abort, with siesta's EngineStatus behind
?verbose=true.
"""
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, parse_args, post_without_length, run  # noqa: E402

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-sleep-")
HTTP_TIMEOUT_S = 60
API_KEY = "sleep-test-key"
KV_BYTES = 512 << 20  # large enough that the RSS fall is measurable
MAX_HELD = 8

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "1, 2, 3, 5, 8, 13,",
]
MAX_TOKENS = 12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `siesta serve` subprocess on a free port; stop() ends it (bounded)."""

    def __init__(self, *extra):
        self.port = free_port()
        self.log_path = os.path.join(tmp, f"serve-{self.port}.log")
        self.log = open(self.log_path, "w")
        cmd = [SIESTA, "--log-level", "info", "serve", "--model", MODEL, "--port", str(self.port), "--threads", "2",
               "--seed", "1", "--max-model-len", "512", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                break
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"siesta serve did not come up; log:\n{open(self.log_path).read()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.log.close()
        return self.proc.returncode


def request(port, method, path, body=None, key=None, timeout=HTTP_TIMEOUT_S):
    """(status, parsed JSON or None) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        return r.status, (json.loads(raw) if raw else None)
    finally:
        conn.close()


def wait_for(predicate, within_s, what):
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {within_s} s: {what}")


srv = None
procs = []


def verbose(path):
    """The path asking for siesta's EngineStatus answer instead of vLLM's body (admin_handlers.h)."""
    return path + ("&" if "?" in path else "?") + "verbose=true"


def admin(method, path, body=None, expect=200):
    """An admin call; POSTs answer siesta's EngineStatus (?verbose=true)."""
    status, j = request(srv.port, method, verbose(path) if method == "POST" else path, body, key=API_KEY)
    assert status == expect, (method, path, status, j)
    return j


def memory():
    return admin("GET", "/memory")


def completion(prompt, max_tokens=MAX_TOKENS, port=None, key=API_KEY, timeout=HTTP_TIMEOUT_S):
    status, j = request(port or srv.port, "POST", "/v1/completions",
                        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True}, key=key, timeout=timeout)
    assert status == 200, (status, j)
    return j["choices"][0]["token_ids"]


def outputs(port=None):
    return [completion(p, port=port) for p in PROMPTS]


def released_bytes(m):
    return sum(t["released_bytes"] for t in m["tags"].values())


def assert_state(j, state):
    assert j["state"] == state, (state, j)


try:
    srv = Server("--enable-sleep-mode", "--kv-cache-memory-bytes", str(KV_BYTES), "--api-key", API_KEY,
                 "--max-held-requests", str(MAX_HELD))
    procs.append(srv)
    BASELINE = outputs()
    AWAKE = memory()
    sizes = {tag: t["total_bytes"] for tag, t in AWAKE["tags"].items()}
    print(f"awake: weights {sizes['weights']} B, kv_cache {sizes['kv_cache']} B, scratch {sizes['scratch']} B, "
          f"RSS {AWAKE['process_rss_bytes']} B", flush=True)
    rss_falls = []

    def awake_memory_is_resident_from_the_pool():
        assert AWAKE["state"] == "running"
        assert sizes["kv_cache"] == KV_BYTES, sizes
        for tag in ("weights", "kv_cache", "scratch"):
            t = AWAKE["tags"][tag]
            assert t["allocations"] == 1 and t["resident_bytes"] == t["total_bytes"] > 0, (tag, t)
        assert AWAKE["process_rss_bytes"] > KV_BYTES
        assert AWAKE["device"]["kind"] == "host" and AWAKE["device"]["total_bytes"] > 0, AWAKE["device"]
        assert admin("GET", "/is_sleeping") == {"is_sleeping": False}
        assert admin("GET", "/is_paused") == {"is_paused": False}

    def check_asleep(level, rss_before):
        """/memory after a sleep at `level`: what is released, and the RSS fall."""
        m = memory()
        tags = m["tags"]
        assert tags["kv_cache"]["released_bytes"] == sizes["kv_cache"], tags["kv_cache"]
        assert tags["scratch"]["released_bytes"] == sizes["scratch"], tags["scratch"]
        if level == 1:
            assert tags["weights"]["offloaded_bytes"] == sizes["weights"], tags["weights"]
        else:
            assert tags["weights"]["released_bytes"] == sizes["weights"], tags["weights"]
        released = released_bytes(m)
        fall = rss_before - m["process_rss_bytes"]
        rss_falls.append((level, released, fall))
        assert fall >= 0.9 * released, f"RSS fell {fall} B, released {released} B (level {level})"
        assert admin("GET", "/is_sleeping") == {"is_sleeping": True}

    def sleep(level, mode="keep"):
        rss_before = memory()["process_rss_bytes"]
        j = admin("POST", f"/sleep?level={level}&mode={mode}")
        assert_state(j, f"sleeping_level_{level}")
        assert j["is_sleeping"] and j["not_resident_tags"] == ["weights", "kv_cache", "scratch"], j
        check_asleep(level, rss_before)
        return j

    def selective_wake(reload=None):
        j = admin("POST", "/wake_up?tags=weights")
        assert_state(j, "partially_awake")
        assert j["not_resident_tags"] == ["kv_cache", "scratch"], j
        assert memory()["tags"]["kv_cache"]["released_bytes"] == sizes["kv_cache"]
        if reload == "reload_weights":
            r = admin("POST", "/reload_weights")
            assert r["weights_loaded"] and r["call"]["weights_loaded_from"] == MODEL, r
        elif reload == "collective_rpc":
            r = admin("POST", "/collective_rpc", {"method": "reload_weights"})
            assert r["weights_loaded"], r
        j = admin("POST", "/wake_up?tags=kv_cache")
        assert_state(j, "running")
        return j

    def cycle_level1_full_wake():
        sleep(1)
        j = admin("POST", "/wake_up")
        assert_state(j, "running")
        assert j["call"]["restored_bytes"]["weights"] == sizes["weights"], j

    def cycle_level1_selective_wake():
        sleep(1)
        selective_wake()

    def cycle_level2_reload_weights():
        sleep(2)
        selective_wake("reload_weights")

    def cycle_level2_collective_rpc():
        sleep(2)
        selective_wake("collective_rpc")

    def cycle_level2_full_wake():
        sleep(2)
        j = admin("POST", "/wake_up")
        assert_state(j, "running")
        assert j["call"]["weights_loaded_from"] == MODEL, j  # read again: no reload came

    def cycle_release_kv_cache_memory():
        rss_before = memory()["process_rss_bytes"]
        assert_state(admin("POST", "/pause?mode=keep"), "paused")
        j = admin("POST", "/release_kv_cache_memory")
        assert_state(j, "paused_kv_released")
        m = memory()
        assert m["tags"]["kv_cache"]["released_bytes"] == sizes["kv_cache"], m
        assert m["tags"]["weights"]["resident_bytes"] == sizes["weights"], m
        fall = rss_before - m["process_rss_bytes"]
        rss_falls.append(("kv", sizes["kv_cache"], fall))
        assert fall >= 0.9 * sizes["kv_cache"], (fall, sizes["kv_cache"])
        assert_state(admin("POST", "/wake_up?tags=kv_cache"), "paused")
        assert_state(admin("POST", "/resume"), "running")

    CYCLES = [cycle_level1_full_wake, cycle_level2_reload_weights, cycle_release_kv_cache_memory,
              cycle_level1_selective_wake, cycle_level2_full_wake, cycle_level2_collective_rpc] * 2

    def twelve_cycles_keep_the_outputs():
        for i, cycle in enumerate(CYCLES):
            try:
                cycle()
                assert memory()["tags"] == AWAKE["tags"], f"pool accounting after {cycle.__name__}"
                got = outputs()
                assert got == BASELINE, (cycle.__name__, got, BASELINE)
            except AssertionError as e:
                raise AssertionError(f"cycle {i} ({cycle.__name__}): {e}") from e
        worst = min(fall / released for _, released, fall in rss_falls)
        print(f"  RSS fall / released bytes over {len(rss_falls)} sleeps: worst {worst:.3f}; e.g. level "
              f"{rss_falls[0][0]}: released {rss_falls[0][1]} B, RSS fell {rss_falls[0][2]} B", flush=True)

    def hundred_cycles_do_not_creep():
        # A server of its own with a smaller KV cache, so that 100 cycles stay
        # quick (a leak per cycle, a host copy or a mapping, shows at any size),
        # and few HTTP threads: each worker's first request grows the RSS by its
        # stack and malloc arena, which a few warm-up cycles take out.
        small = Server("--enable-sleep-mode", "--kv-cache-memory-bytes", str(64 << 20), "--http-threads", "8")
        procs.append(small)
        try:
            def call(method, path):
                status, j = request(small.port, method, verbose(path) if method == "POST" else path)
                assert status == 200, (path, status, j)
                return j
            assert outputs(port=small.port) == BASELINE
            for _ in range(5):
                call("POST", "/sleep?level=1&mode=keep")
                call("POST", "/wake_up")
            awake = call("GET", "/memory")
            start = time.monotonic()
            for i in range(100):
                level = 1 if i % 2 == 0 else 2
                assert call("POST", f"/sleep?level={level}&mode=keep")["state"] == f"sleeping_level_{level}"
                assert call("POST", "/wake_up")["state"] == "running"
            took = time.monotonic() - start
            m = call("GET", "/memory")
            assert m["tags"] == awake["tags"], (m["tags"], awake["tags"])
            assert m["open_exports"] == 0
            rss0, rss1 = awake["process_rss_bytes"], m["process_rss_bytes"]
            pool = sum(t["total_bytes"] for t in awake["tags"].values())
            print(f"  100 cycles (levels 1 and 2, {pool} B of pool memory) in {took:.1f} s: RSS awake {rss0} B, "
                  f"after {rss1} B ({rss1 - rss0:+d} B); pool accounting equal to awake", flush=True)
            assert abs(rss1 - rss0) <= 2 << 20, (rss0, rss1)
            assert outputs(port=small.port) == BASELINE
        finally:
            small.stop()

    def stream_tokens(prompt, max_tokens, got, first_token, errors):
        """Streams one completion; appends its token ids to `got`."""
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=HTTP_TIMEOUT_S)
            body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "stream": True, "return_token_ids": True})
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
            r = conn.getresponse()
            assert r.status == 200, r.status
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                for c in chunk.get("choices", []):
                    got.extend(c.get("token_ids") or [])
                    if got:
                        first_token.set()
            conn.close()
        except Exception as e:  # reported by the check
            errors.append(repr(e))
            first_token.set()

    def sleep_keep_with_32_streams():
        prompts = [f"Request number {i}: tell me about {PROMPTS[i % 4]}" for i in range(32)]
        max_tokens = 48
        alone = [completion(p, max_tokens) for p in prompts]
        got = [[] for _ in prompts]
        firsts = [threading.Event() for _ in prompts]
        errors = []
        threads = [threading.Thread(target=stream_tokens, args=(p, max_tokens, got[i], firsts[i], errors))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        try:
            for e in firsts:
                assert e.wait(60), "a stream produced no token within 60 s"
            j = admin("POST", "/sleep?level=1&mode=keep")
            assert_state(j, "sleeping_level_1")
            at_sleep = [len(g) for g in got]
            unfinished = sum(1 for n in at_sleep if n < max_tokens)
            time.sleep(0.5)
            assert [len(g) for g in got] == at_sleep, "tokens arrived while asleep"
            assert_state(admin("POST", "/wake_up"), "running")
        finally:
            for t in threads:
                t.join(120)
        assert not any(t.is_alive() for t in threads), "a stream did not end"
        assert not errors, errors
        for i in range(32):
            assert got[i] == alone[i], (i, got[i], alone[i])
        print(f"  {unfinished} of 32 streams were unfinished at sleep; all 32 match", flush=True)

    def request_sent_while_asleep_is_served_after_wake():
        sleep(1)
        results, errors = {}, []

        def send(i):
            try:
                results[i] = completion(PROMPTS[i % 4])
            except Exception as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(MAX_HELD)]
        for t in threads:
            t.start()
        wait_for(lambda: admin("POST", "/wake_up?tags=weights")["requests"]["held"] == MAX_HELD, 30,
                 f"{MAX_HELD} requests held")
        status, j = request(srv.port, "POST", "/v1/completions", {"prompt": "one too many", "max_tokens": 2},
                            key=API_KEY)
        assert status == 503, (status, j)
        assert "--max-held-requests" in j["error"]["message"] and "wake_up" in j["error"]["message"], j
        assert not results, "served while asleep"
        assert_state(admin("POST", "/wake_up"), "running")
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert [results[i] for i in range(MAX_HELD)] == [BASELINE[i % 4] for i in range(MAX_HELD)], results

    def repeated_calls_answer_200_with_the_unchanged_state():
        assert_state(admin("POST", "/wake_up"), "running")
        assert_state(admin("POST", "/wake_up?tags=kv_cache"), "running")
        assert_state(admin("POST", "/resume"), "running")
        sleep(1)
        before = memory()["tags"]
        for path in ("/sleep?level=1&mode=keep", "/sleep?level=0&mode=keep", "/pause?mode=keep",
                     "/release_kv_cache_memory"):
            j = admin("POST", path)
            assert_state(j, "sleeping_level_1")
            assert sum(j["call"]["released_bytes"].values()) == 0, (path, j)
        assert memory()["tags"] == before
        assert_state(admin("POST", "/wake_up"), "running")
        assert_state(admin("POST", "/pause?mode=abort"), "paused")
        assert_state(admin("POST", "/pause?mode=wait"), "paused")
        assert admin("GET", "/is_paused") == {"is_paused": True}
        assert_state(admin("POST", "/release_kv_cache_memory"), "paused_kv_released")
        assert_state(admin("POST", "/release_kv_cache_memory"), "paused_kv_released")
        assert_state(admin("POST", "/wake_up"), "paused")
        assert_state(admin("POST", "/wake_up"), "paused")
        assert_state(admin("POST", "/reset_prefix_cache"), "paused")
        assert_state(admin("POST", "/resume"), "running")
        assert outputs() == BASELINE

    def error(method, path, status, needle, body=None):
        code, j = request(srv.port, method, path, body, key=API_KEY)
        assert code == status, (method, path, code, j)
        assert needle in j["error"]["message"], (needle, j)

    def wrong_calls_get_4xx_and_the_engine_keeps_serving():
        error("POST", "/sleep?level=7", 400, "got 7")
        error("POST", "/sleep?level=one", 400, "'level' must be an integer")
        error("POST", "/sleep?level=1&mode=later", 400, "abort, wait or keep")
        error("POST", "/pause?mode=later", 400, "abort, wait or keep")
        error("POST", "/wake_up?tags=everything", 400, "everything")
        error("POST", "/release_kv_cache_memory", 409, "/pause")
        error("POST", "/reload_weights", 409, "pause")
        error("POST", "/collective_rpc", 400, "not supported", {"method": "sleep"})
        # reload_weights while requests are running
        results = []
        t = threading.Thread(target=lambda: results.append(completion(PROMPTS[0], max_tokens=200)))
        t.start()
        time.sleep(0.2)
        error("POST", "/reload_weights", 409, "requests running")
        t.join(60)
        assert len(results) == 1 and len(results[0]) == 200
        # asleep: resume is refused, reload_weights needs the weights woken
        sleep(2)
        error("POST", "/resume", 409, "/wake_up")
        error("POST", "/reload_weights", 409, "wake_up?tags=weights")
        assert_state(admin("POST", "/wake_up?tags=weights"), "partially_awake")
        error("POST", "/resume", 409, "/wake_up")
        error("POST", "/reload_weights", 404, "no-such-dir", {"model": os.path.join(tmp, "no-such-dir")})
        wrong_shape = os.path.join(tmp, "wrong-shape")
        shutil.copytree(MODEL, wrong_shape)
        cfg = json.load(open(os.path.join(wrong_shape, "config.json")))
        cfg["intermediate_size"] = 512
        json.dump(cfg, open(os.path.join(wrong_shape, "config.json"), "w"))
        error("POST", "/reload_weights", 400, "intermediate_size 512 (loaded: 768)", {"model": wrong_shape})
        error("POST", "/reload_weights", 400, "JSON object", [1, 2])
        assert_state(admin("POST", "/wake_up"), "running")  # reads the checkpoint again
        assert outputs() == BASELINE

    def admin_post_without_body_or_length():
        # `curl -X POST host/sleep?level=1` sends neither a body nor Content-Length.
        head, body, elapsed = post_without_length(srv.port, "/sleep?level=1&mode=keep&verbose=true",
                                                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\n")
        assert head.startswith(b"HTTP/1.1 200"), (head, body)
        assert elapsed < 2, f"the server waited {elapsed:.1f} s for a body that was never announced"
        assert_state(json.loads(body), "sleeping_level_1")
        assert_state(admin("POST", "/wake_up"), "running")
        assert outputs() == BASELINE

    def admin_needs_the_api_key():
        for method, path in (("POST", "/sleep?level=1"), ("GET", "/is_sleeping"), ("GET", "/memory")):
            status, j = request(srv.port, method, path)
            assert status == 401, (path, status, j)
        assert admin("GET", "/is_sleeping") == {"is_sleeping": False}

    def without_sleep_mode_admin_answers_400():
        plain = Server("--kv-cache-memory-bytes", str(64 << 20))
        procs.append(plain)
        try:
            for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                                 ("POST", "/release_kv_cache_memory"), ("GET", "/memory")):
                status, j = request(plain.port, method, path)
                assert status == 400, (path, status, j)
                assert "--enable-sleep-mode" in j["error"]["message"], j
            assert outputs(port=plain.port) == BASELINE
        finally:
            plain.stop()

    def generate_tokens(model_dir):
        out = []
        for p in PROMPTS:
            rc, stdout, err = run([SIESTA, "generate", "--model", model_dir, "--prompt", p, "--max-tokens",
                                   str(MAX_TOKENS), "--ignore-eos", "--json"], timeout=120)
            assert rc == 0, err
            out.append(json.loads(stdout)["token_ids"])
        return out

    def reload_weights_from_another_checkpoint_and_back():
        assert generate_tokens(MODEL) == BASELINE  # the server and `generate` agree
        other = os.path.join(tmp, "other-tiny")
        rc, _, err = run([SIESTA, "make-model", "--shape", "tiny", "--out", other, "--seed", "77", "--tokenizer",
                          os.path.join(MODEL, "tokenizer.json")], timeout=120)
        assert rc == 0, err
        theirs = generate_tokens(other)
        assert theirs != BASELINE
        sleep(2)
        assert_state(admin("POST", "/wake_up?tags=weights"), "partially_awake")
        j = admin("POST", "/reload_weights", {"model": other})
        assert j["weights_dir"] == other, j
        assert_state(admin("POST", "/wake_up?tags=kv_cache"), "running")
        assert outputs() == theirs
        # back, while paused only
        assert_state(admin("POST", "/pause?mode=wait"), "paused")
        assert admin("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": MODEL}})[
            "weights_dir"] == MODEL
        assert_state(admin("POST", "/resume"), "running")
        assert outputs() == BASELINE

    def raw(method, path, body=None):
        """(status, raw body) of one request with the API key."""
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=HTTP_TIMEOUT_S)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Authorization": f"Bearer {API_KEY}"}
            if data is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def vllm_answers_as_its_dev_routers_do():
        # /sleep and /wake_up: 200 with an empty body; the others vLLM's JSON.
        assert raw("POST", "/sleep?level=1") == (200, b"")
        assert admin("GET", "/is_sleeping") == {"is_sleeping": True}
        assert raw("POST", "/wake_up?tags=weights") == (200, b"")
        assert raw("POST", "/wake_up") == (200, b"")
        s = admin("GET", "/is_sleeping?verbose=true")
        assert s["is_sleeping"] is False and s["state"] == "running" and "call" not in s, s
        assert admin("GET", "/engine_state")["state"] == "running"
        status, body = raw("POST", "/pause?mode=keep")
        assert (status, json.loads(body)) == (200, {"status": "paused"}), body
        status, body = raw("POST", "/reset_prefix_cache")
        assert (status, json.loads(body)) == (200, {"success": True}), body
        status, body = raw("POST", "/resume")
        assert (status, json.loads(body)) == (200, {"status": "resumed"}), body
        assert raw("POST", "/sleep?level=2&mode=wait") == (200, b"")
        assert raw("POST", "/wake_up?tags=weights") == (200, b"")
        status, body = raw("POST", "/collective_rpc", {"method": "reload_weights", "args": [], "kwargs": {},
                                                       "timeout": 60})
        assert (status, json.loads(body)) == (200, {"results": [None]}), body
        status, body = raw("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"path": MODEL}})
        assert status == 400 and b"'path' is not supported" in body, body
        status, body = raw("POST", "/collective_rpc", {"method": "reload_weights", "extra": 1})
        assert status == 400 and b"'extra' is not a field" in body, body
        status, body = raw("POST", "/reload_weights", {"weights_path": MODEL, "strict": True})
        assert status == 400 and b"'strict' is not supported" in body, body
        assert raw("POST", "/wake_up") == (200, b"")
        assert outputs() == BASELINE

    def sleep_aborts_running_requests_by_default():
        # vLLM's default mode: requests running at sleep end (finish_reason "abort"), and the
        # engine serves the same outputs after wake.
        got, firsts, errors = [], threading.Event(), []
        t = threading.Thread(target=stream_tokens, args=(PROMPTS[0], 400, got, firsts, errors))
        t.start()
        try:
            assert firsts.wait(60)
            assert raw("POST", "/sleep?level=1") == (200, b"")
            t.join(60)
            assert not t.is_alive() and not errors, errors
            assert 0 < len(got) < 400, len(got)
        finally:
            t.join(60)
            assert raw("POST", "/wake_up") == (200, b"")
        assert outputs() == BASELINE

    for fn in (awake_memory_is_resident_from_the_pool, twelve_cycles_keep_the_outputs, hundred_cycles_do_not_creep,
               sleep_keep_with_32_streams, request_sent_while_asleep_is_served_after_wake,
               repeated_calls_answer_200_with_the_unchanged_state, wrong_calls_get_4xx_and_the_engine_keeps_serving,
               admin_post_without_body_or_length, admin_needs_the_api_key, without_sleep_mode_admin_answers_400,
               reload_weights_from_another_checkpoint_and_back, vllm_answers_as_its_dev_routers_do,
               sleep_aborts_running_requests_by_default):
        def settled_then(fn=fn):
            # A check that failed half-way must not leave the next one asleep.
            status, j = request(srv.port, "POST", "/wake_up?verbose=true", key=API_KEY)
            if status == 200 and j["state"] != "running":
                request(srv.port, "POST", "/resume", key=API_KEY)
            start = time.monotonic()
            fn()
            print(f"  ({time.monotonic() - start:.1f} s)", flush=True)
        checks.check(fn.__name__, settled_then)
finally:
    for p in procs:
        p.stop()
    shutil.rmtree(tmp, ignore_errors=True)

checks.finish()
