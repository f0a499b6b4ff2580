#!/usr/bin/env python3
"""W1-py from disk: ddo's loader against diffusers' from_pretrained + group offload.

Writes W1-py's FluxTransformer2DModel (bench/python/bench_common.py: FLUX.1-dev dimensions, seeded
random bf16 weights) to --dir with ``save_pretrained`` (sharded), then, each in a fresh process:

  disk          the files' sequential read bandwidth: cold (page cache dropped for these files
                with posix_fadvise(DONTNEED) after an fsync: no root needed) and warm
  ddo           from_pretrained_with_dynamic_offload(apply_dynamic=True) at each --caps GiB
                (vram_cap_gb), cold and warm page cache: setup seconds, load GB/s, peak RSS, and
                --steps timed steps after a warm-up step
  ddo_disk      the same load with host RAM capped at --host-ram-cap GiB (host_ram_cap_gb): the
                planner's disk tier leaves the rest in the files and the copy scheduler reads it
                every step into a pinned ring (Note [Disk tier]); steps with a warm page cache, and
                ("cold") steps back to back after the files were dropped from it once (the disk
                tier drops what it reads, so each step reads from the drive), against the bound
                max(the host-tier row's step at the same cap, disk bytes / disk bandwidth)
  diffusers     FluxTransformer2DModel.from_pretrained + enable_group_offload (block level, one
                block per group, streams), warm page cache: setup seconds, peak RSS, steps

One JSON line per row on stdout; --out FILE.json writes everything with the machine's facts.

    python bench/python/load_from_disk.py --dir /tmp/w1py-disk --caps 8,16 --out load.json
    python bench/python/load_from_disk.py --size tiny --device sim --dir /tmp/w1py-tiny  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

GB = 1e9
GiB = float(1 << 30)


def log(msg: str) -> None:
    print(f"[load_from_disk] {msg}", file=sys.stderr, flush=True)


bc.set_logger(log)


def shard_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def drop_cache(path: str) -> None:
    for f in shard_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: str) -> float | None:
    """Share of the files' pages in the page cache (mmap + mincore), or None if unknown."""
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = mmap.PAGESIZE
        total = resident = 0
        for f in shard_files(path):
            size = os.path.getsize(f)
            if size == 0:
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                rc = libc.mincore(addr, size, vec)
                libc.munmap(addr, size)
            finally:
                os.close(fd)
            if rc != 0:
                return None
            total += n
            resident += sum(v & 1 for v in bytes(vec))
        return resident / total if total else None
    except Exception:
        return None


