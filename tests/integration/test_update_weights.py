"""Weights pushed over HTTP into `siesta serve` (POST /update_weights), on the tiny CPU model.

A trainer's weights (another checkpoint of the same shape, from `siesta make-model`) are packed into
host shared memory, a /dev/shm file and a memfd named by /proc/PID/fd/N, and pushed: after a pause,
and as an RL loop does it (sleep level 2, wake_up?tags=weights, push in two chunks, wake_up), in
bfloat16 and float32. Each time the greedy outputs equal those of a fresh `siesta serve` started on
that checkpoint, and the answer counts the tensors and bytes. A push naming an unknown or mis-shaped
tensor, an unknown body field, a CUDA IPC push to the CPU model and a push while serving are refused
(400 / 409, the message naming what is wrong) and the outputs stay what they were; the directory
source reads a checkpoint as reload_weights does.

The weight socket (`--weight-socket PATH`, docs/weight-socket.md): an anonymous memfd passed over the
Unix socket (socket.send_fds, "fd": 0) gives a fresh engine's outputs, with the HTTP route's answer;
one connection sends several requests; a missing, extra or badly indexed descriptor, a truncated
memfd, a pipe, an unknown field, malformed JSON, a packet over the limit and a push while serving are
refused by name (the same JSON as over HTTP) and change nothing; the server's descriptor count and
mappings do not grow over 120 requests; streaming clients see no error and no lost request while
pause, an update over the socket and resume cycle; a path that is no socket, a socket another server
listens on and a missing --enable-sleep-mode are one-line CLI errors, a stale socket file is replaced,
and the file goes when the server does.
"""
import http.client
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import (Checks, completion_outcome, expect_clean_error, http_exchange, parse_args,  # noqa: E402
                              run)

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-update-")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8, 13,"]
WEIGHT_SOCKET = os.path.join(tmp, "weights.sock")
MAX_PACKET = 64 << 10  # --max-request-body-bytes of the server: the socket's packet limit too


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *extra):
        self.port = free_port()
        self.log_path = os.path.join(tmp, f"serve-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([SIESTA, "--log-level", "info", "serve", "--model", model, "--port",
                                      str(self.port), "--threads", "2", "--seed", "1", "--max-model-len", "512",
                                      "--kv-cache-memory-bytes", str(64 << 20), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"siesta serve did not come up:\n{open(self.log_path).read()}")

    def request(self, method, path, body=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            text = r.read()
            return r.status, (json.loads(text) if text else None)
        finally:
            conn.close()

    def admin(self, path, body=None, expect=200):
        status, j = self.request("POST", path, body)
        assert status == expect, (path, status, j)
        return j

    def outputs(self):
        out = []
        for p in PROMPTS:
            status, j = self.request("POST", "/v1/completions", {"prompt": p, "max_tokens": 10, "temperature": 0,
                                                                 "ignore_eos": True, "return_token_ids": True})
            assert status == 200, (status, j)
            out.append(j["choices"][0]["token_ids"])
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.log.close()


def checkpoint_tensors(model_dir):
    """[(name, shape, bf16 bytes)] of a one-file bf16 checkpoint, in file order."""
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
        if name == "__metadata__":
            continue
        assert info["dtype"] == "BF16", info
        b, e = info["data_offsets"]
        out.append((name, info["shape"], data[b:e]))
    return out


def to_f32(bf16):
    """bfloat16 bytes as float32 bytes (little-endian: the bf16 bits are the high half)."""
    out = bytearray(2 * len(bf16))
    out[2::4] = bf16[0::2]
    out[3::4] = bf16[1::2]
    return bytes(out)


def pack(tensors, dtype="bfloat16"):
    """(bytes, tensor descriptions) with each tensor at an offset aligned to 64 bytes."""
    blob = bytearray()
    desc = []
    for name, shape, raw in tensors:
        data = raw if dtype == "bfloat16" else to_f32(raw)
        blob += b"\0" * (-len(blob) % 64)
        desc.append({"name": name, "dtype": dtype, "shape": shape, "offset": len(blob)})
        blob += data
    return bytes(blob), desc


def memfd_of(blob, name="siesta-socket-test"):
    """An anonymous memfd holding blob (no path anyone could open it by)."""
    fd = os.memfd_create(name)
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]
    return fd


