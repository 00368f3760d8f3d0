#!/usr/bin/env python3
"""Runs `siesta bench transfer` for each backend configuration, writes
bench/results/transfer_<case>.json (results plus machine, date, commit and
the limit measured in the same run) and plots bandwidth against entry size
into bench/results/transfer_bandwidth.png (needs gnuplot: Debian gnuplot-nox).

  bench/transfer_bench.py --siesta build/bin/siesta [--cases ipc_host_write,ucx_tcp_write]
                          [--sizes 4K,64K,1M,16M,64M] [--batch 4] [--repeat N] [--notes TEXT]
  bench/transfer_bench.py --plot-only --cases ... [--suffix _h200]   # redraw from bench/results
SIESTA_COMMIT overrides the commit recorded (for runs outside a git checkout).
With --repeat N each case runs N times: its rows are the per-size medians
(`of_limit` the median of the runs' engine/limit ratios) and `runs` keeps
every run, for shared machines whose load comes and goes.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# name -> (arguments, what the limit is)
CASES = {
    "ipc_host_write": (["--backend", "ipc", "--memory", "host", "--op", "write"],
                       "memcpy in one process, one thread, same bytes"),
    "ipc_host_read": (["--backend", "ipc", "--memory", "host", "--op", "read"],
                      "memcpy in one process, one thread, same bytes"),
    "ipc_cuda_write": (["--backend", "ipc", "--memory", "cuda", "--op", "write"],
                       "cudaMemcpy device-to-device in one process, same bytes"),
    "ipc_cuda_read": (["--backend", "ipc", "--memory", "cuda", "--op", "read"],
                      "cudaMemcpy device-to-device in one process, same bytes"),
    "ucx_tcp_write": (["--backend", "ucx", "--op", "write", "--ucx-transports", "tcp", "--ucx-net-devices", "lo"],
                      "raw UCX put loop (ucp_put_nbx + flush), same transports, same bytes"),
    "ucx_tcp_read": (["--backend", "ucx", "--op", "read", "--ucx-transports", "tcp", "--ucx-net-devices", "lo"],
                     "raw UCX put loop (ucp_put_nbx + flush), same transports, same bytes"),
    "ucx_sm_write": (["--backend", "ucx", "--op", "write", "--ucx-transports", "sm,self", "--ucx-net-devices", "",
                      "--no-ucx-peer-errors"],
                     "raw UCX put loop (ucp_put_nbx + flush), same transports, same bytes"),
    # Host memory forced through the staging path that CUDA memory takes where UCX has no CUDA support.
    "ucx_tcp_staged_write": (["--backend", "ucx", "--op", "write", "--ucx-transports", "tcp", "--ucx-net-devices",
                              "lo", "--ucx-staging", "always"],
                             "raw UCX put loop (ucp_put_nbx + flush), same transports, same bytes"),
    "ucx_cuda_write": (["--backend", "ucx", "--memory", "cuda", "--op", "write", "--ucx-transports", "tcp",
                        "--ucx-net-devices", "lo"],
                       "raw UCX put loop (ucp_put_nbx + flush) between host buffers, same transports, same bytes"),
    "ucx_cuda_read": (["--backend", "ucx", "--memory", "cuda", "--op", "read", "--ucx-transports", "tcp",
                       "--ucx-net-devices", "lo"],
                      "raw UCX put loop (ucp_put_nbx + flush) between host buffers, same transports, same bytes"),
}
DEFAULT_CASES = "ipc_host_write,ipc_host_read,ucx_tcp_write,ucx_sm_write,ucx_tcp_staged_write"


def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        gpu = r.stdout.strip() or None
    return {"hostname": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(),
            "memory_total_bytes": mem, "gpu": gpu, "load_average_at_start": list(os.getloadavg())}


def commit():
    if os.environ.get("SIESTA_COMMIT"):
        return os.environ["SIESTA_COMMIT"]
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def median_rows(runs):
    rows = []
    for i, first in enumerate(runs[0]):
        per = [run[i] for run in runs]
        row = dict(first)
        for key in ("gb_per_s", "limit_gb_per_s", "p50_us", "p99_us"):
            row[key] = round(statistics.median(r[key] for r in per), 4)
        row["of_limit"] = round(statistics.median(r["gb_per_s"] / r["limit_gb_per_s"] for r in per), 3)
        if "entries_limit_gb_per_s" in first:
            row["entries_limit_gb_per_s"] = round(statistics.median(r["entries_limit_gb_per_s"] for r in per), 4)
            row["of_entries_limit"] = round(
                statistics.median(r["gb_per_s"] / r["entries_limit_gb_per_s"] for r in per), 3)
        row["verified"] = all(r["verified"] for r in per)
        rows.append(row)
    return rows


def run_case(siesta, name, sizes, batch, repeat=1, notes=None):
    args, limit = CASES[name]
    cmd = [siesta, "bench", "transfer", *args, "--sizes", sizes, "--batch", str(batch), "--json"]
    machine_at_start = machine()
    runs = []
    for _ in range(repeat):
        print("running:", " ".join(cmd), file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(r.stderr)
        if r.returncode != 0:
            print(f"{name}: siesta bench transfer failed with exit code {r.returncode}", file=sys.stderr)
            return None
        start = r.stdout.index("[")  # UCX may print its own lines before the list
        runs.append(json.loads(r.stdout[start:r.stdout.rindex("]") + 1]))
    rows = runs[0] if repeat == 1 else median_rows(runs)
    for row in rows:
        if "entries_limit_gb_per_s" in row and "of_entries_limit" not in row:
            row["of_entries_limit"] = round(row["gb_per_s"] / row["entries_limit_gb_per_s"], 3)
    doc = {
        "benchmark": "transfer",
        "case": name,
        "command": " ".join(["siesta", *cmd[1:]]),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_at_start,
        "limit": limit,
        "units": "GB/s = 1e9 bytes per second over one transfer in flight of `batch` entries of `bytes` each; "
                 "latency from submit() to done, per transfer",
        "results": rows,
    }
    if repeat > 1:
        doc["repeat"] = repeat
        doc["runs"] = runs
    if notes:
        doc["notes"] = notes
    return doc


def human(b):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def plot(docs, out):
    gnuplot = shutil.which("gnuplot")
    if not gnuplot:
        print("gnuplot not found (Debian package gnuplot-nox): no plot", file=sys.stderr)
        return
    tmp = tempfile.mkdtemp()
    lines = []
    sizes = sorted({row["bytes"] for doc in docs for row in doc["results"]})
    for i, doc in enumerate(docs):
        path = os.path.join(tmp, f"{doc['case']}.dat")
        with open(path, "w") as f:
            for row in doc["results"]:
                f.write(f"{row['bytes']} {row['gb_per_s']} {row['limit_gb_per_s']}\n")
        color = i + 1
        title = doc["case"].replace("_", " ")
        # The engine: thick line, filled dots. Its limit: thin line, open circles.
        lines.append(f"'{path}' using 1:2 with linespoints lw 3 pt 7 ps 1.2 lc {color} title '{title}'")
        lines.append(f"'{path}' using 1:3 with linespoints lw 1 pt 6 ps 1.2 lc {color} title '{title}: limit'")
    xtics = ", ".join(f'"{human(b)}" {b}' for b in sizes)
    host = docs[0]["machine"]
    batch = docs[0]["results"][0]["batch"]
    script = f"""
