"""`siesta demo`: P, D, the proxy and a colocated reference as real processes.

Checks: the demo succeeds on the CPU with both backends and both modes, every
request's output equals the colocated engine's (the demo compares; this test
also checks the JSON it prints), KV bytes really moved for every request, and
Ctrl-C stops every child process. Bad flags give one line on stderr.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from siesta_test_util import Checks, expect_clean_error, parse_args, run

args = parse_args()
checks = Checks()
MODEL = os.path.join(args.source, "models", "tiny-qwen3")


def children_of(ppid):
    """pids of the live (not zombie) processes whose parent is ppid."""
    kids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == ppid and fields[0] != "Z":
            kids.append(int(pid))
    return kids


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def processes_mentioning(needle):
    """pids whose command line contains needle (children of an earlier demo)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            found.append((int(pid), cmd))
    return found


def demo_json(backend, mode):
    rc, out, err = run([args.siesta, "demo", "--device", "cpu", "--backend", backend, "--mode", mode,
                        "--max-tokens", "16", "--json"], timeout=600)
    assert rc == 0, f"demo exit {rc}; stdout {out[-2000:]!r}; stderr {err[-2000:]!r}"
    report = json.loads(out)
    assert report["device"] == "cpu" and report["backend"] == backend and report["mode"] == mode, report
    reqs = report["requests"]
    assert len(reqs) >= 5, reqs
    for r in reqs:
        assert r["ok"], r
        assert r["equal_colocated"], r
        assert r["tokens"] > 0, r
        assert r["text"], r
        assert r["ttft_ms"] > 0, r
    # Shared-prefix requests may hit D's prefix cache; the others moved KV from P.
    moved = [r for r in reqs if r["kv_bytes"] > 0]
    assert len(moved) >= len(reqs) - 1, [(r["request"], r["kv_bytes"]) for r in reqs]
    # Sleep while serving: D, then P, sleep and wake with requests streaming; every request keeps its output.
    steps = report["sleep_while_serving"]
    assert [s["step"] for s in steps] == ["D sleeps (level 1)", "P sleeps (level 1)"], steps
    for s in steps:
        assert s["ok"] and not s["error"] and not s["request_errors"], s
        assert s["requests"] >= 3 and s["equal_colocated"] == s["requests"], s
        assert s["pool_released_bytes"] > 0 and s["sleep_ms"] > 0 and s["wake_ms"] > 0, s
        assert s["peers_acked"] == s["peers_invalidated"], s
    # The engine whose memory its peer imported invalidates that peer: D in write mode (P writes into it),
    # P in read mode (D reads from it).
    importer = steps[0] if mode == "write" else steps[1]
    assert importer["peers_invalidated"] == 1, steps
    return reqs


# Both backends and both modes (test_pd.py covers every combination in depth).
for backend, mode in [("ipc", "write"), ("ucx", "read")]:
    checks.check(f"demo {backend} {mode}: every output equals colocated, KV moved", lambda b=backend, m=mode: demo_json(b, m))


def table_output():
    rc, out, err = run([args.siesta, "demo", "--device", "cpu", "--max-tokens", "8"], timeout=600)
    assert rc == 0, f"demo exit {rc}: {out[-2000:]!r} {err[-2000:]!r}"
    assert "output = colocated" in out, out
    assert "every output equals the colocated engine's" in out, out
    assert "sleep while serving" in out and "D sleeps (level 1)" in out and "P sleeps (level 1)" in out, out
    assert "NO" not in out.split(), out


checks.check("demo prints the table and its verdict", table_output)


def fleet_json():
    rc, out, err = run([args.siesta, "demo", "--fleet", "--device", "cpu", "--max-tokens", "6", "--json"], timeout=600)
    assert rc == 0, f"demo --fleet exit {rc}; stdout {out[-2000:]!r}; stderr {err[-2000:]!r}"
    j = json.loads(out)
    reqs = j["requests"]
    assert j["fleet"] is True and len(reqs) == 8, j
    for r in reqs:
        assert r["ok"] and r["equal_colocated"], r
        assert r["prefill"].startswith("http://127.0.0.1:") and r["decode"].startswith("http://127.0.0.1:"), r
    # Two prefill and two decode engines served, as the proxy's headers name them.
    assert len({r["prefill"] for r in reqs}) == 2 and len({r["decode"] for r in reqs}) == 2, reqs
    assert not set(r["prefill"] for r in reqs) & set(r["decode"] for r in reqs)
    # Both P were put to sleep: the next request waited for a wake, the one after it did not.
    woke, after = reqs[-2], reqs[-1]
    assert woke["wake_wait_ms"] > 0 and after["wake_wait_ms"] == 0, (woke, after)
    assert all(r["wake_wait_ms"] == 0 for r in reqs[:-2]), reqs


checks.check("demo --fleet: 2 P + 2 D, every output equals colocated, the engines named, one wake waited for",
             fleet_json)


def ctrl_c_stops_children():
    work = tempfile.mkdtemp(prefix="siesta-demo-test-")
    try:
        model = os.path.join(work, "unique-demo-model")
        shutil.copytree(MODEL, model)
        logs = os.path.join(work, "logs")
        p = subprocess.Popen([args.siesta, "demo", "--device", "cpu", "--model", model, "--logs", logs,
                              "--max-tokens", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Wait until P, D, the reference and the proxy run, then interrupt.
        deadline = time.time() + 120
        kids = []
        while time.time() < deadline and p.poll() is None:
            kids = children_of(p.pid)
            if len(kids) == 4:
                break
            time.sleep(0.05)
        assert len(kids) == 4, f"expected 4 children (P, D, proxy, reference), saw {kids}"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode != 0, f"interrupted demo exited 0: {out!r}"
        assert "interrupted" in err, err
        deadline = time.time() + 10
        while any(alive(k) for k in kids) and time.time() < deadline:
            time.sleep(0.1)
        left = [k for k in kids if alive(k)]
        assert not left, f"children left running after Ctrl-C: {left}"
        assert not processes_mentioning(model), "an engine of the demo is still running"
    finally:
        for pid, _ in processes_mentioning(os.path.join(work, "unique-demo-model")):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


checks.check("Ctrl-C stops P, D, the proxy and the reference", ctrl_c_stops_children)


def bad_flags():
    rc, _, err = run([args.siesta, "demo", "--mode", "sideways"])
    expect_clean_error(rc, err, "--mode")
    rc, _, err = run([args.siesta, "demo", "--model", "/nonexistent/model"])
    expect_clean_error(rc, err, "/nonexistent/model")


checks.check("bad flags: one line naming the problem", bad_flags)

checks.finish()
