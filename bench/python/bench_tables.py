"""The markdown tables of the benchmark results, one writer for each, from the JSON documents
the benchmarks write (none of them writes its own table):

  w1_table(docs)   W1 (bench/w1, C++) and W1-py (bench/python/w1_py.py): the rows of one or more
                   documents joined in cap order (several device calls may each run some caps),
                   two targets of docs/design/0009-benchmarks.md checked on each row (peak VRAM within
                   the cap, efficiency >= 0.95 on the calibrated route), one footer line per
                   document (machine, versions, commit, command)
  w2_table(doc)    W2 (bench/python/w2_py.py, which rewrites w2.md after every row with it)
  table(docs)      whichever of the two the documents are

scripts/gpu-bench-table.py is the command line:

    scripts/gpu-bench-table.py w1.json > w1.md
    scripts/gpu-bench-table.py bench/results/*/w1-part*.json      # parts of one W1 run
    build/tools/w1 --size tiny --device sim --caps 0.02,0 | scripts/gpu-bench-table.py -
    scripts/gpu-bench-table.py w2-out/w2.json > w2.md

Example W1 row:
    | flux-dit | 8 | calibrated | 4.2 | 0.347 | 0.345 | 18.96 | 54.7 | 0.176 | 6.98 | 22.9 | 0.344 | 1.00 | ok |
"""

from __future__ import annotations

GB = 1e9


def fmt(value, spec: str) -> str:
    """A figure with ``spec``, or "-" when it was not measured."""
    return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------------------------------------
# W1 and W1-py.
# ---------------------------------------------------------------------------------------------

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
        # The target: without a profile, <= 1.05 x the calibrated step at the same cap.
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


def w1_table(docs: list) -> str:
    """The W1 / W1-py table of one or more documents: rows in cap order, a footer per document."""
    rows = sorted(((doc, row) for doc in docs for row in doc.get("rows", [])),
                  key=lambda pair: sort_key(pair[1]))
    lines = [HEAD, "| " + " | ".join(["---"] * 14) + " |"]
    lines += [line(doc, row) for doc, row in rows]
    lines.append("")
    lines += [footer(doc) for doc in docs]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# W2.
# ---------------------------------------------------------------------------------------------


def profile_cell(r: dict) -> str:
    setup, after = r.get("profile_setup") or {}, r.get("profile_report") or {}
    if not setup and not after:
        return "-"
    s = f"{setup.get('status', '?')} → {after.get('status', '?')}"
    kinds = [k for k in (setup.get("profile_measurement_kind"),
                         after.get("profile_measurement_kind")) if k]
    if kinds:
        s += " (" + " → ".join(dict.fromkeys(kinds)) + ")"
    budget = after.get("resident_budget_gb", setup.get("resident_budget_gb"))
    if budget is not None:
        s += f", budget {budget:.2f}"
    return s


