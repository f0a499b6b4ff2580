"""from_pretrained_with_dynamic_offload: load a component straight into ddo's memory.

The rule and why: docs/design/0008-loading-and-reports.md, section 1.

    loaded = from_pretrained_with_dynamic_offload(
        model_path, model_loader=FluxTransformer2DModel,
        dynamic_offload_config=settings.config, apply_dynamic=True,
        profile_name="my-workload", build_profile=calibrate,
    )
    with loaded.profile_run():
        output = loaded.module(**inputs)

With ``apply_dynamic=False`` the host calls ``enable_offload`` later, at the actual execution
stage, and the profile options belong there: giving them here is a ValueError.

ddo's own loader (``loader="ddo"``; the default when it applies) builds the module from its
config.json without weights (parameters on the meta device, then placeholders that take no
memory), checks the safetensors files against it, and reads every tensor with several threads
straight into the memory ddo gives it: streamed weights into their host slab, residents to the
device. The host never holds the model twice. ``loader="library"`` calls the class's own
``from_pretrained`` and then attaches offload (two copies on the way, diffusers-dynamic-offloader's behaviour).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from . import _C
from ._progress import SetupProgress
from .api import (
    OffloadResult,
    ProfileRunContext,
    RecordEvent,
    _enable,
    _gather,
    _native_settings,
)
from .config import DynamicOffloadConfig
from .profiles import model_class_name

__all__ = ["LoadedModel", "from_pretrained_with_dynamic_offload"]

_LOADERS = ("auto", "ddo", "library")


@contextlib.contextmanager
def _empty_weights() -> Iterator[None]:
    """Parameters registered inside go to the meta device (buffers stay real: a module computes
    its non-persistent buffers itself). Initialisers then run on meta and cost nothing."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _to_placeholders(module: nn.Module) -> None:
    """Every meta tensor becomes a placeholder (no memory; Note [Placeholders]); tied
    parameters stay one object."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = memo.get(id(p))
            if new is None:
                try:
                    new = type(p)(_C.placeholder_like(p), requires_grad=p.requires_grad)
                except TypeError:
                    new = nn.Parameter(_C.placeholder_like(p), requires_grad=p.requires_grad)
                memo[id(p)] = new
            sub._parameters[name] = new  # type: ignore[assignment]
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[name] = memo.setdefault(id(b), _C.placeholder_like(b))


def _sdnq_checkpoint_config(path: str) -> Optional[dict[str, Any]]:
    """The quantization config of a checkpoint saved by the ``sdnq`` package
    (``quantization_config.json`` beside the weights, or ``config.json``'s
    ``quantization_config``) when its ``quant_method`` is "sdnq"; None otherwise."""
    if not os.path.isdir(path):
        return None
    for name, key in (("quantization_config.json", None), ("config.json", "quantization_config")):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                config = json.load(f)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            # json's own message says where, not which file; nested too deep is RecursionError.
            raise ValueError(
                f"{file}: not a readable JSON object ({type(e).__name__}: {e}); re-save the "
                "checkpoint or fix the file") from None
        if not isinstance(config, dict):
            raise ValueError(f"{file}: expected a JSON object, found {type(config).__name__}")
        if key is not None:
            config = config.get(key)
        if isinstance(config, dict) and config.get("quant_method") == "sdnq":
            return config
    return None


def _swap_in_sdnq_layers(module: nn.Module, path: str, config: dict[str, Any],
                         result_dtype: torch.dtype) -> int:
    """Replaces every Linear whose checkpoint tensors are SDNQ-quantized by ddo's
    :class:`~ddo.sdnq.QuantizedLinear` over meta tensors of the file's shapes and dtypes, so the
    loader reads the packed tensors straight into place (Note [Loader pins] for the deferred
    flow). The layout comes from the package's config and the tensors: the weights dtype, one
    scale per row or per group (from the scale's shape), SVD factors when present. Returns how
    many layers were swapped; a layout ddo does not run is a ValueError naming the option."""
    from .sdnq import _UNSUPPORTED_TENSORS, QuantizedLinear

    for option in ("use_hadamard", "use_codebook", "use_codebook_scale"):
        if config.get(option):
            raise ValueError(
                f"{path}: the SDNQ checkpoint was saved with {option}=True, a layout ddo's loader "
                "does not read yet; load it with loader='library' (the package's own loader)"
            )
    for option in ("modules_dtype_dict", "modules_quant_config"):
        if config.get(option):
            raise ValueError(
                f"{path}: the SDNQ checkpoint sets {option} (per-module layouts), which ddo's "
                "loader does not read yet; load it with loader='library'"
            )
    weights_dtype = config.get("weights_dtype")
    if not isinstance(weights_dtype, str):
        raise ValueError(f"{path}: the SDNQ quantization config has no weights_dtype")
    # The matmul layout (use_quantized_matmul, int8 or float8_e4m3fn): the weight stored
    # transposed, [in, out], with one scale per output column, [1, out], computed by a quantized
    # GEMM. The package keeps the plain layout for layers it does not run that way, so each
    # layer's own shapes decide, not the flag alone.
    matmul = bool(config.get("use_quantized_matmul"))
    if matmul and config.get("quantized_matmul_dtype") not in (None, "int8", "float8_e4m3fn"):
        raise ValueError(
            f"{path}: the SDNQ checkpoint sets quantized_matmul_dtype="
            f"{config.get('quantized_matmul_dtype')!r}; ddo runs the int8 and float8_e4m3fn "
            "matmul layouts only; load it with loader='library'"
        )
    tensors = _C.checkpoint_meta(path)  # name -> meta tensor of the stored shape and dtype
    swapped = 0
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, nn.Linear) or f"{name}.scale" not in tensors:
            continue
        meta = {
            part: tensors[f"{name}.{part}"]
            for part in ("weight", "scale", "zero_point", "svd_up", "svd_down", "bias")
            if f"{name}.{part}" in tensors
        }
        # How this layer is stored, and whether ddo runs it: C++'s rule
        # (ddo/sdnq/acceptance.h), the one sdnq_layout applies to the package's modules.
        group, transposed = _C.sdnq_stored_layout(
            matmul, sub.out_features, sub.in_features, list(tensors[f"{name}.weight"].shape),
            list(tensors[f"{name}.scale"].shape))
        layout, why = _C.sdnq_accept_layer(
            type(sub).__name__, True, weights_dtype, result_dtype,
            [sub.out_features, sub.in_features], group, transposed, "svd_up" in meta,
            [extra for extra in _UNSUPPORTED_TENSORS if f"{name}.{extra}" in tensors])
        if why:
            raise ValueError(f"{path}: {name}: ddo cannot run this SDNQ layer ({why}); load it "
                             "with loader='library'")
        layout = list(layout)
        bias = meta.pop("bias", None)
        if bias is not None and bias.dtype.is_floating_point:
            bias = torch.empty(bias.shape, dtype=result_dtype, device="meta")
        layer = QuantizedLinear(sub.in_features, sub.out_features, meta, layout, bias,
                                weights_dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, child, layer)
        swapped += 1
    return swapped


def _has_safetensors(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith(".safetensors")
    try:
        return any(n.endswith(".safetensors") for n in os.listdir(path))
    except OSError:
        return False


def _default_model_loader() -> Any:
    """diffusers.AutoModel, as the diffusers-dynamic-offloader library defaults to."""
    try:
        from diffusers import AutoModel
    except ImportError as e:
        raise TypeError(
            "from_pretrained_with_dynamic_offload without model_loader= loads with "
            "diffusers.AutoModel, and diffusers is not installed: pip install diffusers, or pass "
            "model_loader=, the class to load (e.g. FluxTransformer2DModel) or a "
            "callable(path, **kwargs) returning the module"
        ) from e
    return AutoModel


def _concrete_class(model_loader: Any, path: str) -> Any:
    """diffusers.AutoModel resolved to the class config.json names (its "_class_name"), so that
    ddo's loader can build it without weights; anything else as given."""
    try:
        from diffusers import AutoModel
    except ImportError:
        return model_loader
    if model_loader is not AutoModel:
        return model_loader
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return model_loader  # a single file or a repo id: the library's loader decides
    import diffusers

    with open(config_path, encoding="utf-8") as f:
        try:
            name = json.load(f).get("_class_name")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{config_path}: not a JSON object ({e})") from e
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"{config_path} names the class {name!r}, which diffusers {diffusers.__version__} "
            "does not have; pass model_loader=, the class to load"
        )
    return cls


