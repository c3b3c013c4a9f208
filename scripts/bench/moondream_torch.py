#!/usr/bin/env python3
"""The PyTorch (CPU, float32) floor of `cargo xtask moondream-bench`:
Moondream 2 written from the published architecture (docs/moondream.md;
the same model as scripts/reference/moondream_greedy.py, which is float64
NumPy without a cache), batched and KV-cached, timed on the work the bench
gives it.

    moondream_torch.py CKPT_DIR PLAN_JSON OUT_JSON [--threads N]

PLAN_JSON (written by the bench):
  {"encode": [{"crops": FILE, "rows": R, "cols": C}], "encode_reps": N,
   "query": {"crops", "rows", "cols", "before": [ids], "after": [ids],
             "after_cached": [ids], "decode_tokens": N, "reps": N},
   "concurrency": [{"streams": S, "waves": [[{"crops", "rows", "cols"}] x S],
                    "max_tokens": N}]}
FILE: uint8 crops [1 + R*C, 378, 378, 3], global first (cut by Kestrel, so
both engines encode the same pixels; image decoding and resizing are not
in this floor's times, and are in Kestrel's request figures).

Writes OUT_JSON: encode seconds per crop count (median of `encode_reps`),
time to first token of the query (`before`, the image, `after`) on a new
image, and of a second question (`after_cached`) with the image's prefix KV
kept (the reference's `encode_image` keeps it), decode tokens/s of one
sequence after its first token, and requests/s of `streams` requests at a
time (static batches: every wave's images encoded in one batch, its
prefixes prefilled in one batched forward, its tokens decoded together).
Weights are converted to float32 at load; attention is
`scaled_dot_product_attention` (full in the encoder; in the decoder the
730-row prefix sees itself both ways, later rows causally).
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class Weights:
    """The checkpoint's tensors in float32, read by either published
    naming (`hf` or `exported`)."""

    def __init__(self, path):
        raw = load_file(str(path))
        self.t = {k.replace("._orig_mod", ""): v.float() for k, v in raw.items()}
        self.hf = "model.vision.blocks.0.attn.proj.bias" in self.t

    def __call__(self, hf, exported):
        return self.t[hf if self.hf else exported]

    def linear(self, x, hf, exported):
        return F.linear(x, self(f"{hf}.weight", f"{exported}.weight"),
                        self(f"{hf}.bias", f"{exported}.bias"))

    def norm(self, x, hf, exported):
        w = self(f"{hf}.weight", f"{exported}.weight")
        return F.layer_norm(x, w.shape, w, self(f"{hf}.bias", f"{exported}.bias"), 1e-5)


# config.py's 2025 defaults (docs/moondream.md, "Configuration", 2B): a
# published config.json holds only overrides of these (usually none).
DEFAULTS = {
    "text": {"dim": 2048, "ff_dim": 8192, "n_layers": 24, "vocab_size": 51200,
             "max_context": 2048, "n_heads": 32, "n_kv_heads": 32, "prefix_attn": 730,
             "rope_theta": 10000.0},
    "vision": {"enc_dim": 1152, "enc_patch_size": 14, "enc_n_layers": 27, "enc_ff_dim": 4304,
               "enc_n_heads": 16, "proj_inner_dim": 8192, "proj_out_dim": 2048,
               "crop_size": 378, "in_channels": 3, "max_crops": 12, "overlap_margin": 4},
}


def config(ckpt):
    """The checkpoint's text and vision settings: the defaults, overridden
    by config.json's `config` object."""
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    over = raw.get("config", raw) if isinstance(raw.get("config", raw), dict) else {}
    return {part: {**DEFAULTS[part], **over.get(part, {})} for part in DEFAULTS}


def gelu(x):
    return F.gelu(x, approximate="tanh")