set terminal png size 1100,640 font ',11'
set output '{out}'
set title "siesta transfer engine between two processes: bandwidth vs entry size\\n{host['cpus']} CPUs ({host['cpu']}), {batch} entries per transfer; open circles: the limit measured in the same run"
set logscale x 2
set logscale y 10
set xrange [{sizes[0] / 1.6}:{sizes[-1] * 1.6}]
set xtics ({xtics})
set xlabel 'entry size'
set ylabel 'GB/s'
set grid
set key outside right top
plot {', '.join(lines)}
"""
    subprocess.run([gnuplot], input=script, text=True, check=True)
    shutil.rmtree(tmp)
    print("wrote", out, file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siesta", help="path of the siesta executable")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma separated: " + ",".join(CASES))
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; rows are their per-size medians")
    ap.add_argument("--notes", help="recorded as the result files' notes")
    ap.add_argument("--results", default=RESULTS, help="folder of the result files")
    ap.add_argument("--suffix", default="", help="appended to result file names (e.g. _h200)")
    ap.add_argument("--plot", help="PNG to write (default: <results>/transfer_bandwidth<suffix>.png)")
    ap.add_argument("--plot-only", action="store_true", help="plot the committed results of --cases, run nothing")
    a = ap.parse_args()
    a.plot = a.plot or os.path.join(a.results, f"transfer_bandwidth{a.suffix}.png")
    docs = []
    if a.plot_only:
        for name in a.cases.split(","):
            with open(os.path.join(a.results, f"transfer_{name}{a.suffix}.json")) as f:
                docs.append(json.load(f))
        plot(docs, a.plot)
        return
    if not a.siesta:
        ap.error("--siesta is required unless --plot-only")
    failed = []
    for name in a.cases.split(","):
        doc = run_case(a.siesta, name, a.sizes, a.batch, a.repeat, a.notes)
        if doc is None:  # the others still run
            failed.append(name)
            continue
        with open(os.path.join(a.results, f"transfer_{name}{a.suffix}.json"), "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
        docs.append(doc)
        print(f"{name}:", file=sys.stderr)
        for row in doc["results"]:
            ratio = row.get("of_limit", row["gb_per_s"] / row["limit_gb_per_s"])
            print(f"  {row['bytes']:>10} B  {row['gb_per_s']:8.3f} GB/s  limit {row['limit_gb_per_s']:8.3f}  "
                  f"{100 * ratio:4.0f}%  "
                  f"p50 {row['p50_us']:9.1f} us  p99 {row['p99_us']:9.1f} us  verified {row['verified']}"
                  + (f"  (of cudaMemcpy per entry {100 * row['of_entries_limit']:4.0f}%)"
                     if "of_entries_limit" in row else ""),
                  file=sys.stderr)
    if docs:
        plot(docs, a.plot)
    if failed:
        raise SystemExit("failed: " + ",".join(failed))


if __name__ == "__main__":
    main()
