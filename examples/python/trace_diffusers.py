#!/usr/bin/env python3
"""Traces a diffusers denoiser to TorchScript for C++ (tools/examples/torchscript_flow.cpp).

    python examples/python/trace_diffusers.py flux --out flux/          # tiny, random weights
    python examples/python/trace_diffusers.py unet --out unet/
    build/tools/torchscript_flow --model flux/model.pt --inputs flux/inputs.pt --stream-all

    # FLUX size (random weights, bf16), traced on the GPU it will run on:
    python examples/python/trace_diffusers.py flux --size full --device cuda --dtype bfloat16 \\
        --out flux-full/
    build/tools/torchscript_flow --model flux-full/model.pt --inputs flux-full/inputs.pt \\
        --device cuda:0 --profile flux-cpp
    # the same loop under ddo from Python, for the side-by-side timings (the same inputs):
    python examples/python/trace_diffusers.py flux --size full --device cuda --dtype bfloat16 \\
        --python-flow --profile flux-py --inputs flux-full/inputs.pt
    # or the traced file itself under ddo from Python (ddo.enable_offload takes a ScriptModule):
    python examples/python/trace_diffusers.py flux --device cuda --python-flow \\
        --model flux-full/model.pt --inputs flux-full/inputs.pt

scripts/gpu-jit.sh runs these on the H200 and writes the side-by-side table. Both programs time
the same way: --steps steps in the measured region, each ended by reading the latents back (the
device is done), and the median of the steps after the first --warmup ones (default 1: the first
step learns ddo's fetch order; gpu-jit.sh leaves out 2, since the TorchScript executor profiles the
graph in its first call and optimizes it in its second).

Writes model.pt (torch.jit.save of the traced module) and inputs.pt (torch.save of a dict of named
example tensors: C++ passes them to forward() as keyword arguments). The traced module takes the
model's keyword arguments and returns {"sample": tensor}.

Tracing: torch.jit.trace (TorchScript is in maintenance in torch 2.11 but still traces both
models) with example_kwarg_inputs; return_dict and other non-tensor arguments cannot be traced, so
they keep their defaults and the model's output dataclass (a dict) is traced as a dict. A traced
graph fixes Python control flow and the devices of tensors created inside forward() (arange, ...)
to those of the example: trace on the device the C++ program will run on, with inputs of the
shapes it will use. torch.export + AOTInductor would keep the weights as the compiled artifact's
own constants, read by generated kernels, not as module parameters passed to aten ops, so ddo
could not serve them; a traced module keeps them as parameters that ddo re-points.
"""

import argparse
import json
import os
import time

import torch


def build(kind: str, size: str = "tiny", dtype: torch.dtype = torch.float32,
          device: str = "cpu", seed: int = 0):
    """(model, inputs, latents name): a diffusers denoiser with random weights and example
    inputs. tiny: the configs of python/tests/test_diffusers.py; full: FLUX.1 (schnell layout,
    1024x1024 latents, 512 text tokens) or Stable Diffusion 1.5's UNet (512x512)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    # Built in the target dtype: FLUX in float32 first would need 48 GB on the way.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return _build(kind, size, dtype, device, g)
    finally:
        torch.set_default_dtype(default_dtype)


# The input each model's loop updates (torchscript_flow finds it by these names too).
LATENTS = {"flux": "hidden_states", "unet": "sample"}


def _build(kind, size, dtype, device, g):
    import diffusers

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if kind == "flux":
        if size == "tiny":
            config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                          pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
            img, txt = 16, 8
        else:
            config = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                          attention_head_dim=128, num_attention_heads=24,
                          joint_attention_dim=4096, pooled_projection_dim=768,
                          axes_dims_rope=[16, 56, 56])
            img, txt = 4096, 512
        with torch.device(device):
            model = diffusers.FluxTransformer2DModel(**config)
        inputs = dict(
            hidden_states=randn(1, img, config["in_channels"]),
            encoder_hidden_states=randn(1, txt, config["joint_attention_dim"]),
            pooled_projections=randn(1, config["pooled_projection_dim"]),
            timestep=torch.tensor([0.5], device=device, dtype=dtype),
            img_ids=torch.zeros(img, 3, device=device, dtype=dtype),
            txt_ids=torch.zeros(txt, 3, device=device, dtype=dtype),
        )
        latents = LATENTS["flux"]
    elif kind == "unet":
        if size == "tiny":
            config = dict(block_out_channels=(8, 16), layers_per_block=1, sample_size=8,
                          in_channels=4, out_channels=4,
                          down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                          up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                          cross_attention_dim=16, norm_num_groups=4, attention_head_dim=2)
            tokens = 5
        else:
            config = dict(sample_size=64, cross_attention_dim=768)
            tokens = 77
        with torch.device(device):
            model = diffusers.UNet2DConditionModel(**config)
        side = config["sample_size"]
        inputs = dict(
            sample=randn(1, 4, side, side),
            timestep=torch.tensor([10], device=device),
            encoder_hidden_states=randn(1, tokens, config["cross_attention_dim"]),
        )
        latents = LATENTS["unet"]
    else:
        raise ValueError(f"unknown model kind {kind!r}; use flux or unet")
    return model.eval(), inputs, latents


def sample_of(out) -> torch.Tensor:
    """The model's output tensor: eager models return a dataclass or tuple, traced ones a dict."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["sample"]
    return out[0]