class Moondream:
    def __init__(self, ckpt):
        cfg = config(ckpt)
        self.v, self.t = cfg["vision"], cfg["text"]
        self.w = Weights(Path(ckpt) / "model.safetensors")
        t = self.t
        self.hd = t["dim"] // t["n_heads"]
        rot = self.hd // 2
        freqs = t["rope_theta"] ** (-torch.arange(rot // 2, dtype=torch.float64) * 2 / rot)
        ang = torch.outer(torch.arange(t["max_context"], dtype=torch.float64), freqs)
        self.cos, self.sin = ang.cos().float(), ang.sin().float()
        self.wte = self.w("model.text.wte", "text_model.transformer.embd.wte.weight")

    # Vision.
    def encode_crops(self, crops):
        """uint8 [n, S, S, 3] -> post-LN features [n, patches, enc_dim]."""
        v, w = self.v, self.w
        n, s, p, d, heads = crops.shape[0], v["crop_size"], v["enc_patch_size"], \
            v["enc_dim"], v["enc_n_heads"]
        g = s // p
        x = (torch.from_numpy(crops).float() / 255.0 - 0.5) / 0.5
        x = x.permute(0, 3, 1, 2).reshape(n, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5) \
            .reshape(n, g * g, 3 * p * p)
        vr = "vision_encoder.encoder.model.visual"
        x = w.linear(x, "model.vision.patch_emb", f"{vr}.patch_embed.linear")
        x = x + w("model.vision.pos_emb", f"{vr}.pos_embed")
        hd = d // heads
        for i in range(v["enc_n_layers"]):
            hb, eb = f"model.vision.blocks.{i}", f"{vr}.blocks.{i}"
            h = w.norm(x, f"{hb}.ln1", f"{eb}.norm1")
            qkv = w.linear(h, f"{hb}.attn.qkv", f"{eb}.attn.qkv")
            q, k, val = (qkv[..., j * d:(j + 1) * d].reshape(n, g * g, heads, hd).transpose(1, 2)
                         for j in range(3))
            a = F.scaled_dot_product_attention(q, k, val).transpose(1, 2).reshape(n, g * g, d)
            x = x + w.linear(a, f"{hb}.attn.proj", f"{eb}.attn.proj")
            h = gelu(w.linear(w.norm(x, f"{hb}.ln2", f"{eb}.norm2"), f"{hb}.mlp.fc1", f"{eb}.mlp.fc1"))
            x = x + w.linear(h, f"{hb}.mlp.fc2", f"{eb}.mlp.fc2")
        return w.norm(x, "model.vision.post_ln", f"{vr}.norm")

    def project(self, feats, rows, cols):
        """One image's crop features -> its [patches, dim] tokens."""
        v, w = self.v, self.w
        g, m, d = v["crop_size"] // v["enc_patch_size"], v["overlap_margin"], v["enc_dim"]
        local = feats[1:].reshape(-1, g, g, d)
        win = g - 2 * m
        full = torch.zeros(win * rows + 2 * m, win * cols + 2 * m, d)
        for i in range(rows):
            for j in range(cols):
                y0, y1 = (0 if i == 0 else m), (g if i == rows - 1 else g - m)
                x0, x1 = (0 if j == 0 else m), (g if j == cols - 1 else g - m)
                full[i * win + y0:i * win + y1, j * win + x0:j * win + x1] = \
                    local[i * cols + j, y0:y1, x0:x1]
        pooled = F.adaptive_avg_pool2d(full.permute(2, 0, 1), (g, g)).permute(1, 2, 0)
        x = torch.cat([feats[0], pooled.reshape(g * g, d)], -1)
        pr = "vision_encoder.projection.mlp"
        h = gelu(w.linear(x, "model.vision.proj_mlp.fc1", f"{pr}.fc1"))
        return w.linear(h, "model.vision.proj_mlp.fc2", f"{pr}.fc2")

    def image_tokens(self, images, chunk=8):
        """[(crops u8, rows, cols)] -> one [patches, dim] tensor each; all
        images' crops encoded together, `chunk` crops per batch."""
        crops = np.concatenate([c for c, _, _ in images])
        feats = torch.cat([self.encode_crops(crops[i:i + chunk])
                           for i in range(0, crops.shape[0], chunk)])
        out, at = [], 0
        for c, r, k in images:
            out.append(self.project(feats[at:at + c.shape[0]], r, k))
            at += c.shape[0]
        return out

    # Text.
    def rope(self, x, pos):
        """x [B, H, T, hd]: the first hd/2 dims rotated, pairs (i, i + hd/4)
        written back interleaved (rope.py)."""
        rot = self.hd // 2
        half = rot // 2
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        a, b = x[..., :half], x[..., half:rot]
        r = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        return torch.cat([r, x[..., rot:]], -1)

    def forward(self, x, cache, start):
        """x [B, T, dim] at positions start..start+T; cache: per layer
        [k, v] of [B, H, max, hd], written in place. The last row's hidden
        state [B, dim]."""
        t, w = self.t, self.w
        B, T, dim = x.shape
        H, hd = t["n_heads"], self.hd
        pos = torch.arange(start, start + T)
        end = start + T
        kpos = torch.arange(end)
        prefix = t["prefix_attn"]
        allowed = (kpos[None, :] <= pos[:, None]) | ((pos[:, None] < prefix) & (kpos[None, :] < prefix))
        for layer in range(t["n_layers"]):
            hb, eb = f"model.text.blocks.{layer}", f"text_model.transformer.h.{layer}"
            h = w.norm(x, f"{hb}.ln", f"{eb}.ln")
            qkv = w.linear(h, f"{hb}.attn.qkv", f"{eb}.mixer.Wqkv")
            q, k, v = (qkv[..., n * dim:(n + 1) * dim].reshape(B, T, H, hd).transpose(1, 2)
                       for n in range(3))
            q, k = self.rope(q, pos), self.rope(k, pos)
            kc, vc = cache[layer]
            kc[:, :, start:end], vc[:, :, start:end] = k, v
            a = F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], attn_mask=allowed)
            a = a.transpose(1, 2).reshape(B, T, dim)
            attn = w.linear(a, f"{hb}.attn.proj", f"{eb}.mixer.out_proj")
            mlp = w.linear(gelu(w.linear(h, f"{hb}.mlp.fc1", f"{eb}.mlp.fc1")),
                           f"{hb}.mlp.fc2", f"{eb}.mlp.fc2")
            x = x + attn + mlp
        return x[:, -1]

    def next_token(self, hidden):
        h = self.w.norm(hidden, "model.text.post_ln", "text_model.lm_head.ln")
        return self.w.linear(h, "model.text.lm_head", "text_model.lm_head.linear").argmax(-1)

    def new_cache(self, batch, length):
        t = self.t
        return [[torch.zeros(batch, t["n_heads"], length, self.hd) for _ in range(2)]
                for _ in range(t["n_layers"])]


