"""`siesta serve` as a vLLM user finds it: started with vLLM's flags (--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3 --vllm-metric-names), it refuses what it would
otherwise ignore, samples with penalties, logit_bias, allowed_token_ids, bad_words and min_tokens (the
same tokens alone and under concurrency), returns prompt_logprobs, truncates prompts, sends
continuous usage, renders chat through the chat template with tools and tool results (/tokenize's chat
form gives the tokens the chat endpoint prefills), splits reasoning_content, forces the tool call of
tool_choice required and named, answers GET /v1/models/{id} and /server_info, names responses by
request_id or X-Request-Id, and charts vllm: metrics."""
import http.client
import json
import os
import select
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, parse_args  # noqa: E402

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
TIMEOUT = 60
KEY = "vllm-key"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


class Server:
    def __init__(self, *extra):
        self.proc = subprocess.Popen(
            [SIESTA, "serve", "--model", MODEL, "--port", "0", "--threads", "2", "--seed", "0",
             "--kv-cache-memory-bytes", "64M", "--max-model-len", "512", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.port, self.log = None, b""
        deadline = time.time() + 60
        while self.port is None:
            assert time.time() < deadline and self.proc.poll() is None, self.log
            ready, _, _ = select.select([self.proc.stderr], [], [], 1)
            if ready:
                line = self.proc.stderr.readline()
                self.log += line
                if b"listening on http://" in line:
                    self.port = int(line.split(b"http://")[1].split(b" ")[0].rsplit(b":", 1)[1])
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


def request(method, path, body=None, headers=None, port=None):
    conn = http.client.HTTPConnection("127.0.0.1", port or srv.port, timeout=TIMEOUT)
    try:
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        h.update(headers or {})
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=h)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text
    finally:
        conn.close()


def post(path, body, headers=None):
    s, j = request("POST", path, body, headers)
    assert s == 200, (s, j)
    return j


def refused(path, body, needle):
    s, j = request("POST", path, body)
    assert s == 400, (s, j)
    assert needle in j["error"]["message"], (needle, j)


def stream(path, body):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 200, (r.status, r.read())
        events = r.read().decode().split("\n\n")
    finally:
        conn.close()
    assert events[-2] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def completion(prompt, **kw):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body.update(kw)
    return post("/v1/completions", body)["choices"][0]


PROMPT = "The quick brown fox jumps over the lazy dog."


def nothing_is_silently_ignored():
    refused("/v1/completions", {"prompt": "x", "max_token": 4}, "'max_token' is not a field")
    refused("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a+"}},
            "'structured_outputs' is not supported")
    refused("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "object"}},
            "'guided_json' is not supported")
    refused("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "include_usage")
    refused("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            "--trust-request-chat-template")
    refused("/tokenize", {"prompt": "x", "add_special": True}, "'add_special' is not a field of /tokenize")
    # vLLM ignores `user` too.
    assert completion("x", user="u-1")["text"] is not None


def adjusted_sampling_through_http():
    plain = completion(PROMPT)["token_ids"]
    forced = completion(PROMPT, logit_bias={str(plain[0] + 1): 100})["token_ids"]
    assert forced == [plain[0] + 1] * 8, forced
    allowed = completion(PROMPT, allowed_token_ids=[100, 200, 300])["token_ids"]
    assert set(allowed) <= {100, 200, 300}, allowed
    word = completion(PROMPT, max_tokens=1, return_token_ids=True)
    banned = completion(PROMPT, bad_words=[word["text"].strip()])["token_ids"]
    assert banned[0] != plain[0] and plain[0] not in banned, (plain, banned)
    # eos (token 4093 here) only after min_tokens: with a bias that makes it the top token, the answer
    # still has min_tokens tokens.
    c = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "min_tokens": 3,
                                 "logit_bias": {"4093": 100}, "return_token_ids": True})["choices"][0]
    assert len(c["token_ids"]) == 4 and c["token_ids"][-1] == 4093 and c["finish_reason"] == "stop", c
    # Penalised, seeded sampling: the same tokens alone and with 11 others at once.
    bodies = [{"prompt": f"{PROMPT} {i}", "max_tokens": 12, "ignore_eos": True, "temperature": 0.9, "seed": i,
               "presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
               "logit_bias": {"13": -5}, "return_token_ids": True} for i in range(12)]
    alone = [post("/v1/completions", b)["choices"][0]["token_ids"] for b in bodies]
    together = [None] * 12

    def send(i):
        together[i] = post("/v1/completions", bodies[i])["choices"][0]["token_ids"]
    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone


def prompt_logprobs_truncation_and_usage():
    c = completion(PROMPT, prompt_logprobs=2, max_tokens=2)
    n = len(c["prompt_token_ids"])
    assert len(c["prompt_logprobs"]) == n and c["prompt_logprobs"][0] is None
    for pos in range(1, n):
        entry = c["prompt_logprobs"][pos]
        assert str(c["prompt_token_ids"][pos]) in entry and 2 <= len(entry) <= 3, entry
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
    t = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert t["usage"]["prompt_tokens"] == 4, t["usage"]
    chunks = stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True,
                                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    # Every chunk carries the tokens so far; tokens may share a chunk on a busy machine.
    assert counts and counts[-1] == 3 and counts[0] >= 1, counts
    assert all(a < b for a, b in zip(counts, counts[1:])), counts
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []
    ids = completion(PROMPT, max_tokens=2, logprobs=1, return_tokens_as_token_ids=True)
    assert ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids["token_ids"]]


