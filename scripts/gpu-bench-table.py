#!/usr/bin/env python3
"""The markdown table of benchmark results (W1, W1-py, W2) from the JSON documents the benchmarks
write: the command line of bench/python/bench_tables.py, the one writer of those tables.

    scripts/gpu-bench-table.py w1.json > w1.md
    scripts/gpu-bench-table.py bench/results/*/w1-part*.json      # parts of one W1 run
    build/tools/w1 --size tiny --device sim --caps 0.02,0 | scripts/gpu-bench-table.py -
    scripts/gpu-bench-table.py w2-out/w2.json > w2.md
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "python"))

import bench_tables  # noqa: E402


def main(paths: list) -> int:
    if not paths:
        sys.exit("usage: gpu-bench-table.py RESULT.json... (- reads one document from stdin)")
    docs = [json.load(sys.stdin) if p == "-" else json.load(open(p)) for p in paths]
    sys.stdout.write(bench_tables.table(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
