#!/usr/bin/env python3
"""Synthetic Moondream 2 checkpoints for Kestrel's tests: the published
tensor names and layout (docs/moondream.md), random weights, tiny widths.

    moondream_synth.py OUT_DIR [--names hf|exported] [--dtype F32|F16|BF16]
                       [--seed N] [--no-region]

Writes OUT_DIR/model.safetensors and OUT_DIR/config.json (the HF layout:
the model's settings under "config"). The crop geometry is the real one
(378-pixel crops of 14-pixel patches, 4-patch margins, up to 12 tiles), so
crops, stitching and pooling are exercised at their true sizes; only the
widths and depths are small. `hf` names are the Hugging Face repository's
state dict (model.vision.*, model.text.*, model.region.*); `exported` are
the names the reference's weights.py maps (vision_encoder.*, text_model.*,
region_model.*; Fourier features stored transposed).
"""
import argparse
import json
import struct
from pathlib import Path

import numpy as np

CONFIG = {
    "text": {"dim": 32, "ff_dim": 64, "n_layers": 2, "vocab_size": 64, "max_context": 2048,
             "n_heads": 4, "n_kv_heads": 4, "prefix_attn": 730, "rope_theta": 10000.0},
    "vision": {"enc_dim": 32, "enc_patch_size": 14, "enc_n_layers": 2, "enc_ff_dim": 48,
               "enc_n_heads": 2, "proj_inner_dim": 64, "proj_out_dim": 32, "crop_size": 378,
               "in_channels": 3, "max_crops": 12, "overlap_margin": 4},
    "region": {"dim": 32, "coord_feat_dim": 16, "coord_out_dim": 1024, "size_feat_dim": 16,
               "size_out_dim": 2048, "inner_dim": 64},
}


