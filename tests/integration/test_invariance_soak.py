"""An HTTP concurrency soak whose every answer must equal the same request sent alone.

`siesta serve` gets a fixed set of 26 requests: token-id and text prompts of 1 to about 650 tokens
(some sharing a 96-token prefix), /v1/completions and /v1/chat/completions, greedy and seeded (temperature
0.8-1.0 with top_p, top_k and min_p varied), 8 to 64 tokens, n of 2 and 3, two prompts in one request,
stop strings and stop_token_ids (taken from the request's own output), logprobs, echo, prompt_logprobs,
penalties, logit_bias and min_tokens. Each request is first sent ALONE (nothing else in flight), whole
and streamed, each with a fresh cache_salt (a cold prefill): those answers are the references. Then
CLIENTS threads (16) send random requests of the set for SECONDS (40), half streamed, half with a fresh
cache_salt (a whole prompt to prefill, in chunks of --max-num-batched-tokens, beside the decode rows of
the others) and half without (the prefix cache serves the prompt's full blocks), so that every step
batches prefill chunks and decode rows of different requests at different positions. Every answer is
compared with its reference, field by field: the text (or message), token_ids, prompt_token_ids,
finish_reason, stop_reason, logprobs and prompt_logprobs (the values bit-equal: a batch-invariant
engine computes a row's logits in an order that depends on that row alone, so a logprob that differs
in its last bit shows batching reached the row), and the usage's prompt, completion and total tokens.
A streamed answer is compared after its chunks are joined per choice (how tokens fall into chunks
depends on timing). Not compared: id, created, and usage.prompt_tokens_details.cached_tokens (what the
prefix cache held at the time), which must be 0 for a salted request and at most the prompt otherwise.
Every answer is counted:
  ok       equal to its reference
  wrong    completed with anything else (tokens, or only logprob values: both counted, told apart)
  errored  an HTTP error, an error event, finish_reason abort, a broken stream or a failed connection
  lost     no whole answer within --request-timeout-s of sending (every request has this deadline)
and the checks assert: 0 wrong, 0 errored, 0 lost; the soak had at least CLIENTS/2 requests running
at once; afterwards every request sent alone again (unsalted: from the warm prefix cache) equals its
reference; the server is healthy and within 2 s runs, queues and holds nothing (siesta:kv_blocks_in_use
and kv_cache_usage_perc 0, and the P/D holds where shown, as test_pd_soak.py checks); every engine
request submitted finished and none was aborted.

The CPU model is batch- and chunk-invariant by construction (docs/ARCHITECTURE.md, "The model
forward") and seeded requests own their random stream (src/engine/random.h), so on the CPU every
request kind must pass. Unseeded sampling (temperature > 0 without a seed) is not in the set: it draws
from the engine's generator in step order, so it is not reproducible even alone.

CI runs it on the CPU with the tiny model. The same script is the device form (scripts/device-check,
stage invariance); flags override the environment variables named:
  python3 tests/integration/test_invariance_soak.py --siesta build/bin/siesta --source . \\
      --device cuda --model /tmp/qwen3-0.6b --extra-serve-args=--batch-invariant --seconds 60 \\
      --json /tmp/invariance.json
  --device (SOAK_DEVICE, cpu), --model (SOAK_MODEL, the tiny model), --extra-serve-args
  (SOAK_EXTRA_FLAGS), --clients (SOAK_CLIENTS, 16), --seconds (SOAK_SECONDS, 40), --seed (SOAK_SEED,
  else from the clock, printed), --json (SOAK_JSON), --allow-wrong: count and report wrong answers
  without failing on them (an engine that is not batch-invariant; errors, losses and held blocks
  still fail).
"""
import argparse
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
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, SiestaProcess, http_request, metrics, run_record  # noqa: E402

env = os.environ.get
ap = argparse.ArgumentParser()
ap.add_argument("--siesta", required=True)
ap.add_argument("--source", required=True)
ap.add_argument("--model", default=env("SOAK_MODEL"), help="model directory (default: the embedded tiny Qwen3)")
ap.add_argument("--device", default=env("SOAK_DEVICE", "cpu"))
ap.add_argument("--extra-serve-args", default=env("SOAK_EXTRA_FLAGS", ""), help="more `siesta serve` flags")
ap.add_argument("--clients", type=int, default=int(env("SOAK_CLIENTS", "16")))
ap.add_argument("--seconds", type=float, default=float(env("SOAK_SECONDS", "40")),
                help="soak time (longer, up to 3x, until twice as many answers as references are in)")
