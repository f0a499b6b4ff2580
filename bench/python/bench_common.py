"""Shared pieces of the Python benchmarks (W1-py, W2, load_from_disk, warm_attach): the workload
sizes, FLUX with seeded random weights and its inputs, the measurement helpers (VramMonitor,
measure_b_pinned, host RSS, the step loop), one ddo row (enable_offload, profile_run, counters),
a row run in a child process, and the machine facts. The benchmarks measure the same way because
they run this code; their tables come from bench_tables.py.

    import bench_common as bc
    bc.set_logger(log)                                  # the helpers' log lines go through log
    model, seconds = bc.build_on_device("tiny", "cpu")  # seeded random bf16, left on "cpu"
    first, times, finite, out = bc.run_steps_out(model, inputs, 5, cuda=False)
    bc.ddo_row(ctx, row, model, cap=8.0, calibrate=True, name="w2-int8-cap8")
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench_tables import fmt

GiB = 1 << 30
GB = 1e9

# The host simulation's capacity for an "uncapped" ddo row (--device sim): larger than any tiny
# model with its activations.
SIM_UNCAPPED_GB = 8.0


def _print_log(msg: str) -> None:
    print(msg, flush=True)


_log = _print_log


def set_logger(fn) -> None:
    """Routes the shared helpers' log lines (B_pinned, VmHWM, model build, ...) through ``fn``."""
    global _log
    _log = fn


def log(msg: str) -> None:
    _log(msg)


# ---------------------------------------------------------------------------------------------
# Workload sizes, the model, its inputs.
# ---------------------------------------------------------------------------------------------

SIZES = {
    # FluxTransformer2DModel's defaults are FLUX.1's; FLUX.1-dev adds the guidance embedding.
    "full": dict(config=dict(guidance_embeds=True), grid=(64, 64), txt=512),
    "tiny": dict(
        config=dict(
            # hidden 512: the larger matrices (2-3 MiB) are above one_shot_fast's 1 MiB
            # small-tensor threshold, and the streamed bytes exceed the staging ring, so the tiny
            # size streams every step too
            patch_size=1, in_channels=16, num_layers=4, num_single_layers=8, attention_head_dim=64,
            num_attention_heads=8, joint_attention_dim=64, pooled_projection_dim=32,
            guidance_embeds=True, axes_dims_rope=(16, 24, 24),
        ),
        grid=(4, 4),
        txt=8,
    ),
}


# Wan 2.1-14B's transformer (W4's video row): 480x832 and 21 frames are 6 latent frames of 60x104,
# 9360 tokens after the (1, 2, 2) patches; 512 text tokens of UMT5-XXL's width.
WAN_SIZES = {
    "full": dict(
        config=dict(
            patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        ),
        latent=(6, 60, 104), txt=512,
    ),
    "tiny": dict(
        # hidden 512 and ffn 2048: matrices of 0.5-2 MiB, some above the 1 MiB small-tensor
        # threshold, so the tiny size streams; 2 x 4 x 4 = 32 tokens reach the GEMM paths
        config=dict(
            patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=16,
            out_channels=16, text_dim=64, freq_dim=32, ffn_dim=2048, num_layers=4,
            rope_max_seq_len=64,
        ),
        latent=(2, 8, 8), txt=16,
    ),
}


def _construct_and_fill(size: str, device: str, family: str = "flux"):
    """The family's transformer (FluxTransformer2DModel, or WanTransformer3DModel for "wan")
    constructed on ``device`` with seeded random bf16 weights: N(0, 0.02) for matrices, ones for
    norm weights and zeros for biases, so activations stay finite. Returns (model, construct
    seconds, fill seconds)."""
    import torch
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if family == "wan":
                model = WanTransformer3DModel(**WAN_SIZES[size]["config"])
            else:
                model = FluxTransformer2DModel(**SIZES[size]["config"])
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    t_construct = time.perf_counter() - t0

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
    return model, t_construct, time.perf_counter() - t0 - t_construct


def build_on_device(size: str, device: str):
    """The seeded model (build_model's weights), left on ``device``: the caller decides when
    (and whether) it goes to the host, e.g. after quantizing it on the GPU. Returns (model,
    seconds)."""
    model, t_construct, t_fill = _construct_and_fill(size, device)
    return model, t_construct + t_fill


