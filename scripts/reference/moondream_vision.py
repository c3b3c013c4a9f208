#!/usr/bin/env python3
"""Moondream's vision encoder and projector in NumPy (float64), written
from the published architecture (vikhyat/moondream `moondream/torch/
vision.py`, `layers.py`, `image_crops.py`; docs/moondream.md) for Kestrel's
encoder test.

    moondream_vision.py CKPT_DIR CROPS_U8 ROWS COLS OUT_DIR

CROPS_U8: the crops Kestrel cut (uint8 [1 + ROWS*COLS, S, S, 3], global
first), so this compares the encoder alone, not two resize filters. Writes
OUT_DIR/encoded.f32 (post-LN features of every crop, [crops, patches,
enc_dim]) and OUT_DIR/tokens.f32 (the image tokens, [patches,
proj_out_dim]).

Steps: pixels to [-1, 1]; 14x14 patches flattened channel-major (c, y, x);
patch linear + learned position embedding; pre-LN blocks (x += attn(ln1 x),
x += mlp(ln2 x); full bidirectional attention, scale 1/sqrt(head_dim); MLP
fc1, GELU-tanh, fc2); post LN. Tiles' patch features are stitched into one
map keeping each tile's window (and the outer margins), average-pooled
adaptively back to the crop's grid (PyTorch's adaptive_avg_pool2d bins),
concatenated after the global crop's features, then projected (fc1,
GELU-tanh, fc2). The reference pools to (enc_n_layers, enc_n_layers): 27,
the grid, in every published config; this pools to the grid.
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moondream_synth import read_safetensors  # noqa: E402


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


class Weights:
    def __init__(self, path):
        self.t = {k: v.astype(np.float64) for k, v in read_safetensors(path).items()}
        self.hf = "model.vision.blocks.0.attn.proj.bias" in self.t

    def __call__(self, hf, exported):
        return self.t[hf if self.hf else exported]

    def linear(self, x, hf, exported):
        return x @ self(f"{hf}.weight", f"{exported}.weight").T + self(f"{hf}.bias", f"{exported}.bias")

    def norm(self, x, hf, exported):
        return layer_norm(x, self(f"{hf}.weight", f"{exported}.weight"),
                          self(f"{hf}.bias", f"{exported}.bias"))


def encode(w, v, crops):
    n, s = crops.shape[0], v["crop_size"]
    p, d, heads = v["enc_patch_size"], v["enc_dim"], v["enc_n_heads"]
    g = s // p
    x = (crops.astype(np.float64) / 255.0 - 0.5) / 0.5          # [n, S, S, 3]
    x = x.transpose(0, 3, 1, 2)                                    # [n, C, S, S]
    x = x.reshape(n, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, 3 * p * p)
    vr = "vision_encoder.encoder.model.visual"
    x = w.linear(x, "model.vision.patch_emb", f"{vr}.patch_embed.linear")
    x = x + w("model.vision.pos_emb", f"{vr}.pos_embed")
    hd = d // heads
    for i in range(v["enc_n_layers"]):
        hb, eb = f"model.vision.blocks.{i}", f"{vr}.blocks.{i}"
        h = w.norm(x, f"{hb}.ln1", f"{eb}.norm1")
        qkv = w.linear(h, f"{hb}.attn.qkv", f"{eb}.attn.qkv")
        q, k, val = (qkv[..., j * d:(j + 1) * d].reshape(n, g * g, heads, hd).transpose(0, 2, 1, 3)
                     for j in range(3))
        sc = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        sc /= sc.sum(-1, keepdims=True)
        a = (sc @ val).transpose(0, 2, 1, 3).reshape(n, g * g, d)
        x = x + w.linear(a, f"{hb}.attn.proj", f"{eb}.attn.proj")
        h = w.norm(x, f"{hb}.ln2", f"{eb}.norm2")
        h = gelu_tanh(w.linear(h, f"{hb}.mlp.fc1", f"{eb}.mlp.fc1"))
        x = x + w.linear(h, f"{hb}.mlp.fc2", f"{eb}.mlp.fc2")
    return w.norm(x, "model.vision.post_ln", f"{vr}.norm")


def reconstruct(local, rows, cols, margin):
    """Tiles' [g, g, d] features into one map, keeping each tile's window
    and the outer margins (image_crops.reconstruct_from_crops, patch units)."""
    _, g, _, d = local.shape
    win = g - 2 * margin
    out = np.zeros((win * rows + 2 * margin, win * cols + 2 * margin, d))
    for i in range(rows):
        for j in range(cols):
            y0 = 0 if i == 0 else margin
            y1 = g if i == rows - 1 else g - margin
            x0 = 0 if j == 0 else margin
            x1 = g if j == cols - 1 else g - margin
            out[i * win + y0:i * win + y1, j * win + x0:j * win + x1] = \
                local[i * cols + j, y0:y1, x0:x1]
    return out


def adaptive_avg_pool(x, size):
    """PyTorch's adaptive_avg_pool2d on [H, W, d]: bin i spans
    [floor(i H / size), ceil((i + 1) H / size))."""
    h, wd, _ = x.shape
    out = np.zeros((size, size, x.shape[2]))
    for i in range(size):
        y0, y1 = (i * h) // size, -(-((i + 1) * h) // size)
        for j in range(size):
            x0, x1 = (j * wd) // size, -(-((j + 1) * wd) // size)
            out[i, j] = x[y0:y1, x0:x1].mean(axis=(0, 1))
    return out


def main():
    ckpt, crops_path, rows, cols, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4]), Path(sys.argv[5])
    cfg = json.loads((Path(ckpt) / "config.json").read_text())["config"]
    v = cfg["vision"]
    w = Weights(Path(ckpt) / "model.safetensors")
    s = v["crop_size"]
    g = s // v["enc_patch_size"]
    crops = np.frombuffer(Path(crops_path).read_bytes(), dtype=np.uint8).reshape(-1, s, s, 3)
    assert crops.shape[0] == 1 + rows * cols, (crops.shape, rows, cols)
    x = encode(w, v, crops)
    out.mkdir(parents=True, exist_ok=True)
    (out / "encoded.f32").write_bytes(x.astype(np.float32).tobytes())
    d = v["enc_dim"]
    local = x[1:].reshape(-1, g, g, d)
    pooled = adaptive_avg_pool(reconstruct(local, rows, cols, v["overlap_margin"]), g)
    feats = np.concatenate([x[0], pooled.reshape(g * g, d)], axis=-1)
    pr = "vision_encoder.projection.mlp"
    h = gelu_tanh(w.linear(feats, "model.vision.proj_mlp.fc1", f"{pr}.fc1"))
    tokens = w.linear(h, "model.vision.proj_mlp.fc2", f"{pr}.fc2")
    (out / "tokens.f32").write_bytes(tokens.astype(np.float32).tobytes())


if __name__ == "__main__":
    main()