def _build_empty(model_loader: Any, path: str) -> Optional[nn.Module]:
    """The module from the directory's config.json, without weights; None when model_loader is
    neither a diffusers model class nor a transformers one."""
    if hasattr(model_loader, "load_config") and hasattr(model_loader, "from_config"):
        config = model_loader.load_config(path)  # diffusers ModelMixin
        with _empty_weights():
            return model_loader.from_config(config)
    if hasattr(model_loader, "config_class") and hasattr(model_loader, "_from_config"):
        config = model_loader.config_class.from_pretrained(path)  # transformers PreTrainedModel
        with _empty_weights():
            return model_loader._from_config(config)
    return None


def _default_dtype(model_loader: Any, path: str) -> Optional[torch.dtype]:
    """The dtype the library's own from_pretrained gives without torch_dtype: diffusers keeps
    the module's (float32); transformers 5 uses the dtype saved in config.json."""
    if hasattr(model_loader, "config_class") and hasattr(model_loader, "_from_config"):
        config = model_loader.config_class.from_pretrained(path)
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = getattr(torch, saved, None)
        return saved if isinstance(saved, torch.dtype) else None
    return None
class LoadedModel:
    """The loaded module and, with apply_dynamic=True, its offload."""

    def __init__(self, module: nn.Module, offload: Optional[OffloadResult]) -> None:
        self.module = module
        self.offload = offload
        # Deferred loads (apply_dynamic=False): where the weights went, {"device", "pinned",
        # "pinned_bytes", "pageable_bytes", "reason"?, ...} (Note [Loader pins]).
        self.load_report: dict[str, Any] = {}

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
        """diffusers-dynamic-offloader's field: True while no offload places the module."""
        return self.offload is None or self.offload.should_move_to_execution_device


