#!/usr/bin/env python3
"""An RL loop with siesta colocated on one GPU: PyTorch + transformers as the trainer, `siesta serve
--device cuda` as the rollout engine, over HTTP.

Each iteration:
  1. roll out: greedy completions of a fixed prompt set (token ids);
  2. sleep level 2: siesta gives back its weights, KV cache and activations (every engine: with --pd,
     the prefill and the decode engine);
  3. train: the trainer allocates at least 95% of the memory siesta freed (its optimizer state,
     gradients, activations, and a workspace that tops it up) and takes optimizer steps on the
     rollouts (language-model loss on prompt + completion); then frees the workspace;
  4. push: the parameters are packed into one flat bf16 buffer and sent over CUDA IPC
     (POST /wake_up?tags=weights, POST /update_weights, POST /wake_up?tags=kv_cache, as vLLM's
     weight-transfer API orders it; with --pd to both engines, from the same buffer);
  5. roll out again, and check: the trainer's weights are saved (save_pretrained) and a fresh
     `siesta serve` (colocated, beside the others) started on them gives the same tokens.
Prints a table of each phase's time per iteration and writes it as JSON (--out).

  python3 examples/rl_loop.py --siesta build/bin/siesta --model DIR [--iterations 2] [--steps 2]
                              [--pd] [--gpu-memory-utilization 0.5] [--out FILE.json]
DIR: a Qwen3 checkpoint in bf16 (siesta make-model --shape qwen3-0.6b, or any Hugging Face one).
Needs torch and transformers, and a GPU. Exits 1 if a rollout after a push differs from the fresh
engine's, or the trainer could not take 95% of the freed memory.
"""
import argparse
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import siesta_rl  # noqa: E402

