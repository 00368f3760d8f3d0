#!/usr/bin/env python3
"""The long run of siesta's libFuzzer targets (tests/fuzz): each target for
--runs executions (default 10,000,000) from a corpus kept in BUILD/long/NAME
(seeded from tests/fuzz/corpus/NAME), --jobs targets at a time, the slowest
first. Writes --out (bench/results/fuzz.json): machine, date, commit, and per
target the executions, seconds, executions per second, the corpus's files
and bytes at the end, coverage, peak RSS and crashes (0, or the files
libFuzzer wrote). Prints one table. `scripts/fuzz --long` builds the targets
and runs this.

SIESTA_COMMIT overrides the commit recorded (for runs outside a git checkout).
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Leaks are found; allocation stacks are not kept (twice the executions per
# second; rerun a crash input without this to see where its memory came from).
ASAN_OPTIONS = "detect_leaks=1:malloc_context_size=0"
# Slowest first, so that two at a time finish close together (executions per
# second measured on the 2-vCPU VM in short runs).
TARGETS = [
    ("kv_transfer_params_fuzzer", 4096, "json.dict"),
    ("openai_request_fuzzer", 4096, "json.dict"),
    ("transfer_frame_fuzzer", 4096, None),
    ("admin_params_fuzzer", 1024, "admin.dict"),
    ("json_depth_fuzzer", 4096, "json.dict"),
    ("http_request_fuzzer", 8192, "http.dict"),
]


def machine():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    return {"hostname": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(),
            "memory_total_bytes": mem, "load_average_at_start": list(os.getloadavg()),
            "compiler": subprocess.run(["clang++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]}


def commit():
    if os.environ.get("SIESTA_COMMIT"):
        return os.environ["SIESTA_COMMIT"]
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def run_target(build, name, max_len, dictionary, runs):
    corpus = os.path.join(build, "long", name)
    artifacts = os.path.join(build, "long", name + "_crashes")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    seeds = os.path.join(ROOT, "tests", "fuzz", "corpus", name)
    for f in os.listdir(seeds):
        shutil.copy(os.path.join(seeds, f), os.path.join(corpus, f))
    cmd = [os.path.join(build, "bin", name), f"-runs={runs}", f"-max_len={max_len}", "-timeout=60",
           "-rss_limit_mb=2048", "-print_final_stats=1", f"-artifact_prefix={artifacts}/"]
    if dictionary:
        cmd.append("-dict=" + os.path.join(ROOT, "tests", "fuzz", dictionary))
    cmd.append(corpus)
    log_path = os.path.join(build, "long", name + ".log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, ASAN_OPTIONS=ASAN_OPTIONS),
                            cwd=build).returncode
    seconds = time.monotonic() - t0
    text = open(log_path, errors="replace").read()

    def stat(key):
        m = re.findall(rf"stat::{key}:\s+(\d+)", text)
        return int(m[-1]) if m else None

    cov = re.findall(r"cov: (\d+) ft: (\d+)", text)
    files = [os.path.join(corpus, f) for f in os.listdir(corpus)]
    crashes = sorted(f for f in os.listdir(artifacts))
    executions = stat("number_of_executed_units")
    return {"target": name, "returncode": rc, "executions": executions, "seconds": round(seconds, 1),
            "executions_per_second": round(executions / seconds) if executions else None,
            "corpus_files": len(files), "corpus_bytes": sum(os.path.getsize(f) for f in files),
            "coverage_edges": int(cov[-1][0]) if cov else None, "features": int(cov[-1][1]) if cov else None,
            "peak_rss_mb": stat("peak_rss_mb"), "crashes": len(crashes), "crash_files": crashes,
            "max_len": max_len, "dictionary": dictionary}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build-fuzz"))
    p.add_argument("--runs", type=int, default=10_000_000)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated targets (default: all)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz.json"))
    a = p.parse_args()
    build = os.path.abspath(a.build)
    targets = [t for t in TARGETS if not a.only or t[0] in a.only.split(",")]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = {"machine": machine(), "date": started, "commit": commit(), "runs_per_target": a.runs,
            "sanitizers": "address, undefined (libFuzzer, clang -O1)", "asan_options": ASAN_OPTIONS, "jobs": a.jobs}
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda t: run_target(build, t[0], t[1], t[2], a.runs), targets))
    info["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info["targets"] = results
    info["crashes"] = sum(r["crashes"] for r in results)
    print(f"{'target':28} {'executions':>12} {'exec/s':>8} {'seconds':>8} {'corpus':>7} {'edges':>6} {'crashes':>7}")
    for r in results:
        print(f"{r['target']:28} {r['executions'] or 0:>12} {r['executions_per_second'] or 0:>8} {r['seconds']:>8} "
              f"{r['corpus_files']:>7} {r['coverage_edges'] or 0:>6} {r['crashes']:>7}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    return 1 if info["crashes"] or any(r["returncode"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
