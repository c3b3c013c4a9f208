#!/usr/bin/env python3
"""Tiny synthetic HF `phi` checkpoints (Phi 1.5 / Moondream 2's text decoder
shape) and what an f32 NumPy Phi computes on them.

    phi_fixtures.py SMOLLM2_GGUF OUT_DIR [CASE...]

For each case (all, or the CASEs named) writes OUT_DIR/NAME/ as an HF directory (`config.json` with
`model_type: phi`, `model.safetensors` with HF `modeling_phi.py`'s tensor
names, `tokenizer.json`) and OUT_DIR/NAME.json (prompt text and ids, and per
greedy step the reference's token, its top-1 margin and every logit), as
synthetic_fixtures.py does for the GGUF families. The tokenizer is SmolLM2's
byte-level BPE cut to its first 1024 tokens (that script's `vocabulary`),
written as a `tokenizer.json`; the prompt is plain words, where that file's
ByteLevel pre-tokenizer and SmolLM2's digit-splitting one agree.

The Phi block, from HF `modeling_phi.py` (and Moondream's `text.py`, the
same block): one LayerNorm with bias feeding attention and the MLP in
parallel, `x + attn(ln(x)) + mlp(ln(x))`; Q/K/V, `dense`, `fc1`, `fc2` and
`lm_head` with biases; rotary on the first `partial_rotary_factor *
head_dim` dimensions of each head, half-split (`rotate_half`) within them,
frequencies `theta^(-2i / rotary_dim)`; GELU-tanh (`gelu_new`); causal
attention scaled by `1/sqrt(head_dim)`; `final_layernorm` before the head.

Cases: phi (every tensor F32) and phi_bf16 (matrices, embedding and head in
BF16, LayerNorms and biases F32). Nothing binary is committed: Kestrel's
tests (crates/kestrel-cpu/tests/phi.rs) run this at test time.
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_golden import ByteBPE  # noqa: E402
from synthetic_fixtures import VOCAB, vocabulary  # noqa: E402

N_GREEDY = 8
PROMPT = "the quick brown fox jumps over the lazy dog and then the small cat sat down"

CASES = [
    dict(name="phi", hidden=64, ff=256, layers=2, heads=4, rotary=0.5, theta=10000.0, dtype="F32"),
    dict(name="phi_bf16", hidden=64, ff=256, layers=3, heads=2, rotary=0.25, theta=10000.0, dtype="BF16"),
]


def bf16_bits(a):
    """f32 -> bf16 bits, round to nearest even (as torch rounds)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors):
    """`tensors`: name -> (dtype string, shape, raw bytes), written in order."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def tokenizer_json(tokens, types, merges):
    """A byte-level BPE `tokenizer.json` of SmolLM2's cut vocabulary."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": merges},
    }


class Phi:
    """The f32 Phi decoder on the values the checkpoint stores."""

    def __init__(self, c, w):
        self.c, self.w = c, w
        self.hd = c["hidden"] // c["heads"]
        self.rot = int(self.hd * c["rotary"])
        self.eps = np.float32(1e-5)

    def ln(self, x, name):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def lin(self, x, name):
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def rope(self, x, pos):  # x: [T, heads, hd]; half-split on the first `rot` dims
        rot, half = self.rot, self.rot // 2
        freqs = self.c["theta"] ** (-np.arange(half, dtype=np.float64) * 2 / rot)
        ang = np.outer(np.asarray(pos, dtype=np.float64), freqs)
        cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        a, b, rest = x[..., :half], x[..., half:rot], x[..., rot:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)

    def forward(self, ids, cache):
        start = cache[0][0].shape[0] if cache else 0
        T, H, hd = len(ids), self.c["heads"], self.hd
        pos = np.arange(start, start + T)
        x = self.w["model.embed_tokens.weight"][ids]
        mask = np.where(np.arange(start + T)[None, :] <= pos[:, None], np.float32(0), np.float32(-np.inf))
        for i in range(self.c["layers"]):
            p = f"model.layers.{i}."
            h = self.ln(x, p + "input_layernorm")
            q = self.rope(self.lin(h, p + "self_attn.q_proj").reshape(T, H, hd), pos)
            k = self.rope(self.lin(h, p + "self_attn.k_proj").reshape(T, H, hd), pos)
            v = self.lin(h, p + "self_attn.v_proj").reshape(T, H, hd)
            if len(cache) <= i:
                cache.append((k, v))
            else:
                cache[i] = (np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v]))
            K, V = cache[i]
            s = np.einsum("thd,shd->hts", q, K) * np.float32(1 / np.sqrt(np.float32(hd))) + mask
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = self.lin(np.einsum("hts,shd->thd", pr, V).reshape(T, -1), p + "self_attn.dense")
            g = self.lin(h, p + "mlp.fc1")
            g = np.float32(0.5) * g * (np.float32(1) + np.tanh(
                np.float32(np.sqrt(2 / np.pi)) * (g + np.float32(0.044715) * g * g * g)))
            m = self.lin(g, p + "mlp.fc2")
            x = x + o + m
        return self.lin(self.ln(x[-1], "model.final_layernorm"), "lm_head")


