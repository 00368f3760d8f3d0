"""A fleet of P and D engines on separate "hosts" behind one `siesta proxy`.

Each engine runs in a network namespace of its own, joined to the others and to the test's
namespace (which runs the proxy, the clients and a reference engine) by veth pairs on a bridge;
P and D talk UCX over tcp across them (WRITE mode, the proxy's --mode concurrent). Every output is
compared with the same request sent alone to a colocated reference engine that never slept
(greedy and seeded sampling on the CPU model are deterministic), and every phase counts wrong,
lost and errored answers and checks that every engine's held and in-use blocks come back to 0.

Phases:
  routing      16 clients at once: outputs equal, x-siesta-prefill/-decode name configured
               instances, both P and both D served, /status and /metrics name every instance up
  asleep       a P put to sleep (through the proxy, then directly at the engine) gets no request;
               with every P asleep a request wakes one (x-siesta-wake-wait-ms, the wake metric);
               a wake that cannot happen ends in a clear 503 within --wake-timeout-s
  p-restart    P killed and restarted at the same address while D caches its lookup: the first
               requests load their KV from the new P (no "ignored" write, none waits out
               load_timeout_s)
  d-restart    D (a fixed engine_id) killed and restarted at the same address while P holds its
               descriptor: P handshakes again, the requests load
  link-cut     the route between P's and D's namespaces dropped during transfers: D recomputes,
               nothing waits past its deadline, no block stays held on either side
  shaped-link  P's and D's links shaped with tc tbf (queueing delay and tail drops; the kernel here
               has no sch_netem): outputs identical
  sigstop      a D stopped (SIGSTOP) for longer than the deadlines: the proxy gives up on it and
               serves the requests elsewhere; after SIGCONT it is up and serving again
  park         a proxy with --park-idle-after 1 puts P and D to sleep; the next request wakes them
  chaos        16 clients while single engines are put to sleep and woken, killed and restarted:
               0 wrong, 0 lost, an error only for a request in flight at an engine as it was killed

Needs root (network namespaces); without them the test prints SKIP and exits 77 (ctest: skipped).
The long form (bench/results/fleet.json):
  python3 tests/integration/test_fleet.py --siesta build/bin/siesta --source . --chaos-s 300 \
      --json bench/results/fleet.json
"""
import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, completion_outcome, http_exchange, parse_metrics  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--siesta", required=True)
ap.add_argument("--source", required=True)
ap.add_argument("--clients", type=int, default=16)
ap.add_argument("--chaos-s", type=float, default=25.0, help="length of the chaos phase")
ap.add_argument("--seed", type=int, default=None)
ap.add_argument("--json", default=None, help="write the counts here (the bench form)")
ap.add_argument("--phases", default="routing,asleep,p-restart,d-restart,link-cut,shaped-link,sigstop,park,chaos")
args = ap.parse_args()

SIESTA = os.path.abspath(args.siesta)
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
SEED = args.seed if args.seed is not None else int(time.time()) % 100000
PHASES = args.phases.split(",")
print(f"fleet seed {SEED}", flush=True)

LOAD_TIMEOUT_S = 4
PROXY_TIMEOUT_S = 6
CLIENT_TIMEOUT_S = 60
HTTP_PORT = 8300
SIDE_PORT = 7300
SERVE_ARGS = ["--kv-cache-memory-bytes", "48M", "--max-model-len", "1024", "--seed", "0", "--max-num-seqs", "16",
              "--http-threads", "48", "--threads", "1", "--enable-sleep-mode"]
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
HELD_KEYS = ("siesta:kv_blocks_in_use", "siesta:kv_blocks_held_for_remote", "siesta:kv_blocks_held_for_loads")


# ---- the hosts ---------------------------------------------------------------------------------

def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


TAG = f"sf{os.getpid() % 100000}"
NET = f"10.{100 + os.getpid() % 100}.0"
BRIDGE = f"{TAG}br"
HOSTS = {"p0": f"{NET}.11", "p1": f"{NET}.12", "d0": f"{NET}.21", "d1": f"{NET}.22"}