GiB = 1 << 30


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siesta", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--pd", action="store_true", help="prefill and decode engines with siesta proxy")
    ap.add_argument("--gpu-memory-utilization", default="0.5", help="the colocated engine's share of the GPU")
    ap.add_argument("--kv-cache-memory-bytes", default="16G", help="each P/D engine's KV cache (--pd)")
    ap.add_argument("--check-kv-bytes", default="2G", help="the fresh engine's KV cache")
    ap.add_argument("--keep-logs", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="siesta-rl-")
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    common = ["--device", "cuda", "--enable-sleep-mode", "--max-model-len", "1024"]
    procs, engines = [], []
    rows, ok = [], True
    try:
        # The trainer's copy of the model, resident on the GPU the whole time.
        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda()
        model.train()
        load_s = time.monotonic() - t0
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        vocab = model.config.vocab_size

        if a.pd:
            key_file = siesta_rl.side_channel_key_file(logs)
            p = siesta_rl.serve(a.siesta, "prefill", a.model, logs, *common, "--kv-cache-memory-bytes",
                                a.kv_cache_memory_bytes, "--kv-transfer-config",
                                siesta_rl.pd_config("kv_producer", key_file))
            procs.append(p)
            d = siesta_rl.serve(a.siesta, "decode", a.model, logs, *common, "--kv-cache-memory-bytes",
                                a.kv_cache_memory_bytes, "--kv-transfer-config",
                                siesta_rl.pd_config("kv_consumer", key_file))
            procs.append(d)
            proxy = siesta_rl.Process(a.siesta, "proxy", ["proxy", "--port", "0", "--prefill",
                                                          f"http://127.0.0.1:{p.port}", "--decode",
                                                          f"http://127.0.0.1:{d.port}", "--mode", "concurrent"], logs)
            procs.append(proxy)
            engines, front = [p, d], proxy
        else:
            e = siesta_rl.serve(a.siesta, "engine", a.model, logs, *common, "--gpu-memory-utilization",
                                a.gpu_memory_utilization)
            procs.append(e)
            engines, front = [e], e

        rng = random.Random(7)
        prompts = [[rng.randrange(100, vocab - 1000) for _ in range(a.prompt_tokens)] for _ in range(a.prompts)]
        before, rollout_s = siesta_rl.rollout(front, prompts, a.max_tokens)
        flat = None
        for it in range(1, a.iterations + 1):
            r = {"iteration": it, "rollout_before_s": rollout_s}
            # ---- sleep: every engine gives its memory back
            torch.cuda.synchronize()
            free_awake, total = torch.cuda.mem_get_info()
            t0 = time.monotonic()
            for e in engines:
                j, _ = e.admin("/sleep?level=2")
                assert j["state"] == "sleeping_level_2", j
            r["sleep_s"] = time.monotonic() - t0
            free_asleep, _ = torch.cuda.mem_get_info()
            freed = free_asleep - free_awake
            r["freed_bytes"] = freed

            # ---- train: take >= 95% of what siesta freed, then step
            t0 = time.monotonic()
            allocated_before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            seqs = torch.tensor([pr + out for pr, out in zip(prompts, before)], device="cuda")
            losses = []
            for _ in range(a.steps):
                opt.zero_grad(set_to_none=False)
                loss = model(input_ids=seqs, labels=seqs).loss
                loss.backward()
                opt.step()
                losses.append(float(loss))
            held = torch.cuda.memory_allocated() - allocated_before
            top_up = max(0, int(0.95 * freed) - held)
            workspace = torch.empty(top_up, dtype=torch.uint8, device="cuda")
            workspace.fill_(1)  # touched: the memory is really taken
            torch.cuda.synchronize()
            r["trainer_allocated_bytes"] = torch.cuda.max_memory_allocated() - allocated_before
            r["trainer_share_of_freed"] = r["trainer_allocated_bytes"] / freed if freed > 0 else 0
            del workspace
            torch.cuda.empty_cache()  # back to the driver, for siesta's wake
            r["train_s"] = time.monotonic() - t0
            r["losses"] = losses
            if r["trainer_share_of_freed"] < 0.95:
                ok = False

            # ---- push over CUDA IPC
            t0 = time.monotonic()
            with torch.no_grad():
                flat, tensors = siesta_rl.pack_params(list(model.named_parameters()), flat)
            torch.cuda.synchronize()
            body = siesta_rl.push_body(flat, tensors)
            r["pack_s"] = time.monotonic() - t0
            r["wake_weights_s"], r["update_s"], r["update_server_s"], r["wake_kv_s"] = 0.0, 0.0, 0.0, 0.0
            for e in engines:
                _, dt = e.admin("/wake_up?tags=weights")
                r["wake_weights_s"] += dt
                j, dt = e.admin("/update_weights", body)
                assert j["updated"] == len(tensors), j
                r["update_s"] += dt
                r["update_server_s"] += j["seconds"]
                r["update_gb_per_s"] = j["call"]["weights_update"]["gb_per_s"]
                r["update_bytes"] = j["bytes"]
            for e in engines:
                j, dt = e.admin("/wake_up?tags=kv_cache")
                assert j["state"] == "running", j
                r["wake_kv_s"] += dt

            # ---- roll out with the new weights
            after, r["rollout_after_s"] = siesta_rl.rollout(front, prompts, a.max_tokens)
            r["rollouts_changed"] = after != before

            # ---- check against a fresh engine on the trainer's saved weights
            t0 = time.monotonic()
            saved = os.path.join(tmp, f"trained-{it}")
            model.save_pretrained(saved, safe_serialization=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                if os.path.exists(os.path.join(a.model, f)) and not os.path.exists(os.path.join(saved, f)):
                    shutil.copy(os.path.join(a.model, f), saved)
            r["save_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            fresh = siesta_rl.serve(a.siesta, f"fresh-{it}", saved, logs, "--device", "cuda", "--max-model-len",
                                    "1024", "--kv-cache-memory-bytes", a.check_kv_bytes)
            procs.append(fresh)
            r["fresh_start_s"] = time.monotonic() - t0
            reference, _ = siesta_rl.rollout(fresh, prompts, a.max_tokens)
            fresh.stop()
            procs.remove(fresh)
            shutil.rmtree(saved, ignore_errors=True)
            r["equal_to_fresh_engine"] = after == reference
            if not r["equal_to_fresh_engine"]:
                ok = False
                r["first_difference"] = next(i for i, (x, y) in enumerate(zip(after, reference)) if x != y)
            rows.append(r)
            before, rollout_s = after, r["rollout_after_s"]

        cols = [("it", "iteration", "{:>2}"), ("rollout s", "rollout_before_s", "{:>9.3f}"),
                ("sleep s", "sleep_s", "{:>7.3f}"), ("freed GiB", "freed_bytes", "{:>9.1f}"),
                ("trainer/freed", "trainer_share_of_freed", "{:>13.3f}"), ("train s", "train_s", "{:>7.2f}"),
                ("pack s", "pack_s", "{:>6.3f}"), ("wake w s", "wake_weights_s", "{:>8.3f}"),
                ("update s", "update_s", "{:>8.3f}"), ("(server)", "update_server_s", "{:>8.3f}"),
                ("GB/s", "update_gb_per_s", "{:>6.0f}"), ("wake kv s", "wake_kv_s", "{:>9.3f}"),
                ("rollout s", "rollout_after_s", "{:>9.3f}"), ("= fresh", "equal_to_fresh_engine", "{!s:>7}")]
        print(f"siesta RL loop, {'P/D (prefill + decode engines, proxy)' if a.pd else 'colocated'}, model "
              f"{a.model}; trainer load {load_s:.1f} s")
        print(" ".join(h.rjust(len(f.format(0 if k != 'equal_to_fresh_engine' else True))) for h, k, f in cols))
        for r in rows:
            vals = []
            for _, k, f in cols:
                v = r.get(k, 0)
                vals.append(f.format(v / GiB if k == "freed_bytes" else v))
            print(" ".join(vals))
        print("update s: the HTTP calls (every engine); (server): siesta's own time for them, handle opening, "
              "checks and the device copy included")
        result = {"bench": "rl_loop", "mode": "pd" if a.pd else "colocated",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": siesta_rl.commit(), "machine": siesta_rl.machine(), "config": vars(a),
                  "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "trainer_load_s": load_s, "iterations": rows, "passed": ok,
                  "checks": "each rollout after a push equals a fresh siesta serve on the trainer's saved weights; "
                            "the trainer allocated >= 95% of the device memory siesta freed"}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {a.out}")
        print("RL loop:", "PASSED" if ok else "FAILED")
    except Exception:
        for proc in procs:
            print(f"--- {proc.name} (last lines)\n{proc.tail()}", file=sys.stderr)
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
        if a.keep_logs:
            os.makedirs(a.keep_logs, exist_ok=True)
            for name in os.listdir(logs):
                shutil.copy(os.path.join(logs, name), a.keep_logs)
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
