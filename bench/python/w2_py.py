#!/usr/bin/env python3
"""W2-py: W1-py's FluxTransformer2DModel quantized by the `sdnq` package (int8, uint4), under ddo.

docs/design/0009-benchmarks.md, "W2 flux-sdnq". FLUX.1-dev dimensions,
random bf16 weights (W1-py's seed and fill), 4096 image + 512 text tokens, batch 1, one forward
per step, quantized with `sdnq.sdnq_post_load_quant(model, weights_dtype=..., torch_dtype=bf16)`
(the package's defaults otherwise: uint4 takes its default group size, small and model-specific
layers stay dense; the rows list them). `sdnq` is GPL-3.0: this benchmark uses it as an oracle
and a comparison, ddo never imports it. Rows, all in one invocation, per variant (int8, uint4):

  resident     sdnq's own forward with the whole quantized model on the GPU: T_resident and the
               reference output
  calibration  per cap: ddo preset one_shot_fast, build_profile=True (the SDNQ runtime is picked
               by ddo from the model), zero resident
  probe        per cap where the calibration left a pending SDNQ probe: the normal run that
               probes it (profile status "probing"; kind sdnq_baseline_probe_pending -> sdnq_probe)
  calibrated   per cap: the normal run applying the saved recommendation (after a probe: the
               third run, applying the probe's result)
  group        sdnq + diffusers' enable_group_offload(leaf_level, use_stream=True,
               record_stream=True) in a subprocess (it builds and quantizes its own model)

and for bf16 (W1-py's ddo route): resident, calibration and calibrated at the same caps.

Per row: setup s, first step s, median of --steps timed steps, streamed GB/step (ddo's run
counters), achieved GB/s, peak VRAM (driver view and torch's reserved), peak RSS, bound =
max(T_resident of the row's variant, streamed / B_pinned), efficiency = bound / median, the
profile report (status and profile_measurement_kind at setup and after the region), and max |ddo
output - the resident sdnq output| on the same input. Quantization (on the GPU, weights returned
to the host) is timed and reported apart, not as setup.

  SDNQ_USE_TORCH_COMPILE=0 python bench/python/w2_py.py --out DIR --commit $(git rev-parse --short HEAD)
  python bench/python/w2_py.py --size tiny --device sim --out DIR     # CPU smoke test

Flags: --size full|tiny, --variants int8,uint4,bf16, --caps GiB list (0 = uncapped), --steps N,
--routes resident,ddo,group (ddo = calibration + probe + calibrated), --device cuda|sim (sim: ddo
rows on the host simulation, resident rows on the CPU, the group route on the CPU without
streams as a smoke test), --quant-mode device|host (device: quantize the model where it was
built, on the GPU, then move it to the host; host: move bf16 to the host first and let sdnq
quantize layer by layer with quantization_device=cuda, return_device=cpu), --group-size,
--quantized-matmul, --overrides JSON, --sample-ms, --child-timeout, --deadline-s, --out DIR
(w2.json, w2.md, env.json), --commit SHA. Profiles go to a fresh temporary directory (DDO_PROFILE_DIR).
"""

from __future__ import annotations

# Before sdnq is imported (here and in the subprocess rows): sdnq otherwise compiles its kernels
# with torch.compile at import, which is slow and not what ddo's op is compared against.
import os

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_tables import profile_cell, w2_table  # noqa: E402

GB, GiB = bc.GB, bc.GiB
T0 = float(os.environ.get("W2PY_T0", time.time()))  # a child logs on its parent's clock


def log(msg: str) -> None:
    print(f"[w2-py {time.time() - T0:7.1f}s] {msg}", flush=True)


bc.set_logger(log)

DEFAULT_CAPS = {"full": "4,6,8,12,0", "tiny": "0.1,4,0"}
ALL_ROUTES = ("resident", "ddo", "group")
ALL_VARIANTS = ("int8", "uint4", "bf16")
# The W2 targets (docs/design/0009-benchmarks.md).
TARGETS = {("int8", 8.0): 0.20, ("uint4", 4.0): 0.22}
TARGET_EFFICIENCY = 0.97


# ---------------------------------------------------------------------------------------------
# The model: build, quantize, inventory.
# ---------------------------------------------------------------------------------------------


