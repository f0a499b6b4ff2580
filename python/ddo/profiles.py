"""Named-profile store access and the legacy host-context API (docs/design/0007-named-profiles.md).

Named profiles are created by ``enable_offload(..., profile_name=..., build_profile=True)`` and
``profile_run()``; this module only reads and manages the same files the C++ store and
``ddo profiles list`` use (one store implementation, in ddo_core)::

    ddo.profile_dir()                                   # DDO_PROFILE_DIR or ~/.ddo/profiles
    ddo.load_profile("my-workload", FluxTransformer2DModel)["recommendation"]
    ddo.list_profiles()                                 # what `ddo profiles list` shows

Files are diffusers-dynamic-offloader's ("ddo-capacity-v1-<24 hex>.json", identity {name, model class,
identity version 2, execution mode}), so profiles saved by ``diffusers_dynamic_offloader`` are
found here and the other way round. The older host-context helpers, under the library's names,
are in ``ddo.legacy``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from . import _C

__all__ = [
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
    """The profile identity's class: a Python model's class ``__qualname__``
    (docs/design/0007-named-profiles.md, section 2); for a TorchScript module, its root's
    qualified TorchScript type, as C++ names it
    (``"__torch__.diffusers.models...FluxTransformer2DModel"``)."""
    if isinstance(model_or_class, str):
        return model_or_class
    if isinstance(model_or_class, torch.jit.ScriptModule):
        return _C.jit_module_class_name(model_or_class)
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return cls.__qualname__


def _directory(directory: str | os.PathLike | None) -> str | None:
    return os.fspath(directory) if directory is not None else None


def profile_dir() -> str:
    """DDO_PROFILE_DIR when set and non-empty, else ``Path.home() / ".ddo" / "profiles"``."""
    return _C.profile_dir(None)


def profile_key(name: str, model: Any, execution_mode: str = "linear_runtime") -> str:
    """``"ddo-capacity-v1-"`` and 24 hex digits: the key of ``{name, class qualified name,
    identity version, execution mode}`` (diffusers-dynamic-offloader's rule, computed by ddo_core)."""
    return _C.profile_key(name, model_class_name(model), execution_mode)


def profile_path(
    name: str,
    model: Any,
    directory: str | os.PathLike | None = None,
    execution_mode: str = "linear_runtime",
) -> str:
    return ProfileStore(_directory(directory)).path_for(
        name, model_class_name(model), execution_mode
    )


def load_profile(
    name: str,
    model: Any,
    directory: str | os.PathLike | None = None,
    execution_mode: str = "linear_runtime",
) -> dict[str, Any] | None:
    """The stored record as a dict, or None when absent (invalid files warn and count as absent)."""
    return ProfileStore(_directory(directory)).load(
        name, model_class_name(model), execution_mode
    )


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
