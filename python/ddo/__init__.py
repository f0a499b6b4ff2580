"""ddo: dynamic device offloading for large diffusion models, from PyTorch and diffusers.

The seed page's API, name for name, over the same C++ library the ``ddo`` tools use::

    import ddo

    offload = ddo.enable_offload(
        transformer, preset="auto", profile_name="my-workload", build_profile=calibrate,
    )
    with offload.profile_run() as profile_report:
        latents = pipeline(**inputs, output_type="latent").images

``ddo._C`` is private; everything public is re-exported here. See docs/design/0003-python.md.
"""

import torch as _torch  # noqa: F401  (loads libtorch before _C, which links against it)

from . import _C
from ._C import NotFoundError
from .api import OffloadResult, enable_offload, remove_offload
from .config import (
    DynamicOffloadConfig,
    DynamicOffloadSettings,
    apply_preset,
    preset_config,
    preset_names,
    resolve_preset,
)
from .diffusers import PipelineOffloadResult, enable_pipeline_offload
from .loader import LoadedModel, from_pretrained_with_dynamic_offload
from .profiles import (
    DynamicOffloadProfileSession,
    HostContextStore,
    ProfileStore,
    context_key,
    context_path,
    list_profiles,
    load_profile,
    normalize_context,
    profile_dir,
    profile_key,
    profile_path,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicOffloadConfig",
    "DynamicOffloadProfileSession",
    "DynamicOffloadSettings",
    "HostContextStore",
    "LoadedModel",
    "NotFoundError",
    "OffloadResult",
    "PipelineOffloadResult",
    "ProfileStore",
    "apply_preset",
    "context_key",
    "context_path",
    "enable_offload",
    "enable_pipeline_offload",
    "from_pretrained_with_dynamic_offload",
    "list_profiles",
    "load_profile",
    "normalize_context",
    "preset_config",
    "preset_names",
    "profile_dir",
    "profile_key",
    "profile_path",
    "remove_offload",
    "resolve_preset",
]
