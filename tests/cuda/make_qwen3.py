"""A random Qwen3 checkpoint made with transformers, bf16, save_pretrained. By default Qwen3-0.6B's
shape with HF's own init (std 0.02, norms 1): device-check's fallback when the siesta binary has no
make-model. The shape options make others (device-check's model of another shape: GQA group 5,
untied embeddings); --std widens the init so that logits are not all near-ties.
  python3 make_qwen3.py OUT_DIR [--seed S] [--layers N --hidden H --inter I --heads Q --kv-heads K
                                 --head-dim D --vocab V --untied --std S]
"""
import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--layers", type=int, default=28)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--inter", type=int, default=3072)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--head-dim", type=int, default=128)
ap.add_argument("--vocab", type=int, default=151936)
ap.add_argument("--untied", action="store_true")
ap.add_argument("--std", type=float, default=0.0, help="weights ~ N(0, std), norms ~ 1 + N(0, 0.1); 0: HF's init")
a = ap.parse_args()
torch.manual_seed(a.seed)
cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=not a.untied, bos_token_id=min(151643, a.vocab - 2),
                  eos_token_id=min(151645, a.vocab - 1))
with torch.device("cuda"):
    m = Qwen3ForCausalLM(cfg)
if a.std > 0:
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, a.std)
m.to(torch.bfloat16).save_pretrained(a.out, safe_serialization=True)
print("make_qwen3:", a.out, sum(p.numel() for p in m.parameters()) / 1e9, "B parameters")
