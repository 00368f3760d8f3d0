"""Hugging Face's renderings of the chat requests in tests/data/chat_template/conversations.json
(run on the GPU machine, where transformers is installed; no GPU needed).

  python3 tests/cuda/hf_chat_template.py TOKENIZER_DIR [--out FILE] [--check tests/data/chat_template/expected.json]

TOKENIZER_DIR holds tokenizer.json and tokenizer_config.json (the Qwen3 tokenizer siesta's tests use:
$SIESTA_ASSETS/qwen3-tokenizer). Every request is converted as vLLM (and siesta) convert it
(tests/data/chat_template/chat_reference.py), rendered with AutoTokenizer.apply_chat_template
(tokenize=False; the Qwen3 template of tokenizer_config.json, or qwen2.5.jinja), and encoded with the
same tokenizer (add_special_tokens=False, as vLLM encodes chat prompts). --out writes the expected file
in the format server_chat_template_test reads; --check compares with a committed one, prints each
difference, and exits 1 if there is any.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "chat_template")
sys.path.insert(0, DATA)
import chat_reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--out")
    ap.add_argument("--check")
    a = ap.parse_args()
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer_dir)
    qwen25 = open(os.path.join(DATA, "qwen2.5.jinja")).read()
    out = {"source": f"transformers {transformers.__version__} apply_chat_template and tokenizer", "cases": {}}
    for case in json.load(open(os.path.join(DATA, "conversations.json")))["cases"]:
        messages, tools, agp, cfm, kwargs = chat_reference.to_template_inputs(case["request"])
        extra = {"chat_template": qwen25} if case.get("template") == "qwen2.5" else {}
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, continue_final_message=cfm,
                                       tokenize=False, **extra, **kwargs)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out["cases"][case["name"]] = {"text": text, "token_ids": ids}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {len(out['cases'])} cases to {a.out}")
    if a.check:
        want = json.load(open(a.check))["cases"]
        bad = 0
        for name, got in out["cases"].items():
            exp = want.get(name)
            if exp is None or exp["text"] != got["text"] or exp["token_ids"] != got["token_ids"]:
                bad += 1
                print(f"DIFFERS {name}\n  hf:       {got['text']!r}\n  expected: {exp and exp['text']!r}")
                if exp and exp["text"] == got["text"]:
                    print(f"  (same text, token ids differ: hf {got['token_ids']} expected {exp['token_ids']})")
        print(f"{len(out['cases']) - bad} of {len(out['cases'])} cases equal to {a.check}")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
