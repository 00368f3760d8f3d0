"""Baseline: Hugging Face transformers serving a Qwen3-0.6B-shaped model (random weights) on one GPU.

Adapted from the shared hf_baseline.py: the same measurements (eager `generate`, prompt 128, output 128,
at batch 1, 32 and 128; prefill latency), printed and written as JSON to argv[1] when given.
"""
import json
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
torch.manual_seed(0)
with torch.device("cuda"):
    m = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
result = {"params_billion": sum(p.numel() for p in m.parameters()) / 1e9, "transformers_generate": {}, "prefill_ms": {}}


def run(bs, plen, new):
    x = torch.randint(0, 150000, (bs, plen), device="cuda")
    m.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.time()
    m.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    t = time.time() - t0
    result["transformers_generate"][str(bs)] = bs * new / t
    print(f"hf generate bs={bs} prompt={plen} new={new}: {t:.2f}s  {bs * new / t:.0f} tok/s", flush=True)


for bs in (1, 8, 32, 128):
    run(bs, 128, 128)
with torch.no_grad():
    for n in (512, 4096):
        x = torch.randint(0, 150000, (1, n), device="cuda")
        m(x)
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(5):
            m(x)
        torch.cuda.synchronize()
        result["prefill_ms"][str(n)] = (time.time() - t0) / 5 * 1000
        print(f"hf prefill {n} tokens: {result['prefill_ms'][str(n)]:.1f} ms", flush=True)
result["torch"] = torch.__version__
import transformers  # noqa: E402

result["transformers"] = transformers.__version__
if len(sys.argv) > 1:
    json.dump(result, open(sys.argv[1], "w"), indent=1)