def build_model(size: str, device: str, family: str = "flux"):
    """The seeded model (FLUX, or Wan 2.1 for ``family`` "wan"), constructed on ``device`` (the
    GPU for the full size: default init of 12B parameters on the host takes minutes), then moved
    to the host: one host copy. Returns (model, bytes, parameters, build timings)."""
    import torch

    t0 = time.perf_counter()
    model, t_construct, t_fill = _construct_and_fill(size, device, family)
    model.to("cpu")
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    nbytes = model_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    build = dict(seconds=seconds, construct_s=t_construct, fill_s=t_fill,
                 to_host_s=seconds - t_construct - t_fill)
    log(f"built {type(model).__name__} ({size}) on {device}: {params / 1e9:.2f} B parameters, "
        f"{nbytes / GB:.2f} GB bf16 in {seconds:.1f} s (construct {t_construct:.1f}, fill "
        f"{t_fill:.1f}, to host {build['to_host_s']:.1f})")
    return model, nbytes, params, build


def model_bytes(model) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def make_inputs(size: str, device: str, guidance: bool):
    import torch

    spec = SIZES[size]
    cfg = SIZES[size]["config"]
    h, w = spec["grid"]
    g = torch.Generator().manual_seed(7)
    bf16 = torch.bfloat16
    in_ch = cfg.get("in_channels", 64)
    joint = cfg.get("joint_attention_dim", 4096)
    pooled = cfg.get("pooled_projection_dim", 768)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    inputs = dict(
        hidden_states=torch.randn(1, h * w, in_ch, generator=g).to(bf16),
        encoder_hidden_states=torch.randn(1, spec["txt"], joint, generator=g).to(bf16),
        pooled_projections=torch.randn(1, pooled, generator=g).to(bf16),
        timestep=torch.tensor([0.5], dtype=bf16),
        img_ids=img_ids.reshape(h * w, 3).to(bf16),
        txt_ids=torch.zeros(spec["txt"], 3, dtype=bf16),
    )
    if guidance:
        inputs["guidance"] = torch.tensor([3.5], dtype=bf16)
    return {k: v.to(device) for k, v in inputs.items()}


def make_wan_inputs(size: str, device: str):
    """WanTransformer3DModel's inputs for WAN_SIZES[size]: latents [1, C, F, H, W], a timestep,
    the text states."""
    import torch

    spec = WAN_SIZES[size]
    cfg = spec["config"]
    g = torch.Generator().manual_seed(7)
    bf16 = torch.bfloat16
    inputs = dict(
        hidden_states=torch.randn(1, cfg["in_channels"], *spec["latent"], generator=g).to(bf16),
        timestep=torch.tensor([500], dtype=torch.long),
        encoder_hidden_states=torch.randn(1, spec["txt"], cfg["text_dim"], generator=g).to(bf16),
    )
    return {k: v.to(device) for k, v in inputs.items()}


# ---------------------------------------------------------------------------------------------
# Measurement helpers.
# ---------------------------------------------------------------------------------------------


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def reset_host_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux: "5" > /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        log("cannot reset VmHWM (/proc/self/clear_refs): peak RSS is the process's peak so far")
        return False


def host_rss_gib() -> tuple[float | None, float | None]:
    """(VmRSS, VmHWM) in GiB."""
    rss = hwm = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024 / GiB
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return rss, hwm


def trim_host_memory() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:
        pass


class VramMonitor:
    """Peak device memory of one row: torch's peak reserved, and the driver view (total - free,
    device-wide) sampled by a thread every ``interval_s``. ``foreign`` is device memory held by
    other processes (the parent of a subprocess row), subtracted from the driver view."""

    def __init__(self, cuda: bool, interval_s: float, foreign_bytes: int = 0) -> None:
        self.cuda = cuda
        self.interval_s = interval_s
        self.foreign = foreign_bytes
        self.peak_driver = 0
        self.baseline = 0
        self.peak_reserved = 0
        self._stop = threading.Event()
        self._thread = None

    def _used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak_driver = max(self.peak_driver, self._used())
            except Exception:
                return

    def __enter__(self) -> "VramMonitor":
        if self.cuda:
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = self.peak_driver = self._used()
            if self.interval_s > 0:
                self._thread = threading.Thread(target=self._loop, daemon=True)
                self._thread.start()
        return self

    def note_reserved(self) -> None:
        """Reads torch's peak reserved now (call it before anything resets the counters)."""
        if self.cuda:
            import torch

            self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())
            self.peak_driver = max(self.peak_driver, self._used())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.note_reserved()
            self._stop.set()
            if self._thread is not None:
                self._thread.join()

    def figures(self) -> dict:
        if not self.cuda:
            return {}
        driver = max(0, self.peak_driver - self.foreign)
        return dict(
            peak_vram_gib=max(driver, self.peak_reserved) / GiB,
            peak_reserved_gib=self.peak_reserved / GiB,
            peak_driver_vram_gib=driver / GiB,
            driver_baseline_gib=self.baseline / GiB,
            foreign_vram_gib=self.foreign / GiB,
        )


