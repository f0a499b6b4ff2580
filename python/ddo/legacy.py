"""diffusers-dynamic-offloader's legacy host-context helpers, under its names.

The API: docs/design/0007-named-profiles.md, section 6.

``diffusers_dynamic_offloader`` (0.1.0rc2) let a host describe its workload as a JSON "context"
and record observations under it. These are the same functions over ddo's C++ store
(``core/include/ddo/core/host_context.h``): the same keys, the same files in the same folder, so
files written by the library are read here and files written here are read by the library::

    ctx = {"model": "flux", "gpu": "4090", "steps": 28}
    ddo.record_dynamic_offload_profile(
        ctx, {"status": "success", "capacity": {"metric": "tokens", "value": 4096}},
        recommendation={"profile_resident_module_budget_gb": 3.0})
    profile = ddo.load_dynamic_offload_profile(ctx)
    ddo.get_dynamic_offload_profile_capacity(profile, "tokens")   # {"max_success": 4096.0}

    session = ddo.DynamicOffloadProfileSession(ctx, {"model": "flux", "gpu": "4090"})
    settings, recommendation = session.apply_settings(ddo.DynamicOffloadSettings.from_env())

Where ddo differs from the library on purpose (python/tests/test_compat.py says each): a context
or observation holding NaN or infinity is a ``ValueError`` (the library writes ``NaN`` into the
file, which is not JSON), as are integers beyond 64 bits and nesting deeper than 64 levels.
Named profiles (``enable_offload(..., profile_name=...)``) do not need any of this.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from . import _C
from .config import DynamicOffloadSettings

__all__ = [
    "DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION",
    "DynamicOffloadProfileSession",
    "dynamic_offload_profile_key",
    "dynamic_offload_profile_path",
    "get_dynamic_offload_profile_capacity",
    "get_dynamic_offload_profile_dir",
    "get_dynamic_offload_profile_recommendation",
    "load_dynamic_offload_profile",
    "normalize_dynamic_offload_profile_context",
    "record_dynamic_offload_profile",
]

DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION = 1

# Python recursion guard for the conversion below; ddo_core's own bound (64 levels) gives the
# error for anything deeper than it, this only keeps the converter off Python's recursion limit.
_MAX_CONVERT_DEPTH = 200


def _jsonable(value: Any, what: str, depth: int = 0) -> Any:
    """A host value as JSON, the library's way: mapping keys become ``str(key)``, tuples lists;
    anything else that is not JSON is a TypeError naming its type."""
    if depth > _MAX_CONVERT_DEPTH:
        raise ValueError(f"DDO profile {what} is nested more than 64 levels deep; flatten it")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, what, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, what, depth + 1) for v in value]
    raise TypeError(f"DDO profile {what} contains a non-JSON value: {type(value).__name__}")


def _context(context: Any) -> dict:
    if not isinstance(context, Mapping) or not context:
        raise ValueError("DDO profile context must be a non-empty mapping.")
    return _jsonable(context, "context")


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, Mapping):
        raise TypeError(f"DDO profile {what} must normalize to an object.")
    return _jsonable(value, what)


def _directory(profile_dir: str | os.PathLike | None) -> str:
    # An explicit folder wins; else the C++ store's rule (DDO_PROFILE_DIR with "~" expanded, else
    # ~/.ddo/profiles), so named profiles and these helpers always share one folder.
    if profile_dir:
        return os.path.expanduser(os.fspath(profile_dir))
    return _C.profile_dir(None)


def normalize_dynamic_offload_profile_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``context`` with keys sorted recursively and only JSON values (ddo_core's rule).

    ValueError for an empty or non-mapping context, NaN or infinity, over-deep nesting; TypeError
    for values that are not JSON (sets, bytes, paths, objects)."""
    return _C.normalize_context(_context(context))


def dynamic_offload_profile_key(context: Mapping[str, Any]) -> str:
    """``"ddo-capacity-v1-"`` and 24 hex digits: the library's key for the same context."""
    return _C.context_key(_context(context))


def get_dynamic_offload_profile_dir(profile_dir: str | os.PathLike | None = None) -> Path:
    """``profile_dir`` when given, else DDO_PROFILE_DIR, else ``~/.ddo/profiles`` ("~" expanded)."""
    return Path(_directory(profile_dir))


def dynamic_offload_profile_path(
    context: Mapping[str, Any], profile_dir: str | os.PathLike | None = None
) -> Path:
    """The JSON file of ``context`` (nothing is created)."""
    return Path(_C.context_path(_directory(profile_dir), _context(context)))


def load_dynamic_offload_profile(
    context: Mapping[str, Any], profile_dir: str | os.PathLike | None = None
) -> Optional[dict[str, Any]]:
    """The stored file as a dict, or None when it is missing or invalid (invalid files warn)."""
    store = _C.HostContextStore(_directory(profile_dir))
    return store.load(_context(context))


