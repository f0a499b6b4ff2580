#!/usr/bin/env python3
"""W4's kernel table: where a quantized step's time goes, kernel by kernel.

One process, all resident (no offload: the step's compute, which is what W4's fp8 rows are bound
by). For the family's transformer (bench_common's FLUX.1-dev or Wan 2.1-14B dimensions, random
bf16 weights):

  gemm     per Linear shape at the step's token count: bf16 F.linear; the layer's quantized
           forward (ddo::sdnq_linear: activation quantization + GEMM + epilogue); and
           torch._scaled_mm alone with row-wise and tensor-wise scales, each with and without
           fast accumulation: what the card's fp8 GEMM costs apart from what ddo adds
  steps    bf16 resident, then fp8 resident (ddo.sdnq.quantize_model(model, "fp8")): median
           step seconds and the output against bf16 (relative L2, cosine)
  kernels  one profiled step of each: GPU time per kernel category (bf16 GEMM, fp8 GEMM,
           activation quantization, attention, copies, the rest), kernel count, GPU-busy
           seconds against the step's wall seconds (the gap is host time the GPU waited for),
           and the host side: CPU microseconds per op (self and with children), top ops
  graphed  the same steps captured as one CUDA graph and replayed (bf16, the fp8 layers, and the
           model under enable_offload(quantize="fp8")): the step without the host's per-op
           cost, so the gap to the eager step is what the host adds; a capture that fails is
           logged with its error (an op that syncs or allocates outside the graph's pool)
  host     host microseconds per call of one small Linear (32 rows, 512 x 512: the GPU's part
           is a few microseconds, so calls queued without a sync measure the host): bf16
           F.linear, the fp8 layer's forward, torch.ops.ddo.sdnq_linear called directly,
           torch._scaled_mm alone, and the layer under enable_offload(quantize="fp8")

  python bench/python/w4_profile.py --family flux --out w4-profile-flux.json
  python bench/python/w4_profile.py --size tiny --device sim --out /tmp/p.json  # CPU smoke

The JSON holds every figure and the top kernels by name; the log prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_common import SIZES  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[w4-profile {time.time() - T0:7.1f}s] {msg}", flush=True)


bc.set_logger(log)

from w4_quantized import FLUX_SHAPES, WAN_SHAPES  # noqa: E402  (one list of each family's shapes)

# Kernel categories by name, first match wins (lower-case substrings).
CATEGORIES = [
    ("quantize_rows", ("quantize_rows",)),
    ("int8_epilogue", ("int8_epilogue",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm_fp8", ("f8", "fp8", "e4m3", "scaled_mm")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "sm80_", "cublas")),
    ("copy", ("memcpy", "memset", "copy_kernel", "copy_")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "softmax", "cat", "index")),
]


def category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def gemm_rows(cuda: bool, tokens: int, shapes) -> list:
    import torch
    import ddo

    dev = "cuda" if cuda else "cpu"
    rows = []
    for out_f, in_f, dense, quantized, xi in bc.gemm_cases(cuda, tokens, shapes,
                                                           ("float8_e4m3fn",)):
        q = quantized["float8_e4m3fn"]
        row = dict(out=out_f, inp=in_f, tokens=tokens)
        flops = 2.0 * tokens * in_f * out_f
        with torch.no_grad():
            row["bf16_ms"] = bc.time_ms(lambda: dense(xi), cuda)
            row["layer_fp8_ms"] = bc.time_ms(lambda: q(xi), cuda)
            ref = dense(xi).float()

            def rel(y):
                return float((y.float() - ref).norm() / ref.norm())

            row["layer_fp8_rel_l2"] = rel(q(xi))
            if cuda:
                # The same layer quantized on the GPU: ddo's quantizer gives the CPU's bits.
                qg = ddo.sdnq.quantize_linear(dense, "float8_e4m3fn", 0, quantized_matmul=True)
                row["quantize_gpu_equals_cpu"] = bool(
                    torch.equal(qg.weight.view(torch.uint8).cpu(), q.weight.view(torch.uint8).cpu())
                    and torch.equal(qg.scale.cpu(), q.scale.cpu()))
                # The GEMM alone on pre-quantized operands.
                xs = (xi.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
                xq = (xi.float() / xs).to(torch.float8_e4m3fn)
                wq = q.weight.t()  # [K, N] column-major view of the [N, K] rows
                ws = q.scale.reshape(1, -1).float()
                one = torch.ones((), device=dev)
                b = q.bias
                for fast in (False, True):
                    tag = "fast" if fast else "exact"
                    row[f"rowwise_{tag}_rel_l2"] = rel(torch._scaled_mm(
                        xq, wq, xs, ws, bias=b, out_dtype=torch.bfloat16, use_fast_accum=fast))
                    row[f"rowwise_{tag}_ms"] = bc.time_ms(
                        lambda f=fast: torch._scaled_mm(xq, wq, xs, ws, bias=b,
                                                        out_dtype=torch.bfloat16,
                                                        use_fast_accum=f), cuda)
                    row[f"tensorwise_{tag}_ms"] = bc.time_ms(
                        lambda f=fast: torch._scaled_mm(xq, wq, one, one, bias=b,
                                                        out_dtype=torch.bfloat16,
                                                        use_fast_accum=f), cuda)
                row["quantize_torch_ms"] = bc.time_ms(
                    lambda: (xi.float() / (xi.float().abs().amax(1, keepdim=True) / 448.0))
                    .to(torch.float8_e4m3fn), cuda)
        for k in list(row):
            if k.endswith("_ms") and row[k]:
                row[k.replace("_ms", "_tflops")] = flops / (row[k] * 1e-3) / 1e12
        log("gemm %dx%d: " % (out_f, in_f) + ", ".join(
            f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms")) + "; rel_l2 " +
            ", ".join(f"{k[:-7]} {v:.4f}" for k, v in row.items() if k.endswith("_rel_l2")) +
            f"; quantize gpu==cpu {row.get('quantize_gpu_equals_cpu')}")
        rows.append(row)
    return rows


def host_rows(cuda: bool, calls: int = 2000) -> dict:
    """Host microseconds per call: ``calls`` calls queued, then one sync, divided."""
    import torch
    import ddo

    dev = "cuda" if cuda else "cpu"
    rows, feat = 32, 512
    torch.manual_seed(0)
    lin = torch.nn.Linear(feat, feat).to(torch.bfloat16).to(dev)
    x = torch.randn(rows, feat, device=dev, dtype=torch.bfloat16)
    q = ddo.sdnq.quantize_linear(lin, "float8_e4m3fn", 0, quantized_matmul=True).to(dev)
    out = {}

    def per_call(fn) -> float:
        with torch.no_grad():
            for _ in range(50):
                fn()
            bc.sync(cuda)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                bc.sync(cuda)
                best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        return best

    out["bf16_linear_us"] = per_call(lambda: torch.nn.functional.linear(x, lin.weight, lin.bias))
    out["bf16_module_us"] = per_call(lambda: lin(x))
    out["fp8_module_us"] = per_call(lambda: q(x))
    op = torch.ops.ddo.sdnq_linear
    code = list(q.ddo_sdnq_layout)
    out["fp8_op_us"] = per_call(lambda: op(x, q.weight, q.scale, None, None, None, q.bias, code))
    if cuda:
        xs = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
        xq = (x.float() / xs).to(torch.float8_e4m3fn)
        wq, ws = q.weight.t(), q.scale.reshape(1, -1).float()
        out["scaled_mm_us"] = per_call(lambda: torch._scaled_mm(
            xq, wq, xs, ws, bias=q.bias, out_dtype=torch.bfloat16, use_fast_accum=True))
    # The placeholder path: the dense Linear under enable_offload(quantize="fp8"), resident.
    lin2 = torch.nn.Linear(feat, feat).to(torch.bfloat16)
    kwargs = dict(quantize="fp8", preset="one_shot_fast", profile_name=None)
    if not cuda:
        kwargs.update(execution_device="sim", sim_device_capacity_gb=bc.SIM_UNCAPPED_GB)
    handle = ddo.enable_offload(lin2, **kwargs)
    try:
        out["fp8_offload_us"] = per_call(lambda: lin2(x))
    finally:
        handle.remove()
    log("host us per call: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in out.items()))
    return out


def cpu_table(prof) -> dict:
    """The host side of a profiled step: per op name, calls, self CPU us and CPU us with children."""
    ops: dict = {}
    for ev in prof.key_averages():
        ops[ev.key] = dict(count=ev.count, self_cpu_us=ev.self_cpu_time_total,
                           cpu_us=ev.cpu_time_total)
    total_self = sum(v["self_cpu_us"] for v in ops.values())
    top_self = sorted(ops.items(), key=lambda kv: -kv[1]["self_cpu_us"])[:20]
    top_total = sorted(ops.items(), key=lambda kv: -kv[1]["cpu_us"])[:20]
    return dict(self_cpu_ms=total_self / 1e3,
                top_self=[dict(name=n[:160], **v) for n, v in top_self],
                top_total=[dict(name=n[:160], **v) for n, v in top_total])


def profile_step(model, inputs: dict, cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        model(**inputs, return_dict=False)
        bc.sync(cuda)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            model(**inputs, return_dict=False)
            bc.sync(cuda)
            wall = time.perf_counter() - t0
    kernels: dict = {}
    for ev in prof.events():
        dev_type = str(getattr(ev, "device_type", ""))
        if cuda and "CUDA" not in dev_type:
            continue
        t = getattr(ev, "device_time", None)
        if t is None:
            t = getattr(ev, "cuda_time", 0.0)
        if not cuda:
            if ev.cpu_parent is not None:
                continue
            t = ev.cpu_time
        k = kernels.setdefault(ev.name, [0, 0.0])
        k[0] += 1
        k[1] += t
    cats: dict = {}
    for name, (n, us) in kernels.items():
        c = cats.setdefault(category(name), dict(count=0, ms=0.0))
        c["count"] += n
        c["ms"] += us / 1e3
    busy = sum(c["ms"] for c in cats.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return dict(wall_s_profiled=wall, gpu_busy_ms=busy, cpu=cpu_table(prof),
                kernel_count=sum(c["count"] for c in cats.values()),
                categories={k: dict(v, share=v["ms"] / busy if busy else 0.0) for k, v in cats.items()},
                top=[dict(name=n[:160], count=c, ms=us / 1e3, category=category(n))
                     for n, (c, us) in top])


def graphed_step(model, inputs: dict, steps: int, ref=None) -> dict:
    """The step captured as one CUDA graph and replayed: median seconds per replay, or the
    capture's error. Inputs are the graph's static inputs (they do not change between steps)."""
    import torch

    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model(**inputs, return_dict=False)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(**inputs, return_dict=False)[0]
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(max(steps, 3)):
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        row = dict(step_s=sorted(times)[len(times) // 2])
        if ref is not None:
            row.update(bc.output_vs_reference(out, ref))
        del graph
        return row
    except Exception as e:  # noqa: BLE001  (the figure is the error: what is not capturable)
        torch.cuda.synchronize()
        return dict(error=f"{type(e).__name__}: {str(e)[:300]}")


def print_profile(label: str, p: dict) -> None:
    log(f"{label}: profiled step {p['wall_s_profiled']:.4f} s wall, GPU busy "
        f"{p['gpu_busy_ms']:.1f} ms, {p['kernel_count']} kernels")
    for cat, v in sorted(p["categories"].items(), key=lambda kv: -kv[1]["ms"]):
        log(f"  {cat:14s} {v['ms']:9.2f} ms {100 * v['share']:5.1f} %  ({v['count']} kernels)")
    for t in p["top"][:12]:
        log(f"    {t['ms']:8.2f} ms x{t['count']:<5d} [{t['category']}] {t['name'][:110]}")
    cpu = p["cpu"]
    log(f"  host: {cpu['self_cpu_ms']:.1f} ms self CPU in ops; top by self, then with children")
    for t in cpu["top_self"][:15]:
        log(f"    cpu self {t['self_cpu_us'] / 1e3:8.2f} ms x{t['count']:<5d} "
            f"({t['self_cpu_us'] / max(t['count'], 1):6.1f} us/call) {t['name'][:90]}")
    for t in cpu["top_total"][:15]:
        log(f"    cpu total {t['cpu_us'] / 1e3:8.2f} ms x{t['count']:<5d} "
            f"({t['cpu_us'] / max(t['count'], 1):6.1f} us/call) {t['name'][:90]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("flux", "wan"), default="flux")
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--skip-host", action="store_true")
    p.add_argument("--skip-graph", action="store_true")
    p.add_argument("--out", default="w4-profile.json")
    p.add_argument("--commit")
    args = p.parse_args(argv)
    import torch
    import ddo

    cuda = bc.use_cuda(args.device)
    if cuda is None:
        return 2
    wan = args.family == "wan"
    dev = "cuda" if cuda else "cpu"
    result = dict(benchmark="w4-profile", family=args.family, size=args.size, steps=args.steps,
                  device=dev, command=bc.command_line(),
                  commit=args.commit or bc.default_commit(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    result.update(bc.machine_facts(cuda))

    def save() -> None:
        bc.write_atomic(args.out, json.dumps(result, indent=1, default=str))

    if wan:
        frames, h, w = bc.WAN_SIZES[args.size]["latent"]
        tokens = frames * (h // 2) * (w // 2)
        shapes = WAN_SHAPES
    else:
        grid = SIZES[args.size]["grid"]
        tokens = grid[0] * grid[1] + SIZES[args.size]["txt"]
        shapes = FLUX_SHAPES
    if args.size != "full":
        shapes = [(512, 512), (2048, 512)]
    result["tokens"] = tokens
    if not args.skip_host:
        result["host"] = host_rows(cuda)
        save()
    if not args.skip_gemm:
        result["gemm"] = gemm_rows(cuda, tokens, shapes)
        save()

    model, _, _, _ = bc.build_model(args.size, dev, args.family)
    model.to(dev)
    inputs = (bc.make_wan_inputs(args.size, dev) if wan else
              bc.make_inputs(args.size, dev, bool(model.config.guidance_embeds)))
    first, times, finite, ref = bc.run_steps_out(model, inputs, args.steps, cuda)
    result["bf16_step_s"] = sorted(times)[len(times) // 2]
    log(f"bf16 resident: {result['bf16_step_s']:.4f} s per step")
    result["bf16_profile"] = profile_step(model, inputs, cuda)
    print_profile("bf16", result["bf16_profile"])
    save()
    graph = cuda and not args.skip_graph
    if graph:
        result["bf16_graphed"] = graphed_step(model, inputs, args.steps, ref)
        log(f"bf16 graphed: {result['bf16_graphed']}")
        save()
        # enable_offload(quantize="fp8") with everything resident: the library's own route.
        model.to("cpu")
        torch.cuda.empty_cache()
        handle = ddo.enable_offload(model, quantize="fp8", preset="one_shot_fast")
        first, times, finite, out = bc.run_steps_out(model, inputs, args.steps, cuda)
        row = dict(step_s=sorted(times)[len(times) // 2], **bc.output_vs_reference(out, ref))
        log(f"enable_offload(quantize=fp8) resident: {row}")
        row["graphed"] = graphed_step(model, inputs, args.steps, ref)
        log(f"enable_offload(quantize=fp8) graphed: {row['graphed']}")
        result["fp8_option"] = row
        save()
        handle.remove()
        torch.cuda.empty_cache()

    # Quantized on the host, as W4 and enable_offload's quantize= do.
    model.to("cpu")
    skipped = ddo.sdnq.quantize_model(model, "fp8")
    model.to(dev)
    result["fp8_kept_dense"] = skipped
    first, times, finite, out = bc.run_steps_out(model, inputs, args.steps, cuda)
    result["fp8_step_s"] = sorted(times)[len(times) // 2]
    result.update({f"fp8_{k}": v for k, v in bc.output_vs_reference(out, ref).items()})
    log(f"fp8 resident: {result['fp8_step_s']:.4f} s per step "
        f"({result['fp8_step_s'] / result['bf16_step_s']:.3f}x bf16), rel_l2 {result.get('fp8_rel_l2')}")
    result["fp8_profile"] = profile_step(model, inputs, cuda)
    print_profile("fp8", result["fp8_profile"])
    save()
    if graph:
        result["fp8_graphed"] = graphed_step(model, inputs, args.steps, ref)
        log(f"fp8 graphed: {result['fp8_graphed']}")
        save()
    log(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
