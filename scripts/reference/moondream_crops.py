#!/usr/bin/env python3
"""Moondream's overlap crops, written from the published algorithm
(vikhyat/moondream `moondream/torch/image_crops.py`: `select_tiling` and
`overlap_crop_image`; see docs/moondream.md), for Kestrel's crop tests.

    moondream_crops.py CASES_JSON OUT_DIR

CASES_JSON: {"crop_size": 378, "patch_size": 14, "overlap_margin": 4,
"max_crops": 12, "tilings": [[h, w], ...], "images": [{"name": N,
"png": PATH}, ...]}. Writes OUT_DIR/tilings.json (select_tiling of each
[h, w] after the margins come off, as overlap_crop_image calls it) and, per
image, OUT_DIR/N.json ({"tiling": [rows, cols], "shape": [crops, H, W, 3]})
and OUT_DIR/N.u8 (the crops, uint8, global crop first, row-major tiles).

Resizing is Pillow's LANCZOS, which is what the reference does when pyvips
is not installed; the reference with pyvips uses libvips' lanczos3, so two
reference installs differ from each other by a few levels as Kestrel's
`image`-crate Lanczos3 differs from this one (the test's tolerance).
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def select_tiling(height, width, crop_size, max_crops):
    if height <= crop_size or width <= crop_size:
        return (1, 1)
    min_h = math.ceil(height / crop_size)
    min_w = math.ceil(width / crop_size)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    h_tiles = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    w_tiles = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if h_tiles * w_tiles > max_crops:
        if w_tiles > h_tiles:
            w_tiles = math.floor(max_crops / h_tiles)
        else:
            h_tiles = math.floor(max_crops / w_tiles)
    return (max(1, h_tiles), max(1, w_tiles))


def geometry(cfg):
    margin = cfg["patch_size"] * cfg["overlap_margin"]
    window = (cfg["crop_size"] // cfg["patch_size"] - 2 * cfg["overlap_margin"]) * cfg["patch_size"]
    return margin, window


def tiling_for(h, w, cfg):
    margin, window = geometry(cfg)
    return select_tiling(h - 2 * margin, w - 2 * margin, window, cfg["max_crops"])


def overlap_crops(image, cfg):
    """Global crop + tiles, uint8 [n, crop, crop, 3]."""
    h, w = image.shape[:2]
    margin, window = geometry(cfg)
    size = cfg["crop_size"]
    rows, cols = tiling_for(h, w, cfg)
    crops = np.zeros((rows * cols + 1, size, size, 3), dtype=np.uint8)
    target_h = rows * window + 2 * margin
    target_w = cols * window + 2 * margin
    pil = Image.fromarray(image)
    resized = np.array(pil.resize((target_w, target_h), Image.Resampling.LANCZOS))
    crops[0] = np.array(pil.resize((size, size), Image.Resampling.LANCZOS))
    for i in range(rows):
        for j in range(cols):
            y0, x0 = i * window, j * window
            region = resized[y0:min(y0 + size, target_h), x0:min(x0 + size, target_w)]
            crops[1 + i * cols + j, : region.shape[0], : region.shape[1]] = region
    return crops, (rows, cols)


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tilings = [list(tiling_for(h, w, cases)) for h, w in cases["tilings"]]
    (out / "tilings.json").write_text(json.dumps(tilings))
    for img in cases["images"]:
        pixels = np.array(Image.open(img["png"]).convert("RGB"))
        crops, tiling = overlap_crops(pixels, cases)
        (out / f"{img['name']}.json").write_text(
            json.dumps({"tiling": list(tiling), "shape": list(crops.shape)}))
        (out / f"{img['name']}.u8").write_bytes(crops.tobytes())


if __name__ == "__main__":
    main()