def read_bandwidth(path: str, threads: int = 8, piece: int = 64 << 20, direct: bool = False,
                   limit: int | None = None, stride: int = 1) -> dict:
    """Reads the shards with `threads` pread workers in `piece`-byte jobs; GB/s over all bytes.

    direct: O_DIRECT into page-aligned buffers (no page cache). limit: stop after about this many
    bytes. stride: take every stride-th piece (scattered ranges, like the disk tier's units)."""
    jobs = []
    for f in shard_files(path):
        size = os.path.getsize(f)
        jobs += [(f, off, min(piece, size - off)) for off in range(0, size, piece)]
    jobs = jobs[::stride]
    if limit is not None:
        jobs = jobs[:max(1, limit // piece)]
    lock = threading.Lock()
    state = {"next": 0}
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {f: os.open(f, flags) for f in shard_files(path)}
    chunk = 16 << 20

    def worker():
        import mmap
        buf = mmap.mmap(-1, chunk) if direct else None  # page-aligned for O_DIRECT
        while True:
            with lock:
                i = state["next"]
                state["next"] += 1
            if i >= len(jobs):
                return
            f, off, n = jobs[i]
            got = 0
            while got < n:
                if direct:
                    want = min(n - got, chunk)
                    view = memoryview(buf)[:(want + 4095) // 4096 * 4096]
                    r = os.preadv(fds[f], [view], off + got)
                    if r <= 0:
                        break
                    got += min(r, want)
                    continue
                b = os.pread(fds[f], min(n - got, chunk), off + got)
                if not b:
                    break
                got += len(b)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    nbytes = sum(n for _, _, n in jobs)
    return dict(bytes=nbytes, seconds=dt, gbps=nbytes / dt / GB)


# --- one row per process ----------------------------------------------------------------------


def child(args) -> dict:
    import torch

    import ddo
    from diffusers import FluxTransformer2DModel

    cuda = args.device == "cuda"
    row = dict(route=args.child, cap_gib=args.cap, cache=args.cache)
    inputs = bc.make_inputs(args.size, "cuda" if cuda else "cpu",
                               bc.SIZES[args.size]["config"].get("guidance_embeds", False))
    bc.reset_host_peak()
    rss0, _ = bc.host_rss_gib()
    t0 = time.perf_counter()
    if args.child in ("ddo", "ddo_disk"):
        # W1-py's ddo rows: preset one_shot_fast, the cap through its DDO_ variable.
        os.environ["DDO_VRAM_CAP_GB" if cuda else "DDO_SIM_DEVICE_GB"] = str(args.cap)
        if args.child == "ddo_disk":
            os.environ["DDO_HOST_RAM_CAP_GB"] = str(args.host_ram_cap)
            row["host_ram_cap_gib"] = args.host_ram_cap
        loaded = ddo.from_pretrained_with_dynamic_offload(
            args.dir, model_loader=FluxTransformer2DModel, apply_dynamic=True,
            preset="one_shot_fast", execution_device=args.device, dtype=torch.bfloat16,
        )
        model = loaded.module
        bc.sync(cuda)
        row["setup_s"] = time.perf_counter() - t0
        setup = loaded.report()["setup"]
        row["load"] = setup.get("load")
        row["pinned_gib"] = setup["pinned_bytes"] / GiB
        row["resident_gib"] = setup["bytes"]["resident"] / GiB
        row["pin_s"] = setup["pin_seconds"]
        row["moves_s"] = setup["moves_seconds"]
        row["preset"] = loaded.report()["preset"]
    else:
        model = FluxTransformer2DModel.from_pretrained(args.dir, torch_dtype=torch.bfloat16)
        row["from_pretrained_s"] = time.perf_counter() - t0
        model.enable_group_offload(
            onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
            offload_type="block_level", num_blocks_per_group=1, use_stream=True,
            record_stream=True,
        )
        bc.sync(cuda)
        row["setup_s"] = time.perf_counter() - t0
    rss1, hwm = bc.host_rss_gib()
    row["peak_rss_gib"] = hwm - rss0 if hwm is not None and rss0 is not None else None
    row["rss_after_setup_gib"] = rss1 - rss0 if rss1 is not None and rss0 is not None else None
    if args.child == "ddo" and args.cache == "cold":
        # The drive again, right after the cold load (its rate drifts within a call: 1.99 then
        # 1.70 GB/s on one H100 machine), so the load can be set against both sweeps.
        drop_cache(args.dir)
        row["disk_after"] = read_bandwidth(args.dir, limit=4 << 30)
    if args.child == "ddo_disk":
        run0 = loaded.report()["run"]
        first, times, finite = bc.run_steps(model, inputs, args.steps, cuda)
        row.update(first_step_s=first, step_s=sorted(times)[len(times) // 2], finite=finite)
        run1 = loaded.report()["run"]
        row["disk_bytes_per_step"] = (run1["disk_bytes_read"] - run0["disk_bytes_read"]) / (
            args.steps + 1)
        # The same model with the files dropped from the page cache once, then steps back to
        # back: the disk tier drops what it reads (Note [Disk unit reads]), so every step reads
        # its units from the drive, as on a host whose RAM cannot cache them. Timed as one
        # stretch (reads run ahead across step boundaries), after one step that fills the ring.
        drop_cache(args.dir)
        with torch.no_grad():
            model(**inputs, return_dict=False)
        bc.sync(cuda)
        run1 = loaded.report()["run"]
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(args.steps):
                model(**inputs, return_dict=False)
        bc.sync(cuda)
        stretch_s = time.perf_counter() - t
        # Right after the sync, as run1 was: the read-ahead into the next step is then in the
        # same state at both ends, so the differences are the stretch's own reads. (Taken later,
        # they would count the ring the read-ahead fills meanwhile: 8abc593's run did.)
        run2 = loaded.report()["run"]
        row["cold_step_s"] = stretch_s / args.steps
        row["page_cache_after_cold"] = cached_fraction(args.dir)
        # The drive's sequential bandwidth again, right after the stretch: a network or cloud
        # disk's rate drifts within a run (bursts early on), so the sweep at the start is not
        # the only fair bound. 4 GB, files dropped first, the same reader as the first sweep.
        drop_cache(args.dir)
        row["disk_after"] = read_bandwidth(args.dir, limit=4 << 30)
        row["disk_bytes_per_cold_step"] = (run2["disk_bytes_read"] - run1["disk_bytes_read"]) / (
            args.steps)
        row["disk_waits"] = run2["disk_waits"] - run1["disk_waits"]
        row["disk_wait_ms"] = run2["disk_wait_ms"] - run1["disk_wait_ms"]
        # Were the files kept busy during the cold steps (Note [Read meter])? busy share of
        # the steps' time, GB/s while busy, mean reads in flight while busy.
        a, b = run1.get("file_reads"), run2.get("file_reads")
        if a and b:
            busy = b["busy_s"] - a["busy_s"]
            nbytes = b["bytes"] - a["bytes"]
            row["cold_reads"] = dict(
                bytes=nbytes, busy_s=busy, busy_share=busy / stretch_s,
                gbps_busy=nbytes / busy / GB if busy else None,
                depth=(b["depth_s"] - a["depth_s"]) / busy if busy else None,
                reads=b["reads"] - a["reads"])
        return row
    first, times, finite = bc.run_steps(model, inputs, args.steps, cuda)
    row.update(first_step_s=first, step_s=sorted(times)[len(times) // 2], finite=finite)
    return row


def run_child(args, route: str, cap: float, cache: str) -> dict:
    if cache == "cold":
        drop_cache(args.dir)
    cached = cached_fraction(args.dir)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", route, "--cap", str(cap),
           "--cache", cache, "--dir", args.dir, "--size", args.size, "--device", args.device,
           "--steps", str(args.steps), "--host-ram-cap", str(args.host_ram_cap)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    if out.returncode != 0:
        row = dict(route=route, cap_gib=cap, cache=cache, error=out.stderr[-2000:])
    else:
        row = json.loads(out.stdout.strip().splitlines()[-1])
    row["page_cache_before"] = cached
    row["process_s"] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    return row


def write_model(args) -> dict:
    import torch

    cuda = args.device == "cuda"
    model, nbytes, params, _ = bc.build_model(args.size, "cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    model.save_pretrained(args.dir, max_shard_size=args.shard_size)
    for f in shard_files(args.dir):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache() if cuda else None
    log(f"wrote {nbytes / GB:.1f} GB in {len(shard_files(args.dir))} shards in {dt:.1f} s")
    return dict(bytes=nbytes, params=params, shards=len(shard_files(args.dir)), write_s=dt)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="where the model is written (local disk)")
    p.add_argument("--size", choices=sorted(bc.SIZES), default="full")
    p.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--caps", default="8,16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shard-size", default="5GB")
    p.add_argument("--routes", default="ddo,diffusers,ddo_disk")
    p.add_argument("--host-ram-cap", type=float, default=16.0,
                   help="GiB of host RAM for the ddo_disk rows (DDO_HOST_RAM_CAP_GB)")
    p.add_argument("--keep", action="store_true", help="reuse a model already in --dir")
    p.add_argument("--disk-probes", action="store_true",
                   help="also measure cold reads by pattern (threads, piece, O_DIRECT, scattered)")
    p.add_argument("--out")
    p.add_argument("--commit")
    p.add_argument("--child-timeout", type=int, default=300)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cap", type=float, default=8.0, help=argparse.SUPPRESS)
    p.add_argument("--cache", default="warm", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    cuda = args.device == "cuda"
    result = dict(benchmark="w1-py-from-disk", size=args.size, steps=args.steps,
                  commit=args.commit or bc.default_commit(),
                  command=bc.command_line(),
                  machine=bc.machine_facts(cuda), rows=[])
    if not (args.keep and os.path.isdir(args.dir) and shard_files(args.dir)):
        os.makedirs(args.dir, exist_ok=True)
        result["model"] = write_model(args)
    drop_cache(args.dir)
    result["disk"] = dict(cold=read_bandwidth(args.dir), warm=read_bandwidth(args.dir))
    log(f"disk: cold {result['disk']['cold']['gbps']:.2f} GB/s, "
        f"warm {result['disk']['warm']['gbps']:.2f} GB/s")
    if args.disk_probes:
        # How the read pattern moves the cold bandwidth (4 GB each, files dropped first):
        # piece size, threads, O_DIRECT, and scattered ~unit-sized ranges.
        probes = {}
        for name, kw in (("buffered_t16_p8m", dict(threads=16, piece=8 << 20)),
                         ("buffered_t8_p96m_stride4", dict(threads=8, piece=96 << 20, stride=4)),
                         ("direct_t8_p16m", dict(threads=8, piece=16 << 20, direct=True)),
                         ("direct_t16_p8m", dict(threads=16, piece=8 << 20, direct=True)),
                         ("direct_t4_p64m", dict(threads=4, piece=64 << 20, direct=True))):
            drop_cache(args.dir)
            try:
                probes[name] = read_bandwidth(args.dir, limit=4 << 30, **kw)
            except OSError as e:
                probes[name] = dict(error=str(e))
            log(f"disk probe {name}: {probes[name]}")
        result["disk"]["probes"] = probes
    caps = [float(c) for c in args.caps.split(",") if c.strip()]
    routes = args.routes.split(",")

    def save():
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=2)
            os.replace(args.out + ".tmp", args.out)

    if "ddo" in routes:
        row = run_child(args, "ddo", caps[0], "cold")
        gbps = (row.get("load") or {}).get("gbps")
        if gbps:  # the cold load against the drive's sweep at the start and right after it
            row["load_of_disk"] = gbps / result["disk"]["cold"]["gbps"]
            after = row.get("disk_after", {}).get("gbps")
            row["load_of_disk_after"] = gbps / after if after else None
        result["rows"].append(row)
        save()
        for cap in caps:
            result["rows"].append(run_child(args, "ddo", cap, "warm"))
            save()
    if "ddo_disk" in routes:
        host_steps = {r["cap_gib"]: r.get("step_s") for r in result["rows"]
                      if r.get("route") == "ddo" and r.get("cache") == "warm"}
        for cap in caps:
            row = run_child(args, "ddo_disk", cap, "warm")
            # The bound: the host tier's step at this cap (compute or PCIe), or the disk reads.
            disk = row.get("disk_bytes_per_step")
            # Only the cold stretch has a bound: the disk tier drops what it reads, so after
            # the first step a "warm" run reads from the drive as well.
            disk = row.get("disk_bytes_per_cold_step", disk)
            if disk is not None:
                step = row.get("cold_step_s")
                bound = max(host_steps.get(cap) or 0.0,
                            disk / (result["disk"]["cold"]["gbps"] * GB))
                row["bound_cold_s"] = bound
                row["efficiency_cold"] = bound / step if step else None
                after = row.get("disk_after", {}).get("gbps")
                if after:
                    bound = max(host_steps.get(cap) or 0.0, disk / (after * GB))
                    row["bound_cold_after_s"] = bound
                    row["efficiency_cold_after"] = bound / step if step else None
            result["rows"].append(row)
            save()
    if "diffusers" in routes and cuda:
        result["rows"].append(run_child(args, "diffusers", 0.0, "warm"))
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
