"""diffusers-dynamic-offloader's entry points and helpers under its names (diffusers-dynamic-offloader 0.1.0rc2).

A script written against ``diffusers_dynamic_offloader`` keeps working when its import is
replaced by ``ddo`` for the names below; each one forwards to ddo's own API (the C++ core).
README "Drop-in for diffusers-dynamic-offloader" lists every public name of the library with
ddo's decision, and python/tests/test_compat.py runs both side by side::

    import ddo as ddo_lib          # was: import diffusers_dynamic_offloader as ddo_lib

    settings = ddo_lib.load_dynamic_offload_settings_from_env()
    result = ddo_lib.enable_dynamic_offload(transformer, settings=settings)
    ddo_lib.get_dynamic_offload_state(transformer)["resident_bytes"]
    ddo_lib.remove_dynamic_offload(transformer)

Where a result's shape differs (ddo returns its OffloadResult and report dicts, not the
library's dataclasses), the docstring says so.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping, Optional

from torch import nn

from . import _C
from . import sdnq as _sdnq
from .api import _ATTR, OffloadResult, enable_offload, remove_offload
from .config import DynamicOffloadConfig, DynamicOffloadSettings, apply_preset, preset_names

__all__ = [
    "DDO_PRESETS",
    "apply_dynamic_offload",
    "build_dynamic_offload_event_payload",
    "detect_quantized_backend_modules",
    "enable_diffusers_group_offload",
    "enable_dynamic_offload",
    "format_dynamic_offload_presets",
    "get_available_system_ram_gb",
    "get_dynamic_offload_presets",
    "get_dynamic_offload_state",
    "is_wsl_environment",
    "load_dynamic_offload_settings_from_env",
    "remove_dynamic_offload",
    "resolve_dynamic_offload_preset",
]

_GIB = float(1 << 30)


# ---------------------------------------------------------------------------------------------
# Presets.
# ---------------------------------------------------------------------------------------------


def _preset_table() -> dict[str, dict[str, Any]]:
    # Computed from ddo_core's presets (no second table here): each concrete preset's fields that
    # differ from the built-in defaults.
    defaults = DynamicOffloadConfig().to_dict()
    table: dict[str, dict[str, Any]] = {}
    for name in preset_names():
        if name == "auto":
            continue
        fields = apply_preset(name).to_dict()
        table[name] = {k: v for k, v in fields.items() if defaults.get(k) != v}
    return table


# preset name -> the DynamicOffloadConfig fields it sets. The library's values are DDO_* (and
# DDO_RUNNER_*) environment strings for its runner; ddo's are its config fields by name, typed.
DDO_PRESETS: dict[str, dict[str, Any]] = _preset_table()


def get_dynamic_offload_presets() -> dict[str, dict[str, Any]]:
    """A deep copy of DDO_PRESETS: changing it changes nothing in ddo."""
    return copy.deepcopy(DDO_PRESETS)


def resolve_dynamic_offload_preset(
    requested_preset: str, *, running_on_wsl: Optional[bool] = None
) -> str:
    """The concrete preset a name stands for ("auto" -> "one_shot_fast"; case and blanks are
    ignored; "" stays ""). ValueError naming the valid presets otherwise. ``running_on_wsl`` is
    accepted: as in the library, WSL does not change the preset (it acts below it)."""
    if not isinstance(requested_preset, str):
        raise TypeError(
            f"requested_preset must be a str, not {type(requested_preset).__name__}"
        )
    if not requested_preset.strip():
        return ""
    return _C.resolve_preset(requested_preset)["name"]


def format_dynamic_offload_presets(
    *, default_preset: str = "auto", running_on_wsl: Optional[bool] = None
) -> str:
    """The presets as text: a header with the default's resolution, then each preset's values."""
    resolved = resolve_dynamic_offload_preset(default_preset, running_on_wsl=running_on_wsl)
    lines = ["DDO presets", f"  {default_preset} -> {resolved}", ""]
    for name in sorted(DDO_PRESETS):
        lines.append(name)
        lines.extend(f"  {k}={v}" for k, v in sorted(DDO_PRESETS[name].items()))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


# ---------------------------------------------------------------------------------------------
# Settings and platform.
# ---------------------------------------------------------------------------------------------


def load_dynamic_offload_settings_from_env(
    *,
    execution_device: Any = "cuda:0",
    offload_device: Any = "cpu",
    target_module_classes: Any = None,
    skip_modules_pattern: Any = (),
    always_resident_modules_pattern: Any = None,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    default_preset: str = "",
    component_policies: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> DynamicOffloadSettings:
    """The regular settings loader: preset (DDO_PRESET, else ``default_preset``, else auto) <
    DDO_* variables < these arguments. ``environ`` replaces the process environment.

    Differs from the library on purpose: with neither DDO_PRESET nor ``default_preset`` ddo
    resolves ``auto`` (docs/design/0006-configuration.md, section 3), where the library resolves
    no preset and a disabled plan.
    ``target_module_classes`` is accepted when it names only Linear/Embedding (ddo also streams
    Conv weights); per-component policies come from DDO_<COMPONENT>_ROUTE, so
    ``component_policies`` must be None.
    """
    if component_policies:
        raise ValueError(
            "component_policies is not supported: ddo reads per-component routes from "
            "DDO_<COMPONENT>_ROUTE / DDO_<COMPONENT>_PRESET (pass them in environ=)"
        )
    if offload_device is not None and str(offload_device) != "cpu":
        raise ValueError(
            f"offload_device={offload_device!r} is not supported: ddo streams weights from host "
            "memory; pass 'cpu'"
        )
    env = dict(os.environ if environ is None else environ)
    preset = None
    if not env.get("DDO_PRESET", "").strip() and default_preset and default_preset.strip():
        preset = default_preset
    overrides: dict[str, Any] = {"execution_device": str(execution_device)}
    if skip_modules_pattern:
        overrides["skip_modules_pattern"] = list(skip_modules_pattern)
    if always_resident_modules_pattern is not None:
        overrides["always_resident_modules_pattern"] = list(always_resident_modules_pattern)
    return DynamicOffloadSettings.from_env(preset, env=env, wsl=running_on_wsl, **overrides)


def is_wsl_environment() -> bool:
    """Whether this process runs under WSL (ddo_core's detection: WSL_* variables, /proc)."""
    return bool(DynamicOffloadSettings.from_env("off").wsl)


def get_available_system_ram_gb() -> float:
    """Available system RAM in GiB (DDO_AVAILABLE_SYSTEM_RAM_GB when set), 0.0 when unknown."""
    available = DynamicOffloadSettings.from_env("off").available_ram_bytes()
    return float(available) / _GIB if available else 0.0


# ---------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------


def enable_dynamic_offload(
    module: nn.Module,
    *,
    component: str = "model",
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig] = None,
    preset: Optional[str] = None,
    execution_device: Any = None,
    offload_device: Any = "cpu",
    target_module_classes: Any = None,
    skip_modules_pattern: Any = None,
    always_resident_modules_pattern: Any = None,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    record_event: Any = None,
    event_name: str = "setup_dynamic_offload",
    **config_overrides: Any,
) -> OffloadResult:
    """``enable_offload`` on the dynamic route (the library's high-level entry point).

    Returns ddo's OffloadResult (``.module``, ``.settings``, ``.route``, ``.event_payload``,
    ``.profile_run()``, ``.remove()``), where the library returns its DynamicOffloadApplyResult.
    """
    if skip_modules_pattern:
        config_overrides.setdefault("skip_modules_pattern", list(skip_modules_pattern))
    if always_resident_modules_pattern is not None:
        config_overrides.setdefault(
            "always_resident_modules_pattern", list(always_resident_modules_pattern)
        )
    return enable_offload(
        module,
        preset=preset,
        settings=settings,
        config=config,
        execution_device=execution_device,
        record_event=record_event,
        component=component,
        route="dynamic_offload",
        offload_device=offload_device,
        running_on_wsl=running_on_wsl,
        environ=environ,
        use_environment=use_environment,
        apply_hook=apply_hook,
        **config_overrides,
    )


