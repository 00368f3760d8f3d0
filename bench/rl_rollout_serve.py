#!/usr/bin/env python3
"""The RL rollout shape end to end: `siesta serve` under `siesta bench serve` with one streaming
client per sequence, against the engine-level figure of bench/rl_rollout_bench.cpp.

  python3 bench/rl_rollout_serve.py --siesta BIN --engine-json rl_rollout.json [--model DIR]
      [--device cuda|cpu] [--num-prompts N] [--input-len P] [--output-len O] [--temperature T]
      [--lone-repeat 3] [--threads N] [--extra-serve-arg ARG]... [--out FILE.json]

The shape and the engine's options come from the engine-level JSON (--engine-json, written by
rl_rollout_bench --out) unless given here: the model, the device, sequences x (prompt + output),
the sampling (greedy, or a temperature), --gpu-memory-utilization or --kv-cache-memory-bytes,
--max-num-batched-tokens. The server is started as a vLLM user would start it for that shape
(--max-num-seqs = sequences, --max-model-len = prompt + output). Then, in this order:
  1. a lone streaming request to the fresh server (its first: first-use costs), TTFT and ITL;
  2. `siesta bench serve` (vLLM's bench serve): N prompts of P random token ids, O output tokens
     each, ignore_eos, all at once (request rate inf), max concurrency N; its result JSON is read;
  3. --lone-repeat lone streaming requests to the warm, idle server.
Output tokens/s of (2) against the engine's (batch.output_tokens_per_s): the goal is a ratio of
at least 0.9. The server's share of a step: 1 - (the engine's mean decode step period) / (the
server run's mean TPOT). Prints one table; --out writes JSON with the machine, date and commit.
Exits 1 when a request failed or the server did not start. Standard library only.
"""
import argparse
import datetime
import http.client
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import siesta_rl  # noqa: E402  (standard library only at import)

GOAL = 0.9


def machine():
    """Host, CPU and (where nvidia-smi runs) the GPU."""
    gpu = ""
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    return {"host": platform.node(), "cpu": platform.processor(), "cores": os.cpu_count(), "gpu": gpu,
            "python": sys.version.split()[0]}


