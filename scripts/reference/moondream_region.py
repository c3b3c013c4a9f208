#!/usr/bin/env python3
"""Moondream's region model in NumPy (float64), written from the published
architecture (vikhyat/moondream `moondream/torch/region.py`, `layers.py`,
the point/detect loop of `moondream.py`; docs/moondream.md) for Kestrel's
region test.

    moondream_region.py CKPT_DIR OUT_DIR [--rows N] [--seed S]

Draws N hidden states (standard normal, [N, dim]), N coordinates in [0, 1)
(the first ones the decodable bins' values k / 1024, the rest uniform) and N
sizes (log-uniform in [2^-10, 1]), and writes, as little-endian float32
unless named otherwise:
  hidden.f32 [N, dim], coords.f32 [N], sizes.f32 [N, 2]  (the inputs);
  coord_emb.f32 [N, dim]   linear(fourier(c, coord_features), coord_encoder);
  size_emb.f32 [N, dim]    linear(fourier([w, h], size_features), size_encoder);
  coord_logits.f32 [N, coord_out_dim], size_logits.f32 [N, size_out_dim]
                           mlp(h, decoder): fc1, GELU-tanh, fc2;
  coord_bins.i32 [N], size_bins.i32 [N, 2]   argmax (first maximum);
  coord_values.f64 [N]     bin / coord_out_dim;
  size_values.f64 [N, 2]   2 ** ((bin / 1023) * 10 - 10) per axis.
fourier(x, W) = [cos(2 pi x @ W), sin(2 pi x @ W)], W as [inputs, feat/2]
(the exported naming stores it transposed; read back here).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moondream_synth import read_safetensors  # noqa: E402
from moondream_vision import gelu_tanh  # noqa: E402


def region_weights(path):
    t = {k: v.astype(np.float64) for k, v in read_safetensors(path).items()}
    if "model.region.coord_features" in t:
        g = lambda n: t[f"model.region.{n}"]  # noqa: E731
        return {
            "coord_features": g("coord_features"),
            "size_features": g("size_features"),
            "coord_encoder": (g("coord_encoder.weight"), g("coord_encoder.bias")),
            "size_encoder": (g("size_encoder.weight"), g("size_encoder.bias")),
            "coord_decoder": [(g(f"coord_decoder.{f}.weight"), g(f"coord_decoder.{f}.bias"))
                              for f in ("fc1", "fc2")],
            "size_decoder": [(g(f"size_decoder.{f}.weight"), g(f"size_decoder.{f}.bias"))
                             for f in ("fc1", "fc2")],
        }
    g = lambda n: t[f"region_model.{n}"]  # noqa: E731
    return {
        "coord_features": g("coordinate_features.weight").T,
        "size_features": g("size_features.weight").T,
        "coord_encoder": (g("coordinate_encoder.weight"), g("coordinate_encoder.bias")),
        "size_encoder": (g("size_encoder.weight"), g("size_encoder.bias")),
        "coord_decoder": [(g(f"coordinate_decoder.{f}.weight"), g(f"coordinate_decoder.{f}.bias"))
                          for f in ("fc1", "fc2")],
        "size_decoder": [(g(f"size_decoder.{f}.weight"), g(f"size_decoder.{f}.bias"))
                         for f in ("fc1", "fc2")],
    }


def fourier(x, w):
    f = 2 * np.pi * x @ w
    return np.concatenate([np.cos(f), np.sin(f)], axis=-1)


def linear(x, wb):
    return x @ wb[0].T + wb[1]


def mlp(x, layers):
    return linear(gelu_tanh(linear(x, layers[0])), layers[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=73)
    a = p.parse_args()
    cfg = json.loads((Path(a.ckpt) / "config.json").read_text())["config"]["region"]
    w = region_weights(Path(a.ckpt) / "model.safetensors")
    rng = np.random.default_rng(a.seed)
    n, bins = a.rows, cfg["coord_out_dim"]

    hidden = rng.standard_normal((n, cfg["dim"])).astype(np.float32)
    coords = rng.uniform(0.0, 1.0, n)
    k = min(n, 8)
    coords[:k] = rng.integers(0, bins, k) / bins
    coords = coords.astype(np.float32)
    sizes = (2.0 ** rng.uniform(-10.0, 0.0, (n, 2))).astype(np.float32)

    h = hidden.astype(np.float64)
    coord_emb = linear(fourier(coords.astype(np.float64)[:, None], w["coord_features"]),
                       w["coord_encoder"])
    size_emb = linear(fourier(sizes.astype(np.float64), w["size_features"]), w["size_encoder"])
    coord_logits = mlp(h, w["coord_decoder"])
    size_logits = mlp(h, w["size_decoder"])
    half = size_logits.shape[1] // 2
    coord_bins = coord_logits.argmax(-1)
    size_bins = np.stack([size_logits[:, :half].argmax(-1), size_logits[:, half:].argmax(-1)], -1)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    f32 = lambda name, x: (out / name).write_bytes(np.asarray(x, "<f4").tobytes())  # noqa: E731
    f32("hidden.f32", hidden)
    f32("coords.f32", coords)
    f32("sizes.f32", sizes)
    f32("coord_emb.f32", coord_emb)
    f32("size_emb.f32", size_emb)
    f32("coord_logits.f32", coord_logits)
    f32("size_logits.f32", size_logits)
    (out / "coord_bins.i32").write_bytes(coord_bins.astype("<i4").tobytes())
    (out / "size_bins.i32").write_bytes(size_bins.astype("<i4").tobytes())
    (out / "coord_values.f64").write_bytes((coord_bins / bins).astype("<f8").tobytes())
    (out / "size_values.f64").write_bytes(
        (2.0 ** ((size_bins / 1023.0) * 10.0 - 10.0)).astype("<f8").tobytes())


if __name__ == "__main__":
    main()