def apply_dynamic_offload(
    module: nn.Module, config: Optional[DynamicOffloadConfig] = None
) -> OffloadResult:
    """Attaches offload with an explicit config (the defaults when None), no preset and no
    environment. Returns ddo's OffloadResult where the library returns its hook object."""
    return enable_offload(module, config=config if config is not None else DynamicOffloadConfig())


def enable_diffusers_group_offload(
    module: nn.Module,
    *,
    onload_device: Any = "cuda:0",
    offload_device: Any = "cpu",
    offload_type: str = "leaf_level",
    use_stream: bool = True,
    record_stream: bool = False,
    low_cpu_mem_usage: bool = True,
    num_blocks_per_group: int = 1,
    apply_hook: bool = True,
    record_event: Any = None,
    event_name: str = "setup_diffusers_group_offload",
) -> OffloadResult:
    """The classic group-offload behaviour (whole blocks or leaves streamed in order) as ddo's
    group route, run by ddo's engine instead of diffusers' hooks. ``offload_type``
    "block_level" -> group_block, "leaf_level" -> group_leaf. No preset or DDO_* variables apply
    (the library's helper takes none either)."""
    return enable_offload(
        module,
        config=DynamicOffloadConfig(execution_mode="linear_runtime"),
        execution_device=str(onload_device),
        record_event=record_event,
        route="diffusers_group_offload",
        offload_type=offload_type,
        use_stream=use_stream,
        record_stream=record_stream,
        num_blocks_per_group=num_blocks_per_group,
        offload_device=offload_device,
        low_cpu_mem_usage=low_cpu_mem_usage,
        apply_hook=apply_hook,
    )


