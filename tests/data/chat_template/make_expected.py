"""Writes expected.json: the prompt text of every request in conversations.json as
Python's jinja2 renders the template with Hugging Face's settings (chat_reference.py),
and its token ids from siesta's tokenizer (`siesta tokenize`, itself checked against
Hugging Face's in tokenizer_test).

  python3 tests/data/chat_template/make_expected.py --siesta build/bin/siesta [--assets DIR]

tests/cuda/hf_chat_template.py writes the same file from transformers' own
apply_chat_template and tokenizer on the GPU machine; server_chat_template_test
checks siesta's rendering against whichever was committed.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import chat_reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--siesta", required=True)
    ap.add_argument("--assets", default=os.environ.get("SIESTA_ASSETS", os.path.expanduser("~/.cache/siesta/assets")))
    a = ap.parse_args()
    import jinja2
    tok_dir = os.path.join(a.assets, "qwen3-tokenizer")
    cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    templates = {"qwen3": cfg["chat_template"], "qwen2.5": open(os.path.join(HERE, "qwen2.5.jinja")).read()}
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(cfg.get(k), str)}
    out = {"source": f"Python jinja2 {jinja2.__version__} with Hugging Face's settings; token ids from siesta's tokenizer",
           "cases": {}}
    for case in json.load(open(os.path.join(HERE, "conversations.json")))["cases"]:
        text = chat_reference.render_jinja2(templates[case.get("template", "qwen3")], case["request"], special)
        r = subprocess.run([a.siesta, "tokenize", "--model", tok_dir, "--json", "-"], input=text.encode(),
                           capture_output=True, check=True)
        out["cases"][case["name"]] = {"text": text, "token_ids": json.loads(r.stdout)["ids"]}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {len(out['cases'])} cases")


if __name__ == "__main__":
    main()