def quantize(model, dtype: str, args, cuda: bool, on_device: bool):
    """sdnq_post_load_quant with the package's defaults (group size, skip keys) for ``dtype``;
    on CUDA it quantizes on the GPU: where the model already is (on_device), or layer by layer
    from the host (quantization_device=cuda, return_device=cpu). Returns (model, info)."""
    import torch
    import sdnq

    kw = dict(weights_dtype=dtype, torch_dtype=torch.bfloat16,
              use_quantized_matmul=args.quantized_matmul)
    if args.group_size is not None:
        kw["group_size"] = args.group_size
    if cuda:
        kw.update(quantization_device=torch.device("cuda"),
                  return_device=torch.device("cuda" if on_device else "cpu"))
    bytes_in = bc.model_bytes(model)
    bc.sync(cuda)
    t0 = time.perf_counter()
    model = sdnq.sdnq_post_load_quant(model, **kw)
    bc.sync(cuda)
    seconds = time.perf_counter() - t0
    info = dict(seconds=seconds, weights_dtype=dtype, bf16_bytes=bytes_in,
                bf16_gbps=bytes_in / GB / seconds if seconds > 0 else None,
                where=("gpu, model on the gpu" if on_device else "gpu, layer by layer from the host")
                if cuda else "cpu",
                options={k: str(v) for k, v in kw.items()})
    log(f"{dtype}: sdnq_post_load_quant {seconds:.1f} s ({info['where']}, "
        f"{bytes_in / GB:.2f} GB bf16 in)")
    return model, info


def inventory(model) -> dict:
    """What sdnq made of the model: quantized layers by layout, the Linear layers it left dense
    (names, shapes, bytes), the packed bytes, and what ddo's SDNQ glue says it runs."""
    from collections import Counter

    from torch import nn

    try:
        from ddo import sdnq as ddo_sdnq
    except Exception:  # an older ddo, or none: the inventory still describes the model
        ddo_sdnq = None
    layouts, reasons = Counter(), Counter()
    dense, quantized_bytes, n_quant, ddo_ok = [], 0, 0, 0
    for name, mod in model.named_modules():
        if hasattr(mod, "sdnq_dequantizer") and hasattr(mod, "forward_func"):
            n_quant += 1
            d = mod.sdnq_dequantizer
            layouts[f"{type(mod).__name__} {getattr(d, 'weights_dtype', '?')} group "
                    f"{getattr(d, 'group_size', '?')} packed {getattr(d, 'is_packed', '?')} "
                    f"qmatmul {getattr(d, 'use_quantized_matmul', '?')}"] += 1
            quantized_bytes += sum(p.numel() * p.element_size()
                                   for p in mod.parameters(recurse=False))
            if ddo_sdnq is not None:
                code = ddo_sdnq.sdnq_layout(mod)
                if isinstance(code, str):
                    reasons[code] += 1
                else:
                    ddo_ok += 1
        elif isinstance(mod, nn.Linear):
            w = mod.weight
            dense.append(dict(name=name, shape=list(w.shape), dtype=str(w.dtype).split(".")[-1],
                              bytes=sum(p.numel() * p.element_size()
                                        for p in mod.parameters(recurse=False))))
    total = bc.model_bytes(model)
    return dict(quantized_layers=n_quant, layouts=dict(layouts), quantized_bytes=quantized_bytes,
                dense_linear_layers=dense, dense_linear_bytes=sum(d["bytes"] for d in dense),
                model_bytes=total, other_bytes=total - quantized_bytes
                - sum(d["bytes"] for d in dense),
                ddo_runs_layers=ddo_ok if ddo_sdnq is not None else None,
                ddo_refuses=dict(reasons))


# ---------------------------------------------------------------------------------------------
# Rows.
# ---------------------------------------------------------------------------------------------


def base_row(variant: str, route: str, cap, preset=None) -> dict:
    workload = "flux-diffusers-bf16" if variant == "bf16" else f"flux-sdnq-{variant}"
    return dict(workload=workload, variant=variant, route=route, cap_gib=cap, preset=preset)