def remove_dynamic_offload(module: nn.Module, recurse: bool = True) -> None:
    """Restores ``module`` (and, with ``recurse``, every submodule offloaded on its own)."""
    remove_offload(module)
    if recurse:
        for _name, child in module.named_modules():
            if child is not module and isinstance(getattr(child, _ATTR, None), OffloadResult):
                remove_offload(child)


def get_dynamic_offload_state(module: nn.Module) -> Optional[dict[str, Any]]:
    """The JSON-safe report of the offload attached to ``module`` (OffloadResult.report()), or
    None. The library returns its DynamicOffloadState dataclass; ddo's report has its own keys
    (setup seconds and bytes per action, residents, pins, planner decisions, run figures)."""
    result = getattr(module, _ATTR, None)
    return result.report() if isinstance(result, OffloadResult) else None


def build_dynamic_offload_event_payload(
    settings: DynamicOffloadSettings,
    state: Any = None,
    config: Optional[DynamicOffloadConfig] = None,
) -> dict[str, Any]:
    """A JSON-safe payload for a host's setup event: the resolved preset and platform facts, the
    config (``config`` when given, else the settings'), and ``state`` (an OffloadResult or a
    report dict) under "state". ddo's keys, not the library's."""
    if not isinstance(settings, DynamicOffloadSettings):
        raise TypeError(
            f"settings must be ddo.DynamicOffloadSettings, not {type(settings).__name__}"
        )
    resolved = (config if config is not None else settings.config).to_dict()
    payload: dict[str, Any] = {
        "requested_preset": settings.requested_preset,
        "effective_preset": settings.effective_preset,
        "enabled": settings.enabled,
        "pin_requested": settings.pin_requested,
        "pin_effective": settings.pin_effective,
        "wsl": settings.wsl,
    }
    payload.update(resolved)
    if isinstance(state, OffloadResult):
        payload["state"] = state.report()
    elif isinstance(state, Mapping):
        payload["state"] = copy.deepcopy(dict(state))
    return payload


def detect_quantized_backend_modules(module: nn.Module) -> dict[str, Any]:
    """Quantized layers ddo knows, by backend: ``{"sdnq": {"count": n, "modules": [...]}}``;
    ``{}`` when there are none (as the library answers for a plain model)."""
    names = [name for name, m in module.named_modules() if _sdnq.is_sdnq_layer(m)]
    return {"sdnq": {"count": len(names), "modules": names}} if names else {}


# The library's result classes, for isinstance checks in host code: ddo's results carry the
# same role (module, settings, route, event_payload, profile_run) with ddo's fields.
DynamicOffloadApplyResult = OffloadResult
DiffusersGroupOffloadResult = OffloadResult

