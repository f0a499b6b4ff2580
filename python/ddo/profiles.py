"""Named-profile store access and the legacy host-context API (spec §6).

Named profiles are created by ``enable_offload(..., profile_name=..., build_profile=True)`` and
``profile_run()``; this module only reads and manages the same files the C++ store and
``ddo profiles list`` use (one store implementation, in ddo_core)::

    ddo.profile_dir()                                   # DDO_PROFILE_DIR or ~/.ddo/profiles
    ddo.load_profile("my-workload", FluxTransformer2DModel)["recommendation"]
    ddo.list_profiles()                                 # what `ddo profiles list` shows

The older host-context helpers remain for existing integrations. Their key space
("ddo-context-*.json") is separate from named profiles::

    session = ddo.DynamicOffloadProfileSession(
        {"model": "flux", "gpu": "4090", "steps": 28},   # execution context
        {"model": "flux", "gpu": "4090"},                # capacity context
    )
    session.record({"resident_budget_gb": 6.0}, success=True)
    session.recommendation()["values"]["resident_budget_gb"]   # 6.0
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from . import _C

__all__ = [
    "DynamicOffloadProfileSession",
    "HostContextStore",
    "ProfileStore",
    "context_key",
    "context_path",
    "list_profiles",
    "load_profile",
    "model_class_name",
    "normalize_context",
    "profile_dir",
    "profile_key",
    "profile_path",
]

ProfileStore = _C.ProfileStore
HostContextStore = _C.HostContextStore


def model_class_name(model_or_class: Any) -> str:
    """The profile identity's class: a Python model's class ``__qualname__`` (spec §6)."""
    if isinstance(model_or_class, str):
        return model_or_class
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return cls.__qualname__


def _directory(directory: str | os.PathLike | None) -> str | None:
    return os.fspath(directory) if directory is not None else None


def profile_dir() -> str:
    """DDO_PROFILE_DIR when set and non-empty, else ``Path.home() / ".ddo" / "profiles"``."""
    return _C.profile_dir(None)


def profile_key(name: str, model: Any) -> str:
    """The 32-hex-digit key of ``{name, class qualified name, identity version}``."""
    return _C.profile_key(name, model_class_name(model))


def profile_path(name: str, model: Any, directory: str | os.PathLike | None = None) -> str:
    return ProfileStore(_directory(directory)).path_for(name, model_class_name(model))


def load_profile(
    name: str, model: Any, directory: str | os.PathLike | None = None
) -> dict[str, Any] | None:
    """The stored record as a dict, or None when absent (invalid files warn and count as absent)."""
    return ProfileStore(_directory(directory)).load(name, model_class_name(model))


def list_profiles(directory: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every named profile in the directory, as ``ddo profiles list`` shows them."""
    return ProfileStore(_directory(directory)).list()


def normalize_context(context: Mapping[str, Any]) -> Any:
    """A copy with keys sorted and only JSON-safe values; ValueError for NaN/inf, TypeError for
    values that are not JSON."""
    return _C.normalize_context(context)


def context_key(context: Mapping[str, Any]) -> str:
    return _C.context_key(context)


def context_path(context: Mapping[str, Any], directory: str | os.PathLike | None = None) -> str:
    return _C.context_path(_directory(directory), context)


class DynamicOffloadProfileSession:
    """Pairs an exact execution context with a wider capacity context (legacy API).

    ``record`` appends to the execution context's history (last 20 kept) and updates the
    per-metric limits (max success, min failure) of both; ``recommendation`` gives, per metric,
    the largest value known to succeed below every known failure.
    """

    def __init__(
        self,
        execution_context: Mapping[str, Any],
        capacity_context: Mapping[str, Any] | None = None,
        *,
        directory: str | os.PathLike | None = None,
    ) -> None:
        if capacity_context is None:
            capacity_context = execution_context
        self._native = _C.ProfileSession(
            _directory(directory), execution_context, capacity_context
        )

    execution_context = property(lambda self: self._native.execution_context)
    capacity_context = property(lambda self: self._native.capacity_context)
    execution_key = property(lambda self: self._native.execution_key)
    capacity_key = property(lambda self: self._native.capacity_key)
    execution_path = property(lambda self: self._native.execution_path)
    capacity_path = property(lambda self: self._native.capacity_path)

    def record(
        self,
        metrics: Mapping[str, float],
        success: bool = True,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        self._native.record(dict(metrics), success, details)

    def execution_record(self) -> dict[str, Any] | None:
        return self._native.execution_record()

    def capacity(self) -> dict[str, Any]:
        return self._native.capacity()

    def recommendation(self) -> dict[str, Any]:
        return self._native.recommendation()

    def __repr__(self) -> str:
        return (
            f"DynamicOffloadProfileSession(execution_key={self.execution_key!r}, "
            f"capacity_key={self.capacity_key!r})"
        )