def row_resident(ctx: dict, row: dict, model, keep: dict) -> None:
    """The whole model on the execution device (already there after quantizing on the GPU:
    setup 0), its own forward; keeps the last output in keep["ref"] (on the host) and moves the
    model to the host afterwards (timed apart: keep["to_host_s"])."""
    import torch

    cuda = ctx["cuda"]
    dev = "cuda" if cuda else "cpu"
    bc.reset_host_peak()
    with bc.VramMonitor(cuda, ctx["sample_s"]) as mon:
        already = next(model.parameters()).device.type == dev
        t0 = time.perf_counter()
        model.to(dev)
        bc.sync(cuda)
        row["setup_s"] = time.perf_counter() - t0
        row["already_resident"] = already
        try:
            first, times, finite, out = bc.run_steps_out(model, ctx["inputs"], ctx["steps"], cuda)
            bc.fill_step_figures(row, first, times, finite)
            keep["ref"] = out.detach().to("cpu", copy=True)
        finally:
            mon.note_reserved()
            t1 = time.perf_counter()
            model.to("cpu")
            bc.sync(cuda)
            keep["to_host_s"] = time.perf_counter() - t1
    row.update(mon.figures())
    row["peak_host_rss_gib"] = bc.host_rss_gib()[1]
    row["streamed_gb_per_step"] = 0.0
    row["model_to_host_s"] = keep["to_host_s"]
    if cuda:
        torch.cuda.empty_cache()


