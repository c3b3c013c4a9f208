#!/usr/bin/env python3
"""Tests of compare.py on two small results.json files (testdata/) and on
transcribed figures: run `python3 scripts/bench/test_compare.py`."""

import json
import os
import unittest

import compare

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    with open(os.path.join(HERE, "testdata", name)) as f:
        return json.load(f)


class CompareTest(unittest.TestCase):
    def test_two_bench_results(self):
        lines = compare.compare(load("results-a.json"), load("results-b.json"))
        self.assertIn(
            "| 1 stream, text; PipelinedRideAlong; tokens/s | 100.00 | 110.00 | 1.10 | - | - |",
            lines,
        )
        self.assertIn(
            "| vs llama.cpp; prompt processing tokens/s (pp512) | 500.00 | 450.00 | 0.90 | 2.00 | 1.80 |",
            lines,
        )
        self.assertIn("Only in A: 8 streams, text; PipelinedRideAlong; tokens/s", lines)
        self.assertIn("Only in B: 32 streams, text; PipelinedRideAlong; tokens/s", lines)

    def test_transcribed_figures_key_by_machine(self):
        def doc(pp512):
            row = {"model": "llama-1b", "type": "Q4_K_M", "metric": "pp512",
                   "kestrel": pp512, "llama_cpp": 200.0, "ratio": pp512 / 200.0}
            return {"runs": [{"machine": {"cpu": "Zen 5", "isa": "avx512"}, "rows": [row]}]}
        lines = compare.compare(doc(250.0), doc(300.0))
        self.assertIn("| Zen 5 avx512; llama-1b Q4_K_M; pp512 | 250.00 | 300.00 | 1.20 | 1.25 | 1.50 |", lines)

    def test_the_committed_figures_parse(self):
        docs = os.path.join(HERE, "..", "..", "docs", "bench")
        for name in sorted(os.listdir(docs)):
            if name.endswith(".json"):
                with open(os.path.join(docs, name)) as f:
                    doc = json.load(f)
                rows = sum(len(run["rows"]) for run in doc.get("runs", []))
                # Every transcribed row is its own figure (no two share a key).
                self.assertEqual(len(compare.figures(doc)), rows, name)

    def test_an_unknown_file_is_refused(self):
        with self.assertRaises(ValueError):
            compare.figures({"something": "else"})


if __name__ == "__main__":
    unittest.main()
