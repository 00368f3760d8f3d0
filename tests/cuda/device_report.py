"""The one table scripts/device-check prints last: each step's result, the correctness figures and
the benchmark against its targets, the roofline and the transformers baseline. Also writes
OUT/summary.json.   python3 device_report.py OUT STATUS_FILE
"""
import json
import os
import sys

out, status_file = sys.argv[1], sys.argv[2]


def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception:
        return None


steps = []
for line in open(status_file):
    name, rc, secs = line.strip().split("|")
    steps.append({"step": name, "exit": int(rc), "seconds": int(secs)})
summary = {"steps": steps, "hf_tiny": load("hf_tiny.json"), "hf_0.6b": load("hf_0.6b.json"),
           "bench": load("cuda_qwen3_0.6b.json")}
# Models named with --hf-model: hf_<dir name>.json.
extra = sorted(f[3:-5] for f in os.listdir(out) if f.startswith("hf_") and f.endswith(".json")
               and f not in ("hf_tiny.json", "hf_0.6b.json", "hf_baseline.json"))
for name in extra:
    summary["hf_" + name] = load(f"hf_{name}.json")
for name in ("rl_rollout_0.6b_h200", "rl_rollout_serve_0.6b_h200", "rl_rollout_8b_h200"):
    if load(f"{name}.json"):
        summary[name] = load(f"{name}.json")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)

rows = []
for s in steps:
    rows.append((f"step {s['step']}", "PASS" if s["exit"] == 0 else f"FAIL (exit {s['exit']})", f"{s['seconds']} s"))
for key, label in [("hf_tiny", "tiny"), ("hf_0.6b", "0.6B")] + [("hf_" + n, n) for n in extra]:
    r = summary[key] or {}
    if "logits" in r:
        rows.append((f"{label}: max rel err vs HF fp32 / bf16", f"{r['logits']['max_rel_err_vs_hf_fp32']:.2e}",
                     f"{r['logits']['max_rel_err_vs_hf_bf16']:.2e} (<= 2e-2)"))
    for g, name in (("greedy", "greedy = HF bf16"), ("greedy_batch_invariant", "greedy = HF bf16 (invariant)")):
        if g in r:
            firsts = [p.get("equal_prefix") for p in r[g]["per_prompt"]]
            rows.append((f"{label}: {name}", f"{r[g]['equal_prompts']}/{r[g]['prompts']} prompts",
                         "equal prefixes " + ",".join(str(x) for x in firsts)))
    if "cpu" in r:
        rows.append((f"{label}: max rel err vs CPU fp32", f"{r['cpu']['max_rel_err_vs_cpu_fp32']:.2e}",
                     f"{r['cpu']['prompts']} prompts"))
b = summary["bench"]
if b:
    rows.append(("machine", b["machine"]["gpu"], f"commit {b['commit'][:12]} {b['date']}"))
    rows.append(("D2D copy / cuBLASLt bf16", f"{b['limits']['d2d_copy_GBps']:.0f} GB/s",
                 f"{b['limits']['cublaslt_bf16_TFLOPs']:.0f} TFLOP/s"))
    hf = b.get("hf_baseline") or {}
    for mode, m in b["modes"].items():
        if not m:
            continue
        for k, v in m.get("decode", {}).items():
            base = (hf.get("transformers_generate") or {}).get(k)
            extra = f"floor {k and int(int(k) / (v['floor_ms_per_step'] * 1e-3))} tok/s ({v['fraction_of_floor'] * 100:.0f}%)"
            if base:
                extra += f", HF {base:.0f} tok/s"
            rows.append((f"{mode} decode batch {k}", f"{v['tokens_per_s']:.0f} tok/s ({v['ms_per_step']:.3f} ms/step)", extra))
        for k, v in m.get("prefill", {}).items():
            base = (hf.get("prefill_ms") or {}).get(k)
            extra = f"floor {v['floor_ms']:.2f} ms ({v['fraction_of_floor'] * 100:.0f}%), {v['tflops']:.0f} TFLOP/s"
            if base:
                extra += f", HF {base:.1f} ms"
            rows.append((f"{mode} prefill {k}", f"{v['ms']:.2f} ms", extra))
    for name, prof in (b.get("profile") or {}).items():
        top = sorted(((k, v) for k, v in prof.items() if k != "total"), key=lambda kv: -kv[1])[:6]
        rows.append((f"profile {name} (ms)", f"total {prof.get('total', 0):.3f}",
                     ", ".join(f"{k} {v:.3f}" for k, v in top)))
    tr = b.get("trace") or {}
    if tr.get("per_kernel_mean_ns"):
        # Each kernel of a batch-1 layer: from the previous kernel's end to its own (us).
        parts = ", ".join(f"{v['kernel']} {v['end'] / 1e3:.1f}" for v in tr["per_kernel_mean_ns"])
        att = next((v for v in tr["per_kernel_mean_ns"] if v["kernel"] == "attention"), {})
        rows.append(("decode batch 1, one layer (us)", f"{tr['layer_ns'] / 1e3:.1f}", parts))
        if att:
            rows.append(("  attention after the QKV end (us)",
                         f"wait {att['wait_first'] / 1e3:.1f}-{att['wait_last'] / 1e3:.1f}",
                         f"q/k norm {att['mark3'] / 1e3:.1f}, partition {att['mark4'] / 1e3:.1f}, "
                         f"combined {att['mark5'] / 1e3:.1f}, end {att['end'] / 1e3:.1f}"))
    for t in b.get("targets", []):
        rows.append((f"target: {t['name']}", f"{t['measured']:.3f}", f"{'met' if t['met'] else 'MISSED'} (target {t['target']})"))