def w2_table(result: dict) -> str:
    """The W2 table of one w2_py.py document, the quantization notes and the targets."""
    head = ("| variant | cap GiB | route | setup s | first step s | median step s | "
            "streamed GB/step | GB/s | peak VRAM GiB | peak RSS GiB | bound s | efficiency | "
            "max abs diff | profile (setup → end) |")
    lines = [head, "| " + " | ".join(["---"] * 14) + " |"]
    for r in result["rows"]:
        cap = "none" if r.get("cap_gib") is None else f"{r['cap_gib']:g}"
        route = {"group": "sdnq + diffusers leaf"}.get(r["route"], r["route"])
        if r.get("error") and r.get("median_step_s") is None:
            what = "" if r["error"].startswith("skipped") else "failed: "
            lines.append(f"| {r['variant']} | {cap} | {route} | {what}"
                         f"{r['error'][:100].replace('|', '/')} |" + " - |" * 10)
            continue
        med = fmt(r.get("median_step_s"), ".3f")
        if r["route"] == "calibrated":
            med = f"**{med}**"
        cells = [r["variant"], cap, route, fmt(r.get("setup_s"), ".1f"),
                 fmt(r.get("first_step_s"), ".3f"), med,
                 fmt(r.get("streamed_gb_per_step"), ".2f"), fmt(r.get("achieved_gbps"), ".1f"),
                 fmt(r.get("peak_vram_gib"), ".2f"), fmt(r.get("peak_host_rss_gib"), ".1f"),
                 fmt(r.get("bound_s"), ".3f"), fmt(r.get("efficiency"), ".2f"),
                 fmt(r.get("max_abs_diff_vs_resident"), ".3g"), profile_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    t_res = ", ".join(f"{k} {v:.3f} s" for k, v in result["t_resident_s"].items() if v)
    lines.append(
        f"{'GPU: ' + str(result.get('gpu')) if result['cuda'] else 'sim device (CPU numbers)'}; "
        f"driver {result.get('driver') or '-'}; B_pinned {fmt(result.get('b_pinned_gbps'), '.1f')}"
        f" GB/s; T_resident {t_res or '-'}; torch {result.get('torch_version')}; diffusers "
        f"{result.get('diffusers_version')}; sdnq {result.get('sdnq_version')}; commit "
        f"{result.get('commit') or '-'}")
    if result.get("quantization"):
        lines += ["", "Quantization (sdnq_post_load_quant, not part of setup):", ""]
        for v, q in result["quantization"].items():
            inv = q.get("inventory", {})
            dense = inv.get("dense_linear_layers", [])
            lines.append(
                f"- {v}: {fmt(q.get('seconds'), '.1f')} s ({q.get('where')}), to host "
                f"{fmt(q.get('to_host_s'), '.1f')} s; {inv.get('quantized_layers')} quantized "
                f"layers ({'; '.join(f'{n} × {k}' for k, n in inv.get('layouts', {}).items())}), "
                f"{fmt(inv.get('model_bytes', 0) / GB, '.2f')} GB in all; ddo runs "
                f"{inv.get('ddo_runs_layers')} of them"
                + (f", refuses {inv.get('ddo_refuses')}" if inv.get("ddo_refuses") else "")
                + f"; left dense: {len(dense)} Linear layers, "
                f"{fmt(inv.get('dense_linear_bytes', 0) / GB, '.3f')} GB: "
                + ", ".join(d["name"] for d in dense))
    if result.get("targets"):
        lines += ["", "Targets:", ""]
        for t in result["targets"]:
            mark = {True: "met", False: "MISSED", None: "not measured"}[t["ok"]]
            lines.append(f"- {t['what']}: {fmt(t['value'], '.3f')} — {mark}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# W4: quantized compute (bench/python/w4_quantized.py) and its kernel table (w4_profile.py).
# ---------------------------------------------------------------------------------------------

W4_ROUTE_ORDER = {"resident": 0, "int8-resident": 1, "fp8-resident": 2, "quantize-noprofile": 3,
                  "quantize-calibration": 4, "quantize-calibrated": 5, "fp8-noprofile": 6,
                  "fp8-calibration": 7, "fp8-calibrated": 8, "dequant-noprofile": 9,
                  "dequant-calibrated": 10}


def w4_table(doc: dict) -> str:
    """One W4 document: a row per model route (step seconds against the bf16 resident step,
    output against bf16), then the GEMM rows, then the machine line."""
    t_res = doc.get("t_resident_s")
    head = ("| workload | route | cap GiB | median step s | vs bf16 resident | streamed GB/step | "
            "peak VRAM GiB | rel L2 vs bf16 | cosine |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    rows = [r for r in doc.get("rows", []) if r.get("route") != "gemm"]
    rows.sort(key=lambda r: (r.get("cap_gib") or 0, W4_ROUTE_ORDER.get(r.get("route"), 9)))
    lines = []
    for r in rows:
        step = r.get("median_step_s")
        if r.get("error"):
            lines.append(f"| {r.get('workload', '-')} | {r.get('route')} | "
                         f"{fmt(r.get('cap_gib'), 'g')} | failed: {str(r['error'])[:80]} | | | | | |")
            continue
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r.get("workload", "-"), r.get("route"), fmt(r.get("cap_gib"), "g"), fmt(step, ".3f"),
            fmt(step / t_res if step and t_res else None, ".2f"),
            fmt(r.get("streamed_gb_per_step"), ".2f"), fmt(r.get("peak_vram_gib"), ".2f"),
            fmt(r.get("rel_l2"), ".4f"), fmt(r.get("cosine"), ".5f")))
    out = head + "\n".join(lines) + "\n"
    gemm = [r for r in doc.get("rows", []) if r.get("route") == "gemm"]
    if gemm:
        out += ("\n| GEMM (out x in) | tokens | bf16 ms | fp8 layer ms | fp8 path | int8 layer ms | "
                "int8 path |\n| --- | --- | --- | --- | --- | --- | --- |\n")
        out += "\n".join("| {}x{} | {} | {} | {} | {} | {} | {} |".format(
            r["out"], r["inp"], r.get("tokens"), fmt(r.get("bf16_ms"), ".3f"),
            fmt(r.get("fp8_ms"), ".3f"), r.get("fp8_path", "-"), fmt(r.get("int8_ms"), ".3f"),
            r.get("int8_path", "-")) for r in gemm) + "\n"
    return out + footer(doc)


def w4_profile_table(doc: dict) -> str:
    """One w4_profile document: the step seconds, the kernel categories of one profiled step of
    bf16 and fp8 (GPU milliseconds, share, kernels), and the GEMM variants per shape."""
    fam = doc.get("family", "?")
    bf16, fp8 = doc.get("bf16_profile") or {}, doc.get("fp8_profile") or {}
    out = [f"Kernel table, {fam} ({doc.get('tokens')} tokens), all resident: bf16 "
           f"{fmt(doc.get('bf16_step_s'), '.4f')} s per step, fp8 {fmt(doc.get('fp8_step_s'), '.4f')} s "
           f"(rel L2 vs bf16 {fmt(doc.get('fp8_rel_l2'), '.4f')}).", "",
           "| kernels | bf16 ms | bf16 share | fp8 ms | fp8 share | fp8 kernels |",
           "| --- | --- | --- | --- | --- | --- |"]
    cats = sorted(set(bf16.get("categories", {})) | set(fp8.get("categories", {})),
                  key=lambda c: -(fp8.get("categories", {}).get(c, {}).get("ms", 0)))
    for c in cats:
        b = bf16.get("categories", {}).get(c, {})
        f = fp8.get("categories", {}).get(c, {})
        out.append("| {} | {} | {} | {} | {} | {} |".format(
            c, fmt(b.get("ms"), ".1f"), fmt(100 * b["share"] if "share" in b else None, ".1f"),
            fmt(f.get("ms"), ".1f"), fmt(100 * f["share"] if "share" in f else None, ".1f"),
            f.get("count", "-")))
    out.append("| GPU busy | {} | | {} | | {} |".format(
        fmt(bf16.get("gpu_busy_ms"), ".1f"), fmt(fp8.get("gpu_busy_ms"), ".1f"),
        fp8.get("kernel_count", "-")))
    gemm = doc.get("gemm") or []
    if gemm:
        out += ["", "| GEMM (out x in) | bf16 ms | fp8 layer ms | scaled_mm row-wise exact / fast ms | "
                "tensor-wise exact / fast ms | layer rel L2 |", "| --- | --- | --- | --- | --- | --- |"]
        for r in gemm:
            out.append("| {}x{} | {} | {} | {} / {} | {} / {} | {} |".format(
                r["out"], r["inp"], fmt(r.get("bf16_ms"), ".3f"), fmt(r.get("layer_fp8_ms"), ".3f"),
                fmt(r.get("rowwise_exact_ms"), ".3f"), fmt(r.get("rowwise_fast_ms"), ".3f"),
                fmt(r.get("tensorwise_exact_ms"), ".3f"), fmt(r.get("tensorwise_fast_ms"), ".3f"),
                fmt(r.get("layer_fp8_rel_l2"), ".4f")))
    return "\n".join(out) + "\n\n" + footer(doc)


def lora_table(doc: dict) -> str:
    """The LoRA benchmark (bench/python/lora_bench.py): one row per figure, with its target."""
    base = doc.get("base_step_s")

    def ratio(key):
        v = doc.get(key)
        return fmt(v / base if v and base else None, ".3f")

    read = doc.get("read_targeted_once_s")
    rows = [
        ("step without adapters", fmt(base, ".4f") + " s", "1.000x", "the reference"),
        ("step, rank-{} LoRA unfused".format(doc.get("rank")),
         fmt(doc.get("unfused_step_s"), ".4f") + " s", ratio("unfused_step_s") + "x", "<= 1.05x"),
        ("step, fused", fmt(doc.get("fused_step_s"), ".4f") + " s", ratio("fused_step_s") + "x",
         "1.00x"),
        ("fuse while attached", fmt(doc.get("fuse_s"), ".2f") + " s",
         fmt(doc["fuse_s"] / read if doc.get("fuse_s") and read else None, ".2f") +
         "x one read of the targeted weights", "<= 2x"),
        ("unfuse while attached", fmt(doc.get("unfuse_s"), ".2f") + " s",
         fmt(doc["unfuse_s"] / read if doc.get("unfuse_s") and read else None, ".2f") +
         "x one read", "<= 2x"),
        ("switch to a second adapter", fmt(doc.get("switch_s"), ".2f") + " s", "-", "-"),
        ("step with the second adapter", fmt(doc.get("switched_step_s"), ".4f") + " s",
         ratio("switched_step_s") + "x", "<= 1.05x"),
    ]
    out = ["| what | measured | against | target |", "| --- | --- | --- | --- |"]
    out += ["| {} | {} | {} | {} |".format(*r) for r in rows]
    out.append("")
    out.append(f"Cap {fmt(doc.get('cap_gib'), 'g')} GiB; targeted weights "
               f"{fmt(doc.get('targeted_gb'), '.2f')} GB, adapter {fmt(doc.get('adapter_gb'), '.3f')} GB; "
               f"fused against unfused output: rel L2 {fmt(doc.get('fused_vs_unfused_rel_l2'), '.4f')}.")
    return "\n".join(out) + "\n\n" + footer(doc)


# ---------------------------------------------------------------------------------------------
# Any of them.
# ---------------------------------------------------------------------------------------------


def table(docs: list) -> str:
    """W2 documents get w2_table (one after another), the others (W1, W1-py) one w1_table."""
    if docs and all(doc.get("benchmark") == "w2-py" for doc in docs):
        return "\n".join(w2_table(doc) for doc in docs)
    if any(doc.get("benchmark") == "w2-py" for doc in docs):
        raise ValueError("W2 documents make their own table: pass them apart from W1 / W1-py")
    return w1_table(docs)