def lone_request(port, prompt, max_tokens, temperature, timeout=600):
    """One streaming completion alone: TTFT (to the first chunk with choices, as vLLM's bench
    serve times it), the gaps between chunks, and the tokens counted from the usage chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"lone request: HTTP {r.status}: {r.read()[:500]!r}")
        first, last, gaps, tokens = None, None, [], None
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"lone request: {chunk['error']}")
            now = time.monotonic()
            if chunk.get("choices"):
                if first is None:
                    first = now
                else:
                    gaps.append((now - last) * 1e3)
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
        end = time.monotonic()
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("lone request: no token came back")
    return {"ttft_ms": (first - t0) * 1e3, "e2e_ms": (end - t0) * 1e3, "output_tokens": tokens,
            "itl_ms_mean": statistics.mean(gaps) if gaps else 0.0,
            "itl_ms_p50": statistics.median(gaps) if gaps else 0.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--siesta", required=True)
    ap.add_argument("--engine-json", required=True, help="rl_rollout_bench's --out JSON (the engine-level figure)")
    ap.add_argument("--model", help="model directory (default: the engine JSON's)")
    ap.add_argument("--device", help="cuda or cpu (default: the engine JSON's)")
    ap.add_argument("--num-prompts", type=int, help="sequences (default: the engine JSON's)")
    ap.add_argument("--input-len", type=int, help="prompt tokens (default: the engine JSON's)")
    ap.add_argument("--output-len", type=int, help="output tokens (default: the engine JSON's)")
    ap.add_argument("--temperature", type=float, help="default: the engine JSON's (0: greedy)")
    ap.add_argument("--lone-prompt", type=int, help="a lone request's prompt (default: the engine JSON's)")
    ap.add_argument("--lone-output", type=int, help="a lone request's output (default: the engine JSON's)")
    ap.add_argument("--lone-repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="--device cpu: the model's threads (0: all cores)")
    ap.add_argument("--extra-serve-arg", action="append", default=[], help="one more siesta serve argument")
    ap.add_argument("--timeout-s", type=int, default=1800, help="for the whole bench serve run")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    eng = json.load(open(a.engine_json))
    wl, eo = eng["workload"], eng["engine"]
    model = a.model or eng["model"]["dir"]
    device = a.device or eng["device"]
    n = a.num_prompts or wl["sequences"]
    p = a.input_len or wl["prompt"]
    o = a.output_len or wl["output"]
    temperature = wl["temperature"] if a.temperature is None else a.temperature
    lone_p = a.lone_prompt or eng["lone"]["prompt"]
    lone_o = a.lone_output or eng["lone"]["output"]
    same_shape = (n, p, o) == (wl["sequences"], wl["prompt"], wl["output"])

    serve_args = ["--device", device, "--max-num-seqs", str(n), "--max-model-len", str(p + o),
                  "--max-num-batched-tokens", str(eo["max_num_batched_tokens"])]
    if eo.get("kv_cache_memory_bytes_flag"):
        serve_args += ["--kv-cache-memory-bytes", str(int(float(eo["kv_cache_memory_bytes_flag"])))]
    elif device.startswith("cuda"):
        serve_args += ["--gpu-memory-utilization", str(eo["gpu_memory_utilization"])]
    if device == "cpu":
        serve_args += ["--threads", str(a.threads)]
    serve_args += a.extra_serve_arg

    logs = tempfile.mkdtemp(prefix="siesta-rl-rollout-serve-")
    result_file = os.path.join(logs, "bench_serve.json")
    t0 = time.monotonic()
    try:
        srv = siesta_rl.serve(a.siesta, "serve", model, logs, *serve_args)
    except RuntimeError as e:
        print(f"rl_rollout_serve: {e}", file=sys.stderr)
        return 1
    start_s = time.monotonic() - t0
    ok = True
    bench_argv = [a.siesta, "bench", "serve", "--base-url", f"http://127.0.0.1:{srv.port}", "--num-prompts", str(n),
                  "--random-input-len", str(p), "--random-output-len", str(o), "--ignore-eos",
                  "--max-concurrency", str(n), "--temperature", str(temperature), "--seed", "1",
                  "--disable-tqdm", "--result-file", result_file,
                  "--notes", "bench/rl_rollout_serve.py: siesta serve " + " ".join(serve_args)]
    try:
        vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        rng = random.Random(7)
        prompt = lambda: [rng.randrange(50, min(vocab, 150000) - 100) for _ in range(lone_p)]  # noqa: E731
        fresh = lone_request(srv.port, prompt(), lone_o, temperature)
        print(f"lone fresh: TTFT {fresh['ttft_ms']:.2f} ms, ITL {fresh['itl_ms_mean']:.3f} ms", file=sys.stderr)
        t1 = time.monotonic()
        run = subprocess.run(bench_argv, capture_output=True, text=True, timeout=a.timeout_s)
        bench_s = time.monotonic() - t1
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
            raise RuntimeError(f"siesta bench serve exited {run.returncode}")
        print(run.stdout, file=sys.stderr)
        warm = []
        for _ in range(a.lone_repeat):
            warm.append(lone_request(srv.port, prompt(), lone_o, temperature))
            print(f"lone warm: TTFT {warm[-1]['ttft_ms']:.2f} ms, ITL {warm[-1]['itl_ms_mean']:.3f} ms",
                  file=sys.stderr)
    except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as e:
        print(f"rl_rollout_serve: {e}\nserver log:\n{srv.tail(40)}", file=sys.stderr)
        srv.stop()
        return 1
    srv.stop()

    res = json.load(open(result_file))
    keys = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput", "max_concurrent_requests"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        keys += [f"mean_{m}_ms", f"median_{m}_ms", f"p99_{m}_ms"]
    served = {k: res.get(k) for k in keys}
    ok = res.get("completed") == n and not res.get("failed")
    ok = ok and res.get("total_output_tokens") == n * o

    batch = eng["batch"]
    engine_tok_s = batch["output_tokens_per_s"]
    ratio = res["output_throughput"] / engine_tok_s if engine_tok_s else 0.0
    engine_period = (batch["decode"].get("period_ms") or {}).get("mean") or 0.0
    tpot = res.get("mean_tpot_ms") or 0.0
    share = 1.0 - engine_period / tpot if tpot and engine_period else 0.0
    warm_ttft = statistics.median(w["ttft_ms"] for w in warm) if warm else 0.0
    eng_lone = eng["lone"]

    print(f"RL rollout end to end, {device}, model {model}: {n} streaming clients x ({p} prompt + {o} output), "
          f"{'greedy' if temperature == 0 else f'temperature {temperature}'}")
    print(f"{'figure':<44} {'serve':>12} {'engine':>12}  notes")
    row = lambda name, s, e, note="": print(f"{name:<44} {s:>12} {e:>12}  {note}")  # noqa: E731
    row("output tokens/s", f"{res['output_throughput']:.0f}", f"{engine_tok_s:.0f}",
        f"ratio {ratio:.3f}, goal >= {GOAL}: {'met' if ratio >= GOAL else 'MISSED'}"
        + ("" if same_shape else " (NOT the engine run's shape)"))
    row("wall time (s)", f"{res['duration']:.2f}", f"{batch['wall_s']:.2f}", f"bench serve took {bench_s:.0f} s")
    row("TPOT mean / decode step period mean (ms)", f"{tpot:.2f}", f"{engine_period:.2f}",
        f"server's share of a step {share * 100:.1f}%")
    row("TTFT median, batch (ms)", f"{res.get('median_ttft_ms') or 0:.0f}",
        f"{batch['prefill_phase']['ttft_ms'].get('p50', 0):.0f}", "")
    row("lone request TTFT, fresh (ms)", f"{fresh['ttft_ms']:.2f}", f"{eng_lone['fresh']['ttft_ms']:.2f}",
        f"{lone_p} prompt tokens; server started in {start_s:.1f} s")
    row("lone request TTFT, warm median (ms)", f"{warm_ttft:.2f}", f"{eng_lone['warm_median_ttft_ms']:.2f}",
        f"engine: prefill {eng_lone['warm'][0]['prefill_ms']:.2f} ms" if eng_lone.get("warm") else "")
    if not ok:
        print(f"FAILED: completed {res.get('completed')} of {n}, failed {res.get('failed')}, "
              f"output tokens {res.get('total_output_tokens')} of {n * o}")

    if a.out:
        doc = {"benchmark": "rl_rollout_serve",
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "commit": siesta_rl.commit() or "unknown", "machine": machine(), "device": device,
               "model": model, "workload": {"num_prompts": n, "input_len": p, "output_len": o,
                                            "temperature": temperature, "max_concurrency": n, "ignore_eos": True,
                                            "same_shape_as_engine_run": same_shape},
               "serve_args": serve_args, "bench_serve_argv": bench_argv[1:], "server_start_s": start_s,
               "bench_serve": served,
               "engine": {"json": os.path.abspath(a.engine_json), "commit": eng.get("commit"),
                          "output_tokens_per_s": engine_tok_s, "decode_period_ms_mean": engine_period,
                          "floor_ratio_mean": batch["decode"].get("floor_ratio_mean")},
               "ratio": ratio, "goal": GOAL, "goal_met": ratio >= GOAL,
               "server_share_of_step": share,
               "lone": {"prompt": lone_p, "output": lone_o, "fresh": fresh, "warm": warm,
                        "warm_median_ttft_ms": warm_ttft,
                        "engine_fresh_ttft_ms": eng_lone["fresh"]["ttft_ms"],
                        "engine_warm_median_ttft_ms": eng_lone["warm_median_ttft_ms"]},
               "complete": ok,
               "columns": {"ratio": "bench serve output_throughput / the engine run's batch.output_tokens_per_s",
                           "server_share_of_step": "1 - engine decode step period (mean) / bench serve mean TPOT"}}
        for v in (ratio, share):
            assert math.isfinite(v)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"wrote {a.out}", file=sys.stderr)
    shutil.rmtree(logs, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