f = load("cuda_sync_floor.json")
if f:
    s = f["per_step"]
    rows.append((f"dependent step, {s['steps']} in a chain (us)",
                 f"kernel+PDL {s['stage_kernel_pdl_us']:.2f}, grid barrier {s['stage_grid_barrier_us']:.2f}",
                 f"empty kernel {s['empty_kernel_us']:.2f} / +PDL {s['empty_kernel_pdl_us']:.2f}; "
                 f"x{s['steps']}: {s['steps'] * min(s['stage_kernel_pdl_us'], s['stage_grid_barrier_us']) / 1000:.3f} ms"))
    if "gemv_layer_pdl_us" in s:
        hot = f", weights in L2 {s['gemv_layer_pdl_l2_hot_us']:.1f}" if "gemv_layer_pdl_l2_hot_us" in s else ""
        rows.append(("0.6B decode GEMVs alone, per layer (us)", f"{s['gemv_layer_pdl_us']:.1f} (PDL), {s['gemv_layer_us']:.1f}",
                     f"bytes at copy bandwidth {s['gemv_layer_bytes'] / s['d2d_copy_GBps'] / 1e3:.1f}{hot}"))

for name in ("memory_cuda_offload_staged.json", "memory_cuda_offload_staged_8threads.json",
             "memory_cuda_offload_pinned.json"):
    m = load(name)
    if not m:
        continue
    for r in m.get("results", []):
        if "sleep_offload_ms" in r:
            threads = f" {m['copy_threads']} threads" if m.get("copy_threads") else ""
            rows.append((f"offload {m.get('offload_mode')}{threads} {r['size_bytes'] / 2**30:.0f} GiB",
                         f"sleep {r['sleep_offload_ms']:.0f} ms, wake {r['wake_restore_ms']:.0f} ms",
                         f"limit {m['limit']['to_host_gb_per_s']:.1f}/{m['limit']['from_host_gb_per_s']:.1f} GB/s"))
for shape in ("0.6b", "8b"):
    e = load(f"engine_sleep_{shape}.json")
    if not e:
        continue
    eng = e["engine"]
    rows.append((f"engine {shape}: weights / KV / scratch",
                 f"{eng['weights_bytes'] / 2**30:.2f} / {eng['kv_cache_bytes'] / 2**30:.2f} / "
                 f"{eng['scratch_bytes'] / 2**30:.2f} GiB",
                 f"device used awake {e['device_memory_awake']['used_bytes'] / 2**30:.2f} GiB"))
    for level, v in sorted(e.get("summary", {}).items()):
        asleep = [c["device_used_asleep_bytes"] for c in e["cycles"] if f"level_{c['level']}" == level]
        rows.append((f"engine {shape} {level}", f"sleep {v['sleep_ms_median']:.0f} ms, wake {v['wake_ms_median']:.0f} ms",
                     f"device used asleep {max(asleep) / 2**30:.2f} GiB" if asleep else ""))
    rows.append((f"engine {shape} outputs after wake", "identical" if e["outputs_identical"] else "DIFFER", ""))
    for name, v in (e.get("limits") or {}).items():
        if not isinstance(v, dict):
            continue
        goal = v["goal_ratio"]
        verdict = ""
        if goal:
            met = v["ratio"] >= goal if name == "reload_gb_per_s" else v["ratio"] <= goal
            verdict = f", goal {'>=' if name == 'reload_gb_per_s' else '<='} {goal}x: {'met' if met else 'MISSED'}"
        rows.append((f"engine {shape} {name}", f"{v['measured']:.1f} (limit {v['limit']:.1f}, {v['ratio']:.2f}x)",
                     v["limit_is"] + verdict))

for shape in ("0.6b", "8b"):
    u = load(f"update_weights_{shape}_h200.json")
    if u:
        m = u["median"]
        rows.append((f"update_weights cuda_ipc {shape}", f"{m['server_ms']:.1f} ms ({m['gb_per_s']:.0f} GB/s copy)",
                     f"limit {u['limit']['ms']:.1f} ms, {u['ratio_to_limit']:.2f}x; goal {u['goal_ms']:.0f} ms "
                     f"{'met' if u['goal_met'] else 'MISSED'}; open+check {m['open_and_check_ms']:.1f} ms; "
                     f"tokens = reload: {u['tokens_equal_reload']}"))
