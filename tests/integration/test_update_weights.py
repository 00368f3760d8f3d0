"""Weights pushed over HTTP into `siesta serve` (POST /update_weights), on the tiny CPU model.

A trainer's weights (another checkpoint of the same shape, from `siesta make-model`) are packed into
host shared memory, a /dev/shm file and a memfd named by /proc/PID/fd/N, and pushed: after a pause,
and as an RL loop does it (sleep level 2, wake_up?tags=weights, push in two chunks, wake_up), in
bfloat16 and float32. Each time the greedy outputs equal those of a fresh `siesta serve` started on
that checkpoint, and the answer counts the tensors and bytes. A push naming an unknown or mis-shaped
tensor, an unknown body field, a CUDA IPC push to the CPU model and a push while serving are refused
(400 / 409, the message naming what is wrong) and the outputs stay what they were; the directory
source reads a checkpoint as reload_weights does.
"""
import http.client
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from siesta_test_util import Checks, parse_args, run  # noqa: E402

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-update-")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8, 13,"]


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
    srv = Server(MODEL, "--enable-sleep-mode")
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
finally:
    for s in servers:
        s.stop()
    for p in shm_paths:
        os.unlink(p)
    shutil.rmtree(tmp, ignore_errors=True)
checks.finish()
