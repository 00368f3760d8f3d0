#!/usr/bin/env python3
"""Runs `siesta bench transfer` for each backend configuration, writes
bench/results/transfer_<case>.json (results plus machine, date, commit and
the limit measured in the same run) and plots bandwidth against entry size
into bench/results/transfer_bandwidth.png (needs gnuplot: Debian gnuplot-nox).

  bench/transfer_bench.py --siesta build/bin/siesta [--cases ipc_host_write,ucx_tcp_write]
                          [--sizes 4K,64K,1M,16M,64M] [--batch 4]
"""
import argparse
import datetime
import json
import os
import platform
import shutil
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
    "ucx_tcp_write": (["--backend", "ucx", "--op", "write", "--ucx-transports", "tcp", "--ucx-net-devices", "lo"],
                      "raw UCX put loop (ucp_put_nbx + flush), same transports, same bytes"),
    "ucx_sm_write": (["--backend", "ucx", "--op", "write", "--ucx-transports", "sm,self", "--ucx-net-devices", "",
                      "--no-ucx-peer-errors"],
                     "raw UCX put loop (ucp_put_nbx + flush), same transports, same bytes"),
}
DEFAULT_CASES = "ipc_host_write,ipc_host_read,ucx_tcp_write,ucx_sm_write"


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
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def run_case(siesta, name, sizes, batch):
    args, limit = CASES[name]
    cmd = [siesta, "bench", "transfer", *args, "--sizes", sizes, "--batch", str(batch), "--json"]
    print("running:", " ".join(cmd), file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"{name}: siesta bench transfer failed with exit code {r.returncode}")
    start = r.stdout.index("[")  # UCX may print its own lines before the list
    rows = json.loads(r.stdout[start:r.stdout.rindex("]") + 1])
    return {
        "benchmark": "transfer",
        "case": name,
        "command": " ".join(["siesta", *cmd[1:]]),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "limit": limit,
        "units": "GB/s = 1e9 bytes per second over one transfer in flight of `batch` entries of `bytes` each; "
                 "latency from submit() to done, per transfer",
        "results": rows,
    }


def plot(docs, out):
    gnuplot = shutil.which("gnuplot")
    if not gnuplot:
        print("gnuplot not found (Debian package gnuplot-nox): no plot", file=sys.stderr)
        return
    tmp = tempfile.mkdtemp()
    lines = []
    for i, doc in enumerate(docs):
        path = os.path.join(tmp, f"{doc['case']}.dat")
        with open(path, "w") as f:
            for row in doc["results"]:
                f.write(f"{row['bytes']} {row['gb_per_s']} {row['limit_gb_per_s']}\n")
        color = i + 1
        title = doc["case"].replace("_", " ")
        lines.append(f"'{path}' using 1:2 with linespoints lw 2 pt 7 lc {color} title '{title}'")
        lines.append(f"'{path}' using 1:3 with lines dt 2 lw 1 lc {color} title '{title}: limit'")
    host = docs[0]["machine"]
    script = f"""
set terminal png size 1000,640 font ',11'
set output '{out}'
set title 'siesta transfer engine: bandwidth vs entry size ({host["cpus"]} CPUs, {host["cpu"]}; dashed: limit in the same run)'
set logscale x 2
set logscale y 10
set xlabel 'entry size (bytes; batch of {docs[0]["results"][0]["batch"]} entries per transfer)'
set ylabel 'GB/s'
set format x '%.0s%cB'
set grid
set key left top
plot {', '.join(lines)}
"""
    subprocess.run([gnuplot], input=script, text=True, check=True)
    shutil.rmtree(tmp)
    print("wrote", out, file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siesta", required=True, help="path of the siesta executable")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma separated: " + ",".join(CASES))
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--plot", default=os.path.join(RESULTS, "transfer_bandwidth.png"))
    a = ap.parse_args()
    docs = []
    for name in a.cases.split(","):
        doc = run_case(a.siesta, name, a.sizes, a.batch)
        with open(os.path.join(RESULTS, f"transfer_{name}.json"), "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
        docs.append(doc)
        print(f"{name}:", file=sys.stderr)
        for row in doc["results"]:
            print(f"  {row['bytes']:>10} B  {row['gb_per_s']:8.3f} GB/s  limit {row['limit_gb_per_s']:8.3f}  "
                  f"p50 {row['p50_us']:9.1f} us  p99 {row['p99_us']:9.1f} us  verified {row['verified']}",
                  file=sys.stderr)
    plot(docs, a.plot)


if __name__ == "__main__":
    main()
