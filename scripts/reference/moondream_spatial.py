#!/usr/bin/env python3
"""Moondream's point / detect loop end to end in NumPy (float64), for
Kestrel's spatial test: the text decoder of moondream_greedy.py over BOS +
the image's rows + a point or detect template, then the cycle as the seed
system runs it (docs/moondream.md, "Region model"): greedy under the
stage's ids (x: coord or EOS, the larger logit, EOS on a tie as the first
maximum; y: coord; size: size), a coordinate decoded from the hidden state
of the step that sampled `coord_id` (the residual stream after the last
block, before `post_ln`, as the published `_generate_points` reads it), a
size from the step that sampled `size_id`, each re-encoded as the next
row's input (`coord_encoder(fourier(v))`, `size_encoder(fourier([w, h]))`)
instead of the token's embedding; stop at EOS or after `max_objects`.

    moondream_spatial.py CKPT_DIR CROPS_U8 ROWS COLS PROMPT_JSON OUT_DIR

PROMPT_JSON: {"before": [...], "after": [...], "kind": "point"|"detect",
"max_objects": N, "coord_id": 5, "size_id": 6, "eos_id": 0}. Writes
OUT_DIR/spatial.json: {"tokens": every sampled id (a final EOS
included), "coord_bins": [...], "size_bins": [[w, h], ...], "margins":
the x stages' |coord - EOS| logit gaps and every decoded bin's top-1 minus
top-2 logit}. Every pass recomputes the whole sequence (no cache).
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moondream_greedy import image_tokens, lm_head, text_hidden  # noqa: E402
from moondream_region import fourier, linear, mlp, region_weights  # noqa: E402
from moondream_vision import Weights  # noqa: E402


def top2_gap(v):
    top = np.sort(v)[::-1]
    return float(top[0] - top[1])


def main():
    ckpt, crops_path, rows, cols, prompt_path, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5], Path(sys.argv[6])
    cfg = json.loads((Path(ckpt) / "config.json").read_text())["config"]
    v, t = cfg["vision"], cfg["text"]
    w = Weights(Path(ckpt) / "model.safetensors")
    r = region_weights(Path(ckpt) / "model.safetensors")
    s = v["crop_size"]
    crops = np.frombuffer(Path(crops_path).read_bytes(), dtype=np.uint8).reshape(-1, s, s, 3)
    p = json.loads(Path(prompt_path).read_text())
    coord_id, size_id, eos_id = p["coord_id"], p["size_id"], p["eos_id"]
    cycle = ["x", "y"] + (["size"] if p["kind"] == "detect" else [])
    img = image_tokens(w, v, crops, rows, cols)
    wte = w("model.text.wte", "text_model.transformer.embd.wte.weight")
    x = np.concatenate([wte[p["before"]], img, wte[p["after"]]])
    tokens, coord_bins, size_bins, margins = [], [], [], []
    objects, i = 0, 0
    while True:
        hidden = text_hidden(w, t, x)
        stage = cycle[i % len(cycle)]
        if stage == "x":
            logits = lm_head(w, hidden)
            gap = logits[coord_id] - logits[eos_id]
            margins.append(abs(float(gap)))
            tok = coord_id if gap > 0 else eos_id
        else:
            tok = coord_id if stage == "y" else size_id
        tokens.append(tok)
        if tok == eos_id:
            break
        if tok == coord_id:
            cl = mlp(hidden, r["coord_decoder"])
            b = int(cl.argmax())
            margins.append(top2_gap(cl))
            coord_bins.append(b)
            emb = linear(fourier(np.array([[b / cl.shape[0]]]), r["coord_features"]),
                         r["coord_encoder"])
        else:
            sl = mlp(hidden, r["size_decoder"])
            half = sl.shape[0] // 2
            bins = [int(sl[:half].argmax()), int(sl[half:].argmax())]
            margins.extend([top2_gap(sl[:half]), top2_gap(sl[half:])])
            size_bins.append(bins)
            wh = 2.0 ** ((np.array(bins, dtype=np.float64) / (half - 1)) * 10.0 - 10.0)
            emb = linear(fourier(wh[None, :], r["size_features"]), r["size_encoder"])
        x = np.concatenate([x, emb])
        i += 1
        if i % len(cycle) == 0:
            objects += 1
            if objects == p["max_objects"]:
                break
    out.mkdir(parents=True, exist_ok=True)
    (out / "spatial.json").write_text(json.dumps(
        {"tokens": tokens, "coord_bins": coord_bins, "size_bins": size_bins, "margins": margins}))


if __name__ == "__main__":
    main()
