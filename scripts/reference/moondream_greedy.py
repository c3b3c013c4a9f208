#!/usr/bin/env python3
"""Moondream 2 end to end in NumPy (float64), written from the published
architecture (vikhyat/moondream `moondream/torch/vision.py`, `text.py`,
`layers.py`, `rope.py`; docs/moondream.md): an image's tokens from the
encoder and projector (moondream_vision.py), then the Phi text decoder over
BOS + the image's rows + the prompt's template tokens with the prefix-LM
mask (positions below `prefix_attn` attend each other both ways, later ones
causally), decoded greedily.

    moondream_greedy.py CKPT_DIR CROPS_U8 ROWS COLS PROMPT_JSON OUT_DIR

PROMPT_JSON: {"before": [ids before the image], "after": [ids after it],
"steps": N}; the image's rows follow `before`. Writes OUT_DIR/greedy.json
({"tokens": [...], "margins": [top-1 minus top-2 logit per step]}) and
OUT_DIR/logits.f32 (the first step's logits). The text block: one
LayerNorm feeding attention and MLP in parallel (`x + attn(ln x) +
mlp(ln x)`), a fused QKV with bias, rotary on the first half of each head
(frequencies `theta^(-2i / rot)`, pairs `(x_i, x_{i + rot/2})` written back
interleaved as the reference's `rope.py` does), scale `1/sqrt(head_dim)`,
GELU-tanh MLP, `post_ln` then `lm_head` with bias. Every pass recomputes the
whole sequence (no cache): what a step sees depends on nothing but its
tokens.
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moondream_vision import (Weights, adaptive_avg_pool, encode, gelu_tanh,  # noqa: E402
                              reconstruct)


def image_tokens(w, v, crops, rows, cols):
    g = v["crop_size"] // v["enc_patch_size"]
    x = encode(w, v, crops)
    d = v["enc_dim"]
    pooled = adaptive_avg_pool(reconstruct(x[1:].reshape(-1, g, g, d), rows, cols,
                                           v["overlap_margin"]), g)
    feats = np.concatenate([x[0], pooled.reshape(g * g, d)], axis=-1)
    pr = "vision_encoder.projection.mlp"
    h = gelu_tanh(w.linear(feats, "model.vision.proj_mlp.fc1", f"{pr}.fc1"))
    return w.linear(h, "model.vision.proj_mlp.fc2", f"{pr}.fc2")


def rope(x, pos, rot, theta):
    """x: [T, heads, hd]; the first `rot` dims of each head rotated."""
    half = rot // 2
    freqs = theta ** (-np.arange(half, dtype=np.float64) * 2 / rot)
    ang = np.outer(pos.astype(np.float64), freqs)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:rot]
    rotated = np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*a.shape[:-1], rot)
    return np.concatenate([rotated, x[..., rot:]], axis=-1)


def text_logits(w, t, x):
    """Logits of the last row of the sequence whose inputs are `x` [T, dim]."""
    return lm_head(w, text_hidden(w, t, x))


def lm_head(w, last):
    """`post_ln` then `lm_head` of one hidden state."""
    last = w.norm(last, "model.text.post_ln", "text_model.lm_head.ln")
    return w.linear(last, "model.text.lm_head", "text_model.lm_head.linear")


def text_hidden(w, t, x):
    """The last row's hidden state (the residual stream after the last
    block, before `post_ln`: what the region decoders read)."""
    T, dim, H = x.shape[0], t["dim"], t["n_heads"]
    hd = dim // H
    pos = np.arange(T)
    prefix = t["prefix_attn"]
    i, j = pos[:, None], pos[None, :]
    allowed = (j <= i) | ((i < prefix) & (j < prefix))
    mask = np.where(allowed, 0.0, -np.inf)
    for layer in range(t["n_layers"]):
        hb, eb = f"model.text.blocks.{layer}", f"text_model.transformer.h.{layer}"
        h = w.norm(x, f"{hb}.ln", f"{eb}.ln")
        qkv = w.linear(h, f"{hb}.attn.qkv", f"{eb}.mixer.Wqkv")
        q, k, v = (qkv[:, n * dim:(n + 1) * dim].reshape(T, H, hd) for n in range(3))
        q, k = rope(q, pos, hd // 2, t["rope_theta"]), rope(k, pos, hd // 2, t["rope_theta"])
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", p, v).reshape(T, dim)
        attn = w.linear(a, f"{hb}.attn.proj", f"{eb}.mixer.out_proj")
        mlp = w.linear(gelu_tanh(w.linear(h, f"{hb}.mlp.fc1", f"{eb}.mlp.fc1")),
                       f"{hb}.mlp.fc2", f"{eb}.mlp.fc2")
        x = x + attn + mlp
    return x[-1]


def main():
    ckpt, crops_path, rows, cols, prompt_path, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5], Path(sys.argv[6])
    cfg = json.loads((Path(ckpt) / "config.json").read_text())["config"]
    v, t = cfg["vision"], cfg["text"]
    w = Weights(Path(ckpt) / "model.safetensors")
    s = v["crop_size"]
    crops = np.frombuffer(Path(crops_path).read_bytes(), dtype=np.uint8).reshape(-1, s, s, 3)
    assert crops.shape[0] == 1 + rows * cols, (crops.shape, rows, cols)
    prompt = json.loads(Path(prompt_path).read_text())
    img = image_tokens(w, v, crops, rows, cols)
    wte = w("model.text.wte", "text_model.transformer.embd.wte.weight")
    x = np.concatenate([wte[prompt["before"]], img, wte[prompt["after"]]])
    tokens, margins = [], []
    out.mkdir(parents=True, exist_ok=True)
    for step in range(prompt["steps"]):
        logits = text_logits(w, t, x)
        if step == 0:
            (out / "logits.f32").write_bytes(logits.astype(np.float32).tobytes())
        top = np.argsort(-logits, kind="stable")[:2]
        tokens.append(int(top[0]))
        margins.append(float(logits[top[0]] - logits[top[1]]))
        x = np.concatenate([x, wte[[tokens[-1]]]])
    (out / "greedy.json").write_text(json.dumps({"tokens": tokens, "margins": margins}))


if __name__ == "__main__":
    main()
