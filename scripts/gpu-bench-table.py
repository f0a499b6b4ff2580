#!/usr/bin/env python3
"""Merges W1 result files (bench/w1 --out) into one markdown table for the README.

Several device calls may each run some caps (DDO_W1_CAPS); this joins their rows, in cap order,
and checks the targets of shared/spec/benchmarks.md on each row.

    scripts/gpu-bench-table.py bench/results/w1-*.json > table.md
"""
import json
import sys

ROUTE_ORDER = {"resident": 0, "calibration": 1, "calibrated": 2, "block": 3, "leaf": 4}


def cell(row, key, digits):
    value = row.get(key)
    return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"


def main(paths):
    docs = [json.load(open(p)) for p in paths]
    if not docs:
        sys.exit("usage: gpu-bench-table.py W1.json...")
    rows = []
    for doc in docs:
        for row in doc.get("rows", []):
            rows.append(row)
    rows.sort(key=lambda r: (r["cap_gib"] == 0 and r["route"] != "resident",
                             r["cap_gib"] if r["cap_gib"] else 1e9,
                             ROUTE_ORDER.get(r["route"], 9)))
    print("| cap GiB | route | setup s | first step s | median step s | streamed GB/step | "
          "achieved GB/s | wait s/step | peak VRAM GiB | peak RSS GiB | bound s | efficiency | "
          "targets |")
    print("| --- " * 13 + "|")
    for r in rows:
        cap = r["cap_gib"]
        cap_text = f"{cap:g}" if cap else "none"
        if "error" in r:
            err = r["error"].replace("|", " ").replace("\n", " ")[:70]
            print(f"| {cap_text} | {r['route']} | failed: {err} | | | | | | "
                  f"{cell(r, 'peak_vram_gib', 2)} | {cell(r, 'peak_host_rss_gib', 1)} | | | |")
            continue
        notes = []
        if cap and r.get("peak_vram_gib", 0) > cap:
            notes.append("VRAM over cap")
        if r["route"] == "calibrated" and r.get("efficiency", 0) < 0.95:
            notes.append("eff < 0.95")
        print(f"| {cap_text} | {r['route']} | {cell(r, 'setup_s', 1)} | {cell(r, 'first_step_s', 3)} | "
              f"{cell(r, 'median_step_s', 3)} | {cell(r, 'streamed_gb_per_step', 2)} | "
              f"{cell(r, 'achieved_gbps', 1)} | {cell(r, 'compute_wait_s_per_step', 3)} | "
              f"{cell(r, 'peak_vram_gib', 2)} | {cell(r, 'peak_host_rss_gib', 1)} | "
              f"{cell(r, 'bound_s', 3)} | {cell(r, 'efficiency', 2)} | {', '.join(notes) or 'ok'} |")
    d = docs[0]
    print()
    print(f"GPU {d.get('gpu')}, driver `{d.get('driver', '?')[:60]}`, torch {d.get('torch_version')}, "
          f"commit {d.get('commit')}; B_pinned {d.get('b_pinned_gbps', 0):.1f} GB/s, "
          f"T_resident {max(x.get('t_resident_s', 0) for x in docs):.3f} s, "
          f"model {d.get('model_gb', 0):.1f} GB; commands: "
          + "; ".join(f"`{x.get('command')}`" for x in docs))


if __name__ == "__main__":
    main(sys.argv[1:])
