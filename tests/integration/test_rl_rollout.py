"""The RL rollout benchmark's logic on the tiny CPU model: bench/rl_rollout_bench (built beside siesta)
with a few sequences, then bench/rl_rollout_serve.py against its JSON through `siesta serve`.

Checked in the engine-level JSON: every sequence got its output tokens (N x O, the engine's own
count too), no preemption, the decode steps' floor ratios and throughputs finite and positive, the
bins cover every decode step, the lone requests (fresh and warm) carry TTFT, their phases (which add
up to the TTFT), the prefill and decode step times and a finite ratio; a KV cache too small for the
run stops it with a message naming what fits. In the end-to-end JSON: every request completed with
its tokens, and the ratio to the engine figure is finite. Timing goals are the benchmark's, not
checked here.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, parse_args, run  # noqa: E402

args = parse_args()
SIESTA = args.siesta
BENCH = os.path.join(os.path.dirname(os.path.abspath(SIESTA)), "rl_rollout_bench")
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-rl-rollout-")
N, P, O = 6, 40, 24
LONE_P, LONE_O = 48, 12
COMMON = ["--model", MODEL, "--shape", "tiny", "--device", "cpu", "--threads", "2", "--log-level", "warn"]


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


engine_json = os.path.join(tmp, "rl_rollout_cpu.json")
doc = {}


def engine_run():
    assert os.path.exists(BENCH), f"{BENCH} is missing: build the rl_rollout_bench target"
    rc, out, err = run([BENCH, *COMMON, "--kv-cache-memory-bytes", str(32 << 20), "--sequences", str(N),
                        "--prompt", str(P), "--output", str(O), "--lone-prompt", str(LONE_P), "--lone-output",
                        str(LONE_O), "--lone-repeat", "2", "--bin-steps", "8", "--out", engine_json], timeout=120)
    assert rc == 0, f"exit {rc}\n{out}\n{err}"
    assert "floor / period" in out, out
    doc.update(json.load(open(engine_json)))


def engine_counts():
    b = doc["batch"]
    assert doc["benchmark"] == "rl_rollout" and doc["device"] == "cpu"
    for k in ("machine", "date", "commit"):
        assert doc[k], k
    assert doc["workload"]["sequences"] == N and doc["workload"]["output"] == O
    assert b["output_tokens"] == N * O == b["expected_output_tokens"], b
    assert b["engine_metrics"]["generation_tokens"] == N * O, b["engine_metrics"]
    assert b["preemptions"] == 0
    assert doc["outputs_complete"] is True
    # Every prompt token in a step with prompt tokens; then O - 1 decode steps of all N sequences.
    assert b["prefill_phase"]["prompt_tokens"] == N * P, b["prefill_phase"]
    assert b["decode"]["tokens"] <= N * (O - 1) and b["decode"]["steps"] >= O - 1, b["decode"]


def engine_ratios():
    d = doc["batch"]["decode"]
    for k in ("floor_ratio_mean", "floor_ratio_total", "tokens_per_s"):
        assert finite(d[k]) and d[k] > 0, (k, d[k])
    for k in ("period_ms", "step_ms", "floor_ms"):
        for s in ("mean", "p50", "p99"):
            assert finite(d[k][s]) and d[k][s] > 0, (k, s, d[k])
    assert finite(doc["batch"]["output_tokens_per_s"]) and doc["batch"]["output_tokens_per_s"] > 0
    assert finite(doc["limit"]["copy_gb_per_s"]) and doc["limit"]["copy_gb_per_s"] > 0
    bins = doc["batch"]["bins"]
    assert sum(x["steps"] for x in bins) == d["steps"], bins
    assert all(finite(x["floor_ratio"]) and x["period_ms"] > 0 for x in bins), bins
    # The floor grows with the context the steps read.
    ctx = [x["context_per_sequence"] for x in bins]
    assert ctx == sorted(ctx) and ctx[0] >= P, ctx


def lone_requests():
    lone = doc["lone"]
    runs = [lone["fresh"], *lone["warm"]]
    assert len(lone["warm"]) == 2
    for r in runs:
        assert r["output_tokens"] == LONE_O and r["prompt_tokens"] == LONE_P, r
        assert r["prefill_step_count"] == 1, r
        for k in ("ttft_ms", "prefill_ms", "first_decode_step_ms", "decode_step_ms", "e2e_ms"):
            assert finite(r[k]) and r[k] > 0, (k, r)
        assert finite(r["ttft_over_prefill_plus_decode_step"]) and r["ttft_over_prefill_plus_decode_step"] > 0
        phases = r["phases_ms"]
        assert abs(sum(phases.values()) - r["ttft_ms"]) < 0.05, (phases, r["ttft_ms"])
        assert phases["submit_to_step_start"] >= 0 and phases["step_end_to_consumer"] >= 0, phases
    assert finite(lone["warm_median_ratio"]) and isinstance(lone["goal_met"], bool)


def too_small_kv_cache():
    # 1 MiB of 4 KiB tokens: 16 blocks of 16.
    rc, out, err = run([BENCH, *COMMON, "--kv-cache-memory-bytes", str(1 << 20), "--sequences", "8", "--prompt", "64",
                        "--output", "64"], timeout=60)
    assert rc == 1, (rc, out, err)
    assert "the KV cache holds 256 tokens" in err and "--sequences 2 of 64 + 64" in err, err
    assert "--allow-preemption" in err, err


def end_to_end():
    out_json = os.path.join(tmp, "rl_rollout_serve_cpu.json")
    r = subprocess.run([sys.executable, os.path.join(args.source, "bench", "rl_rollout_serve.py"), "--siesta", SIESTA,
                        "--engine-json", engine_json, "--threads", "2", "--lone-repeat", "1", "--out", out_json],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    s = json.load(open(out_json))
    assert s["benchmark"] == "rl_rollout_serve" and s["complete"] is True, s
    assert s["workload"] == {"num_prompts": N, "input_len": P, "output_len": O, "temperature": 0,
                             "max_concurrency": N, "ignore_eos": True, "same_shape_as_engine_run": True}, s["workload"]
    bs = s["bench_serve"]
    assert bs["completed"] == N and bs["failed"] == 0 and bs["total_output_tokens"] == N * O, bs
    assert finite(s["ratio"]) and s["ratio"] > 0 and isinstance(s["goal_met"], bool)
    assert finite(s["server_share_of_step"])
    assert s["engine"]["output_tokens_per_s"] == doc["batch"]["output_tokens_per_s"]
    for r in (s["lone"]["fresh"], *s["lone"]["warm"]):
        assert finite(r["ttft_ms"]) and r["ttft_ms"] > 0 and r["output_tokens"] == LONE_O, r
    assert "--max-num-seqs" in s["serve_args"] and str(P + O) in s["serve_args"], s["serve_args"]


checks.check("rl_rollout_bench runs on the CPU and writes its JSON", engine_run)
if doc:
    checks.check("every sequence gets its output tokens, counted by the engine too", engine_counts)
    checks.check("decode steps, their floor ratios and the bins are finite and consistent", engine_ratios)
    checks.check("lone requests: TTFT, its phases, prefill and decode step times", lone_requests)
    checks.check("a KV cache too small for the run stops it, naming what fits", too_small_kv_cache)
    checks.check("rl_rollout_serve.py: bench serve through siesta serve against the engine figure", end_to_end)
checks.finish()