ap.add_argument("--seed", type=int, default=int(env("SOAK_SEED")) if env("SOAK_SEED") else None,
                help="the clients' choices of request, form and salt (default: from the clock)")
ap.add_argument("--kv-bytes", default=None, help="KV cache size (default 128M on the CPU, 4G on CUDA)")
ap.add_argument("--max-num-batched-tokens", type=int, default=128,
                help="tokens per engine step: long prompts prefill in chunks beside the decode rows")
ap.add_argument("--request-timeout-s", type=float, default=60.0, help="a request's deadline (else lost)")
ap.add_argument("--json", default=env("SOAK_JSON"), help="write the counts, diffs and settings here")
ap.add_argument("--allow-wrong", action="store_true",
                help="report wrong answers without failing (an engine that is not batch-invariant)")
args = ap.parse_args()

SIESTA = args.siesta
MODEL = args.model or os.path.join(args.source, "models", "tiny-qwen3")
SEED = args.seed if args.seed is not None else int(time.time()) % 100000
ON_CUDA = args.device.startswith("cuda")
KV_BYTES = args.kv_bytes or ("4G" if ON_CUDA else "128M")
SERVE_ARGS = ["--kv-cache-memory-bytes", KV_BYTES, "--max-model-len", "1024", "--seed", "0",
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--device", args.device]
if not ON_CUDA:
    SERVE_ARGS += ["--threads", "2"]
SERVE_ARGS += [a for a in args.extra_serve_args.split() if a]
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-invariance-")
print(f"invariance soak seed {SEED} (pass --seed {SEED} to repeat the clients' choices); {args.clients} clients, "
      f"{args.seconds:g} s, serve {' '.join(SERVE_ARGS)}", flush=True)


# ---- the request set -----------------------------------------------------------------------------

WORDS = ("sleep mode lets an inference server give its memory back while a trainer uses the device and take it "
         "again later at the same addresses prefill and decode run on separate engines the keys and values of "
         "each prompt move between them block by block").split()


def ids(seed, n):
    r = random.Random(seed)
    return [r.randrange(10, 4000) for _ in range(n)]


SHARED = ids(1, 96)  # six full blocks that several prompts share (and share in the prefix cache)


def greedy(**kw):
    return dict(temperature=0, **kw)


def seeded(seed, temperature=0.9, **kw):
    return dict(temperature=temperature, seed=seed, **kw)


class Spec:
    """One request of the set: endpoint, body (without stream), the forms it is sent in, and whether its
    stop condition comes from its own output (probe: "string", "string_included", "token")."""

    def __init__(self, name, path, body, forms=("whole", "stream"), probe=None):
        self.name, self.path, self.body, self.forms, self.probe = name, path, body, forms, probe
        self.kind = "greedy" if body.get("temperature") == 0 else "seeded"


def completion(name, prompt, sampling, max_tokens, forms=("whole", "stream"), probe=None, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
            **sampling, **extra}
    return Spec(name, "/v1/completions", body, forms, probe)


def chat(name, messages, sampling, max_tokens, probe=None, **extra):
    body = {"messages": messages, "ignore_eos": True, "return_token_ids": True, **sampling, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return Spec(name, "/v1/chat/completions", body, probe=probe)


def user(text):
    return [{"role": "user", "content": text}]


LONG_TEXT = " ".join(WORDS * 6)  # 270 words: 384 tokens of the tiny model's tokenizer
SPECS = [
    completion("ids1-greedy", ids(2, 1), greedy(), 16),
    completion("ids5-seeded-top_p", ids(3, 5), seeded(11, top_p=0.95), 24),
    completion("ids17-greedy-logprobs", ids(4, 17), greedy(), 12, logprobs=3),
    completion("ids64-seeded-top_k", ids(5, 64), seeded(12, 1.0, top_k=20), 32),
    completion("shared150-greedy", SHARED + ids(6, 54), greedy(), 40),
    completion("shared200-seeded-min_p-logprobs", SHARED + ids(7, 104), seeded(13, 0.8, min_p=0.05), 48, logprobs=2),
    completion("ids333-greedy", ids(8, 333), greedy(), 64),
    completion("ids480-seeded-n2", ids(9, 480), seeded(14, top_p=0.9, top_k=50), 24, n=2),
    completion("ids600-greedy", ids(10, 600), greedy(), 8),
    completion("shared600-seeded-logprobs", SHARED + ids(11, 504), seeded(15, 1.0), 16, logprobs=1),
    completion("text-hello-greedy", "Hello", greedy(), 20),
    completion("text-greedy-stop", "The engine " + " ".join(WORDS[:20]), greedy(), 48, probe="string"),
    completion("text-long-seeded-stop", LONG_TEXT, seeded(16, top_p=0.95), 64, probe="string"),
    completion("text-seeded-stop_token_ids", " ".join(WORDS[10:40]), seeded(21, 0.8), 40, probe="token"),
    completion("text-seeded-penalties", " ".join(WORDS[:30]), seeded(22, 0.9, top_k=100), 32,
               repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
    completion("text-greedy-logit_bias", "Prefill and decode", greedy(), 16,
               logit_bias={"100": 2.5, "200": 1.5, "300": -100}),
    completion("text-greedy-echo-logprobs", "Blocks move between engines", greedy(), 10, echo=True, logprobs=2),
    completion("ids40-greedy-prompt_logprobs", ids(12, 40), greedy(), 8, forms=("whole",), prompt_logprobs=2),
    completion("two-prompts-seeded-n2", [ids(13, 20), "two prompts in one request"], seeded(17, top_p=0.9), 12, n=2),
    completion("text-seeded-min_tokens-eos", "A short answer:", seeded(18, 1.0), 40, ignore_eos=False, min_tokens=8,
               return_token_ids=False),
    chat("chat-greedy", user("What is sleep mode?"), greedy(), 24),
    chat("chat-system-seeded-logprobs",
         [{"role": "system", "content": "You are brief."}, {"role": "user", "content": " ".join(WORDS[:25])}],
         seeded(19, top_p=0.9), 32, logprobs=True, top_logprobs=2),
    chat("chat-turns-greedy-stop-included",
         [{"role": "user", "content": "Name a block."}, {"role": "assistant", "content": "Block seven."},
          {"role": "user", "content": "And the next one?"}], greedy(), 48, probe="string_included"),
    chat("chat-long-seeded-n3", user(" ".join(WORDS * 10)), seeded(20, 1.0, top_k=40), 16, n=3),
    chat("chat-no-thinking-seeded-min_p", user("Why sleep?"), seeded(23, 0.85, min_p=0.1), 20,
         chat_template_kwargs={"enable_thinking": False}),
    chat("chat-greedy-eos-max_completion_tokens", user("Say something."), greedy(), None, ignore_eos=False,
         max_completion_tokens=64),
]


# ---- one exchange --------------------------------------------------------------------------------

class Answer:
    """What a client made of one exchange: kind "done" (with the normalized answer and its cached_tokens),
    "error" or "lost", with a detail."""

    def __init__(self, kind, detail="", answer=None, cached=None, seconds=0.0):
        self.kind, self.detail, self.answer, self.cached, self.seconds = kind, detail, answer, cached, seconds


def merge(into, part):
    """Joins a streamed choice's chunk into what came before: strings and lists appended, objects merged,
    numbers replaced, nulls kept only where nothing else came."""
    for k, v in part.items():
        if v is None:
            into.setdefault(k, None)
        elif isinstance(v, str):
            into[k] = (into.get(k) or "") + v
        elif isinstance(v, list):
            into[k] = (into.get(k) or []) + v
        elif isinstance(v, dict):
            if not isinstance(into.get(k), dict):
                into[k] = {}
            merge(into[k], v)
        else:
            into[k] = v


def split_cached(answer):
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.pop("cached_tokens", None)
    if not details:
        usage.pop("prompt_tokens_details", None)
    return cached


def normalize(status, raw, stream):
    """(kind, detail, normalized answer, cached_tokens) of one response."""
    if status != 200:
        try:
            e = json.loads(raw)["error"]
            return "error", f"HTTP {status} {e.get('code')}: {e.get('message')}", None, None
        except (ValueError, KeyError, TypeError):
            return "error", f"HTTP {status}, unreadable error body {raw[:200]!r}", None, None
    if not stream:
        try:
            a = json.loads(raw)
        except ValueError:
            return "error", f"unreadable body {raw[:200]!r}", None, None
        for key in ("id", "created"):
            a.pop(key, None)
    else:
        events = raw.decode(errors="replace").split("\n\n")
        if len(events) < 2 or events[-1] != "" or events[-2] != "data: [DONE]":
            return "error", f"the stream did not end with [DONE]: {raw[-200:]!r}", None, None
        ids_seen, choices, a = set(), {}, {"usage": None}
        for e in events[:-2]:
            if not e.startswith("data: "):
                return "error", f"not an SSE data event: {e[:200]!r}", None, None
            try:
                chunk = json.loads(e[6:])
            except ValueError:
                return "error", f"unreadable event {e[:200]!r}", None, None
            if "error" in chunk:
                return "error", f"stream error event: {chunk['error']}", None, None
            ids_seen.add(chunk.get("id"))
            a["object"], a["model"] = chunk.get("object"), chunk.get("model")
            if chunk.get("usage") is not None and not chunk.get("choices"):
                a["usage"] = chunk["usage"]
            for c in chunk.get("choices") or []:
                c = dict(c)
                merge(choices.setdefault(c.pop("index"), {}), c)
        if len(ids_seen) != 1:
            return "error", f"chunks of one stream carry {len(ids_seen)} ids", None, None
        a["choices"] = [choices[k] for k in sorted(choices)]
    finishes = [c.get("finish_reason") for c in a.get("choices", [])]
    if "abort" in finishes:
        return "error", "finish_reason abort", None, None
    cached = split_cached(a)
    return "done", "", a, cached


def send(port, spec, form, salt, timeout_s):
    """One exchange of spec in form ("whole" or "stream"), with a cache_salt when salt is given; the whole
    answer must arrive within timeout_s of sending."""
    body = dict(spec.body)
    if form == "stream":
        body.update(stream=True, stream_options={"include_usage": True})
    if salt:
        body["cache_salt"] = salt
    start = time.monotonic()
    deadline = start + timeout_s
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", spec.path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        sock = conn.sock
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        r = conn.getresponse()
        parts = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return Answer("lost", f"no whole answer within {timeout_s:g} s", seconds=time.monotonic() - start)
            sock.settimeout(left)
            b = r.read1(65536)
            if not b:
                break
            parts.append(b)
        kind, detail, answer, cached = normalize(r.status, b"".join(parts), form == "stream")
        return Answer(kind, detail, answer, cached, time.monotonic() - start)
    except (socket.timeout, TimeoutError):
        return Answer("lost", f"no whole answer within {timeout_s:g} s", seconds=time.monotonic() - start)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Answer("error", f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
    finally:
        conn.close()


def first_diff(got, want, path="$"):
    """Where two answers first differ, in a line; None when equal (floats compared bit for bit)."""
    if type(got) is not type(want):
        return f"{path}: {json.dumps(got)[:160]} != reference {json.dumps(want)[:160]}"
    if isinstance(got, dict):
        for k in sorted(set(got) | set(want)):
            if k not in got or k not in want:
                return f"{path}.{k}: {'missing' if k not in got else 'unexpected'}"
            d = first_diff(got[k], want[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(got, list):
        for i, (g, w) in enumerate(zip(got, want)):
            d = first_diff(g, w, f"{path}[{i}]")
            if d:
                return d
        if len(got) != len(want):
            return f"{path}: {len(got)} items != reference {len(want)}"
        return None
    return None if got == want else f"{path}: {json.dumps(got)[:160]} != reference {json.dumps(want)[:160]}"


def without_logprobs(x):
    if isinstance(x, dict):
        return {k: without_logprobs(v) for k, v in x.items() if k not in ("logprobs", "prompt_logprobs")}
    if isinstance(x, list):
        return [without_logprobs(v) for v in x]
    return x


def judge(spec, salted, answer, reference):
    """(verdict, diff): "ok", "wrong_tokens" (anything but logprob values) or "wrong_logprobs"."""
    prompt_tokens = (answer.answer.get("usage") or {}).get("prompt_tokens")
    if answer.cached is None or prompt_tokens is None or not 0 <= answer.cached <= prompt_tokens:
        return "wrong_tokens", f"usage: cached_tokens {answer.cached} for {prompt_tokens} prompt tokens"
    if salted and answer.cached != 0:
        return "wrong_tokens", f"usage: cached_tokens {answer.cached} for a request with a fresh cache_salt"
    d = first_diff(answer.answer, reference)
    if d is None:
        return "ok", None
    if first_diff(without_logprobs(answer.answer), without_logprobs(reference)) is None:
        return "wrong_logprobs", d
    return "wrong_tokens", d


def essence(spec, answer):
    """Per choice: text, token ids, finish and stop reasons, logprobs: what the whole and the streamed form of
    one request must share."""
    out = []
    for c in answer["choices"]:
        text = c.get("text") if spec.path == "/v1/completions" else (c.get("message") or c.get("delta") or {}).get(
            "content")
        out.append([text, c.get("token_ids"), c.get("finish_reason"), c.get("stop_reason"), c.get("logprobs")])
    return out


def salt():
    return f"soak-{uuid.uuid4().hex}"


# ---- the run --------------------------------------------------------------------------------------

server = None
summary = {"seed": SEED, "device": args.device, "model": MODEL, "extra_serve_args": args.extra_serve_args,
           "serve_args": SERVE_ARGS, "clients": args.clients, "seconds": args.seconds,
           "allow_wrong": args.allow_wrong, "requests_in_set": len(SPECS)}
refs = {}  # (spec index, form) -> normalized answer
soak = {}
TIMEOUT = args.request_timeout_s


def build_references():
    # Stop conditions from each request's own output, alone.
    for s in SPECS:
        if not s.probe:
            continue
        a = send(server.port, s, "whole", salt(), TIMEOUT)
        assert a.kind == "done", (s.name, a.kind, a.detail)
        c = a.answer["choices"][0]
        if s.probe == "token":
            toks = c["token_ids"]
            s.body["stop_token_ids"] = [toks[len(toks) // 2]]
        else:
            text = c.get("text") if s.path == "/v1/completions" else c["message"]["content"]
            # Three characters from the middle on (no U+FFFD, which stands for bytes of no whole character).
            starts = [m for m in range(len(text) // 2, len(text) - 2) if "\ufffd" not in text[m:m + 3]]
            assert starts, (s.name, "no stop string to take from the output", text)
            s.body["stop"] = [text[starts[0]:starts[0] + 3], "never-in-the-output-\u00e9"]
            if s.probe == "string_included":
                s.body["include_stop_str_in_output"] = True
    started = time.monotonic()
    differ = []  # requests whose streamed reference joins to other choices than the whole one
    for i, s in enumerate(SPECS):
        for form in s.forms:
            a = send(server.port, s, form, salt(), TIMEOUT)
            assert a.kind == "done", (s.name, form, a.kind, a.detail)
            assert a.cached == 0, (s.name, form, "cached_tokens with a fresh salt", a.cached)
            refs[(i, form)] = a.answer
        if s.probe:
            assert refs[(i, "whole")]["choices"][0]["finish_reason"] == "stop", (s.name, refs[(i, "whole")])
        if "stream" in s.forms:
            w, st = essence(s, refs[(i, "whole")]), essence(s, refs[(i, "stream")])
            if w != st:
                differ.append(s.name)
                assert args.allow_wrong, (s.name, "the streamed answer joins to other choices than the whole one", w,
                                          st)
    summary["references_stream_whole_differ"] = differ
    summary["references_s"] = round(time.monotonic() - started, 2)
    kinds = [c["finish_reason"] for r in refs.values() for c in r["choices"]]
    summary["reference_finish_reasons"] = {k: kinds.count(k) for k in sorted(set(kinds))}
    print(f"  {len(refs)} references in {summary['references_s']} s, finish reasons "
          f"{summary['reference_finish_reasons']}", flush=True)


def run_soak():
    outcomes = []
    lock = threading.Lock()
    stop = threading.Event()
    keys = sorted(refs)
    monitor = {"samples": 0, "max_running": 0, "sum_running": 0, "max_waiting": 0}

    def client(cid):
        rng = random.Random(SEED * 1000 + cid)
        while not stop.is_set():
            i, form = keys[rng.randrange(len(keys))]
            salted = rng.random() < 0.5
            a = send(server.port, SPECS[i], form, salt() if salted else None, TIMEOUT)
            try:
                verdict, diff = judge(SPECS[i], salted, a, refs[(i, form)]) if a.kind == "done" else (a.kind, a.detail)
            except Exception as e:  # noqa: BLE001 - an answer this script cannot read is an error, not a pass
                verdict, diff = "error", f"unreadable answer: {type(e).__name__}: {e}"
            with lock:
                outcomes.append((i, form, salted, verdict, diff, a.seconds))

    def watch():
        while not stop.is_set():
            try:
                m = metrics(server.port)
            except (OSError, AssertionError, ValueError):
                stop.wait(0.2)
                continue
            running = int(m.get("siesta:num_requests_running", 0))
            monitor["samples"] += 1
            monitor["sum_running"] += running
            monitor["max_running"] = max(monitor["max_running"], running)
            monitor["max_waiting"] = max(monitor["max_waiting"], int(m.get("siesta:num_requests_waiting", 0)))
            stop.wait(0.2)

    before = metrics(server.port)
    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
    watcher = threading.Thread(target=watch, daemon=True)
    for t in threads + [watcher]:
        t.start()
    time.sleep(args.seconds)
    # Past --seconds until the answers are enough to tell (twice the references), at most
    # twice as long again: a slower mode gets its sample instead of a short count.
    while time.monotonic() < started + 3 * args.seconds:
        with lock:
            answered = sum(o[3] in ("ok", "wrong_tokens", "wrong_logprobs") for o in outcomes)
        if answered >= 2 * len(refs):
            break
        time.sleep(0.5)
    stop.set()
    stopped = time.monotonic()
    for t in threads:
        t.join(max(0.0, stopped + TIMEOUT + 15 - time.monotonic()))
    watcher.join(15)
    soak["end"] = time.monotonic()
    stuck = sum(t.is_alive() for t in threads)
    after = metrics(server.port)

    counts = {"ok": 0, "wrong_tokens": 0, "wrong_logprobs": 0, "error": 0, "lost": stuck}
    by_kind = {}
    diffs = []
    for i, form, salted, verdict, diff, _ in outcomes:
        counts[verdict] += 1
        key = f"{SPECS[i].kind}/{form}/{'salted' if salted else 'cached'}"
        k = by_kind.setdefault(key, {"ok": 0, "wrong": 0, "error": 0, "lost": 0})
        k["wrong" if verdict.startswith("wrong") else verdict] += 1
        if verdict != "ok":
            diffs.append({"request": SPECS[i].name, "form": form, "salted": salted, "verdict": verdict, "diff": diff})
    per_request = {}
    for i, form, salted, verdict, diff, _ in outcomes:
        p = per_request.setdefault(SPECS[i].name, {"sent": 0, "wrong": 0})
        p["sent"] += 1
        p["wrong"] += verdict.startswith("wrong")
    seconds = sorted(o[5] for o in outcomes) or [0.0]
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("siesta:prompt_tokens_total", "siesta:generation_tokens_total", "siesta:prefix_cache_hits_total",
                       "siesta:num_preemptions_total", "siesta:num_requests_submitted_total")}
    soak.update({"counts": counts, "by_kind": by_kind, "diffs": diffs, "per_request": per_request,
                 "monitor": monitor, "requests": len(outcomes)})
    summary.update({"soak_s": round(soak["end"] - started, 1), "requests": len(outcomes), "counts": counts,
                    "wrong": counts["wrong_tokens"] + counts["wrong_logprobs"],
                    "errored": counts["error"], "lost": counts["lost"], "by_kind": by_kind,
                    "wrong_by_request": {n: p for n, p in per_request.items() if p["wrong"]},
                    "first_diffs": diffs[:12], "seconds_p50_max": [round(seconds[len(seconds) // 2], 3),
                                                                  round(seconds[-1], 3)],
                    "running_max_mean": [monitor["max_running"],
                                         round(monitor["sum_running"] / max(1, monitor["samples"]), 1)],
                    "waiting_max": monitor["max_waiting"], "engine_deltas": delta})
    print(f"  {len(outcomes)} requests in {summary['soak_s']} s: {counts}; running max {monitor['max_running']} "
          f"mean {summary['running_max_mean'][1]}; latency p50 {summary['seconds_p50_max'][0]} s max "
          f"{summary['seconds_p50_max'][1]} s; {delta}", flush=True)
    for d in diffs[:5]:
        print(f"    {d['verdict']} {d['request']} {d['form']} {'salted' if d['salted'] else 'cached'}: {d['diff']}",
              flush=True)
    if summary["wrong_by_request"]:
        print(f"  wrong by request (sent, wrong): "
              f"{ {n: (p['sent'], p['wrong']) for n, p in summary['wrong_by_request'].items()} }", flush=True)


def soak_answers_equal_references():
    assert refs, "no references"
    run_soak()
    c = soak["counts"]
    assert c["error"] == 0 and c["lost"] == 0, (c, [d for d in soak["diffs"] if d["verdict"] in ("error", "lost")][:5])
    if not args.allow_wrong:
        assert c["wrong_tokens"] == 0 and c["wrong_logprobs"] == 0, (c, soak["diffs"][:5])
    assert c["ok"] + c["wrong_tokens"] + c["wrong_logprobs"] >= 2 * len(refs), ("too few answers to tell", c)


def soak_batched_requests():
    m = soak["monitor"]
    assert m["max_running"] >= max(2, args.clients // 2), m


def alone_again_from_the_prefix_cache():
    wrong = []
    for (i, form), ref in sorted(refs.items()):
        if form != "whole":
            continue
        a = send(server.port, SPECS[i], form, None, TIMEOUT)
        assert a.kind == "done", (SPECS[i].name, a.kind, a.detail)
        verdict, diff = judge(SPECS[i], False, a, ref)
        if verdict != "ok":
            wrong.append((SPECS[i].name, verdict, diff))
    summary["alone_again_wrong"] = len(wrong)
    summary["alone_again_diffs"] = wrong[:12]
    if wrong:
        print(f"  alone again: {len(wrong)} wrong, first {wrong[:3]}", flush=True)
    if not args.allow_wrong:
        assert not wrong, wrong[:5]


def healthy_and_nothing_held():
    assert server.proc.poll() is None, "the server exited"
    status, raw = http_request(server.port, "GET", "/health", timeout=10)
    assert status == 200, (status, raw[:200])
    keys = ("siesta:num_requests_running", "siesta:num_requests_waiting", "siesta:kv_blocks_in_use",
            "siesta:kv_cache_usage_perc", "siesta:kv_blocks_held_for_remote", "siesta:kv_blocks_held_for_loads")
    start = time.monotonic()
    end = start + 2.0
    while True:
        m = metrics(server.port)
        last = {k: m.get(k, 0) for k in keys}
        if all(v == 0 for v in last.values()):
            break
        assert time.monotonic() < end, f"still running or held 2 s after the last answer: {last}"
        time.sleep(0.05)
    summary["clear_after_s"] = round(time.monotonic() - start, 3)


def every_request_finished_none_aborted():
    m = metrics(server.port)
    finished = {r: m.get(f'siesta:request_success_total{{finished_reason="{r}"}}', 0)
                for r in ("stop", "length", "abort")}
    submitted = m.get("siesta:num_requests_submitted_total", 0)
    summary["engine_requests"] = {"submitted": submitted, **finished}
    assert finished["abort"] == 0, finished
    assert sum(finished.values()) == submitted, (submitted, finished)


try:
    server = SiestaProcess(SIESTA, "serve", ["serve", "--model", MODEL, "--port", "0", *SERVE_ARGS], tmp,
                           log_level=os.environ.get("SIESTA_SOAK_LOG_LEVEL", "info"), start_timeout_s=180)
    t0 = time.monotonic()
    checks.check("every request of the set answers alone, streamed as whole (the references)", build_references)
    if refs:
        checks.check(f"{args.clients} clients for {args.seconds:g} s: every answer equals the same request alone"
                     + (" (wrong answers reported only)" if args.allow_wrong else ""), soak_answers_equal_references)
        checks.check("the soak kept requests running together", soak_batched_requests)
        checks.check("alone again, from the warm prefix cache: every answer equals its reference"
                     + (" (reported only)" if args.allow_wrong else ""), alone_again_from_the_prefix_cache)
        checks.check("server healthy; nothing running, queued or holding KV blocks within 2 s",
                     healthy_and_nothing_held)
        checks.check("every engine request finished; none aborted", every_request_finished_none_aborted)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    print(f"invariance soak took {summary['total_s']} s after the server started", flush=True)
finally:
    if server:
        server.stop()
    summary["passed"] = checks.failed == 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_record(args.source, ON_CUDA), **summary}, f, indent=1)
    if checks.failed == 0 and not os.environ.get("SIESTA_TEST_KEEP_LOGS"):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"logs kept in {tmp}")
checks.finish()