def ns(host):
    return f"{TAG}-{host}"


def setup_hosts():
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for host, ip in HOSTS.items():
        sh("ip", "netns", "add", ns(host))
        sh("ip", "link", "add", f"{TAG}{host}", "type", "veth", "peer", "name", f"{TAG}{host}x")
        sh("ip", "link", "set", f"{TAG}{host}x", "netns", ns(host))
        sh("ip", "netns", "exec", ns(host), "ip", "link", "set", f"{TAG}{host}x", "name", "eth0")
        sh("ip", "netns", "exec", ns(host), "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "netns", "exec", ns(host), "ip", "link", "set", "eth0", "up")
        sh("ip", "netns", "exec", ns(host), "ip", "link", "set", "lo", "up")
        sh("ip", "link", "set", f"{TAG}{host}", "master", BRIDGE)
        sh("ip", "link", "set", f"{TAG}{host}", "up")


def teardown_hosts():
    for host in HOSTS:
        sh("ip", "netns", "del", ns(host), check=False)
        sh("ip", "link", "del", f"{TAG}{host}", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def can_make_namespaces():
    if os.geteuid() != 0:
        return "not root"
    if not shutil.which("ip"):
        return "no ip(8)"
    probe = f"{TAG}-probe"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    r = sh("ip", "link", "add", f"{TAG}pb", "type", "bridge", check=False)
    if r.returncode != 0:
        return f"no bridge: {r.stderr.strip()}"
    sh("ip", "link", "del", f"{TAG}pb", check=False)
    return None


def cut_link(a, b, cut):
    """Drops (blackhole routes) or restores the traffic between hosts a and b."""
    for src, dst in ((a, b), (b, a)):
        sh("ip", "netns", "exec", ns(src), "ip", "route", "add" if cut else "del", "blackhole", f"{HOSTS[dst]}/32",
           check=cut)


def shape_link(host, on):
    if on:
        sh("ip", "netns", "exec", ns(host), "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "8mbit",
           "burst", "32kb", "latency", "30ms")
        sh("tc", "qdisc", "add", "dev", f"{TAG}{host}", "root", "tbf", "rate", "8mbit", "burst", "32kb",
           "latency", "30ms")
    else:
        sh("ip", "netns", "exec", ns(host), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        sh("tc", "qdisc", "del", "dev", f"{TAG}{host}", "root", check=False)


def netem_available():
    r = sh("tc", "qdisc", "add", "dev", BRIDGE, "root", "netem", "delay", "1ms", check=False)
    if r.returncode == 0:
        sh("tc", "qdisc", "del", "dev", BRIDGE, "root", check=False)
        return True
    return False


# ---- HTTP ----------------------------------------------------------------------------------------

class Outcome:
    def __init__(self, kind, detail="", tokens=None, headers=None, seconds=0.0):
        self.kind = kind  # "done" | "error" | "lost"
        self.detail = detail
        self.tokens = tokens
        self.headers = headers or {}
        self.seconds = seconds


def generate(port, path, body, timeout=CLIENT_TIMEOUT_S):
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        headers = {k.lower(): v for k, v in r.getheaders()}
        raw = r.read()
        secs = time.monotonic() - start
        kind, detail, tokens = completion_outcome(r.status, raw, body.get("stream"))
        return Outcome(kind, detail, tokens=tokens, headers=headers, seconds=secs)
    except (socket.timeout, TimeoutError):
        return Outcome("lost", f"no answer within {timeout} s", seconds=time.monotonic() - start)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Outcome("error", f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
    finally:
        conn.close()


# ---- processes -----------------------------------------------------------------------------------

tmp = tempfile.mkdtemp(prefix="siesta-fleet-")
AUTH_KEY_FILE = os.path.join(tmp, "side_channel.key")
with open(os.open(AUTH_KEY_FILE, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(os.urandom(32).hex() + "\n")


class Proc:
    """A siesta process (in a namespace or here) whose log gives its port; restartable with the same argv."""

    def __init__(self, name, argv, netns=None, env=None):
        self.name = name
        self.argv = argv
        self.netns = netns
        self.env = dict(os.environ)
        self.env.update(env or {})
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.proc = None
        self.port = None
        self.log_offset = 0
        self.start()

    def start(self, timeout_s=90):
        self.log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([*prefix, SIESTA, "--log-level", "info", *self.argv], stdout=log,
                                     stderr=subprocess.STDOUT, env=self.env)
        log.close()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.proc.poll() is None:
            m = re.search(r"listening on http://[0-9.]+:(\d+)", self.log_since_start())
            if m:
                self.port = int(m.group(1))
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start: {self.log_since_start()[-3000:]}")

    def log_since_start(self):
        with open(self.log_path, errors="replace") as f:
            f.seek(self.log_offset)
            return f.read()

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=15)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


class Engine(Proc):
    def __init__(self, host, role, engine_id=None):
        self.host = host
        self.ip = HOSTS[host]
        cfg = {"kv_connector": "SiestaConnector", "kv_role": role,
               "kv_connector_extra_config": {
                   "backend": "ucx", "mode": "write", "side_channel_host": self.ip, "side_channel_port": SIDE_PORT,
                   "ucx_transports": "tcp", "ucx_net_devices": "eth0", "load_timeout_s": LOAD_TIMEOUT_S,
                   "transfer_timeout_s": 3, "message_timeout_s": 2, "hold_timeout_s": 8, "write_grace_s": 1,
                   "worker_threads": 4, "auth_key_file": AUTH_KEY_FILE}}
        if engine_id:
            cfg["engine_id"] = engine_id
        super().__init__(host.upper(), ["serve", "--model", MODEL, "--host", self.ip, "--port", str(HTTP_PORT),
                                        *SERVE_ARGS, "--kv-transfer-config", json.dumps(cfg)],
                         netns=ns(host), env=UCX_ENV)

    @property
    def url(self):
        return f"http://{self.ip}:{HTTP_PORT}"

    def call(self, method, path, timeout=30):
        return http_exchange(self.ip, HTTP_PORT, method, path, timeout=timeout)

    def metrics(self):
        status, _, raw = self.call("GET", "/metrics", timeout=10)
        assert status == 200, (self.name, status)
        return parse_metrics(raw)

    def held(self):
        m = self.metrics()
        return {k: m.get(k) for k in HELD_KEYS}


def wait_until(what, fn, timeout_s):
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - retried until the deadline, then reported
            last = e
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s} s; last: {last!r}")


# ---- requests ------------------------------------------------------------------------------------

WORDS = ("the prefill engine computes the keys and values of a prompt and the decode engine loads them over "
         "the network block by block while the proxy in front picks which of them serves each request").split()
SHARED = ["You are a careful assistant serving a fleet of engines. " * 3, " ".join(WORDS * 3) + ". "]


def make_specs(n, rng):
    specs = []
    for i in range(n):
        prefix = rng.choice(SHARED) if rng.random() < 0.6 else ""
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 8, 20, 40])))
        body = {"max_tokens": rng.choice([2, 4, 8]), "stream": rng.random() < 0.3, "return_token_ids": True,
                "ignore_eos": True}
        if rng.random() < 0.7:
            body["temperature"] = 0
        else:
            body.update({"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)})
        prompt = f"{prefix}{tail} (fleet question {i})"
        if rng.random() < 0.25:
            body["messages"] = [{"role": "user", "content": prompt}]
            specs.append(("/v1/chat/completions", body))
        else:
            body["prompt"] = prompt
            specs.append(("/v1/completions", body))
    return specs


class Tally:
    """Outcomes of one phase: ok / wrong / lost / errored, with what went wrong."""

    def __init__(self, name):
        self.name = name
        self.lock = threading.Lock()
        self.rows = []  # (spec index, start, end, Outcome)

    def add(self, i, start, o):
        with self.lock:
            self.rows.append((i, start, start + o.seconds, o))

    def counts(self, refs, allowed_error=lambda start, end, o: False):
        c = {"ok": 0, "wrong": 0, "lost": 0, "errored_allowed": 0, "errored": 0}
        bad = []
        for i, start, end, o in self.rows:
            if o.kind == "done":
                key = "ok" if o.tokens == refs[i] else "wrong"
            elif o.kind == "lost":
                key = "lost"
            else:
                key = "errored_allowed" if allowed_error(start, end, o) else "errored"
            c[key] += 1
            if key not in ("ok", "errored_allowed"):
                bad.append((key, i, o.detail, o.headers.get("x-siesta-prefill"), o.headers.get("x-siesta-decode")))
        c["requests"] = len(self.rows)
        return c, bad


def run_clients(port, specs, indices, tally, n_clients, until, rng_seed):
    def client(cid):
        crng = random.Random(rng_seed * 100 + cid)
        while time.monotonic() < until():
            i = crng.choice(indices)
            start = time.monotonic()
            tally.add(i, start, generate(port, *specs[i]))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(n_clients)]
    for t in threads:
        t.start()
    return threads


def join_all(threads):
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 10)
    return sum(t.is_alive() for t in threads)