def record_dynamic_offload_profile(
    context: Mapping[str, Any],
    observation: Mapping[str, Any],
    profile_dir: str | os.PathLike | None = None,
    recommendation: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Appends ``observation`` to the context's file (last 20 kept), under a file lock, atomically.

    ``{"status": "success" | "failure", "capacity": {"metric": m, "value": v}}`` also moves that
    metric's limits (largest success, smallest failure); ``recommendation``, when given, replaces
    the stored one. Returns the file's path."""
    ctx = _context(context)
    obs = _object(observation, "observation")
    rec = _object(recommendation, "recommendation") if recommendation is not None else None
    directory = _directory(profile_dir)
    _C.HostContextStore(directory).record_observation(ctx, obs, rec)
    return Path(_C.context_path(directory, ctx))


def get_dynamic_offload_profile_capacity(
    profile: Mapping[str, Any], metric: str
) -> Optional[dict[str, float]]:
    """``{"max_success": x, "min_failure": y}`` (those present) for ``metric``, or None."""
    limits = profile.get("capacity_limits")
    entry = limits.get(metric) if isinstance(limits, Mapping) else None
    if not isinstance(entry, Mapping):
        return None
    out: dict[str, float] = {}
    for key in ("max_success", "min_failure"):
        if key in entry:
            try:
                out[key] = float(entry[key])
            except (TypeError, ValueError):
                continue
    return out or None


def get_dynamic_offload_profile_recommendation(
    profile: Mapping[str, Any],
) -> Optional[dict[str, Any]]:
    """The recommendation stored with the profile (a copy), or None."""
    recommendation = profile.get("recommendation")
    return copy.deepcopy(dict(recommendation)) if isinstance(recommendation, Mapping) else None


class DynamicOffloadProfileSession:
    """One exact execution context plus a wider capacity context (the library's class).

    ``execution_profile`` / ``capacity_profile`` are the stored files (None when absent), read at
    construction and after each ``record_success``.
    """

    def __init__(
        self,
        execution_context: Mapping[str, Any],
        capacity_context: Mapping[str, Any],
        profile_dir: str | os.PathLike | None = None,
    ) -> None:
        directory = _directory(profile_dir)
        self._native = _C.ProfileSession(
            directory, _context(execution_context), _context(capacity_context)
        )
        self.execution_context: dict[str, Any] = self._native.execution_context
        self.capacity_context: dict[str, Any] = self._native.capacity_context
        self.profile_dir = directory
        self.execution_profile: Optional[dict[str, Any]] = None
        self.capacity_profile: Optional[dict[str, Any]] = None
        self._reload()

    def _reload(self) -> None:
        self.execution_profile = self._native.execution_record()
        self.capacity_profile = self._native.capacity_record()

    # ddo's additions: where the two files are.
    execution_key = property(lambda self: self._native.execution_key)
    capacity_key = property(lambda self: self._native.capacity_key)
    execution_path = property(lambda self: Path(self._native.execution_path))
    capacity_path = property(lambda self: Path(self._native.capacity_path))

    def apply_settings(
        self, settings: DynamicOffloadSettings, *, allow_recommendation: bool = True
    ) -> tuple[DynamicOffloadSettings, Optional[dict[str, Any]]]:
        """``(settings, recommendation)`` with the stored resident budget applied.

        As in the library: a positive manual ``resident_module_budget_gb`` wins and the result is
        ``(settings, None)``; otherwise the execution context's recommendation is returned, and
        with ``allow_recommendation`` its ``profile_resident_module_budget_gb`` becomes the
        settings' resident budget. ddo has no separate profile-budget field, so the budget is
        written to ``resident_module_budget_gb``, capped by ``max_resident_module_budget_gb`` when
        that is positive (the cap on a saved recommendation: docs/design/0007-named-profiles.md,
        section 3). The recommendation is read from the execution context's file as it is at the
        call. The rule is C++'s (DynamicOffloadProfileSession::apply_settings, host_context.h).
        """
        if not isinstance(settings, DynamicOffloadSettings):
            raise TypeError(
                "apply_settings takes ddo.DynamicOffloadSettings (DynamicOffloadSettings.from_env"
                f"(...)), not {type(settings).__name__}"
            )
        native, recommendation = self._native.apply_settings(
            settings._native, bool(allow_recommendation)
        )
        # The settings object itself when nothing changed, as the library returns it.
        if native.to_json() == settings._json:
            return settings, recommendation
        return DynamicOffloadSettings(native), recommendation

    @staticmethod
    def recommend_resident_budget(
        total_vram_gb: float, peak_vram_gb: float, headroom_gb: float
    ) -> float:
        """``max(0, total - peak - headroom)``: the budget a zero-resident peak leaves."""
        return _C.recommend_resident_budget_gb(
            float(total_vram_gb), float(peak_vram_gb), float(headroom_gb)
        )

    def record_success(
        self,
        observation: Mapping[str, Any],
        recommendation: Optional[Mapping[str, Any]] = None,
    ) -> tuple[Path, Path]:
        """Appends ``observation`` to both contexts' files and stores ``recommendation`` with the
        execution context. Returns ``(execution_path, capacity_path)``."""
        obs = _object(observation, "observation")
        rec = _object(recommendation, "recommendation") if recommendation is not None else None
        self._native.record_success(obs, rec)
        self._reload()
        return self.execution_path, self.capacity_path

    def __repr__(self) -> str:
        return (
            f"DynamicOffloadProfileSession(execution_key={self.execution_key!r}, "
            f"capacity_key={self.capacity_key!r})"
        )