def measure_b_pinned(cuda: bool) -> dict:
    """Host-to-device GB/s of one 1 GiB pinned copy (best and median of 5 after a warm-up); on
    the simulation a host copy of 256 MiB, for the record only."""
    import torch

    n = GiB if cuda else 256 << 20
    if cuda:
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    else:
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.empty(n, dtype=torch.uint8)
    rates = []
    for i in range(6):
        sync(cuda)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync(cuda)
        if i:
            rates.append(n / GB / (time.perf_counter() - t0))
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # the caching host allocator keeps the 1 GiB
            torch._C._host_emptyCache()
    out = dict(gbps=max(rates), median_gbps=statistics.median(rates), bytes=n,
               what="pinned host -> cuda, non_blocking" if cuda else "host memcpy (sim)")
    log(f"B_pinned {out['gbps']:.1f} GB/s (median {out['median_gbps']:.1f}; {out['what']})")
    return out


def run_steps(model, inputs: dict, steps: int, cuda: bool, between=None, return_out=False):
    """One warm-up step (timed: "first step"), then ``steps`` timed steps. ``between`` runs after
    the warm-up (e.g. to snapshot counters). Returns (first, [steps], finite), plus the last
    step's output with ``return_out``."""
    import torch

    def one():
        sync(cuda)
        t0 = time.perf_counter()
        out = model(**inputs, return_dict=False)[0]
        sync(cuda)
        return time.perf_counter() - t0, out

    with torch.no_grad():
        first, out = one()
        if between is not None:
            between()
        times = []
        for _ in range(steps):
            dt, out = one()
            times.append(dt)
        finite = bool(torch.isfinite(out).all().item())
    return (first, times, finite, out) if return_out else (first, times, finite)


def fill_step_figures(row: dict, first: float, times: list, finite: bool) -> None:
    row.update(first_step_s=first, step_s=times, median_step_s=statistics.median(times),
               output_finite=finite)


def clear_cap(cuda: bool) -> None:
    """ddo applies vram_cap_gb as the caching allocator's memory fraction; lift it after a row."""
    if cuda:
        import torch

        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def run_steps_out(model, inputs: dict, steps: int, cuda: bool, between=None):
    """run_steps, also returning the last step's output (on the device it was made)."""
    return run_steps(model, inputs, steps, cuda, between=between, return_out=True)


def max_abs_diff(out, ref) -> float | None:
    if out is None or ref is None:
        return None
    return float((out.float().cpu() - ref.float().cpu()).abs().max().item())


def output_vs_reference(out, ref) -> dict:
    """Relative L2 error and cosine similarity of ``out`` against ``ref`` (float32, on out's
    device): the accuracy columns of a quantized row."""
    import torch

    if out is None or ref is None:
        return {}
    a, b = out.float().flatten(), ref.float().flatten().to(out.device)
    return dict(rel_l2=((a - b).norm() / b.norm()).item(),
                cosine=torch.nn.functional.cosine_similarity(a, b, dim=0).item())


def set_bound(row: dict, t_resident, b_pinned_gbps) -> bool:
    """bound = max(T_resident, streamed / B_pinned) and efficiency = bound / median into ``row``;
    False (nothing set) while a figure is missing."""
    median = row.get("median_step_s")
    streamed = row.get("streamed_gb_per_step")
    if median is None or streamed is None or not b_pinned_gbps:
        return False
    bound = streamed / b_pinned_gbps
    if t_resident:
        bound = max(bound, t_resident)
    row["bound_s"] = bound
    row["efficiency"] = bound / median
    return True


# ---------------------------------------------------------------------------------------------
# Rows.
# ---------------------------------------------------------------------------------------------


def _run_delta(before: dict, after: dict, key: str) -> float:
    return float(after.get(key, 0)) - float(before.get(key, 0))


