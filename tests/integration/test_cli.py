"""The siesta CLI against Hugging Face's golden outputs, and its handling of bad input."""
import json
import os
import shutil
import tempfile

from siesta_test_util import Checks, expect_clean_error, parse_args, read_safetensors, run

args = parse_args()
SIESTA = args.siesta
MODEL = os.path.join(args.source, "models", "tiny-qwen3")
GOLDEN = os.path.join(args.source, "tests", "data", "golden")
golden = json.load(open(os.path.join(GOLDEN, "tiny-qwen3_golden.json")))
prompts = golden["prompts"]
checks = Checks()
tmp = tempfile.mkdtemp(prefix="siesta-cli-")


def tokenize_matches_hf():
    for p in prompts + [{"text": c["text"], "input_ids": c["input_ids"]} for c in golden["tokenizer_cases"]]:
        rc, out, err = run([SIESTA, "tokenize", "--model", MODEL, "--json", p["text"]])
        assert rc == 0, err
        assert json.loads(out)["ids"] == p["input_ids"], (p["text"], out)


def tokenize_reads_stdin():
    rc, out, err = run([SIESTA, "tokenize", "--model", MODEL, "-"], input=prompts[0]["text"])
    assert rc == 0, err
    assert [int(x) for x in out.split()] == prompts[0]["input_ids"]


def generate_matches_hf_greedy():
    full = 0
    for p in prompts:
        rc, out, err = run([SIESTA, "generate", "--model", MODEL, "--prompt", p["text"], "--max-tokens", "24",
                            "--ignore-eos", "--json"])
        assert rc == 0, err
        res = json.loads(out)
        assert res["prompt_ids"] == p["input_ids"]
        assert res["token_ids"][:8] == p["greedy_24"][:8], (p["text"], res["token_ids"], p["greedy_24"])
        full += res["token_ids"] == p["greedy_24"]
    assert full >= 7, f"only {full} of 8 prompts reproduce all 24 greedy tokens"


def generate_from_ids_equals_from_text():
    p = prompts[2]
    ids = ",".join(str(i) for i in p["input_ids"])
    rc, a, err = run([SIESTA, "generate", "--model", MODEL, "--prompt-ids", ids, "--max-tokens", "12", "--json"])
    assert rc == 0, err
    rc, b, err = run([SIESTA, "generate", "--model", MODEL, "--prompt", p["text"], "--max-tokens", "12", "--json"])
    assert rc == 0, err
    assert json.loads(a) == json.loads(b)


def dump_logits_matches_hf():
    ref = read_safetensors(os.path.join(GOLDEN, "tiny-qwen3_logits.safetensors"))
    for i, p in enumerate(prompts):
        path = os.path.join(tmp, f"logits_{i}.safetensors")
        rc, _, err = run([SIESTA, "generate", "--model", MODEL, "--prompt", p["text"], "--max-tokens", "1",
                          "--dump-logits", path])
        assert rc == 0, err
        ours = read_safetensors(path)
        assert list(ours.keys()) == ["logits"], ours.keys()
        dtype, shape, a = ours["logits"]
        _, rshape, b = ref[f"logits_{i}"]
        assert dtype == "F32" and shape == rshape, (shape, rshape)
        vocab = shape[1]
        for pos in range(shape[0]):
            row_a = a[pos * vocab:(pos + 1) * vocab]
            row_b = b[pos * vocab:(pos + 1) * vocab]
            max_ref = max(abs(x) for x in row_b)
            max_diff = max(abs(x - y) for x, y in zip(row_a, row_b))
            assert max_diff / max_ref <= 1e-3, (i, pos, max_diff / max_ref)


def seeded_sampling_is_reproducible():
    cmd = [SIESTA, "generate", "--model", MODEL, "--prompt", prompts[0]["text"], "--max-tokens", "16",
           "--temperature", "0.8", "--top-p", "0.95", "--top-k", "50", "--ignore-eos", "--json"]
    rc, a, err = run(cmd + ["--seed", "7"])
    assert rc == 0, err
    rc, b, _ = run(cmd + ["--seed", "7"])
    rc, c, _ = run(cmd + ["--seed", "8"])
    assert json.loads(a)["token_ids"] == json.loads(b)["token_ids"]
    assert json.loads(a)["token_ids"] != json.loads(c)["token_ids"]
    assert len(json.loads(a)["token_ids"]) == 16


