#!/usr/bin/env python3
"""Weights pushed into `siesta serve --device cuda` over CUDA IPC (POST /update_weights), measured
against the device-to-device copy of the same bytes in the same run, and checked.

A trainer-like process (this script, PyTorch) loads checkpoint B's tensors into one flat bf16
buffer on the GPU; siesta serves checkpoint A (same shape, other weights). Then:
  - after a pause, B is pushed --repeat times: the call's time (client and siesta's own, split
    into opening the handle + checks and the copy) against the limit, torch's copy of the buffer
    on the same GPU (cudaMemcpy device to device, CUDA events, median of 5);
  - the RL order once: sleep level 2, wake_up?tags=weights, push, wake_up?tags=kv_cache;
  - the greedy tokens after the push equal those after reload_weights of B's directory.
Goals: Qwen3-0.6B's shape in <= 50 ms, 8B's in <= 250 ms (--goal-ms). Prints one table; --out
writes JSON with the machine, date and commit. Exits 1 if the tokens differ.

  python3 bench/update_weights_bench.py --siesta BIN --model A --push B [--repeat 5] [--goal-ms 50] [--out F]
"""
import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import siesta_rl  # noqa: E402


def checkpoint_tensors(model_dir):
    """(name, file) of every tensor of a checkpoint (one file or shards)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = json.load(open(index))["weight_map"]
        return [(n, os.path.join(model_dir, f)) for n, f in sorted(weight_map.items())]
    path = os.path.join(model_dir, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        return [(n, path) for n in f.keys()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--siesta", required=True)
    ap.add_argument("--model", required=True, help="checkpoint A, which siesta serves first")
    ap.add_argument("--push", required=True, help="checkpoint B (same shape), which is pushed")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--goal-ms", type=float, default=0)
    ap.add_argument("--kv-cache-memory-bytes", default="4G")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    logs = tempfile.mkdtemp(prefix="siesta-push-bench-")
    # B's tensors, packed into one flat buffer as a trainer would hold them.
    t0 = time.monotonic()
    named = []
    by_file = {}
    for name, path in checkpoint_tensors(a.push):
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cuda") as f:
            named += [(name, f.get_tensor(name).to(torch.bfloat16)) for name in names]
    flat, tensors = siesta_rl.pack_params(named)
    del named
    torch.cuda.synchronize()
    load_s = time.monotonic() - t0
    nbytes = sum(torch.Size(t["shape"]).numel() * 2 for t in tensors)

    # The limit: the same bytes copied device to device on this GPU.
    dst = torch.empty_like(flat)
    times = []
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(flat)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del dst
    torch.cuda.empty_cache()
    limit_ms = statistics.median(times[1:])

    srv = siesta_rl.serve(a.siesta, "engine", a.model, logs, "--device", "cuda", "--enable-sleep-mode",
                          "--max-model-len", "1024", "--kv-cache-memory-bytes", a.kv_cache_memory_bytes)
    ok = True
    try:
        vocab = json.load(open(os.path.join(a.model, "config.json")))["vocab_size"]
        rng = random.Random(3)
        prompts = [[rng.randrange(100, vocab - 1000) for _ in range(40)] for _ in range(4)]
        body = siesta_rl.push_body(flat, tensors)
        pushes = []
        srv.admin("/pause?mode=keep")
        for _ in range(a.repeat):
            j, client_s = srv.admin("/update_weights", body)
            w = j["call"]["weights_update"]
            assert j["updated"] == len(tensors), j
            pushes.append({"client_ms": client_s * 1e3, "server_ms": j["seconds"] * 1e3,
                           "open_and_check_ms": w["prepare_seconds"] * 1e3, "copy_ms": w["write_seconds"] * 1e3,
                           "gb_per_s": w["gb_per_s"]})
        srv.admin("/resume")
        pushed, _ = siesta_rl.rollout(srv, prompts, 16)
        # The RL order once.
        rl = {}
        j, rl["sleep_s"] = srv.admin("/sleep?level=2")
        j, rl["wake_weights_s"] = srv.admin("/wake_up?tags=weights")
        j, rl["update_s"] = srv.admin("/update_weights", body)
        rl["update_server_s"] = j["seconds"]
        j, rl["wake_kv_s"] = srv.admin("/wake_up?tags=kv_cache")
        after_rl, _ = siesta_rl.rollout(srv, prompts, 16)
        srv.admin("/pause?mode=keep")
        srv.admin("/reload_weights", {"model": a.push})
        srv.admin("/resume")
        reloaded, _ = siesta_rl.rollout(srv, prompts, 16)
        same = pushed == reloaded and after_rl == reloaded
        ok = same
    finally:
        srv.stop()

    med = {k: statistics.median(p[k] for p in pushes) for k in pushes[0]}
    print(f"update_weights over CUDA IPC: {a.push} ({len(tensors)} tensors, {nbytes / 1e9:.2f} GB) into {a.model}")
    print(f"{'#':>2} {'client ms':>10} {'server ms':>10} {'open+check':>11} {'copy ms':>8} {'GB/s':>7}")
    for i, p in enumerate(pushes):
        print(f"{i + 1:>2} {p['client_ms']:>10.2f} {p['server_ms']:>10.2f} {p['open_and_check_ms']:>11.2f} "
              f"{p['copy_ms']:>8.2f} {p['gb_per_s']:>7.0f}")
    print(f"limit: the same bytes copied device to device by torch: {limit_ms:.2f} ms "
          f"({nbytes / limit_ms / 1e6:.0f} GB/s); median push {med['server_ms']:.2f} ms = "
          f"{med['server_ms'] / limit_ms:.2f}x the limit" +
          (f"; goal {a.goal_ms:.0f} ms: {'met' if med['server_ms'] <= a.goal_ms else 'NOT met'}" if a.goal_ms else ""))
    print(f"RL order: sleep {rl['sleep_s']:.3f} s, wake weights {rl['wake_weights_s']:.3f} s, update "
          f"{rl['update_s']:.3f} s (server {rl['update_server_s']:.3f}), wake kv {rl['wake_kv_s']:.3f} s")
    print(f"tokens after the push equal those after reload_weights of the same checkpoint: {same}")
    result = {"bench": "update_weights_cuda_ipc",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": siesta_rl.commit(), "machine": siesta_rl.machine(), "config": vars(a),
              "tensors": len(tensors), "bytes": nbytes, "trainer_load_s": load_s, "pushes": pushes,
              "median": med, "limit": {"what": "torch copy_ of the same flat buffer on the same GPU (D2D), median",
                                       "ms": limit_ms, "gb_per_s": nbytes / limit_ms / 1e6},
              "ratio_to_limit": med["server_ms"] / limit_ms, "goal_ms": a.goal_ms,
              "goal_met": (med["server_ms"] <= a.goal_ms) if a.goal_ms else None, "rl_order": rl,
              "tokens_equal_reload": same}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
