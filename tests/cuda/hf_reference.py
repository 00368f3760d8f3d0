"""Hugging Face references for the CUDA model's device checks (run on the GPU machine).

  python3 hf_reference.py MODEL_DIR PROMPTS_JSON OUT_DIR [--steps 24]

For every prompt of PROMPTS_JSON (tests/data/golden/*_golden.json: prompts[i].input_ids) writes
  OUT_DIR/ref_logits.safetensors: bf16_<i> (logits of HF's bf16 model, as fp32) and f32_<i>
      (the same bf16 weights upcast to fp32, TF32 off), [len, vocab] each;
  OUT_DIR/ref.json: greedy continuations of `steps` tokens by the bf16 and the fp32 model, and the
      bf16 model's top-1/top-2 margin at every generated step (a near-tie explains a divergence).
Adapted from the shared hf_reference_model.py; transformers' own Qwen3 with its default attention.
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file
from transformers import Qwen3ForCausalLM


def greedy(model, ids, steps, pad):
    x = torch.tensor([ids], device="cuda")
    out = model.generate(x, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    margins = []
    for s in out.scores:
        top = s[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=24)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts = [p["input_ids"] for p in json.load(open(a.prompts))["prompts"]]
    t0 = time.time()
    model = Qwen3ForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    tensors, ref = {}, {"model": a.model, "steps": a.steps, "prompts": []}
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            tensors[f"bf16_{i}"] = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().contiguous()
            g, m = greedy(model, ids, a.steps, pad)
            ref["prompts"].append({"input_ids": ids, "greedy_bf16": g, "margins_bf16": m})
        model = model.float()
        for i, ids in enumerate(prompts):
            tensors[f"f32_{i}"] = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().contiguous()
            g, _ = greedy(model, ids, a.steps, pad)
            ref["prompts"][i]["greedy_f32"] = g
    save_file(tensors, os.path.join(a.out, "ref_logits.safetensors"))
    json.dump(ref, open(os.path.join(a.out, "ref.json"), "w"))
    print(f"hf_reference: {len(prompts)} prompts for {a.model} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