def row_group(ctx: dict, row: dict, variant: str) -> None:
    """Runs in its own process (--only-route group): builds and quantizes its own model, applies
    diffusers' enable_group_offload at leaf level with a stream, measures. On the simulation the
    same hooks run on the CPU without a stream (a smoke test of sdnq under the hooks, no figures
    that mean anything)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("accelerate") is None:
        raise RuntimeError("diffusers' enable_group_offload needs the accelerate package")
    cuda = ctx["cuda"]
    options = dict(offload_type="leaf_level")
    if cuda:
        options.update(use_stream=True, record_stream=True)
    row["group_offload"] = dict(options)
    dev = "cuda" if cuda else "cpu"
    model, build_s = bc.build_on_device(ctx["size"], dev)
    model, qinfo = quantize(model, variant, ctx["args"], cuda, on_device=True)
    row["quantization"] = qinfo
    t0 = time.perf_counter()
    model.to("cpu")
    bc.sync(cuda)
    row["model_to_host_s"] = time.perf_counter() - t0
    nbytes = bc.model_bytes(model)
    inputs = bc.make_inputs(ctx["size"], dev, ctx["guidance"])
    if cuda:
        torch.cuda.empty_cache()
    foreign = bc.foreign_vram_bytes("W2PY")
    bc.trim_host_memory()
    bc.reset_host_peak()
    with bc.VramMonitor(cuda, ctx["sample_s"], foreign) as mon:
        t0 = time.perf_counter()
        model.enable_group_offload(onload_device=torch.device(dev),
                                   offload_device=torch.device("cpu"), **options)
        bc.sync(cuda)
        row["setup_s"] = time.perf_counter() - t0
        log(f"group {variant}: enable_group_offload {row['setup_s']:.1f} s")
        first, times, finite, _ = bc.run_steps_out(model, inputs, ctx["steps"], cuda)
        bc.fill_step_figures(row, first, times, finite)
    row.update(mon.figures())
    row["peak_host_rss_gib"] = bc.host_rss_gib()[1]
    row["streamed_gb_per_step"] = nbytes / GB  # leaf offload streams every tensor each step
    row["achieved_gbps"] = None  # not observable from outside diffusers' hooks
    if not cuda:
        row["note"] = "CPU smoke test (onload to cpu, no stream): step times mean nothing"


def row_subprocess(ctx: dict, row: dict, variant: str) -> None:
    a = ctx["args"]
    flags = ["--only-route", "group", "--variants", variant, "--size", a.size, "--steps",
             str(a.steps), "--sample-ms", str(a.sample_ms), "--device",
             "cuda" if ctx["cuda"] else "sim"]
    if a.group_size is not None:
        flags += ["--group-size", str(a.group_size)]
    if a.quantized_matmul:
        flags.append("--quantized-matmul")
    bc.run_child_row(row, __file__, flags, "W2PY", T0, ctx["cuda"], ctx["child_timeout"],
                     f"group {variant}")


# ---------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------


def finalize(result: dict) -> None:
    b = result.get("b_pinned_gbps")
    for row in result["rows"]:
        t_res = result["t_resident_s"].get(row["variant"])
        if row["route"] == "resident" and row.get("median_step_s") is not None:
            t_res = row["median_step_s"]  # before main() has noted it
        if not bc.set_bound(row, t_res, b):
            continue
        row["t_resident_s"] = t_res
        cap = row.get("cap_gib")
        if cap is not None and row.get("peak_vram_gib") is not None:
            row["under_cap"] = row["peak_vram_gib"] <= cap
    result["targets"] = check_targets(result)


def headline(result: dict, variant: str, cap):
    """The calibrated row of a variant at a cap (the last one: after a probe, the third run)."""
    rows = [r for r in result["rows"] if r["variant"] == variant and r["route"] == "calibrated"
            and r.get("cap_gib") == cap]
    return rows[-1] if rows else None


def check_targets(result: dict) -> list:
    out = []
    for (variant, cap), limit in TARGETS.items():
        r = headline(result, variant, cap)
        got = None if r is None else r.get("median_step_s")
        out.append(dict(what=f"{variant} at {cap:g} GiB <= {limit:.2f} s/step", value=got,
                        ok=None if got is None else got <= limit))
    for r in result["rows"]:
        if r["route"] != "calibrated" or r["variant"] == "bf16":
            continue
        cap = "none" if r.get("cap_gib") is None else f"{r['cap_gib']:g}"
        if r.get("efficiency") is not None:
            out.append(dict(what=f"{r['variant']} at {cap} GiB efficiency >= {TARGET_EFFICIENCY}",
                            value=r["efficiency"], ok=r["efficiency"] >= TARGET_EFFICIENCY))
        if r.get("under_cap") is not None:
            out.append(dict(what=f"{r['variant']} at {cap} GiB peak VRAM under the cap",
                            value=r.get("peak_vram_gib"), ok=r["under_cap"]))
    return out


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(bc.SIZES), default="full")
    p.add_argument("--variants", default="int8,uint4,bf16")
    p.add_argument("--caps", help="GiB list, 0 = uncapped (default: 4,6,8,12,0 full; "
                                  "0.1,4,0 tiny)")
    p.add_argument("--routes", default=",".join(ALL_ROUTES),
                   help="subset of resident,ddo,group (bf16 has no group row)")
    p.add_argument("--quant-mode", choices=("device", "host"), default="device")
    p.add_argument("--group-size", type=int, default=None,
                   help="sdnq group_size (default: the package's default for the dtype)")
    p.add_argument("--quantized-matmul", action="store_true",
                   help="sdnq use_quantized_matmul=True (default False: its dequantize path, "
                        "the one ddo's op reproduces)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds after the start past which rows are listed as skipped, not "
                        "started (a time-limited call still ends with a complete table)")
    p.add_argument("--out", default="w2-out", help="folder for w2.json, w2.md, env.json")
    p.add_argument("--only-route", choices=("group",), help=argparse.SUPPRESS)
    bc.add_common_args(p, child_timeout=240.0)
    args = p.parse_args(argv)
    bc.check_common_args(p, args)
    args.routes = bc.split_list(args.routes)
    args.variants = bc.split_list(args.variants)
    bad = [r for r in args.routes if r not in ALL_ROUTES] + \
          [v for v in args.variants if v not in ALL_VARIANTS]
    if bad:
        p.error(f"unknown route(s)/variant(s) {bad}")
    caps = [float(c) for c in bc.split_list(args.caps or DEFAULT_CAPS[args.size])]
    args.caps = [None if c <= 0 else c for c in caps]
    return args


def child_main(args) -> int:
    import torch

    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    variant = args.variants[0]
    ctx = dict(size=args.size, steps=args.steps, sample_s=args.sample_ms / 1e3, cuda=cuda,
               guidance=bc.SIZES[args.size]["config"].get("guidance_embeds", False), args=args)
    row = base_row(variant, "group", None, "diffusers_group_offload")
    return bc.child_row(row, lambda r: row_group(ctx, r, variant), f"group {variant}",
                        args.row_out)


def environment(cuda: bool, commit) -> dict:
    env = bc.machine_facts(cuda)
    try:
        from importlib.metadata import version

        env["sdnq_version"] = version("sdnq")
    except Exception:
        env["sdnq_version"] = None
    try:
        import ddo

        env["ddo_path"] = "build tree" if "build" in ddo.__file__ else "installed"
        env["ddo_version"] = getattr(ddo, "__version__", None)
    except Exception as e:
        env["ddo_import_error"] = f"{type(e).__name__}: {e}"
    env["commit"] = commit
    env["SDNQ_USE_TORCH_COMPILE"] = os.environ.get("SDNQ_USE_TORCH_COMPILE")
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.only_route:
        return child_main(args)

    bc.fresh_profile_dir("w2py-profiles-")
    os.makedirs(args.out, exist_ok=True)
    log(f"importing torch, diffusers, sdnq, ddo; profiles in a fresh temporary folder")
    import torch
    import diffusers  # noqa: F401
    import sdnq  # noqa: F401

    try:
        import ddo  # noqa: F401

        have_ddo = True
    except Exception as e:
        have_ddo = False
        log(f"cannot import ddo ({type(e).__name__}: {e}): ddo rows will be skipped")

    cuda = bc.use_cuda(args.device)
    if cuda is None:
        return 2
    log(f"device {'cuda' if cuda else 'sim'}; size {args.size}; variants {args.variants}; caps "
        f"{args.caps}; routes {args.routes}; steps {args.steps}; quantize on "
        f"{'the gpu' if cuda else 'the cpu'} ({args.quant_mode})")
    commit = args.commit or bc.default_commit()
    env = environment(cuda, commit)
    grid = bc.SIZES[args.size]["grid"]
    guidance = bool(bc.SIZES[args.size]["config"].get("guidance_embeds", False))
    result = dict(benchmark="w2-py", size=args.size, steps=args.steps, caps=args.caps,
                  variants=args.variants, routes=args.routes, overrides=args.overrides,
                  cuda=cuda, device="cuda" if cuda else "sim",
                  command=bc.command_line(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  inputs=dict(image_tokens=grid[0] * grid[1], text_tokens=bc.SIZES[args.size]["txt"],
                              batch=1, dtype="bfloat16", guidance=guidance),
                  quantization={}, t_resident_s={}, rows=[])
    result.update(env)
    out_json = os.path.join(args.out, "w2.json")
    out_md = os.path.join(args.out, "w2.md")
    bc.write_atomic(os.path.join(args.out, "env.json"), json.dumps(env, indent=1, default=str))

    def save() -> None:
        finalize(result)
        bc.write_atomic(out_json, json.dumps(result, indent=1, default=str))
        bc.write_atomic(out_md, w2_table(result))

    b = bc.measure_b_pinned(cuda)
    result.update(b_pinned_gbps=b["gbps"], b_pinned=b)
    dev = "cuda" if cuda else "cpu"
    ctx = dict(cuda=cuda, size=args.size, steps=args.steps, sample_s=args.sample_ms / 1e3,
               overrides=args.overrides, child_timeout=args.child_timeout, guidance=guidance,
               args=args, inputs=bc.make_inputs(args.size, dev, guidance))
    save()

    def add(variant: str, route: str, cap, preset, fn, *fn_args) -> dict:
        label = f"{variant} {route}" + ("" if cap is None else f"@{cap:g}")
        row = base_row(variant, route, cap, preset)
        if args.deadline_s and time.time() - T0 > args.deadline_s:
            # Listed, not run: the table says what the time limit left out.
            row["error"] = f"skipped: past --deadline-s {args.deadline_s:g}"
            result["rows"].append(row)
            save()
            log(f"{label}: {row['error']}")
            return row
        log(f"{label}: start")

        def cleanup() -> None:
            if have_ddo and fn is bc.ddo_row:
                import ddo

                ddo.remove_offload(fn_args[0])
            bc.clear_cap(cuda)

        bc.measure_row(row, lambda r: fn(ctx, r, *fn_args), label, cleanup)
        result["rows"].append(row)
        save()
        r = result["rows"][-1]
        if not r.get("error"):
            log(f"{label}: {bc.row_summary(r)}"
                + (f", max abs diff {r['max_abs_diff_vs_resident']:.3g}"
                   if r.get("max_abs_diff_vs_resident") is not None else "")
                + (f", profile {profile_cell(r)}" if r.get("profile_setup") else "")
                + ("" if r.get("output_finite", True) else ", OUTPUT NOT FINITE")
                + f" ({r['row_wall_s']:.1f} s)")
        return r

    def ddo_rows(variant: str, model, ref) -> None:
        if not have_ddo:
            return
        for cap in args.caps:
            name = f"w2-{variant}-cap{'none' if cap is None else format(cap, 'g')}"
            add(variant, "calibration", cap, "one_shot_fast", bc.ddo_row, model, cap, True, name,
                ref)
            r = add(variant, "calibrated", cap, "one_shot_fast", bc.ddo_row, model, cap, False,
                    name, ref)
            if (r.get("profile_setup") or {}).get("status") == "probing":
                # That normal run probed the pending SDNQ budget: it is the probe row, and a
                # third run applies the probe's result.
                r["route"] = "probe"
                save()
                add(variant, "calibrated", cap, "one_shot_fast", bc.ddo_row, model, cap, False,
                    name, ref)

    def one_variant(variant: str) -> None:
        t0 = time.perf_counter()
        if args.deadline_s and time.time() - T0 > args.deadline_s:
            add(variant, "all rows", None, None, None)  # listed as skipped
            return
        on_device = cuda and args.quant_mode == "device"
        model, build_s = bc.build_on_device(args.size, dev)  # on the GPU: seconds, not minutes
        log(f"{variant}: built FluxTransformer2DModel ({args.size}) on {dev} in {build_s:.1f} s: "
            f"{bc.model_bytes(model) / GB:.2f} GB bf16")
        info = dict(build_s=build_s)
        if cuda and not on_device:
            t1 = time.perf_counter()
            model.to("cpu")
            bc.sync(cuda)
            torch.cuda.empty_cache()
            info["bf16_to_host_s"] = time.perf_counter() - t1
        if variant != "bf16":
            model, q = quantize(model, variant, args, cuda, on_device)
            info.update(q)
            info["inventory"] = inventory(model)
            inv = info["inventory"]
            log(f"{variant}: {inv['quantized_layers']} quantized layers {inv['layouts']}; "
                f"{inv['model_bytes'] / GB:.2f} GB in all; left dense: "
                f"{[d['name'] for d in inv['dense_linear_layers']]}")
        if variant == "bf16":
            result["bf16_model"] = info
        else:
            result["quantization"][variant] = info
        save()
        keep = {}
        if "resident" in args.routes:
            r = add(variant, "resident", None, None, row_resident, model, keep)
            if r.get("median_step_s") is not None:
                result["t_resident_s"][variant] = r["median_step_s"]
            info["to_host_s"] = keep.get("to_host_s")
        elif next(model.parameters()).device.type != "cpu":
            t1 = time.perf_counter()
            model.to("cpu")
            bc.sync(cuda)
            info["to_host_s"] = time.perf_counter() - t1
        if cuda:
            torch.cuda.empty_cache()
        save()
        if "ddo" in args.routes:
            ddo_rows(variant, model, keep.get("ref"))
        del model
        bc.trim_host_memory()
        if cuda:
            torch.cuda.empty_cache()
        log(f"{variant}: done in {time.perf_counter() - t0:.1f} s")

    # Order: what the targets need first (a timeout keeps the rows written so far).
    for variant in [v for v in args.variants if v != "bf16"]:
        one_variant(variant)
    if "group" in args.routes:
        if importlib_find("accelerate") is None:
            log("accelerate is not installed: the group rows will fail")
        for variant in [v for v in args.variants if v != "bf16"]:
            add(variant, "group", None, "diffusers_group_offload", row_subprocess, variant)
    if "bf16" in args.variants:
        one_variant("bf16")

    save()
    log(f"done: {out_json}, {out_md}")
    print(w2_table(result), flush=True)
    return 0


def importlib_find(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


if __name__ == "__main__":
    sys.exit(main())
