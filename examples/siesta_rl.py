"""What an RL trainer needs to drive siesta from Python: `siesta serve` (and `siesta proxy`) as
processes, its admin calls over HTTP, greedy rollouts, and weights pushed over CUDA IPC.

Pushing over CUDA IPC (POST /update_weights, "source": "cuda_ipc"): the trainer copies its
parameters into one flat bf16 buffer on the GPU (pack_params), takes the buffer's
cudaIpcMemHandle_t from the CUDA driver (cuIpcGetMemHandle of the allocation that holds it; the
buffer's offset in that allocation is its "offset") and sends the handle, base64, with every
tensor's name, dtype, shape and byte offset. siesta opens the handle in its own CUDA context,
copies device to device and closes it before it answers, so the trainer may free or reuse the
buffer as soon as the call returns. No PyTorch ref-counted sharing is involved
(torch.multiprocessing's would keep the block alive waiting for a consumer that never
decrements its counter).

Standard library only at import; torch is imported by the functions that need it.
"""
import base64
import ctypes
import http.client
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Process:
    """A siesta subprocess (serve or proxy) on a port it picks; its log in `logs`."""

    def __init__(self, siesta, name, argv, logs, log_level="info", timeout_s=600):
        self.name = name
        self.log_path = os.path.join(logs, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([siesta, "--log-level", log_level, *argv], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.port = None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.port is None and self.proc.poll() is None:
            m = re.search(r"listening on http://[0-9.]+:(\d+)", open(self.log_path).read())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.1)
        if self.port is None:
            tail = open(self.log_path).read()[-3000:]
            self.stop()
            raise RuntimeError(f"{name} did not start:\n{tail}")

    def request(self, method, path, body=None, timeout=600):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
        finally:
            conn.close()

    def admin(self, path, body=None):
        """POST an admin call; (answer, client seconds). Fails loudly on anything but 200."""
        # siesta's whole status in the answer (vLLM's bodies otherwise: empty for /sleep and /wake_up).
        if "verbose=" not in path:
            path += ("&" if "?" in path else "?") + "verbose=true"
        t0 = time.monotonic()
        status, j = self.request("POST", path, body)
        dt = time.monotonic() - t0
        if status != 200:
            raise RuntimeError(f"{self.name}: POST {path}: HTTP {status}: {j}")
        return j, dt

    def tail(self, lines=30):
        return "\n".join(open(self.log_path).read().splitlines()[-lines:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def serve(siesta, name, model, logs, *extra):
    return Process(siesta, name, ["serve", "--model", model, "--port", "0", "--seed", "0", *extra], logs)


def pd_config(role, key_file):
    """The --kv-transfer-config of a P/D engine: ipc, write mode, the side channel's shared key in `key_file`."""
    return json.dumps({"kv_connector": "SiestaConnector", "kv_role": role,
                       "kv_connector_extra_config": {"backend": "ipc", "mode": "write", "auth_key_file": key_file}})


def side_channel_key_file(folder):
    """A fresh shared secret for a P/D pair's side channel, in a file only this user reads."""
    path = os.path.join(folder, "side_channel.key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    return path


def rollout(server, prompts, max_tokens):
    """Greedy completions of each prompt (token ids), one request at a time so that batching cannot
    change a token; (token ids per prompt, seconds)."""
    t0 = time.monotonic()
    out = []
    for p in prompts:
        status, j = server.request("POST", "/v1/completions", {"prompt": p, "max_tokens": max_tokens,
                                                                "temperature": 0, "ignore_eos": True,
                                                                "return_token_ids": True})
        if status != 200:
            raise RuntimeError(f"{server.name}: completion: HTTP {status}: {j}")
        out.append(j["choices"][0]["token_ids"])
    return out, time.monotonic() - t0


# ---- CUDA IPC through the driver API (libcuda, loaded by torch already) ----

class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _driver():
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.c_uint64]
    cuda.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
    return cuda


def ipc_buffer(ptr, nbytes):
    """The /update_weights buffer of device memory [ptr, ptr + nbytes) of this process: the
    handle of the allocation that holds it, and its offset there."""
    cuda = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    r = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if r != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed: CUDA error {r}")
    h = _IpcHandle()
    r = cuda.cuIpcGetMemHandle(ctypes.byref(h), base)
    if r != 0:
        raise RuntimeError(f"cuIpcGetMemHandle failed: CUDA error {r} (memory of PYTORCH_CUDA_ALLOC_CONF="
                           "expandable_segments cannot be shared this way)")
    assert ptr + nbytes <= base.value + size.value
    # All 64 bytes of the handle (the field's value would stop at its first zero byte).
    raw = ctypes.string_at(ctypes.addressof(h), ctypes.sizeof(h))
    return {"handle": base64.b64encode(raw).decode(), "offset": ptr - base.value, "bytes": nbytes}


def pack_params(named, flat=None, align=256):
    """Copies (name, tensor) pairs (bf16 on the GPU) into one flat uint8 buffer, each at an offset
    aligned to `align`; returns (flat, tensor descriptions for /update_weights). `flat` is reused
    when given and large enough."""
    import torch
    layout, at = [], 0
    for name, t in named:
        at = (at + align - 1) // align * align
        layout.append((name, t, at))
        at += t.numel() * t.element_size()
    if flat is None or flat.numel() < at:
        flat = torch.empty(at, dtype=torch.uint8, device="cuda")
    tensors = []
    dtype_names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    for name, t, off in layout:
        n = t.numel() * t.element_size()
        flat[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach())
        tensors.append({"name": name, "dtype": dtype_names[t.dtype], "shape": list(t.shape), "buffer": 0,
                        "offset": off})
    return flat, tensors


def push_body(flat, tensors, complete=True):
    """The /update_weights body for a packed flat buffer (pack_params); the caller synchronises the
    device first (torch.cuda.synchronize)."""
    return {"source": "cuda_ipc", "buffers": [ipc_buffer(flat.data_ptr(), flat.numel())], "tensors": tensors,
            "complete": complete}


def commit():
    c = os.environ.get("SIESTA_COMMIT")
    if c:
        return c
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def machine():
    import platform
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return {"host": platform.node(), "cpu": platform.processor(), "cores": os.cpu_count(), "gpu": gpu,
            "python": sys.version.split()[0]}
