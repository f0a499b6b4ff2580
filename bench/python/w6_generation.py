#!/usr/bin/env python3
"""W6 (docs/benchmarks.md): whole generations, a cold process per row, from the pipeline folder
on disk to the written output, with examples/python/generate.py.

Rows: all resident without ddo (the reference the outputs are compared with); then, at each --caps
value (GiB), ddo (host RAM capped by --host-ram-cap) and each of --others: diffusers' group
offload at leaf level with streams, its model offload, its sequential offload, and
diffusers-dynamic-offloader from PyPI (generate.py --offload; capped through the allocator's
per-process fraction; their host RAM is not capped, their peak RSS is reported beside it), and
ddo with each of --quantize (generate.py --quantize: the transformer's Linears computed in fp8 or
int8). Every row's output is compared with the reference: max pixel difference and PSNR. Each
row's report (seconds per stage, bytes read and streamed, peak VRAM and RSS; ddo's
GenerationMeter report for ddo rows) goes into --out with the command, the card, the versions
and the commit.

    python bench/python/w6_generation.py --family flux --folder /disk/flux-full --size full \\
        --caps 8,16 --host-ram-cap 32 --out bench/results/w6-flux.json --commit $(git rev-parse HEAD)
    python bench/python/w6_generation.py --family wan --folder /tmp/wan --size tiny --device sim \\
        --caps 0.01 --out /tmp/w6.json          # a smoke test without a GPU
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATE = os.path.join(ROOT, "examples", "python", "generate.py")


def run_row(args, extra, name):
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        output = os.path.join(tmp, "out.png" if args.family == "flux" else "out.webp")
        cmd = [sys.executable, GENERATE, "--random", args.folder, "--family", args.family,
               "--size", args.size, "--device", args.device, "--seed", "0",
               "--output", output, "--report", report_path] + args.generate_args.split() + extra
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            return {"row": name, "command": " ".join(cmd), "error": done.stderr[-2000:]}
        with open(report_path) as f:
            report = json.load(f)
        from PIL import Image

        frames = []
        with Image.open(output) as im:
            for i in range(getattr(im, "n_frames", 1)):
                im.seek(i)
                frames.append(np.asarray(im.convert("RGB"), dtype=np.int16))
        return {"row": name, "command": " ".join(cmd), "wall_seconds": wall, "report": report,
                "pixels": np.stack(frames)}


def psnr(pixels: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio of 8-bit pixels against the reference, in dB (inf when equal)."""
    mse = float(np.mean((pixels.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("flux", "wan"), default="flux")
    p.add_argument("--folder", required=True, help="the random folder (written once)")
    p.add_argument("--size", choices=("tiny", "full"), default="full")
    p.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--caps", default="8,16", help="GiB, comma separated")
    p.add_argument("--host-ram-cap", type=float)
    p.add_argument("--generate-args", default="", help="more generate.py flags for every row")
    p.add_argument("--ddo-args", default="",
                   help="more generate.py flags for ddo's rows only (ddo's options, which "
                        "generate.py refuses on routes without ddo)")
    p.add_argument("--quantize", default="",
                   help="comma separated generate.py --quantize types (fp8, int8): a ddo row "
                        "with each at every cap")
    p.add_argument("--others", default="diffusers-group-leaf,diffusers-model,"
                   "diffusers-sequential,diffusers-dynamic-offloader",
                   help="generate.py --offload routes run at each cap beside ddo (cuda only)")
    p.add_argument("--no-resident", action="store_true",
                   help="skip the all-resident row (run it in another call; pixels are then not "
                        "compared)")
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default="")
    args = p.parse_args()

    import torch
    import diffusers

    result = {
        "benchmark": "W6", "command": " ".join(sys.argv), "commit": args.commit,
        "card": torch.cuda.get_device_name() if args.device == "cuda" else "sim",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "python": platform.python_version()},
        "family": args.family, "size": args.size, "rows": [],
    }
    reference = None

    def add(extra, name):
        # Written after every row: a run cut short by its time limit keeps the rows it finished.
        nonlocal reference
        row = run_row(args, extra, name)
        pixels = row.pop("pixels", None)
        if name == "resident":
            reference = pixels
        if pixels is not None and reference is not None and pixels.shape == reference.shape:
            row["max_pixel_difference"] = int(np.abs(pixels - reference).max())
            row["psnr_db"] = psnr(pixels, reference)
        if "report" in row:
            print(f"{row['row']}: {row['wall_seconds']:.1f} s "
                  f"(generation {row['report']['seconds']:.1f} s)", file=sys.stderr)
        else:
            print(f"{row['row']}: failed\n{row['error']}", file=sys.stderr)
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    if not args.no_resident:
        add(["--no-ddo"], "resident")
    for cap in [c for c in args.caps.split(",") if c]:
        extra = ["--vram-cap", cap] + args.ddo_args.split()
        if args.host_ram_cap:
            extra += ["--host-ram-cap", str(args.host_ram_cap)]
        add(extra, f"ddo cap {cap} GiB")
        for q in [q for q in args.quantize.split(",") if q]:
            add(extra + ["--quantize", q], f"ddo {q} cap {cap} GiB")
        if args.device != "cuda":
            continue  # the others need a GPU
        for route in [r for r in args.others.split(",") if r]:
            add(["--vram-cap", cap, "--offload", route], f"{route} cap {cap} GiB")
    print(args.out)


if __name__ == "__main__":
    main()
