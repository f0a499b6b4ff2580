#!/usr/bin/env python3
"""Writes docs/benchmarks.md from bench/results/: one table per workload, the latest run of each,
with its command, card and date. The tables come from the JSON documents the benchmarks wrote
(bench/python/bench_tables.py renders W1, W1-py and W2), so the page cannot drift from the
results or contradict itself; a run's own README in its folder says what it showed.

    python3 scripts/benchmarks-doc.py              # rewrites docs/benchmarks.md
    python3 scripts/benchmarks-doc.py --check      # exit 1 when docs/benchmarks.md is stale

"Latest" is the newest results folder (folders are named <date>-<card>-<commit>[-what]) holding
a document of that workload; documents in one folder (W1 run in parts) are joined.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "benchmarks.md"
sys.path.insert(0, str(ROOT / "bench" / "python"))
import bench_tables  # noqa: E402  (the one table writer)

# The workloads, in the order of the page: (title, what it measures, glob of its documents,
# the benchmark field the documents carry).
WORKLOADS = [
    ("W1-py: FLUX.1-dev-size transformer, diffusers' model through the Python package",
     "diffusers' `FluxTransformer2DModel` at FLUX.1-dev size (23.8 GB bf16, random weights), "
     "4096 image + 512 text tokens, batch 1, median step after a warm-up. Routes: all resident; "
     "ddo without a profile (`noprofile`), its calibration run and the run applying that profile "
     "(`calibrated`); diffusers' group offload (`diffusers leaf` / `block`). `bound` is "
     "max(T_resident, streamed bytes / B_pinned), B_pinned the card's measured pinned "
     "host-to-device bandwidth; efficiency = bound / step.",
     "w1py*.json", ("w1-py",)),
    ("W1: FLUX.1-size MMDiT in LibTorch (C++)",
     "A FLUX.1-size MMDiT built from stock LibTorch layers (19 double + 38 single blocks, hidden "
     "3072, 4096 + 512 tokens, bf16, 23.8 GB), one forward per step, under emulated VRAM caps.",
     "w1*.json", ("w1",)),
    ("W2: SDNQ-quantized FLUX transformer",
     "The W1-py transformer quantized by the `sdnq` package (int8 per row; uint4 in groups of "
     "64), run under ddo as it is.",
     "w2.json", ("w2", "w2-py")),
]


def folder_key(folder: Path) -> str:
    return folder.name  # <date>-...: sorts by date, then name


def documents(pattern: str, kinds: tuple) -> tuple[Path, list] | None:
    """The newest folder's documents of one workload, or None."""
    by_folder: dict[Path, list] = {}
    for path in RESULTS.rglob(pattern):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("benchmark") not in kinds:
            continue
        top = path.relative_to(RESULTS).parts[0]
        by_folder.setdefault(RESULTS / top, []).append((path, doc))
    if not by_folder:
        return None
    newest = max(by_folder, key=folder_key)
    return newest, [doc for _, doc in sorted(by_folder[newest], key=lambda p: str(p[0]))]


def load_rows(doc: dict) -> str:
    """The loading benchmark (bench/python/load_from_disk.py) as a table."""
    head = ("| route | cap GiB | host RAM cap GiB | page cache | setup s | load GB/s | "
            "peak RSS GiB | step s |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n")
    lines = []
    for r in doc.get("rows", []):
        load = r.get("load") or {}
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r.get("route", "-"), bench_tables.fmt(r.get("cap_gib"), "g"),
            bench_tables.fmt(r.get("host_ram_cap_gib"), "g"), r.get("cache", "-"),
            bench_tables.fmt(r.get("setup_s"), ".2f"), bench_tables.fmt(load.get("gbps"), ".2f"),
            bench_tables.fmt(r.get("peak_rss_gib"), ".2f"), bench_tables.fmt(r.get("step_s"), ".3f")))
    m = doc.get("machine", {})
    foot = (f"\nGPU: {m.get('gpu', '?')}; torch {m.get('torch_full', m.get('torch_version', '?'))}; "
            f"commit {doc.get('commit', '?')}; command `{doc.get('command', '?')}`\n")
    return head + "\n".join(lines) + "\n" + foot


