#!/usr/bin/env python3
"""Repeat generations in one process: attach time of each, with and without warm_process.

The staged flow releases the denoiser after each generation and attaches it again for the next.
This runs that flow on W1-py's FluxTransformer2DModel (bench/python/bench_common.py sizes: FLUX.1-dev
dimensions, seeded random bf16 weights) for --generations generations per mode, all in one
process, each generation being:

    attach   ddo.enable_offload(transformer, preset=...)    timed: the setup the user waits for
    denoise  --steps forward passes                         timed: must not change with the mode
    release  offload.remove()                                timed

Modes, in order: "cold" (--cold-preset, default one_shot_fast: every attach pins and plans again),
and "warm" (preset warm_process: pinned-weight and plan caches, so a later attach pins nothing and
copies nothing), and with --modes warm_keep, warm_process whose remove(keep_residents=True)
leaves the residents on the GPU so a later attach moves nothing either. All use the same VRAM
cap (--cap) and the same fixed resident budget
(--budget GiB, so the two modes place the same residents). Per generation: attach, steps and
release seconds, the weight cache's status and reused bytes, whether the plan was cached, host RSS
after release, and the output's max abs difference from the first generation of the first mode
(0.0: outputs equal). The caches are cleared between modes. One JSON line per generation on
stdout; a summary table at the end; --out FILE.json writes everything.

    python bench/python/warm_attach.py --size full --device cuda --cap 8 --out warm_attach.json
    python bench/python/warm_attach.py --size tiny --device sim      # CPU smoke test (CI)

Needs the ddo package (PYTHONPATH=<build>/python or an installed wheel), torch and diffusers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402  (W1-py's model, inputs and host-memory helpers)


def log(msg: str) -> None:
    print(f"[warm_attach] {msg}", file=sys.stderr, flush=True)


bc.set_logger(log)


def rss_gib() -> float | None:
    rss, _ = bc.host_rss_gib()
    return rss


def generation(model, inputs, args, preset: str, cuda: bool,
               keep_residents: bool = False) -> tuple[dict, object]:
    import torch

    import ddo

    options = dict(preset=preset, execution_device="cuda" if cuda else "sim",
                   resident_module_budget_gb=args.budget, auto_budget_policy="off")
    if cuda:
        options["vram_cap_gb"] = args.cap
    else:
        options["sim_device_capacity_gb"] = args.cap
        options["small_tensor_threshold_bytes"] = 0
    options.update(json.loads(args.overrides))
    bc.sync(cuda)
    t0 = time.perf_counter()
    offload = ddo.enable_offload(model, **options)
    bc.sync(cuda)
    attach_s = time.perf_counter() - t0
    setup = offload.report()["setup"]
    first, times, finite, out = bc.run_steps(model, inputs, args.steps, cuda, return_out=True)
    out = out.float().cpu() if isinstance(out, torch.Tensor) else out
    t0 = time.perf_counter()
    offload.remove(keep_residents=keep_residents)
    bc.sync(cuda)
    release_s = time.perf_counter() - t0
    bc.trim_host_memory()
    cache = setup.get("weight_cache", {})
    row = dict(
        preset=preset,
        attach_s=attach_s,
        setup_s=setup["seconds"],
        pin_s=setup["pin_seconds"],
        moves_s=setup["moves_seconds"],
        plan_cached=setup.get("plan_cached"),
        weight_cache=cache.get("status"),
        reused_gib=cache.get("reused_bytes", 0) / 2**30,
        pinned_new_gib=cache.get("pinned_new_bytes", setup.get("pinned_bytes", 0)) / 2**30,
        streamed_gib=setup["bytes"]["streamed"] / 2**30,
        resident_gib=setup["bytes"]["resident"] / 2**30,
        on_device_gib=setup["bytes"].get("on_device", 0) / 2**30,
        kept_residents=keep_residents,
        first_step_s=first,
        median_step_s=sorted(times)[len(times) // 2] if times else None,
        finite=finite,
        release_s=release_s,
        rss_gib_after=rss_gib(),
    )
    return row, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(bc.SIZES), default="full")
    p.add_argument("--device", choices=("cuda", "sim"), default=None,
                   help="default: cuda when available, else sim")
    p.add_argument("--generations", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per generation (>= 1)")
    p.add_argument("--cap", type=float, default=None,
                   help="VRAM cap GiB (sim: the simulated card); default 8 full, 0.1 tiny")
    p.add_argument("--budget", type=float, default=None,
                   help="fixed resident budget GiB for both modes; default 4 full, 0 tiny")
    p.add_argument("--cold-preset", default="one_shot_fast")
    p.add_argument("--modes", default="cold,warm",
                   help="comma list of cold, warm, warm_keep (warm_process, and remove() keeps "
                        "the residents on the GPU between generations)")
    p.add_argument("--overrides", default="{}", help="JSON config fields for every attach")
    p.add_argument("--out", default=None, help="write all rows here (JSON)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.generations < 1:
        p.error("--steps and --generations must be >= 1")

    import torch

    import ddo

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "sim")) == "cuda"
    if args.cap is None:
        args.cap = 8.0 if args.size == "full" else 0.1
    if args.budget is None:
        args.budget = 4.0 if args.size == "full" else 0.0
    os.environ.setdefault("DDO_PROFILE_DIR", tempfile.mkdtemp(prefix="ddo-warm-attach-"))

    model, nbytes, params, build = bc.build_model(args.size, "cuda" if cuda else "cpu")
    inputs = bc.make_inputs(args.size, "cuda" if cuda else "cpu", guidance=True)
    presets = {"cold": args.cold_preset, "warm": "warm_process", "warm_keep": "warm_process"}
    rows, reference = [], None
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in presets:
            p.error(f"--modes: unknown mode {mode!r}; use cold, warm, warm_keep")
        ddo.clear_pinned_weight_cache()
        ddo.clear_plan_cache()
        for gen in range(1, args.generations + 1):
            # warm_keep: the last generation restores the model fully.
            keep = mode == "warm_keep" and cuda and gen < args.generations
            row, out = generation(model, inputs, args, presets[mode], cuda, keep)
            if reference is None:
                reference = out
            row.update(mode=mode, generation=gen,
                       max_abs_diff=float((out - reference).abs().max()) if out is not None
                       else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
        ddo.clear_pinned_weight_cache()

    print(f"\n{'mode':5} {'gen':>3} {'attach s':>9} {'pin s':>7} {'cache':>5} {'plan':>5} "
          f"{'step s':>8} {'release s':>9} {'RSS GiB':>8} {'diff':>6}")
    for r in rows:
        print(f"{r['mode']:5} {r['generation']:>3} {r['attach_s']:>9.3f} {r['pin_s']:>7.3f} "
              f"{str(r['weight_cache']):>5} {str(r['plan_cached']):>5} "
              f"{r['median_step_s'] or 0:>8.3f} {r['release_s']:>9.3f} "
              f"{r['rss_gib_after'] or 0:>8.2f} {r['max_abs_diff'] or 0:>6.3g}")
    if args.out:
        result = dict(command=" ".join(sys.argv), size=args.size, cuda=cuda, cap_gib=args.cap,
                      budget_gib=args.budget, steps=args.steps, model_bytes=nbytes,
                      params=params, build=build, machine=bc.machine_facts(cuda), rows=rows)
        bc.write_atomic(args.out, json.dumps(result, indent=2))
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