def socket_connect(path=WEIGHT_SOCKET):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(60)
    s.connect(path)
    return s


def socket_call(s, body=None, fds=(), raw=None):
    """One request on the weight socket: (status, body) of its answer packet."""
    data = raw if raw is not None else json.dumps(body).encode()
    if fds:
        socket.send_fds(s, [data], list(fds))
    else:
        s.send(data)
    answer = json.loads(s.recv(1 << 20))
    assert set(answer) == {"status", "body"}, answer
    return answer["status"], answer["body"]


def shm_file(blob, name):
    path = f"/dev/shm/siesta-test-{os.getpid()}-{name}"
    with open(path, "wb") as f:
        f.write(blob)
    return path


other = os.path.join(tmp, "other")
rc, _, err = run([SIESTA, "make-model", "--shape", "tiny", "--out", other, "--seed", "77", "--tokenizer",
                  os.path.join(MODEL, "tokenizer.json")])
assert rc == 0, err
theirs_tensors = checkpoint_tensors(other)
ours_tensors = checkpoint_tensors(MODEL)

servers = []
shm_paths = []
try:
    fresh = Server(other)
    servers.append(fresh)
    theirs = fresh.outputs()
    fresh.stop()
    srv = Server(MODEL, "--enable-sleep-mode", "--weight-socket", WEIGHT_SOCKET, "--max-request-body-bytes",
                 str(MAX_PACKET))
    servers.append(srv)
    ours = srv.outputs()
    assert ours != theirs

    blob, desc = pack(theirs_tensors)
    path = shm_file(blob, "theirs")
    shm_paths.append(path)

    def push_after_pause():
        srv.admin("/pause?mode=keep")
        j = srv.admin("/update_weights", {"source": "shm", "path": path, "tensors": desc, "complete": True})
        assert j["updated"] == len(desc), j
        assert j["bytes"] == sum(len(t[2]) for t in theirs_tensors), j
        assert j["seconds"] > 0, j
        assert j["weights_source"] == "shm" and j["weights_loaded"], j
        assert j["call"]["weights_update"]["from"] == path, j
        srv.admin("/resume")
        assert srv.outputs() == theirs
    checks.check("a push from /dev/shm after a pause gives a fresh engine's outputs", push_after_pause)

    def refused_pushes_change_nothing():
        srv.admin("/pause?mode=keep")
        bad = [dict(t) for t in desc]
        bad[1]["shape"] = [7, 7]
        bad.append({"name": "model.layers.99.mlp.up_proj.weight", "dtype": "bfloat16", "shape": [768, 256],
                    "offset": 0})
        status, j = srv.request("POST", "/update_weights", {"source": "shm", "path": path, "tensors": bad})
        assert status == 400, (status, j)
        msg = j["error"]["message"]
        assert bad[1]["name"] in msg and "model.layers.99.mlp.up_proj.weight" in msg and "unchanged" in msg, msg
        status, j = srv.request("POST", "/update_weights", {"source": "shm", "path": path, "tensors": desc,
                                                             "wait": True})
        assert status == 400 and "unknown field 'wait'" in j["error"]["message"], (status, j)
        status, j = srv.request("POST", "/update_weights", {"source": "cuda_ipc", "tensors": desc,
                                                             "buffers": [{"handle": "A" * 86 + "==", "bytes": 1}]})
        assert status == 400 and "--device cuda" in j["error"]["message"], (status, j)
        status, j = srv.request("POST", "/update_weights", raw=b"{not json")
        assert status == 400, (status, j)
        srv.admin("/resume")
        status, j = srv.request("POST", "/update_weights", {"source": "shm", "path": path, "tensors": desc})
        assert status == 409 and "pause" in j["error"]["message"], (status, j)
        assert srv.outputs() == theirs
    checks.check("refused pushes (400, 409) name the problem and change nothing", refused_pushes_change_nothing)

    def rl_cycle_in_two_chunks_over_a_memfd():
        # Back to our own weights, the way an RL trainer pushes: level 2, weights only, push, wake.
        blob32, desc32 = pack(ours_tensors, "float32")
        fd = os.memfd_create("siesta-test-weights")
        try:
            os.write(fd, blob32)
            memfd = f"/proc/{os.getpid()}/fd/{fd}"
            j = srv.admin("/sleep?level=2&verbose=true")
            assert j["state"] == "sleeping_level_2", j
            j = srv.admin("/wake_up?tags=weights&verbose=true")
            assert j["not_resident_tags"] == ["kv_cache", "scratch"], j
            half = len(desc32) // 2
            j = srv.admin("/update_weights", {"source": "shm", "path": memfd, "tensors": desc32[:half]})
            assert j["updated"] == half and not j["weights_loaded"], j
            status, j = srv.request("POST", "/wake_up")
            assert status == 409 and "incomplete" in j["error"]["message"], (status, j)
            j = srv.admin("/update_weights", {"source": "shm", "path": memfd, "tensors": desc32[half:]})
            assert j["weights_loaded"] and j["weights_unwritten"] == 0, j
            j = srv.admin("/wake_up?verbose=true")
            assert j["state"] == "running", j
        finally:
            os.close(fd)
        assert srv.outputs() == ours
    checks.check("sleep 2, wake weights, a float32 push in two chunks over a memfd, wake: our outputs again",
                 rl_cycle_in_two_chunks_over_a_memfd)

    def dir_source():
        srv.admin("/pause?mode=keep")
        j = srv.admin("/update_weights", {"source": "dir", "path": other})
        assert j["updated"] == len(desc) and j["weights_dir"] == other and j["weights_source"] == "dir", j
        srv.admin("/resume")
        assert srv.outputs() == theirs
        srv.admin("/pause?mode=keep")
        srv.admin("/update_weights", {"weights_path": MODEL})
        srv.admin("/resume")
        assert srv.outputs() == ours
    checks.check("the dir source (and vLLM's weights_path) reads a checkpoint", dir_source)

    ours_blob, ours_desc = pack(ours_tensors)

    def push_a_memfd_over_the_socket():
        st = os.lstat(WEIGHT_SOCKET)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        theirs_fd, ours_fd = memfd_of(blob), memfd_of(ours_blob)
        try:
            srv.admin("/pause?mode=keep")
            with socket_connect() as s:
                status, j = socket_call(s, {"source": "shm", "fd": 0, "tensors": desc, "complete": True}, [theirs_fd])
                assert status == 200, (status, j)
                assert j["updated"] == len(desc), j
                assert j["bytes"] == sum(len(t[2]) for t in theirs_tensors), j
                assert j["seconds"] > 0 and j["weights_source"] == "shm" and j["weights_loaded"], j
                assert j["call"]["weights_update"]["from"] == "fd 0 of the weight socket", j
                assert j["state"] == "paused", j
                srv.admin("/resume")
                assert srv.outputs() == theirs
                # The same connection, a second request: back to our weights, in float32 and two chunks.
                blob32, desc32 = pack(ours_tensors, "float32")
                fd32 = memfd_of(blob32)
                try:
                    srv.admin("/pause?mode=keep")
                    half = len(desc32) // 2
                    for part in (desc32[:half], desc32[half:]):
                        status, j = socket_call(s, {"source": "shm", "fd": 0, "tensors": part}, [fd32])
                        assert status == 200 and j["updated"] == len(part), (status, j)
                    srv.admin("/resume")
                finally:
                    os.close(fd32)
            assert srv.outputs() == ours
        finally:
            os.close(theirs_fd)
            os.close(ours_fd)
    checks.check("a memfd passed over the weight socket gives a fresh engine's outputs (several requests on one "
                 "connection)", push_a_memfd_over_the_socket)

    def socket_refusals_name_the_problem_and_change_nothing():
        full = memfd_of(blob)
        short = memfd_of(blob[:len(blob) // 2])
        r, w = os.pipe()
        body = {"source": "shm", "fd": 0, "tensors": desc, "complete": True}
        try:
            srv.admin("/pause?mode=keep")
            with socket_connect() as s:
                def refused(status_expected, needle, b=None, fds=(), raw=None):
                    status, j = socket_call(s, b, fds, raw)
                    assert status == status_expected, (status, j)
                    msg = j["error"]["message"]
                    assert needle in msg, (needle, msg)
                    assert j["error"]["type"] == "invalid_request_error", j
                    return j
                refused(400, "carried no descriptor", body)                               # missing fd
                refused(400, "carried 2 descriptors, but the body names one", body, [full, full])  # extra fd
                refused(400, "but the body names none", {**{k: v for k, v in body.items() if k != "fd"},
                                                         "path": path}, [full])
                refused(400, "'fd' is 1, but the packet carried 1 descriptor", {**body, "fd": 1}, [full])
                j = refused(400, "past the end of their source", body, [short])           # truncated memfd
                assert "unchanged" in j["error"]["message"], j
                refused(400, "not a regular file", body, [r])                              # a pipe
                refused(400, "unknown field 'wait'", {**body, "wait": True}, [full])
                refused(400, "not valid JSON", raw=b"{not json", fds=[full])
                refused(400, "'path' or 'fd', not both", {**body, "path": path}, [full])
                j = refused(413, f"larger than the limit of {MAX_PACKET} bytes", raw=b" " * (MAX_PACKET + 1),
                            fds=[full])
                assert j["error"]["code"] == "request_too_large", j
                # The same JSON as the HTTP route answers for the same body.
                bad = {"source": "shm", "path": path, "tensors": desc, "wait": True}
                over_http = srv.request("POST", "/update_weights", bad)
                assert socket_call(s, bad) == over_http, (socket_call(s, bad), over_http)
                srv.admin("/resume")
                status, j = socket_call(s, body, [full])                                   # not paused
                assert status == 409 and "pause" in j["error"]["message"], (status, j)
                assert socket_call(s, {**body, "fd": None, "path": path}) == srv.request(
                    "POST", "/update_weights", {**body, "fd": None, "path": path})
            # Over HTTP "fd" is refused, pointing at the socket.
            status, j = srv.request("POST", "/update_weights", body)
            assert status == 400 and "--weight-socket" in j["error"]["message"], (status, j)
            assert srv.outputs() == ours
        finally:
            for fd in (full, short, r, w):
                os.close(fd)
    checks.check("refusals over the socket (missing, extra and bad descriptors, a truncated memfd, a pipe, unknown "
                 "fields, too large, not paused) name the problem and change nothing",
                 socket_refusals_name_the_problem_and_change_nothing)

    def server_descriptors_do_not_grow():
        def fds():
            return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))

        def memfd_maps():
            with open(f"/proc/{srv.proc.pid}/maps") as f:
                return [line for line in f if "siesta-socket-test" in line]
        ours_fd = memfd_of(ours_blob)
        short = memfd_of(ours_blob[:1000])
        try:
            srv.admin("/pause?mode=keep")
            time.sleep(0.2)
            before = fds()
            body = {"source": "shm", "fd": 0, "tensors": ours_desc, "complete": True}
            with socket_connect() as s:
                for i in range(40):
                    assert socket_call(s, body, [ours_fd])[0] == 200
                    assert socket_call(s, body, [short])[0] == 400
                    assert socket_call(s, body, [ours_fd, ours_fd])[0] == 400
            for i in range(40):  # a connection each, some left without reading their answer
                with socket_connect() as s:
                    if i % 2:
                        assert socket_call(s, body, [ours_fd])[0] == 200
                    else:
                        socket.send_fds(s, [json.dumps(body).encode()], [ours_fd])
            with socket_connect() as s:
                assert socket_call(s, body, [ours_fd])[0] == 200  # after every earlier request
            end = time.monotonic() + 10
            while fds() > before and time.monotonic() < end:
                time.sleep(0.05)
            after = fds()
            print(f"  server descriptors: {before} before 161 requests over the socket, {after} after", flush=True)
            assert after <= before, (before, after)
            assert not memfd_maps(), memfd_maps()
            srv.admin("/resume")
            assert srv.outputs() == ours
        finally:
            os.close(ours_fd)
            os.close(short)
    checks.check("the server's descriptors and mappings do not grow across 161 socket requests",
                 server_descriptors_do_not_grow)

    def streams_flow_while_pause_socket_update_resume_cycle():
        theirs_fd, ours_fd = memfd_of(blob), memfd_of(ours_blob)
        stop = threading.Event()
        lock = threading.Lock()
        outcomes = []  # (kind, detail): "done" | "error" | "lost"
        streaming = threading.Event()
        kept = []  # requests the engine held at each pause

        def client(i):
            n = 0
            while not stop.is_set():
                body = {"prompt": f"Client {i} asks: {PROMPTS[(i + n) % len(PROMPTS)]}", "max_tokens": 24,
                        "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
                try:
                    status, _, raw = http_exchange("127.0.0.1", srv.port, "POST", "/v1/completions", body,
                                                   timeout=60)
                    kind, detail, _ = completion_outcome(status, raw, True)
                except (socket.timeout, TimeoutError):
                    kind, detail = "lost", "no answer within 60 s"
                except (OSError, http.client.HTTPException) as e:
                    kind, detail = "error", f"{type(e).__name__}: {e}"
                with lock:
                    outcomes.append((kind, detail))
                streaming.set()
                n += 1
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        try:
            assert streaming.wait(60), "no completion finished within 60 s"
            with socket_connect() as s:
                for cycle, (fd, d) in enumerate([(theirs_fd, desc), (ours_fd, ours_desc)] * 2):
                    time.sleep(0.4)  # streams under way
                    j = srv.admin("/pause?mode=keep&verbose=true")
                    kept.append(j["requests"]["running"] + j["requests"]["waiting"])
                    status, j = socket_call(s, {"source": "shm", "fd": 0, "tensors": d, "complete": True}, [fd])
                    assert status == 200 and j["updated"] == len(d), (cycle, status, j)
                    srv.admin("/resume")
            time.sleep(0.4)
        finally:
            stop.set()
            for t in threads:
                t.join(90)
            os.close(theirs_fd)
            os.close(ours_fd)
        stuck = sum(t.is_alive() for t in threads)
        counts = {k: sum(1 for o in outcomes if o[0] == k) for k in ("done", "error", "lost")}
        print(f"  6 streaming clients through 4 pause / socket update / resume cycles: {counts}, {stuck} stuck; "
              f"requests kept at each pause {kept}", flush=True)
        bad = [o for o in outcomes if o[0] != "done"]
        assert stuck == 0 and counts["error"] == 0 and counts["lost"] == 0, bad[:5]
        assert sum(kept) > 0, kept  # the updates came while requests were in flight
        assert counts["done"] >= 6, counts
        assert srv.outputs() == ours
    checks.check("streaming clients see no error and no lost request while pause, socket update and resume cycle",
                 streams_flow_while_pause_socket_update_resume_cycle)

    def socket_flags_fail_in_one_line():
        base = [SIESTA, "serve", "--model", MODEL, "--port", "0", "--threads", "1", "--kv-cache-memory-bytes",
                str(16 << 20)]
        plain = os.path.join(tmp, "plain-file")
        with open(plain, "w") as f:
            f.write("not a socket")
        rc, _, err = run(base + ["--enable-sleep-mode", "--weight-socket", plain], timeout=60)
        expect_clean_error(rc, err, "exists and is not a socket")
        assert open(plain).read() == "not a socket"
        rc, _, err = run(base + ["--enable-sleep-mode", "--weight-socket", WEIGHT_SOCKET], timeout=60)
        expect_clean_error(rc, err, "another process listens on the socket")
        assert stat.S_ISSOCK(os.lstat(WEIGHT_SOCKET).st_mode)  # the running server's socket is left alone
        with socket_connect() as s:
            assert socket_call(s, {"source": "dir"})[0] == 409  # still answering: running, not paused
        rc, _, err = run(base + ["--weight-socket", os.path.join(tmp, "w2.sock")], timeout=60)
        expect_clean_error(rc, err, "--enable-sleep-mode")
    checks.check("--weight-socket: a non-socket, a live socket and no sleep mode are one-line CLI errors",
                 socket_flags_fail_in_one_line)

    def the_socket_file_goes_with_the_server_and_a_stale_one_is_replaced():
        stale = os.path.join(tmp, "stale.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(stale)  # bound, never listened on, never removed: what a killed server leaves
        s.close()
        other_srv = Server(MODEL, "--enable-sleep-mode", "--weight-socket", stale)
        servers.append(other_srv)
        with socket_connect(stale) as c:
            status, j = socket_call(c, {"source": "dir"})
            assert status == 409 and "pause" in j["error"]["message"], (status, j)
            other_srv.stop()
        assert other_srv.proc.returncode == 0, other_srv.proc.returncode
        assert not os.path.lexists(stale), "the socket file outlived its server"
    checks.check("a stale socket file is replaced, and the file goes when the server stops",
                 the_socket_file_goes_with_the_server_and_a_stale_one_is_replaced)
finally:
    for s in servers:
        s.stop()
    for p in shm_paths:
        os.unlink(p)
    shutil.rmtree(tmp, ignore_errors=True)
checks.finish()
