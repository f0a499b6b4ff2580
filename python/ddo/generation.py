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


class GenerationMeter:
    """Meters one generation; starts when made. See the module docstring."""

    def __init__(self, offloads: Optional[Mapping[str, Optional[OffloadResult]]] = None,
                 cuda_device: Optional[str] = None) -> None:
        """``cuda_device`` ("cuda:N"): measure VRAM there even when ddo places no component (a
        run without ddo, compared with one under it); default: the metered offloads' device."""
        natives = [
            (name, offload._native if offload is not None else None)
            for name, offload in (offloads or {}).items()
        ]
        self._meter = _C.GenerationMeter(natives, cuda_device or "")

    def add(self, name: str, offload: Optional[OffloadResult]) -> None:
        """Meters ``offload`` too, as component ``name`` (a staged flow's next stage)."""
        self._meter.add_offload(name, offload._native if offload is not None else None)

    def drop(self, name: str) -> None:
        """Keeps what component ``name`` streamed; after ``offload.remove()`` that is the totals
        the run ended with (its disk tier's reads finished)."""
        self._meter.drop_offload(name)

    def begin_stage(self, name: str) -> None:
        self._meter.begin_stage(name)

    def end_stage(self, name: str) -> None:
        self._meter.end_stage(name)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """``with meter.stage("vae"):`` -- the block is stage ``name`` (ended if it raises)."""
        self._meter.begin_stage(name)
        try:
            yield
        finally:
            self._meter.end_stage(name)

    def finish(self) -> dict[str, Any]:
        """Ends the generation; its report (the same dict again on a second call)."""
        return self._meter.finish()