def write_case(c, tokens, types, merges, out_dir, rng):
    h, ff, L = c["hidden"], c["ff"], c["layers"]
    d = out_dir / c["name"]
    d.mkdir(parents=True, exist_ok=True)
    tensors, values = {}, {}

    def put(name, a, matrix):
        a = a.astype(np.float32)
        if matrix and c["dtype"] == "BF16":
            bits = bf16_bits(a)
            tensors[name] = ("BF16", a.shape, bits.tobytes())
            values[name] = bf16_value(bits).reshape(a.shape)
        else:
            tensors[name] = ("F32", a.shape, a.tobytes())
            values[name] = a

    def linear(name, rows, cols, std, bias=0.1):
        put(name + ".weight", rng.standard_normal((rows, cols)) * std, True)
        put(name + ".bias", rng.uniform(-bias, bias, rows), False)

    def norm(name):
        put(name + ".weight", 1 + rng.uniform(-0.2, 0.2, h), False)
        put(name + ".bias", rng.uniform(-0.2, 0.2, h), False)

    put("model.embed_tokens.weight", rng.standard_normal((VOCAB, h)), True)
    s_in = 1 / np.sqrt(h)
    for i in range(L):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm")
        for part, std in (("q", 2 * s_in), ("k", 2 * s_in), ("v", s_in)):
            linear(p + f"self_attn.{part}_proj", h, h, std, 0.5)
        linear(p + "self_attn.dense", h, h, s_in)
        linear(p + "mlp.fc1", ff, h, s_in, 0.5)
        linear(p + "mlp.fc2", h, ff, 1 / np.sqrt(ff))
    norm("model.final_layernorm")
    linear("lm_head", VOCAB, h, 2 * s_in, 0.5)
    write_safetensors(d / "model.safetensors", tensors)
    config = {
        "architectures": ["PhiForCausalLM"], "model_type": "phi", "vocab_size": VOCAB,
        "hidden_size": h, "intermediate_size": ff, "num_hidden_layers": L,
        "num_attention_heads": c["heads"], "partial_rotary_factor": c["rotary"],
        "rope_theta": c["theta"], "layer_norm_eps": 1e-5, "hidden_act": "gelu_new",
        "max_position_embeddings": 256, "tie_word_embeddings": False, "qk_layernorm": False,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(config, indent=1))
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(tokens, types, merges)))
    return Phi(c, values)


def main():
    smol = GGUFReader(sys.argv[1])
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261207)
    tokens, types, merges = vocabulary(smol, VOCAB)
    tok = ByteBPE(tokens, merges, types)
    ids = tok.encode(PROMPT)
    assert tok.decode(ids) == PROMPT
    only = set(sys.argv[3:])
    unknown = only - {c["name"] for c in CASES}
    assert not unknown, f"unknown cases: {sorted(unknown)}"
    for c in CASES:
        if only and c["name"] not in only:
            continue
        model = write_case(c, tokens, types, merges, out_dir, rng)
        cache, steps = [], []
        logits = model.forward(ids, cache)
        for _ in range(N_GREEDY):
            nxt = int(np.argmax(logits))
            order = np.argsort(-logits, kind="stable")
            steps.append({"token": nxt, "margin": float(logits[order[0]] - logits[order[1]]),
                          "logits": [[int(i), round(float(logits[i]), 6)] for i in range(len(logits))]})
            logits = model.forward([nxt], cache)
        (out_dir / f"{c['name']}.json").write_text(json.dumps({
            "case": c, "prompt": PROMPT, "prompt_ids": ids, "steps": steps}))
        print(c["name"], len(ids), "prompt tokens ->", [s["token"] for s in steps], flush=True)


if __name__ == "__main__":
    main()
