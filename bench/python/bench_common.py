"""Shared pieces of the Python benchmarks (W1-py, W2): the FLUX model kept where it was built, a
step loop that returns its output, and one ddo row (enable_offload, profile_run, counters).

The measurement helpers themselves (VramMonitor, measure_b_pinned, host RSS, inputs, sizes) are
w1_py.py's and are re-exported from here, so both benchmarks measure the same way:

    import bench_common as bc
    model = bc.build_on_device("tiny", "cpu")           # seeded random bf16, left on "cpu"
    first, times, finite, out = bc.run_steps_out(model, inputs, 5, cuda=False)
    bc.ddo_row(ctx, row, model, cap=8.0, calibrate=True, name="w2-int8-cap8")
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import w1_py  # noqa: E402  (the W1-py benchmark: its helpers are the shared measurement code)
from w1_py import (  # noqa: E402,F401  (re-exported)
    GB,
    GiB,
    SIZES,
    VramMonitor,
    clear_cap,
    default_commit,
    fill_step_figures,
    host_rss_gib,
    machine_facts,
    make_inputs,
    measure_b_pinned,
    reset_host_peak,
    sync,
    trim_host_memory,
    write_atomic,
)

# The host simulation's capacity for an "uncapped" ddo row (--device sim): larger than any tiny
# model with its activations.
SIM_UNCAPPED_GB = 8.0


def set_logger(fn) -> None:
    """Routes the shared helpers' log lines (B_pinned, VmHWM, ...) through ``fn``."""
    w1_py.log = fn


def log(msg: str) -> None:
    w1_py.log(msg)


def build_on_device(size: str, device: str):
    """FluxTransformer2DModel with W1-py's seeded random bf16 weights (same seed and fill as
    w1_py.build_model), left on ``device``: the caller decides when (and whether) it goes to the
    host, e.g. after quantizing it on the GPU. Returns (model, seconds)."""
    import torch
    from diffusers import FluxTransformer2DModel

    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**SIZES[size]["config"])
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    if device != "cpu":
        torch.cuda.synchronize()
    return model, time.perf_counter() - t0


def model_bytes(model) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def run_steps_out(model, inputs: dict, steps: int, cuda: bool, between=None):
    """w1_py.run_steps, also returning the last step's output (on the device it was made)."""
    return w1_py.run_steps(model, inputs, steps, cuda, between=between, return_out=True)


def max_abs_diff(out, ref) -> float | None:
    if out is None or ref is None:
        return None
    return float((out.float().cpu() - ref.float().cpu()).abs().max().item())


def _run_delta(before: dict, after: dict, key: str) -> float:
    return float(after.get(key, 0)) - float(before.get(key, 0))


def ddo_row(ctx: dict, row: dict, model, cap, calibrate: bool, name: str, ref=None) -> None:
    """One ddo row: enable_offload(preset one_shot_fast, profile ``name``, build_profile=
    ``calibrate``, vram_cap_gb=``cap``; None = uncapped), one warm-up and ctx["steps"] timed
    steps inside profile_run(), then remove. Fills ``row`` as it goes (a failure keeps what was
    measured): setup, streamed bytes and GB/s from the run counters over the timed steps, peak
    VRAM and RSS, the profile report at setup (``profile_setup``: calibrating / probing /
    applied) and after the region (``profile_report``), and max |out - ref| when ``ref`` is
    given. ctx: cuda, steps, sample_s, overrides, inputs (on the execution device)."""
    import ddo

    cuda = ctx["cuda"]
    steps = ctx["steps"]
    row["profile_name"] = name
    kwargs = dict(ctx.get("overrides") or {}, preset="one_shot_fast", profile_name=name,
                  build_profile=calibrate)
    if cuda:
        if cap is not None:
            kwargs["vram_cap_gb"] = cap
    else:
        kwargs.update(execution_device="sim",
                      sim_device_capacity_gb=SIM_UNCAPPED_GB if cap is None else cap)
    inputs = ctx["inputs"]
    offload = None
    reset_host_peak()
    try:
        with VramMonitor(cuda, ctx["sample_s"]) as mon:
            t0 = time.perf_counter()
            offload = ddo.enable_offload(model, **kwargs)
            sync(cuda)
            row["setup_s"] = time.perf_counter() - t0
            mon.note_reserved()  # setup's peak: the calibration region resets the counters
            row["profile_setup"] = dict(offload.profile_report)
            report = offload.report()
            row["execution_mode"] = report.get("execution_mode")
            row["setup"] = report["setup"]
            row["plan"] = report.get("plan")
            row["resident_gb"] = report["setup"]["bytes"]["resident"] / GB
            row["kept_modules"] = report.get("python", {}).get("kept_modules")
            snap = {}

            def snapshot():
                snap["before"] = offload.report()["run"]

            with offload.profile_run() as profile_report:
                first, times, finite, out = run_steps_out(model, inputs, steps, cuda,
                                                          between=snapshot)
                after = offload.report()["run"]
                mon.note_reserved()  # before the region's end touches the peak counters
            fill_step_figures(row, first, times, finite)
        row["profile_report"] = dict(profile_report)
        row["max_abs_diff_vs_resident"] = max_abs_diff(out, ref)
        before = snap["before"]
        streamed = _run_delta(before, after, "bytes_streamed")
        copy_ms = _run_delta(before, after, "copy_ms")
        row["streamed_gb_per_step"] = streamed / steps / GB
        row["achieved_gbps"] = streamed / (copy_ms * 1e6) if copy_ms > 0 else None
        row["compute_wait_s_per_step"] = _run_delta(before, after, "compute_wait_ms") / 1e3 / steps
        row["run"] = after
        row.update(mon.figures())
        if not cuda and "peak_vram_gb" in after:  # the sim device's own probe
            row["peak_vram_gib"] = after["peak_vram_gb"]
        row["peak_host_rss_gib"] = host_rss_gib()[1]
    finally:
        if offload is not None:
            offload.remove()
        else:
            ddo.remove_offload(model)
        clear_cap(cuda)
