"""A random Qwen3-0.6B-shaped checkpoint made with transformers (device-check's fallback when the
siesta binary has no make-model): HF's own init (std 0.02, norms 1), bf16, save_pretrained.
  python3 make_qwen3.py OUT_DIR [--seed S]
"""
import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--seed", type=int, default=1)
a = ap.parse_args()
torch.manual_seed(a.seed)
cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
with torch.device("cuda"):
    m = Qwen3ForCausalLM(cfg)
m.to(torch.bfloat16).save_pretrained(a.out, safe_serialization=True)
print("make_qwen3:", a.out, sum(p.numel() for p in m.parameters()) / 1e9, "B parameters")