def tensors(cfg, rng, names, region=True):
    """{name: float32 array} with the published names and shapes."""
    v, t, r = cfg["vision"], cfg["text"], cfg["region"]
    out = {}

    def lin(name, o, i, scale=1.0):
        out[f"{name}.weight"] = rng.standard_normal((o, i)) * scale / np.sqrt(i)
        out[f"{name}.bias"] = rng.standard_normal(o) * 0.1

    def ln(name, d):
        out[f"{name}.weight"] = 1.0 + rng.standard_normal(d) * 0.1
        out[f"{name}.bias"] = rng.standard_normal(d) * 0.1

    hf = names == "hf"
    d, patches = v["enc_dim"], (v["crop_size"] // v["enc_patch_size"]) ** 2
    root = "model.vision" if hf else "vision_encoder.encoder.model.visual"
    lin(f"{root}.patch_emb" if hf else f"{root}.patch_embed.linear", d,
        v["in_channels"] * v["enc_patch_size"] ** 2)
    out[f"{root}.pos_emb" if hf else f"{root}.pos_embed"] = rng.standard_normal((1, patches, d)) * 0.5
    for i in range(v["enc_n_layers"]):
        b = f"{root}.blocks.{i}"
        ln(f"{b}.ln1" if hf else f"{b}.norm1", d)
        lin(f"{b}.attn.qkv", 3 * d, d, 2.0)
        lin(f"{b}.attn.proj", d, d)
        ln(f"{b}.ln2" if hf else f"{b}.norm2", d)
        lin(f"{b}.mlp.fc1", v["enc_ff_dim"], d)
        lin(f"{b}.mlp.fc2", d, v["enc_ff_dim"])
    ln(f"{root}.post_ln" if hf else f"{root}.norm", d)
    proj = "model.vision.proj_mlp" if hf else "vision_encoder.projection.mlp"
    lin(f"{proj}.fc1", v["proj_inner_dim"], 2 * d)
    lin(f"{proj}.fc2", v["proj_out_dim"], v["proj_inner_dim"])

    td, hd = t["dim"], t["dim"] // t["n_heads"]
    qkv = (t["n_heads"] + 2 * t["n_kv_heads"]) * hd
    out["model.text.wte" if hf else "text_model.transformer.embd.wte.weight"] = \
        rng.standard_normal((t["vocab_size"], td))
    for i in range(t["n_layers"]):
        b = f"model.text.blocks.{i}" if hf else f"text_model.transformer.h.{i}"
        ln(f"{b}.ln", td)
        lin(f"{b}.attn.qkv" if hf else f"{b}.mixer.Wqkv", qkv, td)
        lin(f"{b}.attn.proj" if hf else f"{b}.mixer.out_proj", td, td)
        lin(f"{b}.mlp.fc1", t["ff_dim"], td)
        lin(f"{b}.mlp.fc2", td, t["ff_dim"])
    ln("model.text.post_ln" if hf else "text_model.lm_head.ln", td)
    lin("model.text.lm_head" if hf else "text_model.lm_head.linear", t["vocab_size"], td)

    if region:
        rd = r["dim"]
        cf = rng.standard_normal((1, r["coord_feat_dim"] // 2)) * 4.0
        sf = rng.standard_normal((2, r["size_feat_dim"] // 2)) * 4.0
        if hf:
            out["model.region.coord_features"] = cf
            out["model.region.size_features"] = sf
        else:
            out["region_model.coordinate_features.weight"] = cf.T.copy()
            out["region_model.size_features.weight"] = sf.T.copy()
        root = "model.region" if hf else "region_model"
        lin(f"{root}.coord_encoder" if hf else "region_model.coordinate_encoder", rd,
            r["coord_feat_dim"])
        cd = f"{root}.coord_decoder" if hf else "region_model.coordinate_decoder"
        lin(f"{cd}.fc1", r["inner_dim"], rd)
        lin(f"{cd}.fc2", r["coord_out_dim"], r["inner_dim"])
        lin(f"{root}.size_encoder", rd, r["size_feat_dim"])
        lin(f"{root}.size_decoder.fc1", r["inner_dim"], rd)
        lin(f"{root}.size_decoder.fc2", r["size_out_dim"], r["inner_dim"])
    return {k: np.asarray(a, dtype=np.float32) for k, a in out.items()}


def to_bf16_bits(a):
    """float32 -> bfloat16 bits (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def stored(a, dtype):
    """(bytes, the float32 values those bytes hold)."""
    if dtype == "F32":
        return a.tobytes(), a
    if dtype == "F16":
        h = a.astype(np.float16)
        return h.tobytes(), h.astype(np.float32)
    bits = to_bf16_bits(a)
    return bits.tobytes(), from_bf16_bits(bits)


def write_safetensors(path, named, dtype):
    """Writes `named` ({name: float32 array}) in `dtype`, returning the
    values as stored (what any reader computes with)."""
    header, blobs, offset, values = {}, [], 0, {}
    for name in sorted(named):
        data, vals = stored(named[name], dtype)
        header[name] = {"dtype": dtype, "shape": list(named[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
        values[name] = vals
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return values


def read_safetensors(path):
    """{name: float32 array} from a safetensors file (F32/F16/BF16)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[base + a:base + b]
        if info["dtype"] == "F32":
            arr = np.frombuffer(buf, dtype=np.float32)
        elif info["dtype"] == "F16":
            arr = np.frombuffer(buf, dtype=np.float16).astype(np.float32)
        elif info["dtype"] == "BF16":
            arr = from_bf16_bits(np.frombuffer(buf, dtype=np.uint16))
        else:
            raise ValueError(f"{name}: dtype {info['dtype']}")
        out[name.replace("._orig_mod", "")] = arr.reshape(info["shape"])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--names", choices=["hf", "exported"], default="hf")
    p.add_argument("--dtype", choices=["F32", "F16", "BF16"], default="F32")
    p.add_argument("--seed", type=int, default=72)
    p.add_argument("--no-region", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    write_safetensors(out / "model.safetensors",
                      tensors(CONFIG, rng, a.names, region=not a.no_region), a.dtype)
    (out / "config.json").write_text(json.dumps(
        {"architectures": ["HfMoondream"], "model_type": "moondream1", "config": CONFIG},
        indent=1))


if __name__ == "__main__":
    main()