def w6_rows(doc: dict) -> str:
    """W6 (bench/python/w6_generation.py): whole generations, a cold process per row."""
    head = ("| row | generation s | encode s | denoise s | decode s | streamed GB | "
            "read from disk GB | peak VRAM GiB | peak RSS GiB | max pixel diff | PSNR dB |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    lines = []
    for r in doc.get("rows", []):
        report = r.get("report")
        if report is None:
            lines.append(f"| {r.get('row', '-')} | failed | - | - | - | - | - | - | - | - | - |")
            continue
        stages = report.get("stages", {})
        gen = report.get("generation", {})
        vram = gen.get("peak_vram_gb")
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r.get("row", "-"), bench_tables.fmt(report.get("seconds"), ".1f"),
            *(bench_tables.fmt(stages.get(n, {}).get("seconds"), ".1f")
              for n in ("encode", "denoise", "decode")),
            bench_tables.fmt(gen.get("bytes_streamed", 0) / 1e9, ".1f"),
            bench_tables.fmt(gen.get("disk_bytes_read", 0) / 1e9, ".1f"),
            bench_tables.fmt(vram if vram is not None and vram >= 0 else None, ".2f"),
            bench_tables.fmt(gen.get("peak_rss_gb"), ".2f"),
            bench_tables.fmt(r.get("max_pixel_difference"), "d"),
            bench_tables.fmt(r.get("psnr_db"), ".1f")))
    versions = doc.get("versions", {})
    foot = (f"\nGPU: {doc.get('card', '?')}; torch {versions.get('torch', '?')}, diffusers "
            f"{versions.get('diffusers', '?')}; commit {doc.get('commit', '?')}; command "
            f"`{doc.get('command', '?')}`\n")
    return head + "\n".join(lines) + "\n" + foot


def section(out: list, title: str, what: str, pattern: str, kinds: tuple, render_doc) -> None:
    """Appends a workload's section: its title, what it measures, and the newest run's documents
    each rendered by `render_doc` (or a line saying there is none)."""
    out += [title, "", what, ""]
    found = documents(pattern, kinds)
    if found is None:
        out += ["No run in `bench/results/` yet.", ""]
        return
    folder, docs = found
    out += [run_line(folder), ""] + [render_doc(d).rstrip() + "\n" for d in docs]


def run_line(folder: Path) -> str:
    return f"Run of {folder.name[:10]}: `bench/results/{folder.name}/`."


def render() -> str:
    out = [
        "# Benchmarks",
        "",
        "Generated by `scripts/benchmarks-doc.py` from `bench/results/` (do not edit by hand): for",
        "each workload the newest run, its command, card and commit. Compare timings only within one",
        "run: the GPU machine is an H100 or an H200 depending on the day. Each run's folder has a",
        "README saying what it showed and what was missed.",
        "",
    ]
    for title, what, pattern, kinds in WORKLOADS:
        found = documents(pattern, kinds)
        out += [f"## {title}", "", what, ""]
        if found is None:
            out += ["No run in `bench/results/` yet.", ""]
            continue
        folder, docs = found
        out += [run_line(folder), "", bench_tables.table(docs).rstrip(), ""]
    out += ["## W4: quantized compute (`quantize=\"fp8\"` / `\"int8\"`)", "",
            "The W1-py transformer (FLUX.1-dev size) and Wan 2.1-14B's transformer (480x832, 21 "
            "frames) with their Linears computed by the card's fp8 or int8 GEMM: bf16 resident, "
            "quantized resident, and fp8 under ddo at each cap; the output against the bf16 "
            "model's. The kernel tables (`bench/python/w4_profile.py`) show where one resident "
            "step's GPU time goes, by kernel category, and each Linear shape's GEMM variants.", ""]
    found_any = False
    for fam in ("flux", "wan"):
        found = documents(f"w4*{fam}*.json" if fam == "wan" else "w4.json", ("w4",))
        if found is not None:
            found_any = True
            folder, docs = found
            out += [run_line(folder), ""] + [bench_tables.w4_table(d).rstrip() + "\n" for d in docs]
        found = documents(f"w4-profile-{fam}*.json", ("w4-profile",))
        if found is not None:
            found_any = True
            folder, docs = found
            out += [run_line(folder), ""]
            out += [bench_tables.w4_profile_table(d).rstrip() + "\n" for d in docs]
    if not found_any:
        out += ["No run in `bench/results/` yet.", ""]
    section(out, "## LoRA: adapters unfused and fused under ddo",
            "The W1-py transformer under ddo at one cap (`bench/python/lora_bench.py`): a random "
            "LoRA on every attention and MLP Linear loaded through diffusers' `load_lora_adapter` "
            "while attached, the step unfused and fused against the model without adapters, the "
            "seconds to fuse and unfuse while attached against one read of the targeted weights "
            "from pinned memory, and a switch to a second adapter.",
            "lora*.json", ("lora",), bench_tables.lora_table)
    section(out, "## Loading from disk: the W1-py transformer from safetensors shards",
            "A fresh process per row reads the sharded checkpoint and attaches (`cold`: the files "
            "dropped from the page cache first). `ddo_disk` caps host RAM so that part of the "
            "streamed weights is read from the files every step (the disk tier).",
            "load*.json", ("w1-py-from-disk",), load_rows)
    section(out, "## W6: whole generations, from the pipeline folder to the written output",
            "A cold process per row (`examples/python/generate.py`): the text encoders, the "
            "denoising steps and the VAE decode, each component read from the folder and "
            "released after its stage. Rows: all resident (the reference the pixels are compared "
            "with); ddo under each cap; diffusers' offload routes and diffusers-dynamic-offloader "
            "under the same caps. Streamed, disk and VRAM figures are ddo's GenerationMeter's.",
            "w6*.json", ("W6",), w6_rows)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the page is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python3 scripts/benchmarks-doc.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
