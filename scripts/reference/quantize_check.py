#!/usr/bin/env python3
"""Quantize f32 values with the `gguf` package's reference quantizers (an
implementation of ggml's `quantize_row_*_ref` independent of Kestrel's),
for crates/kestrel-model/tests/quantize_reference.rs.

    python scripts/reference/quantize_check.py DIR TYPE...

Reads DIR/input.f32 (little-endian f32, a multiple of 256 values) and, for
every TYPE (a GGMLQuantizationType name gguf==0.17.1 can quantize: F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), writes the raw blocks to DIR/TYPE.bin.
Needs scripts/reference/requirements.txt (numpy, gguf==0.17.1).
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize


def main():
    root = Path(sys.argv[1])
    values = np.fromfile(root / "input.f32", dtype="<f4").reshape(-1, 256)
    done = []
    for name in sys.argv[2:]:
        raw = quantize(values, GGMLQuantizationType[name])
        (root / f"{name}.bin").write_bytes(np.ascontiguousarray(raw).tobytes())
        done.append(f"{name}:{raw.nbytes}")
    print("quantized", " ".join(done))


if __name__ == "__main__":
    main()
