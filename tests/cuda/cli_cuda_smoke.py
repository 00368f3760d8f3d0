"""--device cuda through the siesta CLI on the GPU machine (scripts/device-check, stage cli):
generate (default, batch-invariant, and --no-batch-invariant; a KV budget too small is a one-line error), then serve with
--enable-sleep-mode and the KV cache sized by --gpu-memory-utilization: greedy completions before,
after sleep level 1 + wake and after sleep level 2 + wake are identical, and /memory shows the
pool released while asleep.   python3 cli_cuda_smoke.py SIESTA_BIN MODEL_DIR [cpu]
(cpu: the same checks against the CPU engine, for trying the script on a machine without a GPU)
"""
import json
import subprocess
import sys
import time
import urllib.request

siesta, model = sys.argv[1], sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
size_kv = ["--gpu-memory-utilization", "0.1"] if device == "cuda" else ["--kv-cache-memory-bytes", "256M"]
failures = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


def run(args):
    r = subprocess.run([siesta] + args, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


gen = ["generate", "--model", model, "--prompt", "The quick brown fox", "--max-tokens", "16", "--ignore-eos",
       "--json", "--device", device]
rc, out, err = run(gen)
check(f"generate --device {device}", rc == 0 and len(json.loads(out)["token_ids"]) == 16, err.strip()[-300:])
rc2, out2, err2 = run(gen)
check(f"generate --device {device} is repeatable", rc2 == 0 and out2 == out, err2.strip()[-300:])
rc, out3, err = run(gen + ["--batch-invariant"])
check(f"generate --device {device} --batch-invariant is the default", rc == 0 and out3 == out, err.strip()[-300:])
rc, out4, err = run(gen + ["--no-batch-invariant"])
check(f"generate --device {device} --no-batch-invariant", rc == 0 and len(json.loads(out4)["token_ids"]) == 16,
      err.strip()[-300:])
rc, _, err = run(gen + ["--kv-cache-memory-bytes", "1K"])
lines = [l for l in err.strip().splitlines() if l.strip()]
check("generate: a KV budget too small is one line", rc == 1 and len(lines) == 1 and "KV cache" in lines[0], err)

port = 18123
proc = subprocess.Popen([siesta, "serve", "--model", model, "--device", device, "--enable-sleep-mode", "--port",
                         str(port), "--max-num-seqs", "16"] + size_kv,
                        stderr=subprocess.PIPE, text=True)
base = f"http://127.0.0.1:{port}"


def call(path, body=None, method=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")


try:
    for _ in range(300):
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except Exception:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    check(f"serve --device {device} starts", proc.poll() is None)
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]

    def complete():
        r = call("/v1/completions", {"model": model, "prompt": prompts, "max_tokens": 24, "temperature": 0,
                                     "ignore_eos": True, "return_token_ids": True})
        return [c.get("token_ids") or c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]

    before = complete()
    mem_awake = call("/memory")
    for level in (1, 2):
        call(f"/sleep?level={level}&mode=keep", {}, "POST")
        mem = call("/memory")
        check(f"sleep level {level} reports sleeping", call("/is_sleeping").get("is_sleeping") is True)
        tags = mem["tags"]
        released = [t for t in ("kv_cache", "scratch") + (("weights",) if level == 2 else ())
                    if tags[t]["resident_bytes"] == 0]
        check(f"sleep level {level}: the pool released its memory", len(released) == (3 if level == 2 else 2),
              json.dumps(tags)[:300])
        if device == "cuda":
            pool = sum(t["total_bytes"] for t in tags.values())
            drop = mem_awake["device"]["used_bytes"] - mem["device"]["used_bytes"]
            check(f"sleep level {level}: device memory given back", drop >= pool - (64 << 20),
                  f"{drop / 2**30:.2f} GiB of {pool / 2**30:.2f} GiB")
        call("/wake_up", {}, "POST")
        after = complete()
        check(f"completions after sleep level {level} + wake are identical", after == before,
              f"{after[:1]} vs {before[:1]}")
    print("memory awake:", json.dumps(mem_awake)[:600])
finally:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    print("serve stderr (tail):", (err or "")[-800:])

print(f"{len(failures)} failed: {failures}" if failures else "all passed")
sys.exit(1 if failures else 0)
