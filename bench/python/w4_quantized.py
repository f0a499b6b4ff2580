#!/usr/bin/env python3
"""W4: quantized compute. W1-py's FLUX transformer computed in fp8 and int8 against bf16.

docs/design/0009-benchmarks.md's W1-py model (FLUX.1-dev dimensions, random bf16 weights, 4096
image + 512 text tokens, batch 1). Rows, all in one invocation, in this order:

  gemm          per FLUX Linear shape at 4608 tokens: bf16 F.linear, the fp8 and the int8 path
                of a quantized_matmul layer (activation quantization included), median ms
  resident      bf16, the whole model on the GPU: gives T_resident and the reference output
  int8-resident the model quantized by ddo.sdnq.quantize_model(m, "int8"), all on the GPU
  fp8-resident  the same with "fp8"
  quantize noprofile / calibration / calibrated  per cap: enable_offload(bf16 model,
                quantize="fp8"), the user's path: Linears served from quantized copies
  fp8 noprofile / calibration / calibrated  per cap: enable_offload on the fp8 model
  dequant noprofile / calibrated            per cap: the same fp8 weights with the layers'
                quantized_matmul flag cleared (ddo_sdnq_layout[7] = 0): the dequantize path

Per model row: bench_common's figures (setup, first and median step, streamed GB per step, peak
VRAM and RSS, bound and efficiency) plus the output against the bf16 resident output (relative L2
and cosine similarity). The targets (FLUX fp8 at 8 GiB <= 0.14 s and >= 1.25x faster than bf16
resident; fp8 resident <= 0.125 s) are checked by the reader, not here.

``--family wan`` runs the video row instead: Wan 2.1-14B's WanTransformer3DModel (480x832, 21
frames: 6 latent frames, 9360 tokens; bench_common.WAN_SIZES), bf16 resident against fp8 at
8 GiB by default (target: <= 0.7x the bf16 resident step), with the GEMM table for its shapes.

  python bench/python/w4_quantized.py --out w4.json --commit $(git rev-parse --short HEAD)
  python bench/python/w4_quantized.py --family wan --out w4-wan.json
  python bench/python/w4_quantized.py --size tiny --device sim --out /tmp/w4.json   # CPU smoke

Flags: --family flux|wan, --size full|tiny, --caps GiB list, --steps N, --routes
(gemm,resident,int8,quantize,fp8,dequant), --device cuda|sim, --sample-ms, --out FILE.json, --commit SHA.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_common import GB, SIZES, VramMonitor, build_model, make_inputs  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[w4 {time.time() - T0:7.1f}s] {msg}", flush=True)


bc.set_logger(log)

DEFAULT_CAPS = {("flux", "full"): "4,8,16", ("flux", "tiny"): "0.1,1.5",
                ("wan", "full"): "8", ("wan", "tiny"): "0.1"}
ALL_ROUTES = ("gemm", "resident", "int8", "quantize", "fp8", "dequant")
DEFAULT_ROUTES = {"flux": ",".join(ALL_ROUTES), "wan": "gemm,resident,quantize"}
# FLUX.1's Linear shapes (out, in): attention projections, the MLPs, the single blocks' fused
# projection and output, the modulations.
FLUX_SHAPES = [(3072, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360),
               (18432, 3072), (9216, 3072)]
# Wan 2.1-14B's: attention projections (self and cross), the MLP, the text projection.
WAN_SHAPES = [(5120, 5120), (13824, 5120), (5120, 13824), (5120, 4096)]


def gemm_rows(cuda: bool, tokens: int, shapes) -> list:
    import torch

    import ddo

    dev = "cuda" if cuda else "cpu"
    rows = []
    for out_f, in_f, dense, quantized, xi in bc.gemm_cases(cuda, tokens, shapes,
                                                           ("float8_e4m3fn", "int8")):
        row = dict(route="gemm", out=out_f, inp=in_f, tokens=tokens)
        with torch.no_grad():
            row["bf16_ms"] = bc.time_ms(lambda: dense(xi), cuda)
            ref = dense(xi)
            for name, q in quantized.items():
                path, why = ddo._C.sdnq_linear_path(q.ddo_sdnq_layout, q.scale.dtype,
                                                           dev, tokens)
                key = "fp8" if name.startswith("float8") else "int8"
                row[f"{key}_path"] = path
                row[f"{key}_why"] = why
                row[f"{key}_ms"] = bc.time_ms(lambda: q(xi), cuda)
                row[f"{key}_rel_l2"] = bc.output_vs_reference(q(xi), ref)["rel_l2"]
                q.ddo_sdnq_layout[7] = 0  # the same weights, dequantize path
                row[f"{key}_dequant_ms"] = bc.time_ms(lambda: q(xi), cuda)
        log(f"gemm {out_f}x{in_f}: bf16 {row['bf16_ms']:.3f} ms, fp8 {row['fp8_ms']:.3f} "
            f"({row['fp8_path']}), int8 {row['int8_ms']:.3f} ({row['int8_path']})")
        rows.append(row)
    return rows


def set_matmul_flag(model, on: bool) -> None:
    import ddo

    for m in model.modules():
        if isinstance(m, ddo.sdnq.QuantizedLinear):
            m.ddo_sdnq_layout[7] = 1 if on else 0


def resident_row(ctx: dict, row: dict, model, ref) -> object:
    cuda = ctx["cuda"]
    dev = "cuda" if cuda else "cpu"
    bc.reset_host_peak()
    with VramMonitor(cuda, ctx["sample_s"]) as mon:
        t0 = time.perf_counter()
        model.to(dev)
        bc.sync(cuda)
        row["setup_s"] = time.perf_counter() - t0
        first, times, finite, out = bc.run_steps_out(model, ctx["inputs"], ctx["steps"], cuda)
        bc.fill_step_figures(row, first, times, finite)
    row.update(mon.figures())
    model.to("cpu")
    bc.clear_cap(cuda)
    if ref is not None:
        row.update(bc.output_vs_reference(out, ref))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("flux", "wan"), default="flux")
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--caps")
    p.add_argument("--routes")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--out", default="w4.json")
    p.add_argument("--commit")
    args = p.parse_args(argv)
    caps = [float(c) for c in bc.split_list(args.caps or DEFAULT_CAPS[args.family, args.size])]
    routes = bc.split_list(args.routes or DEFAULT_ROUTES[args.family])
    wan = args.family == "wan"

    profile_dir = bc.fresh_profile_dir("w4-profiles-")
    import torch
    import ddo

    cuda = bc.use_cuda(args.device)
    if cuda is None:
        return 2
    result = dict(benchmark="w4", family=args.family, size=args.size, steps=args.steps, caps=caps, routes=routes,
                  device="cuda" if cuda else "sim",
                  command=bc.command_line(),
                  commit=args.commit or bc.default_commit(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  profile_dir=profile_dir, rows=[])
    result.update(bc.machine_facts(cuda))

    def save() -> None:
        for r in result["rows"]:
            if r.get("route") != "gemm":
                bc.set_bound(r, result.get("t_resident_s"), result.get("b_pinned_gbps"))
        bc.write_atomic(args.out, json.dumps(result, indent=1, default=str))

    if wan:
        frames, h, w = bc.WAN_SIZES[args.size]["latent"]
        tokens = frames * (h // 2) * (w // 2)  # the (1, 2, 2) patches; text is cross-attended
        full_shapes = WAN_SHAPES
    else:
        grid = SIZES[args.size]["grid"]
        tokens = grid[0] * grid[1] + SIZES[args.size]["txt"]
        full_shapes = FLUX_SHAPES
    result["tokens"] = tokens
    if "gemm" in routes:
        shapes = full_shapes if args.size == "full" else [(512, 512), (2048, 512)]
        result["rows"].extend(gemm_rows(cuda, tokens, shapes))
        save()

    # Built on the GPU (the host's default init of 12-14B parameters takes minutes), then held on
    # the host: one copy.
    model, nbytes, params, build = build_model(args.size, "cuda" if cuda else "cpu", args.family)
    b = bc.measure_b_pinned(cuda)
    result.update(model_gb=nbytes / GB, parameters=params, b_pinned_gbps=b["gbps"])
    dev = "cuda" if cuda else "cpu"
    # One set of inputs on the execution device: resident rows and ddo rows (the sim computes on
    # the CPU) read the same tensors.
    inputs = (bc.make_wan_inputs(args.size, dev) if wan else
              make_inputs(args.size, dev, bool(model.config.guidance_embeds)))
    ctx = dict(cuda=cuda, steps=args.steps, sample_s=args.sample_ms / 1e3, overrides={},
               inputs=inputs)

    def add(route: str, cap, fn) -> dict:
        label = route if cap is None else f"{route}@{cap:g}"
        row = dict(workload=f"{args.family}-diffusers", route=route, cap_gib=cap)
        bc.measure_row(row, fn, label, lambda: bc.clear_cap(cuda))
        result["rows"].append(row)
        save()
        r = result["rows"][-1]
        if not r.get("error"):
            log(f"{label}: {bc.row_summary(r)}, rel_l2 {r.get('rel_l2')}, cos {r.get('cosine')}")
        return r

    ref = {}

    def resident_bf16(row):
        ref["out"] = resident_row(ctx, row, model, None)

    if "resident" in routes:
        r = add("resident", None, resident_bf16)
        result["t_resident_s"] = r.get("median_step_s")
    if "int8" in routes:
        int8 = copy.deepcopy(model)
        row_skipped = ddo.sdnq.quantize_model(int8, "int8")
        add("int8-resident", None, lambda row: (row.update(kept_dense=row_skipped),
                                                resident_row(ctx, row, int8, ref.get("out"))))
        del int8
    if "quantize" in routes:
        # The user's path: enable_offload(bf16 model, quantize="fp8"), the model left as it was.
        qctx = dict(ctx, overrides=dict(ctx["overrides"], quantize="fp8"))
        for cap in caps:
            add("quantize-noprofile", cap,
                lambda row, c=cap: bc.ddo_row(qctx, row, model, c, False, None, ref=ref.get("out")))
            add("quantize-calibration", cap,
                lambda row, c=cap: bc.ddo_row(qctx, row, model, c, True,
                                              f"w4-{args.family}-q-{c:g}", ref=ref.get("out")))
            add("quantize-calibrated", cap,
                lambda row, c=cap: bc.ddo_row(qctx, row, model, c, False,
                                              f"w4-{args.family}-q-{c:g}", ref=ref.get("out")))
    if "fp8" in routes or "dequant" in routes:
        skipped = ddo.sdnq.quantize_model(model, "fp8")
        result["fp8_kept_dense"] = skipped
        result["fp8_model_gb"] = sum(t.numel() * t.element_size()
                                     for t in model.parameters()) / GB
        add("fp8-resident", None, lambda row: resident_row(ctx, row, model, ref.get("out")))

        def ddo_row(row, cap, calibrate, name, matmul):
            set_matmul_flag(model, matmul)
            bc.ddo_row(ctx, row, model, cap, calibrate, name, ref=ref.get("out"))

        for cap in caps:
            if "fp8" in routes:
                add("fp8-noprofile", cap, lambda row, c=cap: ddo_row(row, c, False, None, True))
                add("fp8-calibration", cap,
                    lambda row, c=cap: ddo_row(row, c, True, f"w4-{args.family}-fp8-{c:g}", True))
                add("fp8-calibrated", cap,
                    lambda row, c=cap: ddo_row(row, c, False, f"w4-{args.family}-fp8-{c:g}", True))
            if "dequant" in routes:
                add("dequant-noprofile", cap,
                    lambda row, c=cap: ddo_row(row, c, False, None, False))
                add("dequant-calibrated", cap,
                    lambda row, c=cap: (ddo_row(row, c, True, f"w4-{args.family}-dq-{c:g}", False),
                                        ddo_row(row, c, False, f"w4-{args.family}-dq-{c:g}", False)))
        set_matmul_flag(model, True)
    save()
    log(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