def copy_model(name):
    d = os.path.join(tmp, name)
    shutil.copytree(MODEL, d)
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o644)
    return d


def corrupt_safetensors_is_one_line_error():
    d = copy_model("truncated")
    path = os.path.join(d, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    rc, _, err = run([SIESTA, "generate", "--model", d, "--prompt", "hi", "--max-tokens", "2"])
    expect_clean_error(rc, err, "model.safetensors")
    with open(path, "wb") as f:
        f.write(b"\xff" * 8 + b"{not json")
    rc, _, err = run([SIESTA, "generate", "--model", d, "--prompt", "hi", "--max-tokens", "2"])
    expect_clean_error(rc, err, "model.safetensors")


def config_missing_field_is_one_line_error():
    d = copy_model("noconfig")
    cfg = json.load(open(os.path.join(d, "config.json")))
    del cfg["hidden_size"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    rc, _, err = run([SIESTA, "generate", "--model", d, "--prompt", "hi", "--max-tokens", "2"])
    expect_clean_error(rc, err, "hidden_size")


def prompt_id_out_of_vocab_is_one_line_error():
    rc, _, err = run([SIESTA, "generate", "--model", MODEL, "--prompt-ids", "1,2,4096", "--max-tokens", "2"])
    expect_clean_error(rc, err, "4096")
    rc, _, err = run([SIESTA, "generate", "--model", MODEL, "--prompt-ids", "1,x", "--max-tokens", "2"])
    expect_clean_error(rc, err, "prompt-ids")


def missing_model_dir_is_one_line_error():
    rc, _, err = run([SIESTA, "generate", "--model", os.path.join(tmp, "nope"), "--prompt", "hi", "--max-tokens", "2"])
    expect_clean_error(rc, err, "nope")
    rc, _, err = run([SIESTA, "tokenize", "--model", os.path.join(tmp, "nope"), "hi"])
    expect_clean_error(rc, err, "nope")


def make_model_tiny_generates():
    out = os.path.join(tmp, "made")
    rc, _, err = run([SIESTA, "make-model", "--shape", "tiny", "--out", out, "--seed", "3",
                      "--tokenizer", os.path.join(MODEL, "tokenizer.json")])
    assert rc == 0, err
    rc, a, err = run([SIESTA, "generate", "--model", out, "--prompt", "hello", "--max-tokens", "8", "--ignore-eos",
                      "--json"])
    assert rc == 0, err
    assert len(json.loads(a)["token_ids"]) == 8
    # --layers: fewer decoder layers of the same widths; a non-positive count is a one-line error.
    two = os.path.join(tmp, "made2")
    rc, _, err = run([SIESTA, "make-model", "--shape", "tiny", "--out", two, "--layers", "2",
                      "--tokenizer", os.path.join(MODEL, "tokenizer.json")])
    assert rc == 0, err
    with open(os.path.join(two, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 2
    rc, a, err = run([SIESTA, "generate", "--model", two, "--prompt", "hello", "--max-tokens", "4", "--ignore-eos",
                      "--json"])
    assert rc == 0, err
    rc, _, err = run([SIESTA, "make-model", "--shape", "tiny", "--out", os.path.join(tmp, "made0"), "--layers", "0"])
    expect_clean_error(rc, err, "--layers")


def gpu_present():
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def device_cuda_without_gpu_is_one_line_error():
    if gpu_present():
        return  # the GPU machine runs the CUDA engine instead (cuda_engine_test)
    rc, _, err = run([SIESTA, "generate", "--model", MODEL, "--prompt", "hi", "--max-tokens", "2", "--device", "cuda"])
    expect_clean_error(rc, err, "--device cuda")
    rc, _, err = run([SIESTA, "serve", "--model", MODEL, "--port", "0", "--device", "cuda"], timeout=60)
    expect_clean_error(rc, err, "--device cuda")


def device_flags_are_checked():
    gen = [SIESTA, "generate", "--model", MODEL, "--prompt", "hi", "--max-tokens", "2"]
    rc, _, err = run(gen + ["--device", "cuda:x"])
    expect_clean_error(rc, err, "--device")
    assert rc == 2, f"a bad --device ordinal is a usage error (exit 2), got {rc}"
    rc, _, err = run(gen + ["--device", "tpu"])
    expect_clean_error(rc, err, "--device")
    assert rc == 2, f"a bad --device is a usage error (exit 2), got {rc}"
    for bad in ("0", "1.5", "-0.2"):
        rc, _, err = run(gen + ["--device", "cuda", "--gpu-memory-utilization", bad])
        expect_clean_error(rc, err, "--gpu-memory-utilization")
    rc, _, err = run(gen + ["--gpu-memory-utilization", "0.5"])
    expect_clean_error(rc, err, "applies to --device cuda only")
    rc, _, err = run([SIESTA, "serve", "--model", MODEL, "--port", "0", "--gpu-memory-utilization", "0.5"], timeout=60)
    expect_clean_error(rc, err, "applies to --device cuda only")
    rc, _, err = run(gen + ["--kv-cache-memory-bytes", "1K"])
    expect_clean_error(rc, err, "--kv-cache-memory-bytes allows")
    rc, _, err = run(gen + ["--kv-cache-memory-bytes", "lots"])
    expect_clean_error(rc, err, "--kv-cache-memory-bytes")


def cpu_flags_keep_the_cpu_output():
    p = prompts[1]
    base = [SIESTA, "generate", "--model", MODEL, "--prompt", p["text"], "--max-tokens", "12", "--ignore-eos", "--json"]
    rc, a, err = run(base)
    assert rc == 0, err
    rc, b, err = run(base + ["--device", "cpu", "--batch-invariant", "--kv-cache-memory-bytes", "64M"])
    assert rc == 0, err
    assert json.loads(a) == json.loads(b)
    # The CPU model has one (batch-invariant) path: --no-batch-invariant, which allows results that vary
    # with the batch, keeps it.
    rc, c, err = run(base + ["--device", "cpu", "--no-batch-invariant"])
    assert rc == 0, err
    assert json.loads(a) == json.loads(c)


def tensor_parallel_keeps_the_output():
    p = prompts[3]
    base = [SIESTA, "generate", "--model", MODEL, "--prompt", p["text"], "--max-tokens", "12", "--ignore-eos", "--json",
            "--dump-logits"]
    outs = []
    for i, tp in enumerate((["--tensor-parallel-size", "1"], ["--tensor-parallel-size", "2"], ["-tp", "4"],
                            ["-tp=2"])):
        path = os.path.join(tmp, f"tp_logits_{i}.safetensors")
        rc, out, err = run(base + [path] + tp)
        assert rc == 0, (tp, err)
        with open(path, "rb") as f:
            outs.append((json.loads(out), f.read()))
    for o in outs[1:]:
        assert o[0] == outs[0][0]
        assert o[1] == outs[0][1], "prompt logits differ from tensor parallel size 1"


def tensor_parallel_sizes_are_checked():
    gen = [SIESTA, "generate", "--model", MODEL, "--prompt", "hi", "--max-tokens", "2"]
    rc, _, err = run(gen + ["--tensor-parallel-size", "3"])
    expect_clean_error(rc, err, "does not divide the 4 attention heads")
    rc, _, err = run(gen + ["-tp", "0"])
    expect_clean_error(rc, err, "--tensor-parallel-size must be at least 1, got 0")
    rc, _, err = run(gen + ["--tensor-parallel-size=-1"])
    expect_clean_error(rc, err, "--tensor-parallel-size must be at least 1, got -1")
    rc, _, err = run(gen + ["--device", "cuda", "-tp", "2"])
    expect_clean_error(rc, err, "tensor parallelism on CUDA is not built yet")
    rc, _, err = run([SIESTA, "serve", "--model", MODEL, "--port", "0", "--tensor-parallel-size", "3"], timeout=60)
    expect_clean_error(rc, err, "does not divide the 4 attention heads")


for fn in (tokenize_matches_hf, tokenize_reads_stdin, generate_matches_hf_greedy, generate_from_ids_equals_from_text,
           dump_logits_matches_hf, seeded_sampling_is_reproducible, corrupt_safetensors_is_one_line_error,
           config_missing_field_is_one_line_error, prompt_id_out_of_vocab_is_one_line_error,
           missing_model_dir_is_one_line_error, make_model_tiny_generates, device_cuda_without_gpu_is_one_line_error,
           device_flags_are_checked, cpu_flags_keep_the_cpu_output, tensor_parallel_keeps_the_output,
           tensor_parallel_sizes_are_checked):
    checks.check(fn.__name__, fn)
shutil.rmtree(tmp, ignore_errors=True)
checks.finish()
