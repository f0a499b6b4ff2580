#!/usr/bin/env python3
"""W1-py: diffusers' own FluxTransformer2DModel under ddo, against diffusers' group offload.

shared/spec/benchmarks.md, "W1-py": FLUX.1-dev dimensions (19 double + 38 single blocks, 24 heads
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
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

GiB = 1 << 30
GB = 1e9
T0 = float(os.environ.get("W1PY_T0", time.time()))  # a child logs on its parent's clock


def log(msg: str) -> None:
    print(f"[w1-py {time.time() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Workload sizes.
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
# tiny: at 0.1 GiB the window is smaller than the streamed bytes (every step streams) and the
# recommendation is 0 (1 GiB headroom); at 1.5 GiB the calibrated run keeps everything resident.
DEFAULT_CAPS = {"full": "8,12,16,24", "tiny": "0.1,1.5"}
ALL_ROUTES = ("resident", "calibrated", "noprofile", "block", "leaf")


def build_model(size: str, device: str):
    """A FluxTransformer2DModel with seeded random bf16 weights, returned on the host.

    Constructed on ``device`` (the GPU for the full size: default init of 12B parameters on the
    host takes minutes), refilled with N(0, 0.02) for matrices, ones for norm weights and zeros
    for biases so activations stay finite, then moved to the host: one host copy.
    """
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
    t_fill = time.perf_counter() - t0 - t_construct
    model.to("cpu")
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    tensors = list(model.parameters()) + list(model.buffers())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(p.numel() for p in model.parameters())
    build = dict(seconds=seconds, construct_s=t_construct, fill_s=t_fill,
                 to_host_s=seconds - t_construct - t_fill)
    log(f"built FluxTransformer2DModel ({size}) on {device}: {params / 1e9:.2f} B parameters, "
        f"{nbytes / GB:.2f} GB bf16 in {seconds:.1f} s (construct {t_construct:.1f}, fill "
        f"{t_fill:.1f}, to host {build['to_host_s']:.1f})")
    return model, nbytes, params, build


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


def _run_delta(before: dict, after: dict, key: str) -> float:
    return float(after.get(key, 0)) - float(before.get(key, 0))


def row_ddo(ctx: dict, row: dict, cap: float, calibrate: bool, profile: bool = True) -> None:
    import ddo

    cuda = ctx["cuda"]
    model = ctx["model"]
    steps = ctx["steps"]
    name = f"w1py-cap{cap:g}" if profile else None
    row["profile_name"] = name
    kwargs = dict(ctx["overrides"], preset="one_shot_fast", profile_name=name,
                  build_profile=calibrate)
    if cuda:
        kwargs["vram_cap_gb"] = cap
    else:
        kwargs.update(execution_device="sim", sim_device_capacity_gb=cap)
    inputs = make_inputs(ctx["size"], "cuda" if cuda else "cpu", ctx["guidance"])
    offload = None
    reset_host_peak()
    try:
        with VramMonitor(cuda, ctx["sample_s"]) as mon:
            t0 = time.perf_counter()
            offload = ddo.enable_offload(model, **kwargs)
            sync(cuda)
            row["setup_s"] = time.perf_counter() - t0
            mon.note_reserved()  # setup's peak: the calibration region resets the counters
            report = offload.report()
            row["setup"] = report["setup"]
            row["plan"] = report.get("plan")
            row["resident_gb"] = report["setup"]["bytes"]["resident"] / GB
            snap = {}

            def snapshot():
                snap["before"] = offload.report()["run"]

            # Normal runs: the region is a no-op (the recommendation was applied at setup); it
            # is opened anyway so both rows run the same code.
            with offload.profile_run() as profile_report:
                result = run_steps(model, inputs, steps, cuda, between=snapshot)
                after = offload.report()["run"]
                mon.note_reserved()  # before the region's end touches the peak counters
            fill_step_figures(row, *result)
        row["profile_report"] = dict(profile_report)
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
        del inputs
        clear_cap(cuda)


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
    foreign = int(os.environ.get("W1PY_FOREIGN_VRAM_BYTES", "0"))
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
    import torch

    fd, path = tempfile.mkstemp(prefix=f"w1py-{route}-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, W1PY_T0=repr(T0))
    if ctx["cuda"]:
        free, total = torch.cuda.mem_get_info()
        env["W1PY_FOREIGN_VRAM_BYTES"] = str(total - free)  # this process's context
    cmd = [sys.executable, os.path.abspath(__file__), "--only-route", route, "--size",
           ctx["size"], "--steps", str(ctx["steps"]), "--sample-ms",
           str(ctx["sample_s"] * 1e3), "--row-out", path]
    log(f"{route}: subprocess {' '.join(cmd[1:])}")
    try:
        proc = subprocess.run(cmd, env=env, timeout=ctx["child_timeout"])
        with open(path) as f:
            text = f.read()
        if text.strip():
            row.update(json.loads(text))
        if proc.returncode != 0 and "error" not in row:
            row["error"] = f"subprocess exited with status {proc.returncode}"
    except subprocess.TimeoutExpired:
        row["error"] = f"subprocess timed out after {ctx['child_timeout']} s"
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------


def finalize(row: dict, t_resident, b_pinned_gbps) -> None:
    median = row.get("median_step_s")
    streamed = row.get("streamed_gb_per_step")
    if median is None or streamed is None or not b_pinned_gbps:
        return
    bound = streamed / b_pinned_gbps
    if t_resident:
        bound = max(bound, t_resident)
    row["bound_s"] = bound
    row["efficiency"] = bound / median


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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


def default_commit():
    if os.environ.get("DDO_COMMIT"):
        return os.environ["DDO_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--caps", help="GiB list (default: 8,12,16,24 full; tiny values for tiny)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up (>= 5)")
    p.add_argument("--routes", default=",".join(ALL_ROUTES),
                   help="subset of resident,calibrated,noprofile,block,leaf (calibrated = "
                        "calibration + calibrated per cap; noprofile = no profile_name per cap)")
    p.add_argument("--device", choices=("cuda", "sim"), default=None,
                   help="default: cuda when available, else sim")
    p.add_argument("--t-resident", type=float, default=None,
                   help="T_resident in s when the resident row is not run")
    p.add_argument("--sample-ms", type=float, default=5.0,
                   help="driver-view VRAM sampling period (0: only torch's peak reserved)")
    p.add_argument("--child-timeout", type=float, default=300.0,
                   help="seconds for each diffusers route subprocess")
    p.add_argument("--overrides", default="{}",
                   help="JSON object of config fields for every ddo row, e.g. "
                        "'{\"prefetch_window_mb\": 2048}'")
    p.add_argument("--out", default="w1py.json")
    p.add_argument("--commit", default=None)
    p.add_argument("--only-route", choices=("block", "leaf"), help=argparse.SUPPRESS)
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1 (the spec asks for >= 5)")
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    bad = [r for r in routes if r not in ALL_ROUTES]
    if bad:
        p.error(f"unknown route(s) {bad}; choose from {','.join(ALL_ROUTES)}")
    args.routes = routes
    try:
        args.overrides = json.loads(args.overrides)
        assert isinstance(args.overrides, dict)
    except (ValueError, AssertionError):
        p.error("--overrides must be a JSON object of config fields")
    args.caps = [float(c) for c in (args.caps or DEFAULT_CAPS[args.size]).split(",") if c.strip()]
    return args


def child_main(args) -> int:
    ctx = dict(size=args.size, steps=args.steps, sample_s=args.sample_ms / 1e3, cuda=True,
               guidance=SIZES[args.size]["config"].get("guidance_embeds", False))
    row = base_row(args.only_route, None, "diffusers_group_offload")
    try:
        row_diffusers(ctx, row, args.only_route)
        rc = 0
    except Exception as e:  # recorded, not raised: the parent merges the row
        row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        log(f"{args.only_route}: failed: {row['error'][:300]}")
        rc = 1
    write_atomic(args.row_out, json.dumps(row, indent=1, default=str))
    return rc


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.only_route:
        return child_main(args)

    # A fresh profile directory: the C++ settings loader reads DDO_PROFILE_DIR at enable time.
    profile_dir = tempfile.mkdtemp(prefix="w1py-profiles-")
    os.environ["DDO_PROFILE_DIR"] = profile_dir
    log(f"importing torch, diffusers, ddo; profiles in {profile_dir}")
    import torch
    import diffusers  # noqa: F401
    import ddo

    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    if cuda and not torch.cuda.is_available():
        log("--device cuda but CUDA is not available")
        return 2
    log(f"ddo from {os.path.dirname(ddo.__file__)}; device {'cuda' if cuda else 'sim'}; "
        f"size {args.size}; caps {args.caps}; routes {args.routes}; steps {args.steps}")

    result = dict(benchmark="w1-py", size=args.size, steps=args.steps, caps=args.caps,
                  routes=args.routes, overrides=args.overrides, cuda=cuda,
                  device="cuda" if cuda else "sim",
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                  commit=args.commit or default_commit(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  profile_dir=profile_dir, rows=[])
    result.update(machine_facts(cuda))

    def save() -> None:
        for r in result["rows"]:
            finalize(r, result.get("t_resident_s"), result.get("b_pinned_gbps"))
        write_atomic(args.out, json.dumps(result, indent=1, default=str))

    model, nbytes, params, build = build_model(args.size, "cuda" if cuda else "cpu")
    guidance = bool(model.config.guidance_embeds)
    grid = SIZES[args.size]["grid"]
    result.update(model_gb=nbytes / GB, model_bytes=nbytes, parameters=params,
                  model_build_s=build["seconds"], model_build=build,
                  model_config={k: v for k, v in dict(model.config).items()
                                if not k.startswith("_")},
                  inputs=dict(image_tokens=grid[0] * grid[1], text_tokens=SIZES[args.size]["txt"],
                              batch=1, dtype="bfloat16", guidance=guidance))
    b = measure_b_pinned(cuda)
    result.update(b_pinned_gbps=b["gbps"], b_pinned=b, t_resident_s=args.t_resident)
    save()

    ctx = dict(model=model, size=args.size, steps=args.steps, cuda=cuda, guidance=guidance,
               sample_s=args.sample_ms / 1e3, child_timeout=args.child_timeout,
               overrides=args.overrides)

    def add(route: str, cap, preset, fn, *fn_args) -> dict:
        label = route if cap is None else f"{route}@{cap:g}"
        log(f"{label}: start")
        t0 = time.perf_counter()
        row = base_row(route, cap, preset)
        try:
            fn(ctx, row, *fn_args)
        except Exception as e:  # an OOM at a cap is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            try:
                if ctx.get("model") is not None:
                    ddo.remove_offload(ctx["model"])
                clear_cap(cuda)
            except Exception as cleanup:
                log(f"{label}: cleanup after the failure failed too: {cleanup}")
        row["row_wall_s"] = time.perf_counter() - t0
        result["rows"].append(row)
        save()
        r = result["rows"][-1]
        if r.get("error"):
            log(f"{label}: FAILED after {r['row_wall_s']:.1f} s: {r['error'][:300]}")
        else:
            log(f"{label}: setup {r.get('setup_s', 0):.2f} s, first {r['first_step_s']:.3f} s, "
                f"median {r['median_step_s']:.3f} s, streamed "
                f"{r.get('streamed_gb_per_step', 0):.2f} GB/step, peak VRAM "
                f"{fmt(r.get('peak_vram_gib'), '.2f')} GiB, peak RSS "
                f"{fmt(r.get('peak_host_rss_gib'), '.1f')} GiB, efficiency "
                f"{fmt(r.get('efficiency'), '.2f')}"
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
