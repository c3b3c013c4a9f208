#!/usr/bin/env python3
"""Greedy decode of any Llama-family GGUF with the f32 NumPy reference of
smollm2_golden.py (every tensor dequantized by the `gguf` package, whatever
its type), for crates/kestrel-cpu/tests/kquant_model.rs.

    python scripts/reference/greedy_check.py MODEL.gguf STEPS IDS_JSON

IDS_JSON is a JSON list of prompts, each a list of token ids. Prints one JSON
line: a list, per prompt, of {"greedy_ids": [...], "top5": [[[id, logit], ...], ...]}
(top5 per step, logits before choosing that step's token).
Needs scripts/reference/requirements.txt.
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_golden import Llama  # noqa: E402


def main():
    path, steps, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    model = Llama(GGUFReader(path))
    out = []
    for ids in prompts:
        cache, greedy, tops = [], [], []
        logits = model.forward(ids, cache)
        for _ in range(steps):
            top = np.argsort(-logits)[:5]
            tops.append([[int(t), float(logits[t])] for t in top])
            greedy.append(int(top[0]))
            logits = model.forward([int(top[0])], cache)
        out.append({"greedy_ids": greedy, "top5": tops})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
