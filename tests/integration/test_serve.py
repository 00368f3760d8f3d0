"""`siesta serve` over HTTP: OpenAI/vLLM request and response shapes, streaming, batch invariance under
concurrency, prefix caching and preemption, bad input, client disconnects, API keys, the chat format,
and `siesta bench serve` against it."""
import http.client
import json
import os
import random
import select
import socket
import subprocess
import tempfile
import threading
import time

from siesta_test_util import Checks, parse_args, post_without_length, run

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
golden = json.load(open(os.path.join(args.source, "tests", "data", "golden", "tiny-qwen3_golden.json")))
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-serve-")
TIMEOUT = 60  # seconds for any single HTTP exchange
servers = []


class Server:
    """A `siesta serve` process on a free port (it binds port 0 and prints the port it got)."""

    def __init__(self, *extra):
        # A small KV cache unless the test sizes it: the memory pool commits it all at startup.
        size = [] if any(a.startswith("--kv-cache") or a == "--num-kv-blocks" for a in extra) else [
            "--kv-cache-memory-bytes", "64M"]
        self.proc = subprocess.Popen(
            [SIESTA, "serve", "--model", MODEL, "--port", "0", "--threads", "2", "--seed", "0", *size, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        servers.append(self)
        self.port = None
        self.log = b""
        deadline = time.time() + 60
        while self.port is None:
            left = deadline - time.time()
            assert left > 0 and self.proc.poll() is None, f"server did not start: {self.log!r}"
            ready, _, _ = select.select([self.proc.stderr], [], [], left)
            if ready:
                line = self.proc.stderr.readline()
                self.log += line
                if b"listening on http://" in line:
                    self.port = int(line.split(b"http://")[1].split(b" ")[0].rsplit(b":", 1)[1])
        # Keep draining stderr so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        wait_healthy(self.port)

    def _drain(self):
        for line in self.proc.stderr:
            self.log += line

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def request(port, method, path, body=None, headers=None, raw=None, timeout=TIMEOUT):
    """(status, parsed JSON or text) of one HTTP exchange."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text
    finally:
        conn.close()


def wait_healthy(port):
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if request(port, "GET", "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("server not healthy within 30 s")


def post(port, path, body, headers=None):
    status, j = request(port, "POST", path, body, headers)
    assert status == 200, (status, j)
    return j


def stream(port, path, body, headers=None):
    """The parsed `data:` chunks of a streamed response; checks the SSE framing and the final [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
        r = conn.getresponse()
        assert r.status == 200, (r.status, r.read())
        assert r.getheader("Content-Type").startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    finally:
        conn.close()
    assert events[-1] == "", events[-1:]
    assert events[-2] == "data: [DONE]", events[-3:]
    chunks = []
    for e in events[:-2]:
        assert e.startswith("data: "), e
        chunks.append(json.loads(e[len("data: "):]))
    return chunks


def collect_stream(chunks, kind="completion"):
    """Per choice index: text, token_ids, finish_reason, as one non-streamed choice would have them."""
    out = {}
    for c in chunks:
        for ch in c["choices"]:
            o = out.setdefault(ch["index"], {"text": "", "token_ids": [], "finish_reason": None})
            o["text"] += ch["delta"].get("content", "") if kind == "chat" else ch["text"]
            o["token_ids"] += ch.get("token_ids", [])
            if ch.get("finish_reason"):
                o["finish_reason"] = ch["finish_reason"]
    return out


def metrics(port, headers=None):
    status, text = request(port, "GET", "/metrics", headers=headers)
    assert status == 200, status
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def metric(values, name, **labels):
    """The value of a metric whose name matches and whose labels include the given ones."""
    for key, v in values.items():
        if key == name or key.startswith(name + "{"):
            if all(f'{k}="{val}"' in key for k, val in labels.items()):
                return v
    raise AssertionError(f"no metric {name} {labels}")


def tokenize(text):
    rc, out, err = run([SIESTA, "tokenize", "--model", MODEL, "--json", "-"], input=text, timeout=60)
    assert rc == 0, err
    return json.loads(out)["ids"]


main = Server("--max-model-len", "512", "--max-request-body-bytes", "1000000")
PORT = main.port


# ---- completions as `siesta generate` computes them --------------------------------------------------

def greedy_completions_equal_generate():
    for p in golden["prompts"][:4]:
        rc, out, err = run([SIESTA, "generate", "--model", MODEL, "--prompt", p["text"], "--max-tokens", "16",
                            "--ignore-eos", "--json", "--threads", "2"])
        assert rc == 0, err
        ref = json.loads(out)
        r = post(PORT, "/v1/completions", {"model": MODEL, "prompt": p["text"], "max_tokens": 16, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True})
        choice = r["choices"][0]
        assert choice["prompt_token_ids"] == ref["prompt_ids"], p["text"]
        assert choice["token_ids"] == ref["token_ids"], (p["text"], choice["token_ids"], ref["token_ids"])
        assert choice["text"] == ref["text"]
        assert choice["finish_reason"] == "length"
        assert r["object"] == "text_completion" and r["model"] == MODEL and r["id"].startswith("cmpl-")
        assert r["usage"] == {"prompt_tokens": len(ref["prompt_ids"]), "completion_tokens": 16,
                              "total_tokens": len(ref["prompt_ids"]) + 16,
                              "prompt_tokens_details": r["usage"]["prompt_tokens_details"]}


def token_prompt_batch_and_n_choices():
    ids = golden["prompts"][0]["input_ids"]
    r = post(PORT, "/v1/completions", {"prompt": [ids, golden["prompts"][1]["text"]], "n": 2, "max_tokens": 6,
                                       "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["prompt_token_ids"] == ids
    assert r["choices"][0]["token_ids"] == r["choices"][1]["token_ids"]  # greedy: both choices agree
    alone = post(PORT, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})
    assert alone["choices"][0]["token_ids"] == r["choices"][0]["token_ids"]
    assert r["usage"]["prompt_tokens"] == len(ids) + len(golden["prompts"][1]["input_ids"])
    assert r["usage"]["completion_tokens"] == 24


def streaming_matches_whole_response_and_reports_usage():
    body = {"prompt": golden["prompts"][2]["text"], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 2}
    whole = post(PORT, "/v1/completions", body)
    chunks = stream(PORT, "/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}))
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    got = collect_stream(chunks[:-1])[0]
    assert got["text"] == whole["choices"][0]["text"]
    assert got["token_ids"] == whole["choices"][0]["token_ids"]
    assert got["finish_reason"] == "length"
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert all(len(t) >= 1 and v <= 0 for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))


def echo_and_chat_logprobs():
    prompt = golden["prompts"][0]["text"]
    base = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = post(PORT, "/v1/completions", base)["choices"][0]["text"]
    echoed = post(PORT, "/v1/completions", dict(base, echo=True))["choices"][0]["text"]
    assert echoed == prompt + plain, (echoed, plain)
    s = collect_stream(stream(PORT, "/v1/completions", dict(base, echo=True, stream=True)))[0]
    assert s["text"] == prompt + plain
    # echo with logprobs: the prompt's tokens lead the logprobs (the first without a value), then the
    # output's, as without echo.
    lp = post(PORT, "/v1/completions", dict(base, logprobs=1))["choices"][0]["logprobs"]
    e = post(PORT, "/v1/completions", dict(base, echo=True, logprobs=1))["choices"][0]
    n = len(golden["prompts"][0]["input_ids"])
    assert len(e["logprobs"]["tokens"]) == n + 5 and e["logprobs"]["token_logprobs"][0] is None, e["logprobs"]
    assert e["logprobs"]["top_logprobs"][0] is None and e["text"] == prompt + plain
    assert e["logprobs"]["tokens"][n:] == lp["tokens"] and e["logprobs"]["token_logprobs"][n:] == lp["token_logprobs"]
    assert "".join(e["logprobs"]["tokens"]) == e["text"]
    assert len(e["prompt_logprobs"]) == n and e["prompt_logprobs"][0] is None
    r = post(PORT, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                            "temperature": 0, "ignore_eos": True, "logprobs": True,
                                            "top_logprobs": 3})
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}, e
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-9
        assert all(isinstance(x, int) and 0 <= x < 256 for x in e["bytes"])


def stop_strings_end_the_text():
    base = {"prompt": golden["prompts"][0]["text"], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = post(PORT, "/v1/completions", base)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = post(PORT, "/v1/completions", dict(base, stop=[stop]))["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == stop
    assert r["text"] == full[:full.index(stop)]
    s = collect_stream(stream(PORT, "/v1/completions", dict(base, stop=stop, stream=True)))[0]
    assert s["text"] == r["text"] and s["finish_reason"] == "stop"


# ---- concurrency, prefix cache, preemption ----------------------------------------------------------

def mixed_requests():
    rng = random.Random(5)
    shared = [rng.randrange(10, 4000) for _ in range(40)]
    reqs = []
    for i in range(32):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(10, 4000) for _ in range(5 + (i * 7) % 50)]
        body = {"prompt": prompt, "max_tokens": 8 + i % 17, "ignore_eos": True, "return_token_ids": True}
        if i % 2:
            body.update(temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i)
        else:
            body.update(temperature=0)
        if i % 4 == 1:
            body["stream"] = True
        reqs.append(body)
    return reqs


def run_completion(port, body):
    if body.get("stream"):
        got = collect_stream(stream(port, "/v1/completions", body))[0]
        return got["token_ids"], got["text"], got["finish_reason"]
    c = post(port, "/v1/completions", body)["choices"][0]
    return c["token_ids"], c["text"], c["finish_reason"]


def run_concurrently(port, reqs):
    results = [None] * len(reqs)
    errors = []

    def worker(i):
        try:
            results[i] = run_completion(port, reqs[i])
        except Exception as e:  # reported below, with the request that failed
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(r is not None for r in results)
    return results


ALONE = {}


def concurrent_mixed_requests_equal_each_alone():
    reqs = mixed_requests()
    for i, body in enumerate(reqs):
        ALONE[i] = run_completion(PORT, body)
        assert len(ALONE[i][0]) == body["max_tokens"]
    batched = run_concurrently(PORT, reqs)
    for i, r in enumerate(batched):
        assert r == ALONE[i], (i, reqs[i], r, ALONE[i])


def prefix_cache_hits_show_in_metrics_and_change_nothing():
    prompt = [random.Random(9).randrange(10, 4000) for _ in range(70)]
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    before = metrics(PORT)
    a = post(PORT, "/v1/completions", body)["choices"][0]["token_ids"]
    b = post(PORT, "/v1/completions", body)["choices"][0]["token_ids"]
    after = metrics(PORT)
    assert a == b
    hits = metric(after, "siesta:prefix_cache_hits_total") - metric(before, "siesta:prefix_cache_hits_total")
    queries = metric(after, "siesta:prefix_cache_queries_total") - metric(before, "siesta:prefix_cache_queries_total")
    assert hits >= 64, hits  # the second request found 4 full blocks of 16 tokens
    assert queries >= 140, queries
    r = post(PORT, "/v1/completions", dict(body, return_token_ids=False))
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def preemption_under_a_tiny_kv_cache_keeps_outputs():
    # 24 blocks of 16 tokens for 32 requests of up to 114 tokens each: requests are preempted and recomputed.
    tiny = Server("--max-model-len", "128", "--kv-cache-memory-bytes", str(24 * 65536),
                  "--max-num-batched-tokens", "64")
    reqs = mixed_requests()
    assert ALONE, "needs the results of concurrent_mixed_requests_equal_each_alone"
    batched = run_concurrently(tiny.port, reqs)
    for i, r in enumerate(batched):
        assert r == ALONE[i], (i, r, ALONE[i])
    m = metrics(tiny.port)
    assert metric(m, "siesta:num_preemptions_total") > 0
    assert metric(m, "siesta:num_kv_blocks") == 24
    # The loop publishes its gauges after the step that answered the last request.
    deadline = time.time() + 10
    while metric(m, "siesta:kv_cache_usage_perc") != 0 and time.time() < deadline:
        time.sleep(0.05)
        m = metrics(tiny.port)
    assert metric(m, "siesta:kv_cache_usage_perc") == 0
    tiny.stop()


# ---- bad input ------------------------------------------------------------------------------------

def expect_error(status, body, code_status, needle=None, code=None):
    assert status == code_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    e = body["error"]
    assert {"message", "type", "code"} <= set(e), e
    assert isinstance(e["message"], str) and e["message"], e
    if needle:
        assert needle in e["message"], (needle, e["message"])
    if code:
        assert e["code"] == code, e


def bad_input_gets_openai_errors():
    P = "/v1/completions"
    cases = [
        (dict(raw=b"{not json"), 400, "not valid JSON", "invalid_json"),
        (dict(raw=b""), 400, "empty", "invalid_json"),
        (dict(body=[1, 2]), 400, "JSON object", None),
        (dict(body={"max_tokens": 4}), 400, "'prompt' is required", None),
        (dict(body={"prompt": 5}), 400, "'prompt' must be", None),
        (dict(body={"prompt": "hi", "max_tokens": "ten"}), 400, "'max_tokens' must be an integer", None),
        (dict(body={"prompt": "hi", "max_tokens": 0}), 400, "'max_tokens'", None),
        (dict(body={"prompt": "hi", "temperature": "hot"}), 400, "'temperature' must be a number", None),
        (dict(body={"prompt": "hi", "temperature": -1}), 400, "temperature", None),
        (dict(body={"prompt": "hi", "top_p": 1.5}), 400, "top_p", None),
        (dict(body={"prompt": "hi", "top_k": -2}), 400, "top_k", None),
        (dict(body={"prompt": "hi", "n": 0}), 400, "'n'", None),
        (dict(body={"prompt": "hi", "logprobs": 21}), 400, "'logprobs'", None),
        (dict(body={"prompt": "hi", "stream": "yes"}), 400, "'stream' must be a boolean", None),
        (dict(body={"prompt": "hi", "stop": 3}), 400, "'stop'", None),
        (dict(body={"prompt": "hi", "min_tokens": 9, "max_tokens": 4}), 400, "min_tokens", None),
        (dict(body={"prompt": [1, 2, 4096]}), 400, "4096", None),
        (dict(body={"prompt": [1, -1]}), 400, "-1", None),
        (dict(body={"prompt": "hi", "model": "no-such-model"}), 404, "no-such-model", "model_not_found"),
        (dict(body={"prompt": [7] * 600}), 400, "600", None),
        (dict(body={"prompt": [7] * 600}), 400, "512", None),
        (dict(body={"prompt": [7] * 500, "max_tokens": 20}), 400, "520", None),
        (dict(raw=json.dumps({"prompt": "a" * 1100000}).encode()), 413, "1000000", None),
    ]
    for kw, status, needle, code in cases:
        s, b = request(PORT, "POST", P, **kw)
        expect_error(s, b, status, needle, code)
    # A POST that announces no body (no Content-Length, not chunked) has none: answered at once.
    head, raw, elapsed = post_without_length(PORT, "/v1/completions", timeout=TIMEOUT)
    assert head.startswith(b"HTTP/1.1 400"), (head, raw)
    assert elapsed < 2, f"the server waited {elapsed:.1f} s for a body that was never announced"
    expect_error(400, json.loads(raw), 400, "body is empty")
    s, b = request(PORT, "GET", "/v1/no-such-route")
    expect_error(s, b, 404, "/v1/no-such-route")
    s, b = request(PORT, "GET", "/v1/completions")
    expect_error(s, b, 404)
    chat = "/v1/chat/completions"
    for body, needle in [({"max_tokens": 3}, "'messages' is required"), ({"messages": "hi"}, "'messages' must be"),
                         ({"messages": [{"role": "wizard", "content": "x"}]}, "wizard"),
                         ({"messages": [{"role": "user"}]}, "content"),
                         ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        s, b = request(PORT, "POST", chat, body)
        expect_error(s, b, 400, needle)
    s, b = request(PORT, "POST", chat, {"model": "other", "messages": [{"role": "user", "content": "x"}]})
    expect_error(s, b, 404, None, "model_not_found")
    s, b = request(PORT, "POST", "/detokenize", {"tokens": [1, 99999]})
    expect_error(s, b, 400, "99999")
    # Everyone else is still served.
    r = post(PORT, "/v1/completions", {"prompt": "still here", "max_tokens": 3})
    assert len(r["choices"][0]["text"]) > 0 and request(PORT, "GET", "/health")[0] == 200


# ---- client disconnects ------------------------------------------------------------------------------

def raw_request(port, body):
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def client_disconnect_aborts_the_request():
    before = metric(metrics(PORT), "siesta:request_success_total", finished_reason="abort")
    long = {"prompt": "tell me everything", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    streaming = raw_request(PORT, dict(long, stream=True))
    assert streaming.recv(200).startswith(b"HTTP/1.1 200"), "no response head"
    streaming.close()
    whole = raw_request(PORT, long)
    time.sleep(0.2)
    whole.close()
    deadline = time.time() + 20
    while time.time() < deadline:
        m = metrics(PORT)
        aborted = metric(m, "siesta:request_success_total", finished_reason="abort") - before
        if aborted >= 2 and metric(m, "siesta:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert aborted == 2, aborted
    assert metric(m, "siesta:num_requests_running") == 0
    assert metric(m, "siesta:kv_cache_usage_perc") == 0
    assert request(PORT, "GET", "/health")[0] == 200
    post(PORT, "/v1/completions", {"prompt": "after", "max_tokens": 2})


# ---- API key --------------------------------------------------------------------------------------------

def api_key_is_required_everywhere_but_health():
    keyed = Server("--api-key", "sesame", "--max-model-len", "256")
    good = {"Authorization": "Bearer sesame"}
    assert request(keyed.port, "GET", "/health")[0] == 200
    # A Prometheus scraper holds no key; a browser's CORS preflight neither.
    assert request(keyed.port, "GET", "/metrics")[0] == 200
    s, _ = request(keyed.port, "OPTIONS", "/v1/chat/completions",
                   headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"})
    assert s == 204, s
    # The scheme in any case, as RFC 7235 reads it.
    assert request(keyed.port, "GET", "/v1/models", headers={"Authorization": "bearer sesame"})[0] == 200
    for method, path, body in [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                               ("GET", "/server_info", None),
                               ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]})]:
        for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}]:
            s, b = request(keyed.port, method, path, body, headers)
            expect_error(s, b, 401, None, "invalid_api_key")
    s, models = request(keyed.port, "GET", "/v1/models", headers=good)
    assert s == 200 and models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    assert post(keyed.port, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=good)["choices"]
    assert metric(metrics(keyed.port, headers=good), "siesta:request_success_total", finished_reason="length") == 1
    keyed.stop()
    closed = Server("--api-key", "sesame", "--metrics-require-key")
    s, b = request(closed.port, "GET", "/metrics")
    expect_error(s, b, 401, None, "invalid_api_key")
    assert request(closed.port, "GET", "/metrics", headers=good)[0] == 200
    closed.stop()


# ---- chat -------------------------------------------------------------------------------------------------

def chat_uses_the_qwen3_format():
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is sleep mode?"}]
    expected = ("<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nWhat is sleep mode?<|im_end|>\n"
                "<|im_start|>assistant\n")
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = post(PORT, "/v1/chat/completions", body)
    c = r["choices"][0]
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert c["prompt_token_ids"] == tokenize(expected), (c["prompt_token_ids"], tokenize(expected))
    assert c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
    assert len(c["token_ids"]) == 10 and r["usage"]["completion_tokens"] == 10
    # The same conversation as a completion prompt gives the same tokens.
    comp = post(PORT, "/v1/completions", {"prompt": expected, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                          "return_token_ids": True})["choices"][0]
    assert comp["token_ids"] == c["token_ids"] and comp["text"] == c["message"]["content"]
    # Thinking off: the empty think block after the generation prompt.
    off = post(PORT, "/v1/chat/completions", dict(body, chat_template_kwargs={"enable_thinking": False}))
    assert off["choices"][0]["prompt_token_ids"] == tokenize(expected + "<think>\n\n</think>\n\n")
    # /tokenize renders the same conversation.
    t = post(PORT, "/tokenize", {"messages": messages})
    assert t["tokens"] == tokenize(expected) and t["count"] == len(t["tokens"])
    # Streaming: a role chunk first, then content deltas that add up to the message.
    chunks = stream(PORT, "/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True}))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    got = collect_stream(chunks[:-1], "chat")[0]
    assert got["text"] == c["message"]["content"] and got["token_ids"] == c["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def tokenize_detokenize_and_models():
    text = golden["prompts"][3]["text"]
    t = post(PORT, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert t["tokens"] == golden["prompts"][3]["input_ids"] and t["max_model_len"] == 512
    assert len(t["token_strs"]) == len(t["tokens"])
    assert post(PORT, "/detokenize", {"tokens": t["tokens"]})["prompt"] == text
    s, m = request(PORT, "GET", "/v1/models")
    assert s == 200 and m["object"] == "list" and m["data"][0]["id"] == MODEL


# ---- bench serve -----------------------------------------------------------------------------------------

def bench_serve_reports_and_writes_json():
    # vLLM's flags, summary and result JSON.
    out = os.path.join(tmp, "bench")
    rc, stdout, err = run([SIESTA, "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}", "--num-prompts", "12",
                           "--max-concurrency", "4", "--random-input-len", "24", "--random-output-len", "8",
                           "--save-result", "--result-dir", out, "--result-filename", "b.json", "--disable-tqdm",
                           "--metadata", "run=ci"],
                          timeout=120)
    assert rc == 0, err
    for line in ("============ Serving Benchmark Result ============", "Successful requests:                     12",
                 "Maximum request concurrency:             4", "Mean TTFT (ms):", "Median TPOT (ms):",
                 "P99 ITL (ms):", "Total token throughput (tok/s):"):
        assert line in stdout, (line, stdout)
    j = json.load(open(os.path.join(out, "b.json")))
    assert j["completed"] == 12 and j["failed"] == 0 and j["num_prompts"] == 12 and j["max_concurrency"] == 4
    assert j["total_output_tokens"] == 96 and j["total_input_tokens"] == 12 * 24 and j["run"] == "ci"
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{m}_ms" in j, (stat, m, sorted(j))
        assert j[f"median_{m}_ms"] > 0, (m, j[f"median_{m}_ms"])
    # Tokens that arrive together share a chunk (one gap fewer), as with any server.
    assert len(j["ttfts"]) == 12 and len(j["itls"]) == 12 and all(1 <= len(x) <= 7 for x in j["itls"])
    assert j["input_lens"] == [24] * 12 and j["output_lens"] == [8] * 12 and j["errors"] == [""] * 12
    assert j["duration"] > 0 and j["request_throughput"] > 0 and j["request_rate"] == "inf"
    assert j["max_concurrent_requests"] <= 4 and "cpu" in j["siesta"]["machine"] and j["date"]
    # A rate and vLLM's default file name.
    rc, stdout, err = run([SIESTA, "bench", "serve", "--host", "127.0.0.1", "--port", str(PORT), "--num-prompts", "6",
                           "--random-input-len", "8", "--random-output-len", "2", "--request-rate", "50",
                           "--save-result", "--result-dir", out, "--label", "siesta", "--disable-tqdm"], timeout=120)
    assert rc == 0, err
    assert "Request rate configured (RPS):           50.00" in stdout, stdout
    names = [n for n in os.listdir(out) if n.startswith("siesta-50.0qps-tiny-qwen3-")]
    assert len(names) == 1, os.listdir(out)


def server_survived_everything():
    assert main.proc.poll() is None, main.log[-2000:]
    assert request(PORT, "GET", "/health")[0] == 200


try:
    for fn in (greedy_completions_equal_generate, token_prompt_batch_and_n_choices,
               streaming_matches_whole_response_and_reports_usage, echo_and_chat_logprobs, stop_strings_end_the_text,
               concurrent_mixed_requests_equal_each_alone, prefix_cache_hits_show_in_metrics_and_change_nothing,
               preemption_under_a_tiny_kv_cache_keeps_outputs, bad_input_gets_openai_errors,
               client_disconnect_aborts_the_request, api_key_is_required_everywhere_but_health,
               chat_uses_the_qwen3_format, tokenize_detokenize_and_models, bench_serve_reports_and_writes_json):
        checks.check(fn.__name__, fn)
    checks.check(server_survived_everything.__name__, server_survived_everything)
finally:
    for s in servers:
        s.stop()
checks.finish()