def _check_load_args(profile_name: Any, build_profile: Any, apply_dynamic: bool, loader: Any,
                     read_workers: Any, dtype: Any, quantize: Any) -> Optional[str]:
    """from_pretrained_with_dynamic_offload's arguments checked before any read; returns
    ``quantize`` as the attach takes it (None for none)."""
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
    if loader not in _LOADERS:
        raise ValueError(f"loader must be one of {', '.join(_LOADERS)}, not {loader!r}")
    if read_workers is not None and (
        isinstance(read_workers, bool) or not isinstance(read_workers, int) or read_workers < 1
    ):
        raise ValueError(
            f"read_workers must be an int >= 1 or None (one per core), not {read_workers!r}"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, not {dtype!r}")
    if quantize is not None and not isinstance(quantize, str):
        raise TypeError(f'quantize must be "fp8", "int8" or None, not {quantize!r}')
    # The package's type name ("" for "none"); a ValueError naming the choices before any read.
    quantize = quantize if quantize and _C.sdnq_quantize_type(quantize) else None
    if not apply_dynamic and (profile_name or build_profile):
        raise ValueError(
            "profile_name/build_profile were given with apply_dynamic=False; pass them to the "
            "later enable_offload call, at the actual execution stage"
        )
    if not apply_dynamic and quantize is not None:
        raise ValueError(
            f"quantize={quantize!r} was given with apply_dynamic=False: the quantized copies are "
            "made when an offload attaches; pass quantize= to the later enable_offload call, at "
            "the actual execution stage"
        )
    return quantize


def _empty_for_ddo_loader(loader: str, load_kwargs: dict, model_loader: Any,
                          path: str) -> Optional[nn.Module]:
    """The module ddo's loader fills (built from config.json without weights), or None when the
    library's own from_pretrained loads it ("library", or "auto" with library keywords or no
    safetensors files, or a class ddo cannot build)."""
    module: Optional[nn.Module] = None
    if loader != "library" and not (loader == "auto" and load_kwargs):
        if loader == "ddo" and load_kwargs:
            raise TypeError(
                f"loader='ddo' takes no library keywords ({', '.join(sorted(load_kwargs))}); "
                "use loader='library' for them"
            )
        if _has_safetensors(path):
            module = _build_empty(model_loader, path)
        elif loader == "ddo":
            raise FileNotFoundError(
                f"{path}: no .safetensors files; ddo's loader reads a component directory "
                "(config.json and its safetensors files) or one .safetensors file"
            )
        if module is None and loader == "ddo":
            raise TypeError(
                f"loader='ddo' builds diffusers or transformers model classes from config.json; "
                f"{getattr(model_loader, '__name__', model_loader)!r} is neither: pass "
                "loader='library'"
            )
    return module


def _with_progress(module: nn.Module, record_event: Optional[RecordEvent],
                   read: Callable[[str, list, SetupProgress], Any]) -> Any:
    """``read(model_class, entries, progress)`` with the one progress line of a long load."""
    model_class = model_class_name(module)
    entries, _, _ = _gather(module)
    progress = SetupProgress(model_class, record_event)
    progress.start()
    try:
        result = read(model_class, entries, progress)
    except BaseException:
        progress.close(failed=True)
        raise
    progress.close()
    return result


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
    loader: str = "auto",
    read_workers: Optional[int] = None,
    allow_unexpected_keys: bool = False,
    quantize: Optional[str] = None,
    **load_kwargs: Any,
) -> LoadedModel:
    """Loads a component and, with ``apply_dynamic=True``, attaches offload.

    ``apply_dynamic`` defaults to False as in diffusers-dynamic-offloader: the host attaches offload later,
    at the execution stage, with ``enable_offload`` (and passes the profile options there).
    ``build_profile=None`` is False. ``loader``: "ddo" reads the safetensors files straight into
    place (module docstring), "library" calls ``model_loader.from_pretrained``, "auto" (default)
    takes "ddo" when the directory holds safetensors files and ``model_loader`` is a diffusers or
    transformers model class, else "library". ``subfolder=`` is joined to the path; other keywords
    go to ``model_loader.from_pretrained`` (and select the library loader under "auto").
    ``quantize="fp8" | "int8"`` (with ``apply_dynamic=True``) is ``enable_offload(quantize=)``
    on the loaded module: each qualifying Linear computes from a quantized copy, which is what
    streams, and keeps its dense weight. With ddo's loader that dense weight points into the
    checkpoint file (mapped copy-on-write: page cache, no memory of its own) where the file holds
    it in the model's dtype, and the quantized copy is never read from the files (Note [Quantized
    dense weights] in torch/src/attach_quantize.cpp). A deferred load takes no ``quantize``: pass
    it to the later ``enable_offload``.
    """
    if model_loader is None:
        model_loader = _default_model_loader()
    build_profile = False if build_profile is None else build_profile
    quantize = _check_load_args(profile_name, build_profile, apply_dynamic, loader, read_workers,
                                dtype, quantize)
    path = os.fspath(model_path)
    subfolder = load_kwargs.pop("subfolder", None)
    if subfolder:
        path = os.path.join(path, subfolder)
    model_loader = _concrete_class(model_loader, path)

    def attach(module: nn.Module, load: Optional[dict[str, Any]] = None) -> OffloadResult:
        return _enable(
            module,
            preset=preset if dynamic_offload_config is None else None,
            profile_name=profile_name,
            build_profile=build_profile,
            settings=None,
            config=dynamic_offload_config,
            execution_device=execution_device,
            record_event=record_event,
            overrides={},
            load=load,
            quantize=quantize,
        )

    module = _empty_for_ddo_loader(loader, load_kwargs, model_loader, path)
    if module is None:
        module = _load_with_library(path, model_loader, dtype, load_kwargs)
        return LoadedModel(module, attach(module) if apply_dynamic else None)

    target = dtype if dtype is not None else _default_dtype(model_loader, path)
    if target is not None:
        module.to(target)  # on meta: no memory, no copy
    sdnq_config = _sdnq_checkpoint_config(path)
    if sdnq_config is not None:
        # A checkpoint of the sdnq package: its quantized Linears become ddo's SDNQ layers, whose
        # packed tensors the loader reads like any other (after module.to: they keep their dtypes).
        _swap_in_sdnq_layers(module, path, sdnq_config, target or torch.float32)
    _to_placeholders(module)
    module.eval()
    load = {
        "path": path,
        "read_workers": read_workers or 0,
        "allow_unexpected_keys": allow_unexpected_keys,
    }
    if apply_dynamic:
        return LoadedModel(module, attach(module, load))
    # Deferred: the weights go into pinned memory for the execution device these settings name,
    # and the later enable_offload streams them from there (Note [Loader pins]).
    settings = _native_settings(preset if dynamic_offload_config is None else None, None,
                                dynamic_offload_config, execution_device)
    pins = _with_progress(module, record_event, lambda model_class, entries, progress: (
        _C.load_weights_for_offload(model_class, entries, load, record_event=progress,
                                    **settings)))
    loaded = LoadedModel(module, None)
    loaded.load_report = pins
    return loaded


def _load_with_library(
    path: str, model_loader: Any, dtype: Any, load_kwargs: dict[str, Any]
) -> nn.Module:
    """The module as the library's own loader gives it (two copies on the way)."""
    loader_fn: Callable[..., nn.Module]
    if hasattr(model_loader, "from_pretrained"):
        kwargs = dict(load_kwargs)
        if dtype is not None:
            kwargs.setdefault("torch_dtype", dtype)
        module = model_loader.from_pretrained(path, **kwargs)
    elif callable(model_loader):
        loader_fn = model_loader
        module = loader_fn(path, **load_kwargs)
        if dtype is not None:
            module = module.to(dtype)
    else:
        raise TypeError("model_loader must be a class with from_pretrained or a callable")
    if not isinstance(module, nn.Module):
        raise TypeError(f"model_loader returned {type(module).__name__}, not an nn.Module")
    module.eval()
    return module
