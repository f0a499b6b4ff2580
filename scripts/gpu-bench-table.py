#!/usr/bin/env python3
"""The markdown table of W1 and W1-py results: the one writer of it (the benchmarks emit JSON).

Reads the JSON documents that bench/w1 (--out, or stdout) and bench/python/w1_py.py (--out)
write, joins their rows in cap order (several device calls may each run some caps) and checks two
targets of shared/spec/benchmarks.md on each row: peak VRAM within the cap, and efficiency
>= 0.95 on the calibrated route. One footer line per document: machine, versions, commit, command.

    scripts/gpu-bench-table.py w1.json > w1.md
    scripts/gpu-bench-table.py bench/results/*/w1-part*.json      # parts of one W1 run
    build/tools/w1 --size tiny --device sim --caps 0.02,0 | scripts/gpu-bench-table.py -

Example row:
    | flux-dit | 8 | calibrated | 4.2 | 0.347 | 0.345 | 18.96 | 54.7 | 0.176 | 6.98 | 22.9 | 0.344 | 1.00 | ok |
"""
import json
import sys

ROUTE_ORDER = {"resident": 0, "noprofile": 1, "calibration": 2, "calibrated": 3, "block": 4,
               "leaf": 5}
# W1-py's block and leaf rows are diffusers' own group offload; W1's are ddo's compat presets.
PY_ROUTE_NAMES = {"block": "diffusers block", "leaf": "diffusers leaf"}
HEAD = ("| workload | cap GiB | route | setup s | first step s | median step s | streamed GB/step | "
        "achieved GB/s | wait s/step | peak VRAM GiB | peak RSS GiB | bound s | efficiency | "
        "targets |")
# (row key, decimals) of the cells after the route.
CELLS = [("setup_s", 1), ("first_step_s", 3), ("median_step_s", 3), ("streamed_gb_per_step", 2),
         ("achieved_gbps", 1), ("compute_wait_s_per_step", 3), ("peak_vram_gib", 2),
         ("peak_host_rss_gib", 1), ("bound_s", 3), ("efficiency", 2)]


def cell(row: dict, key: str, digits: int) -> str:
    """Fixed decimals, or three significant digits for the small figures of the tiny model."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    if value != 0 and abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.{digits}f}"


def cap_of(row: dict) -> float:
    """The cap in GiB; 0 when uncapped (W1 writes 0, W1-py null)."""
    return row.get("cap_gib") or 0


def sort_key(row: dict):
    cap = cap_of(row)
    # The resident row first, then by cap, the uncapped rows of other routes last.
    return (row["route"] != "resident", cap == 0, cap, ROUTE_ORDER.get(row["route"], 9))


def targets(row: dict, doc: dict | None = None) -> str:
    notes = []
    cap = cap_of(row)
    if row["route"] == "noprofile" and doc and row.get("median_step_s"):
        # Issue 15's target: without a profile, <= 1.05 x the calibrated step at the same cap.
        for other in doc.get("rows", []):
            if other["route"] == "calibrated" and cap_of(other) == cap and other.get("median_step_s"):
                ratio = row["median_step_s"] / other["median_step_s"]
                notes.append(f"{ratio:.2f} x calibrated" + (" (> 1.05)" if ratio > 1.05 else ""))
    if cap and isinstance(row.get("peak_vram_gib"), (int, float)) and row["peak_vram_gib"] > cap:
        notes.append("VRAM over cap")
    if row["route"] == "calibrated" and row.get("efficiency", 0) < 0.95:
        notes.append("eff < 0.95")
    if row.get("error"):
        notes.append("error: " + row["error"].replace("|", "/").replace("\n", " ")[:60])
    return ", ".join(notes) or "ok"


def line(doc: dict, row: dict) -> str:
    cap = cap_of(row)
    route = row["route"]
    if doc.get("benchmark") == "w1-py":
        route = PY_ROUTE_NAMES.get(route, route)
    head = [row.get("workload", "-"), f"{cap:g}" if cap else "none", route]
    if row.get("error") and row.get("median_step_s") is None:
        err = row["error"].replace("|", "/").replace("\n", " ")[:80]
        cells = [f"failed: {err}"] + ["-"] * 5 + [cell(row, "peak_vram_gib", 2),
                                                  cell(row, "peak_host_rss_gib", 1), "-", "-", "-"]
    else:
        cells = [cell(row, key, digits) for key, digits in CELLS] + [targets(row, doc)]
    return "| " + " | ".join(head + cells) + " |"


def footer(doc: dict) -> str:
    if doc.get("device") == "sim":
        where = "sim device (CPU numbers)"
    else:
        where = f"GPU: {doc.get('gpu') or '?'}"
        if doc.get("driver"):
            where += f" (driver {str(doc['driver'])[:60]})"
    t_res = doc.get("t_resident_s")
    parts = [where, f"B_pinned {doc.get('b_pinned_gbps') or 0:.1f} GB/s",
             f"T_resident {'-' if t_res is None else format(t_res, '.3f')} s",
             f"model {doc.get('model_gb') or 0:.1f} GB", f"torch {doc.get('torch_version', '?')}"]
    if doc.get("diffusers_version"):
        parts.append(f"diffusers {doc['diffusers_version']}")
    parts.append(f"commit {doc.get('commit') or '-'}")
    if doc.get("command"):
        parts.append(f"command `{doc['command']}`")
    return "; ".join(parts)


def table(docs: list) -> str:
    rows = sorted(((doc, row) for doc in docs for row in doc.get("rows", [])),
                  key=lambda pair: sort_key(pair[1]))
    lines = [HEAD, "| " + " | ".join(["---"] * 14) + " |"]
    lines += [line(doc, row) for doc, row in rows]
    lines.append("")
    lines += [footer(doc) for doc in docs]
    return "\n".join(lines) + "\n"


def main(paths: list) -> int:
    if not paths:
        sys.exit("usage: gpu-bench-table.py W1.json... (- reads one document from stdin)")
    docs = [json.load(sys.stdin) if p == "-" else json.load(open(p)) for p in paths]
    sys.stdout.write(table(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
