"""ddo: dynamic device offloading for large diffusion models, from PyTorch and diffusers.

The named-profile API (docs/design/0007-named-profiles.md), name for name, over the same C++
library the ``ddo`` tools use::

    import ddo

    offload = ddo.enable_offload(
        transformer, preset="auto", profile_name="my-workload", build_profile=calibrate,
    )
    with offload.profile_run() as profile_report:
        latents = pipeline(**inputs, output_type="latent").images

diffusers-dynamic-offloader 0.1.0rc2 (``diffusers_dynamic_offloader``) is a drop-in: its entry points,
helpers and legacy host-context functions are here under its names (``ddo.compat``,
``ddo.legacy``), and ddo reads and writes its profile files. README "Drop-in for
diffusers-dynamic-offloader" lists each of its names with ddo's status.

``ddo._C`` is private; everything public is re-exported here, and no ``_C`` class is: the one
``_C`` name here is ``NotFoundError``, the exception class of the error table
(docs/design/0003-python.md, "Errors"). The legacy host-context API lives in ``ddo.legacy``
(re-exported under diffusers-dynamic-offloader's names for the drop-in); the named-profile store is
reached through ``load_profile``, ``list_profiles`` and ``profile_path``.
"""

import torch as _torch  # noqa: F401  (loads libtorch before _C, which links against it)

from . import _C
from ._C import NotFoundError
from .api import OffloadResult, enable_offload, remove_offload
from .cache import (
    clear_pinned_weight_cache,
    clear_plan_cache,
    pinned_weight_cache_stats,
    plan_cache_stats,
)
from .compat import (
    DDO_PRESETS,
    DiffusersGroupOffloadResult,
    DynamicOffloadApplyResult,
    apply_dynamic_offload,
    build_dynamic_offload_event_payload,
    detect_quantized_backend_modules,
    enable_diffusers_group_offload,
    enable_dynamic_offload,
    format_dynamic_offload_presets,
    get_available_system_ram_gb,
    get_dynamic_offload_presets,
    get_dynamic_offload_state,
    is_wsl_environment,
    load_dynamic_offload_settings_from_env,
    remove_dynamic_offload,
    resolve_dynamic_offload_preset,
)
from .config import (
    DynamicOffloadConfig,
    DynamicOffloadSettings,
    apply_preset,
    preset_config,
    preset_names,
    resolve_preset,
)
from .diffusers import PipelineOffloadResult, enable_pipeline_offload
from .generation import GenerationMeter
from .legacy import (
    DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION,
    DynamicOffloadProfileSession,
    dynamic_offload_profile_key,
    dynamic_offload_profile_path,
    get_dynamic_offload_profile_capacity,
    get_dynamic_offload_profile_dir,
    get_dynamic_offload_profile_recommendation,
    load_dynamic_offload_profile,
    normalize_dynamic_offload_profile_context,
    record_dynamic_offload_profile,
)
from .loader import LoadedModel, from_pretrained_with_dynamic_offload
from .profiles import list_profiles, load_profile, profile_dir, profile_key, profile_path

__version__ = "0.1.0"

DynamicOffloadLoadResult = LoadedModel  # diffusers-dynamic-offloader's name for the loader's result

__all__ = [
    "DDO_PRESETS",
    "DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION",
    "DiffusersGroupOffloadResult",
    "DynamicOffloadApplyResult",
    "DynamicOffloadLoadResult",
    "apply_dynamic_offload",
    "build_dynamic_offload_event_payload",
    "detect_quantized_backend_modules",
    "dynamic_offload_profile_key",
    "dynamic_offload_profile_path",
    "enable_diffusers_group_offload",
    "enable_dynamic_offload",
    "format_dynamic_offload_presets",
    "get_available_system_ram_gb",
    "get_dynamic_offload_presets",
    "get_dynamic_offload_profile_capacity",
    "get_dynamic_offload_profile_dir",
    "get_dynamic_offload_profile_recommendation",
    "get_dynamic_offload_state",
    "is_wsl_environment",
    "load_dynamic_offload_profile",
    "load_dynamic_offload_settings_from_env",
    "normalize_dynamic_offload_profile_context",
    "record_dynamic_offload_profile",
    "remove_dynamic_offload",
    "resolve_dynamic_offload_preset",
    "DynamicOffloadConfig",
    "DynamicOffloadProfileSession",
    "DynamicOffloadSettings",
    "GenerationMeter",
    "LoadedModel",
    "NotFoundError",
    "OffloadResult",
    "PipelineOffloadResult",
    "apply_preset",
    "clear_pinned_weight_cache",
    "clear_plan_cache",
    "enable_offload",
    "enable_pipeline_offload",
    "from_pretrained_with_dynamic_offload",
    "list_profiles",
    "load_profile",
    "pinned_weight_cache_stats",
    "plan_cache_stats",
    "preset_config",
    "preset_names",
    "profile_dir",
    "profile_key",
    "profile_path",
    "remove_offload",
    "resolve_preset",
]
