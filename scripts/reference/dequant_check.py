#!/usr/bin/env python3
"""Dequantize raw ggml blocks with the `gguf` package (an implementation of
ggml's reference dequantization independent of Kestrel's), for
crates/kestrel-model/tests/dequant_gguf_py.rs.

    python scripts/reference/dequant_check.py DIR

For every DIR/<TYPE>.bin (raw blocks of ggml type TYPE, e.g. Q4_K.bin),
writes DIR/<TYPE>.f32: the dequantized values as little-endian f32.
Needs scripts/reference/requirements.txt (numpy, gguf==0.17.1).
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


def main():
    root = Path(sys.argv[1])
    done = []
    for src in sorted(root.glob("*.bin")):
        qtype = GGMLQuantizationType[src.stem]
        raw = np.frombuffer(src.read_bytes(), dtype=np.uint8)
        values = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(-1)
        values.astype("<f4").tofile(src.with_suffix(".f32"))
        done.append(f"{src.stem}:{values.size}")
    print("dequantized", " ".join(done))


if __name__ == "__main__":
    main()
