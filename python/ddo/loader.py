"""from_pretrained_with_dynamic_offload: load a component, then attach offload (seed "Staged
pipelines and loading").

    loaded = from_pretrained_with_dynamic_offload(
        model_path, model_loader=FluxTransformer2DModel,
        dynamic_offload_config=settings.config, apply_dynamic=True,
        profile_name="my-workload", build_profile=calibrate,
    )
    with loaded.profile_run():
        output = loaded.module(**inputs)

With ``apply_dynamic=False`` the host calls ``enable_offload`` later, at the actual execution
stage, and the profile options belong there: giving them here is a ValueError.

Loading itself is the loader's own (``model_loader.from_pretrained``, e.g. diffusers); the
offload is the same C++ enable_offload as everywhere. Loading straight into pinned memory (spec
§8) is the C++ loader's job and not wired into Python yet (docs/design/0003-python.md).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

from torch import nn

from .api import OffloadResult, ProfileRunContext, RecordEvent, _enable
from .config import DynamicOffloadConfig

__all__ = ["LoadedModel", "from_pretrained_with_dynamic_offload"]


class LoadedModel:
    """The loaded module and, with apply_dynamic=True, its offload."""

    def __init__(self, module: nn.Module, offload: Optional[OffloadResult]) -> None:
        self.module = module
        self.offload = offload

    def profile_run(self) -> ProfileRunContext:
        if self.offload is None:
            raise RuntimeError(
                "this model was loaded with apply_dynamic=False; call enable_offload(module, "
                "profile_name=..., build_profile=...) at the execution stage and use its "
                "profile_run()"
            )
        return self.offload.profile_run()

    def report(self) -> dict[str, Any]:
        return self.offload.report() if self.offload is not None else {}

    @property
    def should_move_to_execution_device(self) -> bool:
        """The seed library's field: True while no offload places the module."""
        return self.offload is None or self.offload.should_move_to_execution_device


def from_pretrained_with_dynamic_offload(
    model_path: str | os.PathLike,
    *,
    model_loader: Any = None,
    dynamic_offload_config: Optional[DynamicOffloadConfig | Mapping[str, Any]] = None,
    apply_dynamic: bool = False,
    profile_name: Optional[str] = None,
    build_profile: Optional[bool] = None,
    dtype: Any = None,
    preset: Optional[str] = None,
    execution_device: Optional[str] = None,
    record_event: Optional[RecordEvent] = None,
    **load_kwargs: Any,
) -> LoadedModel:
    """Loads a component with ``model_loader`` and, with ``apply_dynamic=True``, attaches offload.

    ``apply_dynamic`` defaults to False as in the seed library: the host attaches offload later,
    at the execution stage, with ``enable_offload`` (and passes the profile options there).
    ``build_profile=None`` is False. Other keywords go to ``model_loader.from_pretrained``.
    """
    if model_loader is None:
        raise TypeError(
            "from_pretrained_with_dynamic_offload needs model_loader=, the class to load (e.g. "
            "FluxTransformer2DModel) or a callable(path, **kwargs) returning the module"
        )
    if build_profile is None:
        build_profile = False
    if not isinstance(build_profile, bool):
        raise TypeError(
            f"build_profile must be True or False, not {build_profile!r} "
            f"({type(build_profile).__name__})"
        )
    if profile_name is not None and not isinstance(profile_name, str):
        raise TypeError(
            f"profile_name must be a str such as 'my-workload' or None, not {profile_name!r} "
            f"({type(profile_name).__name__})"
        )
    if not apply_dynamic and (profile_name or build_profile):
        raise ValueError(
            "profile_name/build_profile were given with apply_dynamic=False; pass them to the "
            "later enable_offload call, at the actual execution stage"
        )
    loader: Callable[..., nn.Module]
    if hasattr(model_loader, "from_pretrained"):
        kwargs = dict(load_kwargs)
        if dtype is not None:
            kwargs.setdefault("torch_dtype", dtype)
        module = model_loader.from_pretrained(os.fspath(model_path), **kwargs)
    elif callable(model_loader):
        module = model_loader(os.fspath(model_path), **load_kwargs)
        if dtype is not None:
            module = module.to(dtype)
    else:
        raise TypeError("model_loader must be a class with from_pretrained or a callable")
    if not isinstance(module, nn.Module):
        raise TypeError(f"model_loader returned {type(module).__name__}, not an nn.Module")
    module.eval()
    offload = None
    if apply_dynamic:
        offload = _enable(
            module,
            preset=preset if dynamic_offload_config is None else None,
            profile_name=profile_name,
            build_profile=build_profile,
            settings=None,
            config=dynamic_offload_config,
            execution_device=execution_device,
            record_event=record_event,
            overrides={},
        )
    return LoadedModel(module, offload)
