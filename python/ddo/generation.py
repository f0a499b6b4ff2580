"""GenerationMeter: one report per generation -- seconds per stage, bytes streamed and read from
disk, peak VRAM and peak RSS. The meter is C++'s (ddo/torch/generation.h); this is its Python
face over ``OffloadResult`` objects.

    meter = ddo.GenerationMeter()                 # or GenerationMeter({"transformer": offload})
    with meter.stage("text_encoder"):
        te = ddo.enable_offload(text_encoder, ...)
        meter.add("text_encoder", te)
        embeds = text_encoder(ids)
        te.remove()
        meter.drop("text_encoder")                # keep its figures: the totals it ended with
    ...
    report = meter.finish()   # {"seconds", "stages": [{"name", "seconds", "calls"}], "bytes_streamed",
                              #  "disk_bytes_read", "components", "peak_vram_gb", "peak_rss_gb", ...}

For a pipeline offloaded whole, ``with offloads.generation() as gen:`` times each component's
forward as a stage (ddo.diffusers.GenerationContext).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional

from . import _C
from .api import OffloadResult

__all__ = ["GenerationMeter"]


def _name(call: str, name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"GenerationMeter.{call}(name=...) takes a str, not "
                        f"{type(name).__name__} ({name!r})")
    return name


def _native(call: str, name: str, offload: object) -> Any:
    if offload is None:
        return None
    if not isinstance(offload, OffloadResult):
        raise TypeError(f"GenerationMeter.{call}: component {name!r} is a "
                        f"{type(offload).__name__}, expected what ddo.enable_offload returns "
                        "(ddo.OffloadResult) or None for a component ddo does not place")
    return offload._native


class GenerationMeter:
    """Meters one generation; starts when made. See the module docstring. Stages may be timed
    from several threads at once: each thread's spans are its own, and two threads timing one
    stage both count (two calls)."""

    def __init__(self, offloads: Optional[Mapping[str, Optional[OffloadResult]]] = None,
                 cuda_device: Optional[str] = None) -> None:
        """``cuda_device`` ("cuda:N"): measure VRAM there even when ddo places no component (a
        run without ddo, compared with one under it); default: the metered offloads' device."""
        if offloads is not None and not isinstance(offloads, Mapping):
            raise TypeError("GenerationMeter(offloads=...) takes a mapping of component name to "
                            f"ddo.OffloadResult or None, not {type(offloads).__name__}")
        if cuda_device is not None and not isinstance(cuda_device, str):
            raise TypeError("GenerationMeter(cuda_device=...) takes a str such as 'cuda:0', not "
                            f"{type(cuda_device).__name__}")
        natives = [
            (_name("__init__", name), _native("__init__(offloads=...)", name, offload))
            for name, offload in (offloads or {}).items()
        ]
        self._meter = _C.GenerationMeter(natives, cuda_device or "")

    def add(self, name: str, offload: Optional[OffloadResult]) -> None:
        """Meters ``offload`` too, as component ``name`` (a staged flow's next stage)."""
        self._meter.add_offload(_name("add", name), _native("add(offload=...)", name, offload))

    def drop(self, name: str) -> None:
        """Keeps what component ``name`` streamed; after ``offload.remove()`` that is the totals
        the run ended with (its disk tier's reads finished)."""
        self._meter.drop_offload(_name("drop", name))

    def begin_stage(self, name: str) -> None:
        self._meter.begin_stage(_name("begin_stage", name))

    def end_stage(self, name: str) -> None:
        self._meter.end_stage(_name("end_stage", name))

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """``with meter.stage("vae"):`` -- the block is stage ``name`` (ended if it raises)."""
        self._meter.begin_stage(_name("stage", name))
        try:
            yield
        finally:
            self._meter.end_stage(name)

    def finish(self) -> dict[str, Any]:
        """Ends the generation; its report (the same dict again on a second call)."""
        return self._meter.finish()