def load_crops(spec, size):
    c = np.frombuffer(Path(spec["crops"]).read_bytes(), dtype=np.uint8).reshape(-1, size, size, 3)
    assert c.shape[0] == 1 + spec["rows"] * spec["cols"], (c.shape, spec)
    return c, spec["rows"], spec["cols"]


def run(md, plan):
    size = md.v["crop_size"]
    out = {"engine": f"pytorch {torch.__version__} (cpu, float32, {torch.get_num_threads()} threads, "
                     f"{torch.backends.cpu.get_cpu_capability()})"}
    with torch.inference_mode():
        encode = []
        for spec in plan["encode"]:
            img = load_crops(spec, size)
            times = []
            for _ in range(plan["encode_reps"]):
                t0 = time.perf_counter()
                md.image_tokens([img])
                times.append(time.perf_counter() - t0)
            encode.append({"crops": img[0].shape[0], "seconds": statistics.median(times)})
        out["encode"] = encode

        q = plan["query"]
        img = load_crops(q, size)
        before, after = torch.tensor(q["before"]), torch.tensor(q["after"])
        second = torch.tensor(q["after_cached"])
        n_prefix = len(q["before"]) + md.v["crop_size"] ** 2 // md.v["enc_patch_size"] ** 2
        total = n_prefix + max(len(q["after"]), len(q["after_cached"])) + q["decode_tokens"]
        cold, warm, rates = [], [], []
        for _ in range(q["reps"]):
            cache = md.new_cache(1, total)
            t0 = time.perf_counter()
            tokens = md.image_tokens([img])[0]
            x = torch.cat([md.wte[before], tokens, md.wte[after]])[None]
            tok = md.next_token(md.forward(x, cache, 0))
            cold.append(time.perf_counter() - t0)
            # The image's prefix KV kept: only the template is prefilled.
            t0 = time.perf_counter()
            tok = md.next_token(md.forward(md.wte[second][None], cache, n_prefix))
            warm.append(time.perf_counter() - t0)
            pos = n_prefix + len(q["after_cached"])
            t0 = time.perf_counter()
            for _ in range(q["decode_tokens"] - 1):
                tok = md.next_token(md.forward(md.wte[tok][:, None], cache, pos))
                pos += 1
            rates.append((q["decode_tokens"] - 1) / (time.perf_counter() - t0))
        out["ttft_cold_s"] = statistics.median(cold)
        out["ttft_cached_s"] = statistics.median(warm)
        out["decode_tokens_per_s"] = statistics.median(rates)

        conc = []
        for c in plan["concurrency"]:
            n_tok = c["max_tokens"]
            t0 = time.perf_counter()
            requests = 0
            for wave in c["waves"]:
                imgs = md.image_tokens([load_crops(s, size) for s in wave])
                B = len(imgs)
                x = torch.stack([torch.cat([md.wte[before], t, md.wte[after]]) for t in imgs])
                cache = md.new_cache(B, x.shape[1] + n_tok)
                tok = md.next_token(md.forward(x, cache, 0))
                pos = x.shape[1]
                for _ in range(n_tok - 1):
                    tok = md.next_token(md.forward(md.wte[tok][:, None], cache, pos))
                    pos += 1
                requests += B
            wall = time.perf_counter() - t0
            conc.append({"streams": c["streams"], "requests": requests, "wall_s": wall,
                         "requests_per_s": requests / wall,
                         "tokens_per_s": requests * n_tok / wall})
        out["concurrency"] = conc
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("plan")
    p.add_argument("out")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    md = Moondream(a.ckpt)
    plan = json.loads(Path(a.plan).read_text())
    # Warm-up (thread pools, first-touch of the weights): not timed.
    with torch.inference_mode():
        md.image_tokens([load_crops(plan["query"], md.v["crop_size"])])
    Path(a.out).write_text(json.dumps(run(md, plan), indent=1))


if __name__ == "__main__":
    main()