for name in ("rl_loop_0.6b_h200.json", "rl_loop_pd_0.6b_h200.json"):
    r = load(name)
    if r:
        for it in r["iterations"]:
            rows.append((f"rl_loop {r['mode']} #{it['iteration']}",
                         f"update {it['update_server_s'] * 1e3:.1f} ms, trainer {it['trainer_share_of_freed']:.3f}"
                         " of freed", f"sleep {it['sleep_s']:.2f} s, wake {it['wake_weights_s'] + it['wake_kv_s']:.2f}"
                         f" s, = fresh engine: {it['equal_to_fresh_engine']}"))

for shape in ("0.6b", "nbi_0.6b", "8b"):  # nbi_: --no-batch-invariant
    r = load(f"rl_rollout_{shape}_h200.json")
    if not r:
        continue
    w, b = r["workload"], r["batch"]
    d = b["decode"]
    goal = lambda met: "met" if met else "MISSED"  # noqa: E731
    rows.append((f"rl_rollout {shape} {w['sequences']} x ({w['prompt']} + {w['output']})",
                 f"{b['output_tokens_per_s']:.0f} tok/s, step {d['period_ms'].get('mean', 0):.2f} ms",
                 f"floor {d['floor_ms'].get('mean', 0):.2f} ms: {d['floor_ratio_mean']:.2f} of it (goal >= "
                 f"{d['goal']}: {goal(d['goal_met'])}); prefill phase {b['prefill_phase']['ms'] / 1e3:.1f} s, "
                 f"{b['preemptions']} preemptions"))
    for bn in b["bins"][:: max(1, len(b["bins"]) // 4)]:
        rows.append((f"  decode steps {bn['first_step']}+", f"{bn['period_ms']:.2f} ms",
                     f"floor {bn['floor_ms']:.2f} ms ({bn['floor_ratio']:.2f}), "
                     f"context {bn['context_per_sequence']:.0f}"))
    lone = r["lone"]
    warm = lone["warm"][0] if lone["warm"] else lone["fresh"]
    rows.append((f"rl_rollout {shape} lone {lone['prompt']}-token TTFT fresh / warm",
                 f"{lone['fresh']['ttft_ms']:.1f} / {lone['warm_median_ttft_ms']:.1f} ms",
                 f"warm: prefill {warm['prefill_ms']:.2f} ms + decode step {warm['decode_step_ms']:.3f} ms, "
                 f"ratio {lone['warm_median_ratio']:.2f} (goal <= {lone['goal']}: {goal(lone['goal_met'])}); "
                 f"fresh: prefill {lone['fresh']['prefill_ms']:.1f} ms, first decode step "
                 f"{lone['fresh']['first_decode_step_ms']:.1f} ms"))
    srv = load(f"rl_rollout_serve_{shape}_h200.json")
    if srv:
        bs = srv["bench_serve"]
        rows.append((f"rl_rollout_serve {shape} (siesta serve, {srv['workload']['num_prompts']} clients)",
                     f"{bs['output_throughput']:.0f} tok/s, {srv['ratio']:.2f} of the engine",
                     f"goal >= {srv['goal']}: {'met' if srv['goal_met'] else 'MISSED'}; "
                     f"TPOT {bs['mean_tpot_ms']:.2f} ms, server's share of a step "
                     f"{srv['server_share_of_step'] * 100:.1f}%; lone TTFT fresh "
                     f"{srv['lone']['fresh']['ttft_ms']:.1f} ms, warm {srv['lone']['warm_median_ttft_ms']:.1f} ms"))

# Batch-invariant against the default mode at each point of the 8B bench (stage bench8b).
b8 = load("cuda_qwen3_8b.json")
if b8 and "batch_invariant" in b8.get("modes", {}) and "default" in b8.get("modes", {}):
    inv, dflt = b8["modes"]["batch_invariant"], b8["modes"]["default"]
    parts = [f"decode b{bs} {dflt['decode'][bs]['ms_per_step'] / inv['decode'][bs]['ms_per_step']:.2f}"
             for bs in sorted(inv.get("decode", {}), key=int) if bs in dflt.get("decode", {})]
    parts += [f"prefill {n} {dflt['prefill'][n]['ms'] / inv['prefill'][n]['ms']:.2f}"
              for n in sorted(inv.get("prefill", {}), key=int) if n in dflt.get("prefill", {})]
    rows.append(("cuda_qwen3 8B, batch-invariant / cuBLASLt path", ", ".join(parts), "speed ratio (goal >= 0.9)"))

for mode, label in (("bi", "default flags (batch-invariant)"), ("nbi", "--no-batch-invariant")):
    r = load(f"invariance_{mode}_0.6b_h200.json")
    if r:
        c = r.get("counts") or {}
        rows.append((f"invariance soak 0.6B, {label}", f"{r.get('wrong')} wrong of {r.get('requests')}",
                     f"tokens {c.get('wrong_tokens')}, logprob values only {c.get('wrong_logprobs')}, errored "
                     f"{r.get('errored')}, lost {r.get('lost')}; {r['clients']} clients, {r['seconds']:g} s"))

w0 = max(len(r[0]) for r in rows)
w1 = max(len(r[1]) for r in rows)
print("\n" + "=" * (w0 + w1 + 40))
for r in rows:
    print(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}")