def ddo_row(ctx: dict, row: dict, model, cap, calibrate: bool, name, ref=None) -> None:
    """One ddo row: enable_offload(preset one_shot_fast, profile ``name`` (None: no profile),
    build_profile=``calibrate``, vram_cap_gb=``cap``; None = uncapped), one warm-up and
    ctx["steps"] timed steps inside profile_run(), then remove. Fills ``row`` as it goes (a
    failure keeps what was measured): setup, streamed bytes and GB/s from the run counters over
    the timed steps, peak VRAM and RSS, the profile report at setup (``profile_setup``:
    calibrating / probing / applied) and after the region (``profile_report``), and max |out -
    ref| when ``ref`` is given. ctx: cuda, steps, sample_s, overrides, inputs (on the execution
    device)."""
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

            # Normal runs: the region is a no-op (the recommendation was applied at setup); it
            # is opened anyway so calibration and normal rows run the same code.
            with offload.profile_run() as profile_report:
                first, times, finite, out = run_steps_out(model, inputs, steps, cuda,
                                                          between=snapshot)
                after = offload.report()["run"]
                mon.note_reserved()  # before the region's end touches the peak counters
            fill_step_figures(row, first, times, finite)
        row["profile_report"] = dict(profile_report)
        if ref is not None:
            row["max_abs_diff_vs_resident"] = max_abs_diff(out, ref)
            row.update(output_vs_reference(out, ref))
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


def row_summary(r: dict) -> str:
    """A measured row's log line: setup, first and median step, streamed, peak VRAM and RSS,
    efficiency (a benchmark appends its own figures)."""
    return (f"setup {fmt(r.get('setup_s'), '.2f')} s, first {fmt(r.get('first_step_s'), '.3f')} s, "
            f"median {fmt(r.get('median_step_s'), '.3f')} s, streamed "
            f"{fmt(r.get('streamed_gb_per_step'), '.2f')} GB/step, peak VRAM "
            f"{fmt(r.get('peak_vram_gib'), '.2f')} GiB, peak RSS "
            f"{fmt(r.get('peak_host_rss_gib'), '.1f')} GiB, efficiency "
            f"{fmt(r.get('efficiency'), '.2f')}")


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:2000]}"


def measure_row(row: dict, fn, label: str, cleanup=None) -> None:
    """Runs fn(row), timed into row["row_wall_s"]. An exception is a result (an OOM at a cap):
    recorded in row["error"] and logged, then ``cleanup`` runs (its own failure is logged)."""
    t0 = time.perf_counter()
    try:
        fn(row)
    except Exception as e:
        row["error"] = error_text(e)
        if cleanup is not None:
            try:
                cleanup()
            except Exception as failure:
                log(f"{label}: cleanup after the failure failed too: {failure}")
    row["row_wall_s"] = time.perf_counter() - t0
    if row.get("error"):
        log(f"{label}: FAILED after {row['row_wall_s']:.1f} s: {row['error'][:300]}")


# A row in a child process: the parent runs its own script again with the child's flags and
# --row-out FILE; the child measures one row (child_row) and writes it to FILE; the parent merges
# it. Environment: <PREFIX>_T0 (the parent's clock, for the child's log) and, on CUDA,
# <PREFIX>_FOREIGN_VRAM_BYTES (the device memory the parent holds, left out of the child's peak).


def run_child_row(row: dict, script: str, flags: list, env_prefix: str, t0: float, cuda: bool,
                  timeout: float, label: str) -> None:
    import torch

    fd, path = tempfile.mkstemp(prefix=f"{env_prefix.lower()}-row-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, **{f"{env_prefix}_T0": repr(t0)})
    if cuda:
        free, total = torch.cuda.mem_get_info()
        env[f"{env_prefix}_FOREIGN_VRAM_BYTES"] = str(total - free)  # this process's context
    cmd = [sys.executable, os.path.abspath(script)] + flags + ["--row-out", path]
    log(f"{label}: subprocess {' '.join(cmd[1:])}")
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout)
        with open(path) as f:
            text = f.read()
        if text.strip():
            row.update(json.loads(text))
        if proc.returncode != 0 and "error" not in row:
            row["error"] = f"subprocess exited with status {proc.returncode}"
    except subprocess.TimeoutExpired:
        row["error"] = f"subprocess timed out after {timeout} s"
    finally:
        os.unlink(path)


def foreign_vram_bytes(env_prefix: str) -> int:
    """In a child row: the device memory its parent holds (run_child_row)."""
    return int(os.environ.get(f"{env_prefix}_FOREIGN_VRAM_BYTES", "0"))


def child_row(row: dict, fn, label: str, row_out: str) -> int:
    """The child's side: fn(row), a failure recorded in the row (not raised: the parent merges
    it), the row written to ``row_out``. Returns the child's exit status."""
    try:
        fn(row)
        rc = 0
    except Exception as e:
        row["error"] = error_text(e)
        log(f"{label}: failed: {row['error'][:300]}")
        rc = 1
    write_atomic(row_out, json.dumps(row, indent=1, default=str))
    return rc


