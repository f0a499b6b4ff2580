#!/usr/bin/env python3
"""W1-py: diffusers' own FluxTransformer2DModel under ddo, against diffusers' group offload.

docs/design/0009-benchmarks.md, "W1-py": FLUX.1-dev dimensions (19 double + 38 single blocks, 24 heads
x 128, guidance embedding), random bf16 weights, 4096 image + 512 text tokens, batch 1, one
forward per step. Rows, all in one invocation:

  resident      the whole model on the GPU (.to("cuda")): gives T_resident
  calibration   per cap: ddo preset one_shot_fast, build_profile=True, steps inside profile_run()
  calibrated    per cap: the normal run (build_profile=False) applying the saved recommendation
  noprofile     per cap: a first run without a profile (no profile_name): the auto policy alone
  block, leaf   diffusers' enable_group_offload (block_level with 1 block per group / leaf_level,
                use_stream=True, record_stream=True), each in a subprocess of this script (its
                hooks are not removed cleanly), uncapped: they need little VRAM

Per row: setup s, first step s (the warm-up), median of --steps timed steps, streamed GB per step
(ddo: the offload's run counters over the timed steps; diffusers: the model's bytes, both routes
stream every weight each step), achieved GB/s, compute-stream wait per step (ddo), peak VRAM
(max of torch's peak reserved and the driver view sampled every --sample-ms), peak host RSS
(VmHWM, reset per row through /proc/self/clear_refs), bound = max(T_resident, streamed /
B_pinned) and efficiency = bound / median. B_pinned is measured in the same run (1 GiB pinned
host tensor -> GPU, best of 5). JSON is rewritten after every row (partial results survive a
timeout); scripts/gpu-bench-table.py writes the markdown table from it (the one writer, shared
with bench/w1).

  python bench/python/w1_py.py --out w1py.json --commit $(git rev-parse --short HEAD)
  scripts/gpu-bench-table.py w1py.json > w1py.md
  python bench/python/w1_py.py --size tiny --device sim          # CPU smoke test, sim device

Flags: --size full|tiny, --caps GiB list, --steps N, --routes resident,calibrated,noprofile,block,leaf,
--device cuda|sim (sim: ddo rows on the host simulation with sim_device_capacity_gb=cap, the
resident row on the CPU, diffusers routes skipped), --t-resident S (when the resident row is not
run), --overrides JSON (config fields for every ddo row), --sample-ms, --child-timeout,
--out FILE.json, --commit SHA. The profiles go to a fresh temporary directory
(DDO_PROFILE_DIR, set before the first enable_offload).

Needs the ddo package (PYTHONPATH=<build>/python or an installed wheel), torch and diffusers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402  (the measurement code all Python benchmarks share)
from bench_common import (  # noqa: E402
    GB,
    SIZES,
    VramMonitor,
    build_model,
    clear_cap,
    fill_step_figures,
    host_rss_gib,
    make_inputs,
    reset_host_peak,
    run_steps,
    sync,
    trim_host_memory,
)

T0 = float(os.environ.get("W1PY_T0", time.time()))  # a child logs on its parent's clock


def log(msg: str) -> None:
    print(f"[w1-py {time.time() - T0:7.1f}s] {msg}", flush=True)


bc.set_logger(log)


# ---------------------------------------------------------------------------------------------
# Workload sizes (bench_common.SIZES: full, tiny).
# ---------------------------------------------------------------------------------------------

# tiny: at 0.1 GiB the window is smaller than the streamed bytes (every step streams) and the
# recommendation is 0 (1 GiB headroom); at 1.5 GiB the calibrated run keeps everything resident.
DEFAULT_CAPS = {"full": "8,12,16,24", "tiny": "0.1,1.5"}
ALL_ROUTES = ("resident", "calibrated", "noprofile", "block", "leaf")


# ---------------------------------------------------------------------------------------------
# Rows.
# ---------------------------------------------------------------------------------------------


def base_row(route: str, cap, preset=None) -> dict:
    return dict(workload="flux-diffusers", route=route, cap_gib=cap, preset=preset)


# Each row function fills ``row`` as it goes, so a failure keeps what was measured before it.


def row_resident(ctx: dict, row: dict) -> None:
    import torch

    cuda = ctx["cuda"]
    model = ctx["model"]
    dev = "cuda" if cuda else "cpu"
    inputs = make_inputs(ctx["size"], dev, ctx["guidance"])
    reset_host_peak()
    with VramMonitor(cuda, ctx["sample_s"]) as mon:
        t0 = time.perf_counter()
        model.to(dev)
        sync(cuda)
        row["setup_s"] = time.perf_counter() - t0
        try:
            fill_step_figures(row, *run_steps(model, inputs, ctx["steps"], cuda))
        finally:
            mon.note_reserved()
            model.to("cpu")
            del inputs
            sync(cuda)
    row.update(mon.figures())
    row["peak_host_rss_gib"] = host_rss_gib()[1]
    row["streamed_gb_per_step"] = 0.0
    if cuda:
        torch.cuda.empty_cache()


def row_ddo(ctx: dict, row: dict, cap: float, calibrate: bool, profile: bool = True) -> None:
    """bench_common.ddo_row at ``cap`` under the profile w1py-cap<cap> (none without
    ``profile``), on fresh inputs."""
    inputs = make_inputs(ctx["size"], "cuda" if ctx["cuda"] else "cpu", ctx["guidance"])
    name = f"w1py-cap{cap:g}" if profile else None
    bc.ddo_row(dict(ctx, inputs=inputs), row, ctx["model"], cap, calibrate, name)


def row_diffusers(ctx: dict, row: dict, route: str) -> None:
    """Runs in its own process (--only-route): builds its own model, applies
    enable_group_offload, measures. Its hooks stay until the process ends."""
    import importlib.util

    import torch

    if importlib.util.find_spec("accelerate") is None:
        # diffusers' group-offload hooks call accelerate's send_to_device (NameError without it)
        raise RuntimeError("diffusers' enable_group_offload needs the accelerate package")
    if route == "block":
        options = dict(offload_type="block_level", num_blocks_per_group=1)
    else:
        options = dict(offload_type="leaf_level")
    options.update(use_stream=True, record_stream=True)
    row["group_offload"] = dict(options)
    model, nbytes, _, _ = build_model(ctx["size"], "cuda")
    inputs = make_inputs(ctx["size"], "cuda", ctx["guidance"])
    foreign = bc.foreign_vram_bytes("W1PY")
    trim_host_memory()
    reset_host_peak()
    with VramMonitor(True, ctx["sample_s"], foreign) as mon:
        t0 = time.perf_counter()
        model.enable_group_offload(
            onload_device=torch.device("cuda"), offload_device=torch.device("cpu"), **options
        )
        sync(True)
        row["setup_s"] = time.perf_counter() - t0
        log(f"{route}: enable_group_offload {row['setup_s']:.1f} s")
        fill_step_figures(row, *run_steps(model, inputs, ctx["steps"], True))
    row.update(mon.figures())
    row["peak_host_rss_gib"] = host_rss_gib()[1]
    row["streamed_gb_per_step"] = nbytes / GB  # both routes stream every weight each step
    row["achieved_gbps"] = None  # not observable from outside diffusers' hooks


def row_subprocess(ctx: dict, row: dict, route: str) -> None:
    flags = ["--only-route", route, "--size", ctx["size"], "--steps", str(ctx["steps"]),
             "--sample-ms", str(ctx["sample_s"] * 1e3)]
    bc.run_child_row(row, __file__, flags, "W1PY", T0, ctx["cuda"], ctx["child_timeout"], route)


# ---------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--caps", help="GiB list (default: 8,12,16,24 full; tiny values for tiny)")
    p.add_argument("--routes", default=",".join(ALL_ROUTES),
                   help="subset of resident,calibrated,noprofile,block,leaf (calibrated = "
                        "calibration + calibrated per cap; noprofile = no profile_name per cap)")
    p.add_argument("--t-resident", type=float, default=None,
                   help="T_resident in s when the resident row is not run")
    p.add_argument("--out", default="w1py.json")
    p.add_argument("--only-route", choices=("block", "leaf"), help=argparse.SUPPRESS)
    bc.add_common_args(p, child_timeout=300.0)
    args = p.parse_args(argv)
    bc.check_common_args(p, args)
    args.routes = bc.split_list(args.routes)
    bad = [r for r in args.routes if r not in ALL_ROUTES]
    if bad:
        p.error(f"unknown route(s) {bad}; choose from {','.join(ALL_ROUTES)}")
    args.caps = [float(c) for c in bc.split_list(args.caps or DEFAULT_CAPS[args.size])]
    return args


def child_main(args) -> int:
    ctx = dict(size=args.size, steps=args.steps, sample_s=args.sample_ms / 1e3, cuda=True,
               guidance=SIZES[args.size]["config"].get("guidance_embeds", False))
    row = base_row(args.only_route, None, "diffusers_group_offload")
    return bc.child_row(row, lambda r: row_diffusers(ctx, r, args.only_route), args.only_route,
                        args.row_out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.only_route:
        return child_main(args)

    profile_dir = bc.fresh_profile_dir("w1py-profiles-")
    log(f"importing torch, diffusers, ddo; profiles in {profile_dir}")
    import torch
    import diffusers  # noqa: F401
    import ddo

    cuda = bc.use_cuda(args.device)
    if cuda is None:
        return 2
    log(f"ddo from {os.path.dirname(ddo.__file__)}; device {'cuda' if cuda else 'sim'}; "
        f"size {args.size}; caps {args.caps}; routes {args.routes}; steps {args.steps}")

    result = dict(benchmark="w1-py", size=args.size, steps=args.steps, caps=args.caps,
                  routes=args.routes, overrides=args.overrides, cuda=cuda,
                  device="cuda" if cuda else "sim",
                  command=bc.command_line(),
                  commit=args.commit or bc.default_commit(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  profile_dir=profile_dir, rows=[])
    result.update(bc.machine_facts(cuda))

    def save() -> None:
        for r in result["rows"]:
            bc.set_bound(r, result.get("t_resident_s"), result.get("b_pinned_gbps"))
        bc.write_atomic(args.out, json.dumps(result, indent=1, default=str))

    model, nbytes, params, build = build_model(args.size, "cuda" if cuda else "cpu")
    guidance = bool(model.config.guidance_embeds)
    grid = SIZES[args.size]["grid"]
    result.update(model_gb=nbytes / GB, model_bytes=nbytes, parameters=params,
                  model_build_s=build["seconds"], model_build=build,
                  model_config={k: v for k, v in dict(model.config).items()
                                if not k.startswith("_")},
                  inputs=dict(image_tokens=grid[0] * grid[1], text_tokens=SIZES[args.size]["txt"],
                              batch=1, dtype="bfloat16", guidance=guidance))
    b = bc.measure_b_pinned(cuda)
    result.update(b_pinned_gbps=b["gbps"], b_pinned=b, t_resident_s=args.t_resident)
    save()

    ctx = dict(model=model, size=args.size, steps=args.steps, cuda=cuda, guidance=guidance,
               sample_s=args.sample_ms / 1e3, child_timeout=args.child_timeout,
               overrides=args.overrides)

    def add(route: str, cap, preset, fn, *fn_args) -> dict:
        label = route if cap is None else f"{route}@{cap:g}"
        log(f"{label}: start")
        row = base_row(route, cap, preset)

        def cleanup() -> None:
            if ctx.get("model") is not None:
                ddo.remove_offload(ctx["model"])
            clear_cap(cuda)

        bc.measure_row(row, lambda r: fn(ctx, r, *fn_args), label, cleanup)
        result["rows"].append(row)
        save()
        r = result["rows"][-1]
        if not r.get("error"):
            log(f"{label}: {bc.row_summary(r)}"
                + (f", profile {r['profile_report'].get('status')}"
                   if r.get("profile_report") else "")
                + ("" if r.get("output_finite", True) else ", OUTPUT NOT FINITE")
                + f" ({r['row_wall_s']:.1f} s)")
        return r

    if "resident" in args.routes:
        r = add("resident", None, None, row_resident)
        if r.get("median_step_s") is not None and args.t_resident is None:
            result["t_resident_s"] = r["median_step_s"]
            save()
    for cap in args.caps:
        if "noprofile" in args.routes:  # first: nothing measured yet in this process
            add("noprofile", cap, "one_shot_fast", row_ddo, cap, False, False)
        if "calibrated" in args.routes:
            add("calibration", cap, "one_shot_fast", row_ddo, cap, True)
            add("calibrated", cap, "one_shot_fast", row_ddo, cap, False)

    diffusers_routes = [r for r in ("block", "leaf") if r in args.routes]
    if diffusers_routes and not cuda:
        log(f"skipping diffusers routes {diffusers_routes}: enable_group_offload needs CUDA")
    elif diffusers_routes:
        if result["accelerate_version"] is None:
            log("accelerate is not installed: diffusers' group offload rows will fail")
        # Each child builds its own model: give back this process's host and device copies.
        ctx.pop("model")
        del model
        trim_host_memory()
        torch.cuda.empty_cache()
        for route in diffusers_routes:
            add(route, None, "diffusers_group_offload", row_subprocess, route)

    save()
    log(f"done: {args.out} (table: scripts/gpu-bench-table.py {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
