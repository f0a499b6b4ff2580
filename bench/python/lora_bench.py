#!/usr/bin/env python3
"""LoRA under ddo: the step with adapters unfused and fused, the time to fuse and unfuse while
attached, and a switch between two adapters.

W1-py's transformer (FLUX.1-dev dimensions, random bf16 weights, 4096 + 512 tokens) under ddo at
one cap, in one process and one attach:

  base       the model without adapters: median step (the reference step)
  unfused    adapter "a" (rank --rank on every attention and MLP Linear: TARGETS) loaded through
             diffusers' load_lora_adapter after the attach: median step, against base
  fuse       transformer.fuse_lora() while attached: seconds, against the time to read the
             targeted base weights once from pinned memory (their bytes / B_pinned)
  fused      median step after the fuse, against base
  unfuse     transformer.unfuse_lora(): seconds
  switch     adapter "b" loaded (same rank), set_adapters("b"), delete_adapters("a"): seconds,
             then the median step with "b"
The outputs of fused and unfused steps are compared (relative L2): a fuse computes the same model.

  python bench/python/lora_bench.py --cap 8 --out lora.json --commit $(git rev-parse --short HEAD)
  python bench/python/lora_bench.py --size tiny --device sim --cap 0.05 --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_common import GB, SIZES  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[lora {time.time() - T0:7.1f}s] {msg}", flush=True)


bc.set_logger(log)

# FLUX's attention projections (image and text streams) and MLPs, as LoRA trainers target them.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
           "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
           "proj_mlp", "proj_out"]


def lora_state_dict(model, rank: int, seed: int) -> dict:
    """A LoRA for `model` in the format diffusers' load_lora_adapter reads, built from the target
    Linears' shapes (A: [rank, in], B: [out, rank]), random and nonzero, in the model's dtype."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name.endswith(t) for t in TARGETS):
            a = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
            b = torch.randn(m.out_features, rank, generator=g) * 0.01
            out[f"transformer.{name}.lora_A.weight"] = a.to(m.weight.dtype)
            out[f"transformer.{name}.lora_B.weight"] = b.to(m.weight.dtype)
    return out


def targeted_bytes(model) -> int:
    import torch

    return sum(m.weight.numel() * m.weight.element_size() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name.endswith(t) for t in TARGETS))


def steps(model, inputs, n: int, cuda: bool):
    first, times, finite, out = bc.run_steps_out(model, inputs, n, cuda)
    return sorted(times)[len(times) // 2], out


def timed(fn, cuda: bool) -> float:
    bc.sync(cuda)
    t0 = time.perf_counter()
    fn()
    bc.sync(cuda)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--cap", type=float, default=8.0, help="VRAM cap in GiB (sim: its capacity)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="lora.json")
    p.add_argument("--commit")
    args = p.parse_args(argv)
    if args.rank < 1 or args.steps < 1 or args.cap <= 0:
        p.error("--rank and --steps take positive integers, --cap a positive number of GiB")
    import ddo
    from diffusers.utils import logging as diffusers_logging

    # load_lora_adapter lists the other adapter's keys as missing when a second one loads.
    diffusers_logging.set_verbosity_error()
    cuda = bc.use_cuda(args.device)
    if cuda is None:
        return 2
    result = dict(benchmark="lora", size=args.size, cap_gib=args.cap, rank=args.rank,
                  steps=args.steps, targets=TARGETS, device="cuda" if cuda else "sim",
                  command=bc.command_line(), commit=args.commit or bc.default_commit(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    result.update(bc.machine_facts(cuda))

    def save() -> None:
        bc.write_atomic(args.out, json.dumps(result, indent=1, default=str))

    dev = "cuda" if cuda else "cpu"
    model, nbytes, params, build = bc.build_model(args.size, dev)
    result.update(model_gb=nbytes / GB, b_pinned_gbps=bc.measure_b_pinned(cuda)["gbps"],
                  targeted_gb=targeted_bytes(model) / GB)
    result["read_targeted_once_s"] = result["targeted_gb"] / result["b_pinned_gbps"]
    # The adapters' state dicts are made before the attach: on the sim, host allocations made
    # while attached count against its card.
    sd_a = lora_state_dict(model, args.rank, 1)
    sd_b = lora_state_dict(model, args.rank, 2)
    result["adapter_gb"] = sum(t.numel() * t.element_size() for t in sd_a.values()) / GB
    inputs = bc.make_inputs(args.size, dev, bool(model.config.guidance_embeds))
    opts = (dict(preset="one_shot_fast", vram_cap_gb=args.cap) if cuda else
            dict(preset="one_shot_fast", execution_device="sim", sim_device_capacity_gb=args.cap))
    offload = ddo.enable_offload(model, **opts)
    try:
        result["base_step_s"], _ = steps(model, inputs, args.steps, cuda)
        log(f"base: {result['base_step_s']:.4f} s per step")
        save()
        result["load_a_s"] = timed(lambda: model.load_lora_adapter(
            dict(sd_a), prefix="transformer", adapter_name="a"), cuda)
        result["unfused_step_s"], unfused = steps(model, inputs, args.steps, cuda)
        log(f"unfused: {result['unfused_step_s']:.4f} s per step "
            f"({result['unfused_step_s'] / result['base_step_s']:.3f}x base; target <= 1.05x)")
        save()
        result["fuse_s"] = timed(lambda: model.fuse_lora(), cuda)
        result["fused_step_s"], fused = steps(model, inputs, args.steps, cuda)
        result.update({f"fused_vs_unfused_{k}": v
                       for k, v in bc.output_vs_reference(fused, unfused).items()})
        log(f"fuse {result['fuse_s']:.2f} s (reading the targeted weights once: "
            f"{result['read_targeted_once_s']:.2f} s; target <= 2x); fused "
            f"{result['fused_step_s']:.4f} s per step "
            f"({result['fused_step_s'] / result['base_step_s']:.3f}x base; target 1.00x), "
            f"rel_l2 vs unfused {result.get('fused_vs_unfused_rel_l2')}")
        save()
        result["unfuse_s"] = timed(lambda: model.unfuse_lora(), cuda)
        log(f"unfuse {result['unfuse_s']:.2f} s")

        def switch():
            model.load_lora_adapter(dict(sd_b), prefix="transformer", adapter_name="b")
            model.set_adapters(["b"])
            model.delete_adapters(["a"])

        result["switch_s"] = timed(switch, cuda)
        result["switched_step_s"], _ = steps(model, inputs, args.steps, cuda)
        log(f"switch {result['switch_s']:.2f} s; step with b {result['switched_step_s']:.4f} s")
        report = offload.report()
        result["plan"] = report.get("plan")
        result["adapters_added"] = report.get("python", {}).get("adapters_added")
        result["peak_vram_gb"] = report.get("run", {}).get("peak_vram_gb")
    finally:
        offload.remove()
    save()
    log(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