# ---- the run -------------------------------------------------------------------------------------

why_not = can_make_namespaces()
if why_not:
    print(f"SKIP: network namespaces cannot be made here ({why_not}); the fleet test needs root and "
          f"ip netns/veth/bridge", flush=True)
    sys.exit(77)

checks = Checks()
results = {"seed": SEED, "phases": {}}
engines = {}
proxies = []
ref = None
try:
    setup_hosts()
    results["netem"] = netem_available()
    print(f"tc netem {'available' if results['netem'] else 'unavailable (no sch_netem); shaping with tbf'}",
          flush=True)
    ref = Proc("ref", ["serve", "--model", MODEL, "--port", "0", *SERVE_ARGS])
    rng = random.Random(SEED)
    specs = make_specs(80, rng)
    refs = [generate(ref.port, path, body).tokens for path, body in specs]
    assert all(r is not None for r in refs), "the reference engine failed a request"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        started = {h: pool.submit(Engine, h, "kv_producer" if h[0] == "p" else "kv_consumer",
                                  None if h[0] == "p" else f"decode-{h[1]}") for h in HOSTS}
        engines = {h: f.result() for h, f in started.items()}
    P0, P1, D0, D1 = engines["p0"], engines["p1"], engines["d0"], engines["d1"]
    common = ["--mode", "concurrent", "--timeout-s", str(PROXY_TIMEOUT_S), "--health-interval-s", "0.3",
              "--health-timeout-s", "3", "--allow-unauthenticated-admin", "--port", "0"]
    fleet = Proc("proxy-fleet", ["proxy", "--prefill", f"{P0.url},{P1.url}", "--decode", f"{D0.url},{D1.url}",
                                 "--wake-on-demand", "--wake-timeout-s", "20", "--retries", "1", *common])
    pinned = Proc("proxy-pinned", ["proxy", "--prefill", P0.url, "--decode", D0.url, "--retries", "0",
                                   "--wake-on-demand", "--wake-timeout-s", "2", *common])
    proxies = [fleet, pinned]

    def status_of(proxy):
        s, _, raw = http_exchange("127.0.0.1", proxy.port, "GET", "/status")
        assert s == 200, s
        return {i["url"]: i for i in json.loads(raw)["instances"]}

    def all_up(proxy, urls):
        st = status_of(proxy)
        return all(st[u]["state"] == "up" for u in urls)

    def engines_alive():
        """Every engine still runs: one that died (a crash, not a kill of ours) fails the phase, with its log."""
        for e in engines.values():
            rc = e.proc.poll()
            assert rc is None, f"{e.name} exited with {rc}; its log ends: {e.log_since_start()[-1500:]}"

    def blocks_back(who):
        engines_alive()
        def zero():
            held = {e.name: e.held() for e in who}
            return held if all(v == 0 for h in held.values() for v in h.values()) else None
        return wait_until("every engine's held and in-use blocks at 0", zero, 15)

    wait_until("the fleet proxy sees all four engines up", lambda: all_up(fleet, [e.url for e in engines.values()]),
               10)

    def loads(e, outcome):
        return e.metrics().get(f'siesta:kv_loads_total{{outcome="{outcome}"}}', 0)

    def sequential(proxy, indices, tally):
        for i in indices:
            start = time.monotonic()
            tally.add(i, start, generate(proxy.port, *specs[i]))

    def record(name, counts, extra=None):
        engines_alive()
        results["phases"][name] = {**counts, **(extra or {})}
        print(f"{name}: {json.dumps(results['phases'][name])}", flush=True)

    # ---- routing
    if "routing" in PHASES:
        def routing():
            tally = Tally("routing")
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                futs = [pool.submit(lambda i: (i, time.monotonic(), generate(fleet.port, *specs[i])), i % len(specs))
                        for i in range(args.clients * 2)]
                for f in futs:
                    i, start, o = f.result()
                    tally.add(i, start, o)
            counts, bad = tally.counts(refs)
            served_p = {o.headers.get("x-siesta-prefill") for _, _, _, o in tally.rows}
            served_d = {o.headers.get("x-siesta-decode") for _, _, _, o in tally.rows}
            record("routing", counts, {"prefill_served": sorted(map(str, served_p)),
                                       "decode_served": sorted(map(str, served_d))})
            assert counts["ok"] == counts["requests"], bad
            assert served_p == {P0.url, P1.url}, served_p
            assert served_d == {D0.url, D1.url}, served_d
            s, _, raw = http_exchange("127.0.0.1", fleet.port, "GET", "/metrics")
            m = parse_metrics(raw)
            for e in engines.values():
                role = "prefill" if e.host[0] == "p" else "decode"
                assert m[f'siesta_proxy_instance_state{{role="{role}",instance="{e.url}",state="up"}}'] == 1
        checks.check("routing: least-loaded over 2 P + 2 D, outputs equal, headers name the instances", routing)

    # ---- asleep
    if "asleep" in PHASES:
        def asleep():
            s, _, _ = http_exchange("127.0.0.1", fleet.port, "POST", f"/sleep?instance={P1.url}&level=1", timeout=60)
            assert s == 200, s
            assert status_of(fleet)[P1.url]["state"] == "asleep", status_of(fleet)[P1.url]
            tally = Tally("asleep")
            sequential(fleet, range(6), tally)
            counts, bad = tally.counts(refs)
            assert counts["ok"] == 6, bad
            assert all(o.headers.get("x-siesta-prefill") == P0.url for *_, o in tally.rows), "routed to a sleeper"
            # Put to sleep behind the proxy's back: the health round sees it; a request wakes one P.
            s, _, _ = P0.call("POST", "/sleep?level=1", timeout=60)
            assert s == 200, s
            wait_until("the proxy sees P0 asleep", lambda: status_of(fleet)[P0.url]["state"] == "asleep", 5)
            o = generate(fleet.port, *specs[7])
            assert o.kind == "done" and o.tokens == refs[7], (o.kind, o.detail)
            waited = int(o.headers.get("x-siesta-wake-wait-ms", "0"))
            assert waited > 0, o.headers
            _, _, raw = http_exchange("127.0.0.1", fleet.port, "GET", "/metrics")
            m = parse_metrics(raw)
            assert m['siesta_proxy_wake_wait_seconds_count{role="prefill"}'] >= 1, m
            woken = [e for e in (P0, P1) if json.loads(e.call("GET", "/is_sleeping")[2])["is_sleeping"] is False]
            assert len(woken) == 1, "exactly one P woken"
            for e in (P0, P1):
                e.call("POST", "/wake_up", timeout=60)
            # A wake that cannot happen: P0 asleep and stopped, the pinned proxy's --wake-timeout-s 2.
            assert P0.call("POST", "/sleep?level=1", timeout=60)[0] == 200
            wait_until("the pinned proxy sees P0 asleep", lambda: status_of(pinned)[P0.url]["state"] == "asleep", 5)
            os.kill(P0.proc.pid, signal.SIGSTOP)
            try:
                o = generate(pinned.port, *specs[8])
            finally:
                os.kill(P0.proc.pid, signal.SIGCONT)
            assert o.kind == "error" and ("HTTP 503 wake_timeout" in o.detail or "HTTP 503 no_instance_up" in o.detail), \
                o.detail
            assert o.seconds < 2 + 3, o.seconds
            assert P0.call("POST", "/wake_up", timeout=60)[0] == 200
            wait_until("all up again", lambda: all_up(fleet, [P0.url, P1.url]) and all_up(pinned, [P0.url]), 10)
            record("asleep", counts, {"wake_wait_ms": waited, "wake_timeout_answer": o.detail[:120]})
        checks.check("asleep: never routed to a sleeping P; wake on demand with its wait reported; bounded 503",
                     asleep)

    # ---- restarts
    # Prompts each restart phase sends first (D's prefix cache holds none of them: every one moves KV).
    FRESH = {"p-restart": range(40, 46), "d-restart": range(46, 52)}

    def restart_phase(name, victim, survivor):
        def run():
            tally = Tally(name)
            sequential(pinned, range(32, 36), tally)  # the survivor caches the victim's lookup or descriptor
            victim.kill()
            victim.start()
            wait_until("the pinned proxy sees the restarted engine up", lambda: all_up(pinned, [victim.url]), 10)
            d = D0
            done_before = loads(d, "loaded")
            handshakes_before = P0.metrics().get("siesta:kv_peer_handshakes_total", 0)
            after = Tally(name + "-after")
            sequential(pinned, FRESH[name], after)
            counts, bad = after.counts(refs)
            slowest = max(o.seconds for *_, o in after.rows)
            done = loads(d, "loaded") - done_before
            ignored = len(re.findall(r"notified a write for request .* ignored", D0.log_since_start()))
            record(name, counts, {"loads_done": done, "slowest_s": round(slowest, 3), "ignored_writes": ignored,

                                  "p_handshakes": P0.metrics().get("siesta:kv_peer_handshakes_total", 0)
                                  - handshakes_before})
            assert counts["ok"] == 6, bad
            assert done == 6, f"{done} of 6 requests loaded their KV from P (the rest recomputed)"
            assert ignored == 0, "D ignored a write of the restarted P"
            assert slowest < LOAD_TIMEOUT_S, f"a request took {slowest:.2f} s (waited out load_timeout_s?)"
            blocks_back([P0, D0])
        return run

    if "p-restart" in PHASES:
        checks.check("p-restart: D follows a P restarted at its cached address at the first message",
                     restart_phase("p-restart", P0, D0))
    if "d-restart" in PHASES:
        checks.check("d-restart: P handshakes again with a D restarted under the same engine_id",
                     restart_phase("d-restart", D0, P0))

    # ---- link cut
    if "link-cut" in PHASES:
        def link_cut():
            tally = Tally("link-cut")
            failed_before = loads(D0, "failed")
            end = time.monotonic() + 9
            threads = run_clients(pinned.port, specs, range(52, 80), tally, 4, lambda: end, SEED + 1)
            time.sleep(1.5)
            cut_link("p0", "d0", True)
            time.sleep(5)
            cut_link("p0", "d0", False)
            lost = join_all(threads)
            counts, bad = tally.counts(refs)
            slowest = max(o.seconds for *_, o in tally.rows)
            failed = loads(D0, "failed") - failed_before
            record("link-cut", counts, {"loads_failed": failed, "slowest_s": round(slowest, 3), "stuck": lost})
            assert lost == 0 and counts["ok"] == counts["requests"], bad
            assert failed > 0, "no load failed while the link was cut (did any transfer run?)"
            # A load gives up at load_timeout_s; the request then computes its prompt.
            assert slowest < LOAD_TIMEOUT_S + PROXY_TIMEOUT_S, slowest
            blocks_back([P0, D0])
        checks.check("link-cut: D recomputes, nothing past its deadline, no block held", link_cut)

    # ---- shaped link
    if "shaped-link" in PHASES:
        def shaped():
            tally = Tally("shaped-link")
            done_before, failed_before = loads(D0, "loaded"), loads(D0, "failed")
            shape_link("p0", True)
            shape_link("d0", True)
            try:
                end = time.monotonic() + 6
                lost = join_all(run_clients(pinned.port, specs, range(80), tally, 3, lambda: end, SEED + 2))
            finally:
                shape_link("p0", False)
                shape_link("d0", False)
            counts, bad = tally.counts(refs)
            record("shaped-link", counts, {"shaping": "tbf rate 8mbit burst 32kb latency 30ms, both directions",
                                           "loads_done": loads(D0, "loaded") - done_before,
                                           "loads_failed": loads(D0, "failed") - failed_before})
            assert lost == 0 and counts["ok"] == counts["requests"], bad
            blocks_back([P0, D0])
        checks.check("shaped-link: delay and tail drops between P and D leave every output identical", shaped)

    # ---- sigstop
    if "sigstop" in PHASES:
        def sigstop():
            tally = Tally("sigstop")
            end = time.monotonic() + 13
            threads = run_clients(fleet.port, specs, range(80), tally, 8, lambda: end, SEED + 3)
            time.sleep(1)
            stopped_at = time.monotonic()
            os.kill(D1.proc.pid, signal.SIGSTOP)
            time.sleep(PROXY_TIMEOUT_S + 3)
            os.kill(D1.proc.pid, signal.SIGCONT)
            resumed_at = time.monotonic()
            lost = join_all(threads)
            # A stream D1 had begun cannot move elsewhere: it ends with an error event naming D1.
            counts, bad = tally.counts(refs, lambda s, e, o: s <= resumed_at and e >= stopped_at
                                       and "stream error" in o.detail and D1.url in o.detail)
            wait_until("D1 up again", lambda: all_up(fleet, [D1.url]), 10)
            again = Tally("sigstop-after")
            sequential(fleet, range(20, 30), again)
            record("sigstop", counts, {"stuck": lost, "after": again.counts(refs)[0]})
            assert lost == 0 and counts["wrong"] == 0 and counts["errored"] == 0 and counts["lost"] == 0, bad
            assert again.counts(refs)[0]["ok"] == 10
            blocks_back(list(engines.values()))
        checks.check("sigstop: a stopped D is timed out and routed around; it serves again after SIGCONT", sigstop)

    # ---- park
    if "park" in PHASES:
        def park():
            parker = Proc("proxy-park", ["proxy", "--prefill", P0.url, "--decode", D0.url, "--wake-on-demand",
                                         "--park-idle-after", "1", "--wake-timeout-s", "20", *common])
            try:
                def asleep(e):
                    return json.loads(e.call("GET", "/is_sleeping")[2])["is_sleeping"]
                wait_until("P0 and D0 parked after 1 s without traffic", lambda: asleep(P0) and asleep(D0), 8)
                tally = Tally("park")
                sequential(parker, range(52, 56), tally)
                counts, bad = tally.counts(refs)
                waited = int(tally.rows[0][3].headers.get("x-siesta-wake-wait-ms", "0"))
                _, _, raw = http_exchange("127.0.0.1", parker.port, "GET", "/metrics")
                m = parse_metrics(raw)
                parks = sum(v for k, v in m.items() if k.startswith("siesta_proxy_instance_parks_total"))
                record("park", counts, {"first_wake_wait_ms": waited, "parks": parks})
                assert counts["ok"] == 4, bad
                assert waited > 0, "the first request after the park waited for no wake"
                assert parks >= 2, m
            finally:
                parker.stop()
            for e in (P0, D0):
                assert e.call("POST", "/wake_up", timeout=60)[0] == 200
            wait_until("all up again", lambda: all_up(fleet, [x.url for x in engines.values()]), 10)
            blocks_back([P0, D0])
        checks.check("park: idle engines put to sleep by the proxy, woken by the next request", park)

    # ---- chaos
    if "chaos" in PHASES:
        def chaos():
            tally = Tally("chaos")
            kills = []  # (engine url, killed at, restarted at)
            sleeps = []  # (engine url, put to sleep at, woken at)
            ops = []
            end = time.monotonic() + args.chaos_s
            threads = run_clients(fleet.port, specs, range(80), tally, args.clients, lambda: end, SEED + 4)
            orng = random.Random(SEED + 5)
            while time.monotonic() < end - 3:
                e = orng.choice(list(engines.values()))
                op = orng.choice(["sleep-proxy", "sleep-direct", "kill"])
                ops.append((round(time.monotonic() - (end - args.chaos_s), 2), op, e.name))
                if op == "kill":
                    t0 = time.monotonic()
                    e.kill()
                    time.sleep(orng.uniform(0.5, 2))
                    e.start()
                    kills.append((e.url, t0, time.monotonic()))
                else:
                    t0 = time.monotonic()
                    if op == "sleep-proxy":
                        s, _, body = http_exchange("127.0.0.1", fleet.port, "POST",
                                             f"/sleep?instance={e.url}&level=1&mode=keep", timeout=60)
                    else:
                        s, _, body = e.call("POST", "/sleep?level=1&mode=keep", timeout=60)
                    assert s == 200, (op, e.name, s, body[:300])
                    time.sleep(orng.uniform(0.5, 2.5))
                    s, _, body = e.call("POST", "/wake_up", timeout=60)
                    assert s == 200, ("wake_up", e.name, s, body[:300])
                    sleeps.append((e.url, t0, time.monotonic()))
                wait_until("the fleet up again", lambda: all_up(fleet, [x.url for x in engines.values()]), 15)
                time.sleep(orng.uniform(0.3, 1.5))
            lost = join_all(threads)

            def killed_under(s, e, o):
                # In flight at an engine as it was killed, past the point of a retry (a stream begun, or
                # the proxy's one retry spent on it too): a clear error naming an instance.
                return any(s <= k_end and e >= k_start for _, k_start, k_end in kills) and \
                    ("prefill instance" in o.detail or "decode instance" in o.detail or "stream error" in o.detail)
            def slept_under(s, e, o):
                # A stream a D held through its keep-mode sleep longer than the proxy's --timeout-s: the
                # proxy's idle deadline ends it, with an error naming that D.
                return "stream error" in o.detail and f"no answer within {PROXY_TIMEOUT_S:.1f} s" in o.detail and \
                    any(url in o.detail and s <= w_end and e >= w_start for url, w_start, w_end in sleeps)
            counts, bad = tally.counts(refs, lambda s, e, o: killed_under(s, e, o) or slept_under(s, e, o))
            record("chaos", counts, {"stuck": lost, "operations": len(ops), "kills": len(kills), "ops": ops,
                                     "not_allowed": bad[:20]})
            assert counts["requests"] > 0
            assert lost == 0 and counts["wrong"] == 0 and counts["lost"] == 0 and counts["errored"] == 0, bad
            blocks_back(list(engines.values()))
        checks.check("chaos: sleeps, wakes, kills and restarts of single engines; 0 wrong, every request answered",
                     chaos)
finally:
    for p in proxies:
        p.stop()
    for e in engines.values():
        e.stop()
    if ref:
        ref.stop()
    teardown_hosts()

if args.json:
    commit = subprocess.run(["git", "-C", args.source, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    results.update({"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "commit": commit,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "clients": args.clients, "chaos_s": args.chaos_s})
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
print(f"logs in {tmp}")
checks.finish()