def chat_renders_tools_and_prefills_what_tokenize_gives():
    conversation = {
        "messages": [{"role": "developer", "content": "Use tools."},
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "18C, cloudy"}],
        "tools": [WEATHER]}
    r = post("/v1/chat/completions", dict(conversation, max_tokens=4, temperature=0, ignore_eos=True,
                                          return_token_ids=True, tool_choice="none", return_prompt_text=True))
    t = post("/tokenize", dict(conversation))
    assert r["prompt_token_ids"] == t["tokens"], (r["prompt_token_ids"], t["tokens"])
    text = r["prompt_text"]
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools"), text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text, text
    assert "<tool_response>\n18C, cloudy\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    for kw in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        a = post("/v1/chat/completions", dict(conversation, max_tokens=1, return_token_ids=True, **kw))
        assert a["prompt_token_ids"] == post("/tokenize", dict(conversation, **kw))["tokens"]
    cont = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}],
            "continue_final_message": True, "add_generation_prompt": False}
    a = post("/v1/chat/completions", dict(cont, max_tokens=2, return_token_ids=True, echo=True))
    assert a["prompt_token_ids"] == post("/tokenize", cont)["tokens"]
    assert a["choices"][0]["message"]["content"].startswith("Hi the")


def reasoning_and_tool_calls_as_vllm_reads_them():
    # The tiny model never closes its reasoning: all of it is reasoning_content, no content (vLLM's
    # qwen3 parser for an answer cut short), streamed or not; thinking off makes it content.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    m = post("/v1/chat/completions", body)["choices"][0]["message"]
    assert m["content"] is None and m["reasoning_content"] and m["reasoning"] == m["reasoning_content"], m
    chunks = stream("/v1/chat/completions", dict(body, stream=True))
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    assert streamed == m["reasoning_content"], (streamed, m)
    off = post("/v1/chat/completions", dict(body, chat_template_kwargs={"enable_thinking": False}))
    assert off["choices"][0]["message"]["content"] and off["choices"][0]["message"]["reasoning_content"] is None
    # tool_choice named / required: the answer opens with the tool call, whatever the model.
    tools = dict(body, tools=[WEATHER], max_tokens=40)  # this tokenizer spells <tool_call> in many tokens
    named = post("/v1/chat/completions", dict(tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              return_token_ids=True))
    choice = named["choices"][0]
    text = post("/detokenize", {"tokens": choice["token_ids"]})["prompt"]
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": '), text
    # No reasoning comes first then (this tokenizer has no </think> to force after): the text is the answer.
    assert choice["message"]["reasoning_content"] is None, choice["message"]
    req = post("/v1/chat/completions", dict(tools, tool_choice="required", return_token_ids=True))["choices"][0]
    assert post("/detokenize", {"tokens": req["token_ids"]})["prompt"].startswith("<tool_call>\n")
    # auto: the tools reach the template; a call the model writes comes back as tool_calls (unit tests
    # check the parser on such answers: this model writes none).
    auto = post("/v1/chat/completions", dict(tools))
    assert auto["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


def models_server_info_and_ids():
    s, card = request("GET", f"/v1/models/{MODEL}")
    assert s == 200 and card["id"] == MODEL and card["object"] == "model", card
    s, j = request("GET", "/v1/models/other-model")
    assert s == 404 and j["error"]["code"] == "model_not_found", j
    s, info = request("GET", "/server_info")
    assert s == 200 and isinstance(info["vllm_config"], str) and info["siesta_config"]["reasoning_parser"] == "qwen3"
    s, info = request("GET", "/server_info?config_format=json")
    assert info["vllm_config"]["max_model_len"] == 512, info
    r = post("/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "my-id"})
    assert r["id"] == "cmpl-my-id", r["id"]
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                      "request_id": "my-id"}, headers={"X-Request-Id": "from-header"})
    assert r["id"] == "chatcmpl-from-header", r["id"]
    # The same request_id twice at once is fine: engine ids stay unique.
    post("/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "my-id"})


def vllm_metric_names():
    s, text = request("GET", "/metrics", headers={"Authorization": ""})
    assert s == 200, s
    for needle in ('vllm:num_requests_running{model_name="' + MODEL + '",engine="0"}',
                   'siesta:engine_sleep_state{model_name="' + MODEL + '",sleep_state="awake"} 1',
                   "# TYPE vllm:e2e_request_latency_seconds histogram", "vllm:generation_tokens_total"):
        assert needle in text, needle


srv = Server("--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
             "qwen3", "--vllm-metric-names")
try:
    for fn in (nothing_is_silently_ignored, adjusted_sampling_through_http, prompt_logprobs_truncation_and_usage,
               chat_renders_tools_and_prefills_what_tokenize_gives, reasoning_and_tool_calls_as_vllm_reads_them,
               models_server_info_and_ids, vllm_metric_names):
        checks.check(fn.__name__, fn)
finally:
    srv.stop()


def bad_flags_are_refused_at_startup():
    for flags, needle in ((["--tool-call-parser", "mistral"], "hermes"), (["--enable-auto-tool-choice"], "--tool-call-parser"),
                          (["--reasoning-parser", "deepseek_r1"], "qwen3"), (["--chat-template", "/no/such/file"], "no such file")):
        r = subprocess.run([SIESTA, "serve", "--model", MODEL, "--port", "0", "--kv-cache-memory-bytes", "64M", *flags],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and needle in r.stderr, (flags, r.returncode, r.stderr)


checks.check(bad_flags_are_refused_at_startup.__name__, bad_flags_are_refused_at_startup)
checks.finish()