# ---------------------------------------------------------------------------------------------
# Flags, results, the machine.
# ---------------------------------------------------------------------------------------------


def add_common_args(p, child_timeout: float) -> None:
    """The flags every FLUX benchmark takes: --steps, --device, --sample-ms, --child-timeout,
    --overrides, --commit and the child's --row-out."""
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up (>= 5)")
    p.add_argument("--device", choices=("cuda", "sim"), default=None,
                   help="default: cuda when available, else sim")
    p.add_argument("--sample-ms", type=float, default=5.0,
                   help="driver-view VRAM sampling period (0: only torch's peak reserved)")
    p.add_argument("--child-timeout", type=float, default=child_timeout,
                   help="seconds for each subprocess row")
    p.add_argument("--overrides", default="{}",
                   help="JSON object of config fields for every ddo row, e.g. "
                        "'{\"prefetch_window_mb\": 2048}'")
    p.add_argument("--commit", default=None)
    p.add_argument("--row-out", help=argparse.SUPPRESS)


def check_common_args(p, args) -> None:
    """Checks --steps and parses --overrides (p.error on a bad value)."""
    if args.steps < 1:
        p.error("--steps must be >= 1 (docs/design/0009-benchmarks.md asks for >= 5)")
    try:
        args.overrides = json.loads(args.overrides)
        assert isinstance(args.overrides, dict)
    except (ValueError, AssertionError):
        p.error("--overrides must be a JSON object of config fields")


def split_list(text: str) -> list:
    return [s.strip() for s in text.split(",") if s.strip()]


def fresh_profile_dir(prefix: str) -> str:
    """A fresh temporary profile folder in DDO_PROFILE_DIR (the C++ settings loader reads it at
    enable time: set it before the first enable_offload)."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.environ["DDO_PROFILE_DIR"] = path
    return path


def use_cuda(device) -> bool | None:
    """--device: cuda, sim, or None (cuda when available); None when cuda is asked for and not
    available."""
    import torch

    cuda = device == "cuda" if device else torch.cuda.is_available()
    if cuda and not torch.cuda.is_available():
        log("--device cuda but CUDA is not available")
        return None
    return cuda


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def machine_facts(cuda: bool) -> dict:
    import diffusers
    import torch

    try:
        import accelerate

        accelerate_version = accelerate.__version__
    except ImportError:
        accelerate_version = None
    facts = dict(torch_version=torch.__version__.split("+")[0], torch_full=torch.__version__,
                 diffusers_version=diffusers.__version__, accelerate_version=accelerate_version,
                 python=sys.version.split()[0],
                 host=os.uname().nodename, cpus=os.cpu_count(), gpu=None, driver=None)
    if cuda:
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["cuda_runtime"] = torch.version.cuda
        try:
            facts["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip() or None
        except Exception:
            pass
    return facts


def time_ms(fn, cuda: bool, reps: int = 20) -> float:
    """The median milliseconds of ``fn`` over ``reps`` calls after one warm-up, the device
    synchronized around each call."""
    fn()
    sync(cuda)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(cuda)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def gemm_cases(cuda: bool, tokens: int, shapes, weights_dtypes):
    """For each (out, in) of ``shapes``: (out, in, the bf16 Linear on the device, {weights dtype:
    its ddo.sdnq.quantize_linear(..., quantized_matmul=True) layer quantized on the host, on the
    device}, a contiguous [tokens, in] bf16 input). The GEMM rows of W4 and its kernel table."""
    import torch
    import ddo

    dev = "cuda" if cuda else "cpu"
    x = torch.randn(tokens, max(i for _, i in shapes), device=dev, dtype=torch.bfloat16)
    for out_f, in_f in shapes:
        lin = torch.nn.Linear(in_f, out_f).to(torch.bfloat16)
        quantized = {name: ddo.sdnq.quantize_linear(lin, name, 0, quantized_matmul=True).to(dev)
                     for name in weights_dtypes}
        yield out_f, in_f, lin.to(dev), quantized, x[:, :in_f].contiguous()


def command_line() -> str:
    """The invoking command as a reader reruns it from the repository root: the script by its
    path in the repository, and absolute paths among the arguments by their file names (result
    documents never name a folder of the machine that wrote them)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]),
                             os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    args = [os.path.basename(a) if os.path.isabs(a) else a for a in sys.argv[1:]]
    return " ".join(["python", script] + args)


def default_commit():
    if os.environ.get("DDO_COMMIT"):
        return os.environ["DDO_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None