@torch.no_grad()
def trace(model, inputs: dict, check_trace: bool = True):
    """check_trace=False skips torch's check (a second trace and more forward passes: at FLUX
    size, time out of the GPU run's budget for a check the tiny tests already make)."""
    return torch.jit.trace(model, example_kwarg_inputs=inputs, strict=False,
                           check_trace=check_trace)


@torch.no_grad()
def denoise(model, inputs: dict, latents: str, steps: int):
    """The loop torchscript_flow runs: latents = latents - out / steps, the other inputs fixed.
    Returns (first step's output, final latents)."""
    x, first = inputs[latents], None
    for _ in range(steps):
        out = sample_of(model(**{**inputs, latents: x}))
        first = out if first is None else first
        x = x - out / steps
    return first, x


def save(traced, inputs: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    model_path, inputs_path = os.path.join(out_dir, "model.pt"), os.path.join(out_dir, "inputs.pt")
    traced.save(model_path)
    torch.save({k: v.cpu() for k, v in inputs.items()}, inputs_path)
    return model_path, inputs_path


# torchscript_flow --stream-all: no resident budget, every weight streamed.
STREAM_ALL = dict(small_tensor_threshold_bytes=0, auto_budget_policy="off",
                  resident_module_budget_gb=0.0, always_resident_modules_pattern=[])


def steady_ms(step_ms: list, warmup: int) -> float:
    """torchscript_flow's figure: the median of the steps after the first ``warmup`` (all of
    them when there are no more), the upper middle one for an even count."""
    later = sorted(step_ms[warmup:] or step_ms)
    return later[len(later) // 2]


@torch.no_grad()
def python_flow(model, inputs, latents, steps, device, profile, stream_all=False, warmup=1):
    """torchscript_flow's phases under ddo from Python (for timings): attach, the loop under
    profile_run(), remove; calibrating, then reusing the profile. ``model`` is the eager model or
    a TorchScript module (ddo.enable_offload takes both). Prints the same figures and returns the
    report torchscript_flow writes with --report (per phase: attach_s, loop_s, step_ms, first_ms,
    steady_ms_per_step, release_s, profile, offload)."""
    import ddo

    execution = "sim" if device == "cpu" else device
    options = dict(STREAM_ALL) if stream_all else {}
    report = {}
    for phase in ("calibrate", "reuse"):
        t0 = time.perf_counter()
        offload = ddo.enable_offload(model, execution_device=execution, profile_name=profile,
                                     build_profile=phase == "calibrate", **options)
        attach_s = time.perf_counter() - t0
        step_ms, x = [], inputs[latents]
        start = time.perf_counter()
        with offload.profile_run() as profile_report:
            for _ in range(steps):
                t0 = time.perf_counter()
                x = x - sample_of(model(**{**inputs, latents: x})) / steps
                x.sum().item()  # waits for the device
                step_ms.append(1e3 * (time.perf_counter() - t0))
        loop_s = time.perf_counter() - start
        offload_report = offload.report()
        t0 = time.perf_counter()
        offload.remove()
        release_s = time.perf_counter() - t0
        steady = steady_ms(step_ms, warmup)
        print(f"\n== {phase}: attach {attach_s:.3f} s, {steps} steps in {loop_s:.3f} s (first "
              f"{step_ms[0]:.1f} ms, then {steady:.1f} ms/step)\nprofile report: "
              f"{dict(profile_report)}")
        report[phase] = dict(attach_s=attach_s, loop_s=loop_s, step_ms=step_ms,
                             first_ms=step_ms[0], steady_ms_per_step=steady,
                             release_s=release_s, profile=dict(profile_report),
                             offload=offload_report)
    report.update(model_class=offload.model_class, steps=steps, warmup=warmup)
    print(f"\ntimings (median of the steps after the first {warmup}): calibrate "
          f"{report['calibrate']['steady_ms_per_step']:.1f} ms/step, reuse "
          f"{report['reuse']['steady_ms_per_step']:.1f} ms/step")
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("flux", "unet"))
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--device", default="cpu",
                   help="where to trace (and where C++ will run): cpu, cuda[:N]; with "
                        "--python-flow also sim[:N] (the host simulation; tensors on the CPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--out", help="folder for model.pt and inputs.pt")
    p.add_argument("--python-flow", action="store_true",
                   help="instead run the loop under ddo from Python and print timings")
    p.add_argument("--profile", default="torchscript-flow-py")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1,
                   help="with --python-flow: steps left out of the median (torchscript_flow's "
                        "--warmup)")
    p.add_argument("--stream-all", action="store_true",
                   help="with --python-flow: every weight streamed, as torchscript_flow's flag")
    p.add_argument("--inputs", help="with --python-flow: the inputs.pt a trace wrote (the same "
                                    "inputs as the C++ run) instead of new ones")
    p.add_argument("--model", help="with --python-flow: run this traced model.pt (torch.jit.load) "
                                   "instead of the eager model; needs --inputs")
    p.add_argument("--report", help="with --python-flow: write the phases' figures as JSON, as "
                                    "torchscript_flow --report does")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps needs a positive number and --warmup one of 0 or more")

    dtype = getattr(torch, args.dtype)
    # Tensors live on the CPU for the host simulation (ddo's "sim" device) and a CPU run.
    tensors_on = "cpu" if args.device.startswith("sim") else args.device
    if not args.python_flow:
        if not args.out:
            p.error("--out is required unless --python-flow")
        model, inputs, latents = build(args.kind, args.size, dtype, tensors_on)
        t0 = time.perf_counter()
        traced = trace(model, inputs, check_trace=args.size != "full")
        model_path, inputs_path = save(traced, inputs, args.out)
        print(f"traced {type(model).__name__} in {time.perf_counter() - t0:.1f} s: {model_path}, "
              f"{inputs_path} (latents: {latents})")
        return

    t_load = time.perf_counter()
    if args.model:
        if not args.inputs:
            p.error("--model needs --inputs (the inputs it was traced with)")
        model, latents = torch.jit.load(args.model, map_location="cpu").eval(), LATENTS[args.kind]
    else:
        # Built where it will run (default init of 12B parameters on the host takes minutes),
        # then handed to ddo on the host, which places the weights.
        model, inputs, latents = build(args.kind, args.size, dtype, tensors_on)
        model.to("cpu")
        if tensors_on.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if args.inputs:
        inputs = torch.load(args.inputs)
    inputs = {k: v.to(tensors_on) for k, v in inputs.items()}
    load_s = time.perf_counter() - t_load
    print(f"{'loaded ' + args.model if args.model else 'built the eager model'} in "
          f"{load_s:.1f} s; latents: {latents}")
    execution = args.device if args.device != "cpu" else "sim"
    report = python_flow(model, inputs, latents, args.steps, execution, args.profile,
                         args.stream_all, args.warmup)
    report["load_s"] = load_s
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
