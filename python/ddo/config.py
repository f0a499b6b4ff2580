"""DynamicOffloadConfig, DynamicOffloadSettings and the preset helpers.

The rules: docs/design/0006-configuration.md.

Both classes are views of the C++ structs: the field names, defaults, type checks, presets,
environment variables and override order all live in ddo_core. Python keeps a dict of the
fields as ddo_core last returned them, so reading a field is a dict lookup and every write goes
through the same checks as C++ code::

    config = DynamicOffloadConfig(execution_mode="linear_runtime", resident_module_budget_gb=4)
    config.pin_cpu_memory = True                # checked by ddo_core
    config.pin_memory = True                    # TypeError: unknown config field "pin_memory" ...
    settings = DynamicOffloadSettings.from_env(preset="low_ram_safe", verbose=True)
    settings.config.resident_module_budget_gb   # 3.0 (or DDO_RESIDENT_MODULE_BUDGET_GB)
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from . import _C

__all__ = [
    "DynamicOffloadConfig",
    "DynamicOffloadSettings",
    "apply_preset",
    "preset_config",
    "preset_names",
    "resolve_preset",
]


class DynamicOffloadConfig:
    """Every knob of ddo with the spec's defaults; fields are set by their spec names.

    ``DynamicOffloadConfig(**fields)`` starts from the built-in defaults (no preset, no
    environment: use ``DynamicOffloadSettings.from_env`` for those). Unknown names raise
    ``TypeError`` listing them; bad values raise ``ValueError`` naming the field. Enums are
    their spellings (``execution_mode="linear_runtime"``), sizes are GiB floats, lists are lists
    of str. Reading a list field returns a copy: assign to change it.
    """

    __slots__ = ("_fields",)

    def __init__(self, **fields: Any) -> None:
        object.__setattr__(self, "_fields", _C.config_apply(None, fields))

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> "DynamicOffloadConfig":
        """A config from a (possibly partial) dict of fields over the defaults."""
        return cls(**dict(fields))

    @staticmethod
    def field_names() -> list[str]:
        """Every field's spec name, in the C++ declaration order."""
        return list(_C.config_field_names())

    @staticmethod
    def defaults() -> dict[str, Any]:
        return _C.config_defaults()

    def replace(self, **overrides: Any) -> "DynamicOffloadConfig":
        """A copy with ``overrides`` applied (checked like the constructor)."""
        out = object.__new__(DynamicOffloadConfig)
        object.__setattr__(out, "_fields", _C.config_apply(self._fields, overrides))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe field dict (enum spellings; ``available_system_ram_gb`` may be None)."""
        return copy.deepcopy(self._fields)

    # -- field access -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        try:
            value = fields[name]
        except KeyError:
            raise AttributeError(
                f"DynamicOffloadConfig has no field {name!r}; fields: {', '.join(fields)}"
            ) from None
        return list(value) if isinstance(value, list) else value

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, "_fields", _C.config_apply(self._fields, {name: value}))

    def __delattr__(self, name: str) -> None:
        raise AttributeError("DynamicOffloadConfig fields cannot be deleted; assign a value")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._fields))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DynamicOffloadConfig):
            return NotImplemented
        return self._fields == other._fields

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        defaults = _C.config_defaults()
        changed = ", ".join(
            f"{k}={v!r}" for k, v in self._fields.items() if defaults.get(k) != v
        )
        return f"DynamicOffloadConfig({changed})"

    def __copy__(self) -> "DynamicOffloadConfig":
        return self.replace()

    def __deepcopy__(self, memo: dict) -> "DynamicOffloadConfig":
        return self.replace()

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_fields", _C.config_apply(None, state))


def _config_fields(config: DynamicOffloadConfig | Mapping[str, Any] | None) -> dict | None:
    if config is None:
        return None
    if isinstance(config, DynamicOffloadConfig):
        return config._fields
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(
        f"config must be a DynamicOffloadConfig or a dict of fields, not {type(config).__name__}"
    )


class DynamicOffloadSettings:
    """The resolved view of a config ("the regular settings loader").

    See docs/design/0006-configuration.md, section 2.

    Build it with ``from_env``; ``config`` is the resolved ``DynamicOffloadConfig``. The other
    attributes say what the preset resolved to and what the platform allowed: ``requested_preset``,
    ``effective_preset``, ``preset_description``, ``enabled``, ``pin_requested``,
    ``pin_effective``, ``wsl``, ``side_streams_effective``, ``component_policies``.
    """

    __slots__ = ("_native", "_json", "_config")

    def __init__(self, native: "_C.Settings") -> None:
        if not isinstance(native, _C.Settings):
            raise TypeError("use DynamicOffloadSettings.from_env(...) to build settings")
        self._native = native
        self._json = native.to_json()
        self._config = DynamicOffloadConfig.from_dict(self._json["config"])

    @classmethod
    def from_env(
        cls,
        preset: str | None = None,
        config: DynamicOffloadConfig | Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        wsl: bool | None = None,
        **overrides: Any,
    ) -> "DynamicOffloadSettings":
        """Resolves defaults < preset (``preset``, else DDO_PRESET, else auto) < DDO_* variables
        < ``config`` (replaces the three before it) < keyword ``overrides``.

        ``env`` replaces the process environment (for tests); ``wsl`` states the platform fact
        instead of detecting it.
        """
        native = _C.Settings.from_env(
            preset=preset,
            config=_config_fields(config),
            overrides=overrides or None,
            env=dict(env) if env is not None else None,
            wsl=wsl,
        )
        return cls(native)

    def with_overrides(self, **overrides: Any) -> "DynamicOffloadSettings":
        """These settings with keyword ``overrides`` on their config (field names as in
        ``from_env``): the preset, the component policies and the platform facts they were built
        with are kept, and no environment is read (ddo::core::DynamicOffloadSettings::
        with_overrides, the rule ``enable_offload(..., settings=s, **overrides)`` applies)."""
        return DynamicOffloadSettings(self._native.with_overrides(overrides))

    @property
    def config(self) -> DynamicOffloadConfig:
        return self._config.replace()

    requested_preset = property(lambda self: self._json["requested_preset"])
    effective_preset = property(lambda self: self._json["effective_preset"])
    preset_description = property(lambda self: self._json["preset_description"])
    enabled = property(lambda self: self._json["enabled"])
    pin_requested = property(lambda self: self._json["pin_requested"])
    pin_effective = property(lambda self: self._json["pin_effective"])
    wsl = property(lambda self: self._json["wsl"])
    side_streams_effective = property(lambda self: self._json["side_streams_effective"])

    @property
    def component_policies(self) -> dict[str, dict[str, Any]]:
        return copy.deepcopy(self._json["component_policies"])

    def policy_for(self, component: str) -> dict[str, Any]:
        """``{"route": ..., "preset": ...}`` for a pipeline component (DDO_<COMPONENT>_ROUTE)."""
        return self._native.policy_for(component)

    def available_ram_bytes(self) -> int | None:
        return self._native.available_ram_bytes()

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._json)

    def __repr__(self) -> str:
        return (
            f"DynamicOffloadSettings(requested_preset={self.requested_preset!r}, "
            f"effective_preset={self.effective_preset!r}, enabled={self.enabled}, "
            f"config={self._config!r})"
        )


def preset_names() -> list[str]:
    """Every valid preset: ``auto`` first, then the concrete presets.

    See docs/design/0006-configuration.md, section 4."""
    return list(_C.preset_names())


def resolve_preset(name: str) -> dict[str, Any]:
    """``{"requested", "name", "description", "enabled"}``; ValueError naming the valid ones."""
    return _C.resolve_preset(name)


def apply_preset(
    name: str, config: DynamicOffloadConfig | Mapping[str, Any] | None = None
) -> DynamicOffloadConfig:
    """A copy of ``config`` (default: the built-in defaults) with the preset's values applied."""
    fields, _info = _C.apply_preset(name, _config_fields(config))
    return DynamicOffloadConfig.from_dict(fields)


def preset_config(name: str) -> DynamicOffloadConfig:
    """The built-in defaults with the preset's values (no environment)."""
    return apply_preset(name)
