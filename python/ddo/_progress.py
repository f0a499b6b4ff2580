"""Progress for long setups: one line on a terminal, nothing otherwise (no tqdm).

ddo_torch reports each setup phase (plan, pin, moves, setup) through the record_event callback;
``SetupProgress`` shows them as one rewritten line on stderr when stderr is a terminal, and
forwards every event to the host's own ``record_event``::

    ddo: FluxTransformer2DModel: plan 0.01 s | pin 4.20 s 22.1 GiB | moves 0.80 s | ready in 5.1 s
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, TextIO

RecordEvent = Callable[[str, float, dict], Any]

_GIB = float(1 << 30)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class SetupProgress:
    """A record_event callback that draws progress and chains the host's callback."""

    def __init__(
        self,
        label: str,
        record_event: Optional[RecordEvent] = None,
        stream: Optional[TextIO] = None,
        enabled: Optional[bool] = None,
    ) -> None:
        self._label = label
        self._host = record_event
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = _is_terminal(self._stream) if enabled is None else enabled
        self._parts: list[str] = []
        self.events: list[tuple[str, float, dict]] = []

    def start(self) -> None:
        """Shows the line before the first phase ends (pinning can take minutes)."""
        if self._enabled:
            self._stream.write(f"\r\x1b[Kddo: {self._label}: setting up offload ...")
            self._stream.flush()

    def close(self, failed: bool = False) -> None:
        """Ends the line when setup stopped before its final event."""
        if self._enabled and (failed or (self._parts and not self._parts[-1].startswith("ready"))):
            self._stream.write(" (stopped)\n" if failed else "\n")
            self._stream.flush()

    def __call__(self, name: str, seconds: float, payload: dict) -> None:
        if name != "load_progress":  # several a second while reading: drawn, not kept
            self.events.append((name, seconds, payload))
        if self._enabled:
            self._draw(name, seconds, payload)
        if self._host is not None:
            self._host(name, seconds, payload)

    def _draw(self, name: str, seconds: float, payload: dict) -> None:
        if name == "load_progress":
            line = f"ddo: {self._label}: " + " | ".join(self._parts + [_load_text(payload)])
            self._stream.write("\r\x1b[K" + line)
            self._stream.flush()
            return
        if name == "load":
            self._parts.append(f"load {seconds:.1f} s " + _load_text(payload, final=True))
        elif name == "setup":
            self._parts.append(f"ready in {seconds:.1f} s")
        else:
            part = f"{name} {seconds:.2f} s"
            nbytes = payload.get("bytes") if isinstance(payload, dict) else None
            if isinstance(nbytes, (int, float)) and nbytes > 0:
                part += f" {nbytes / _GIB:.1f} GiB"
            self._parts.append(part)
        line = f"ddo: {self._label}: " + " | ".join(self._parts)
        end = "\n" if name == "setup" else ""
        self._stream.write("\r\x1b[K" + line + end)
        self._stream.flush()


def _load_text(payload: dict, final: bool = False) -> str:
    """'12.3/23.8 GiB 5.1 GB/s 2 s left' while reading; '23.8 GiB 5.1 GB/s' at the end."""
    done = float(payload.get("bytes", 0) or 0)
    total = float(payload.get("total_bytes", 0) or 0)
    gbps = float(payload.get("gbps", 0) or 0)
    if final:
        return f"{done / _GIB:.1f} GiB {gbps:.1f} GB/s"
    left = (total - done) / (gbps * 1e9) if gbps > 0 else 0.0
    return f"load {done / _GIB:.1f}/{total / _GIB:.1f} GiB {gbps:.1f} GB/s {left:.0f} s left"
