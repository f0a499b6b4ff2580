"""enable_offload for torch.nn.Module: the entry point of the named-profile API.

The API and its rules: docs/design/0007-named-profiles.md.

Python gathers the model once: ``named_modules()`` in order, each module's class, kind (Linear,
Conv1d/2d/3d, Embedding, other) and its direct parameters and buffers, as the model's own tensor
objects. ddo_torch (C++) plans, places and re-points those tensors in place; from then on the
model runs unchanged and no Python code runs per op (interception is at the dispatcher)::

    offload = enable_offload(model, preset="auto", profile_name="my-workload",
                             build_profile=calibrate)
    with offload.profile_run() as profile_report:      # calibration: measured and saved
        output = pipeline(**inputs)
    profile_report["status"]                            # "saved" (calibration) / "applied" / ...
    remove_offload(model)                               # ordinary tensors again

The offload stays attached to the model (``model._ddo_offload``) until ``remove_offload`` or
``offload.remove()``, so the host does not have to keep the result alive.

A TorchScript module (``torch.jit.trace`` / ``torch.jit.script`` / ``torch.jit.load``) is not
walked in Python: its children are RecursiveScriptModules, which no isinstance test recognises.
It goes to the C++ path a C++ program uses for a ``torch::jit::Module`` (Note [TorchScript
modules] in torch/src/jit_module.cpp), which classifies by TorchScript type, refuses frozen
modules, and names profiles after the root's qualified type
(``"__torch__.diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"``); the
result is the same ``OffloadResult``::

    traced = torch.jit.trace(model, example_kwarg_inputs=inputs, strict=False)
    offload = enable_offload(traced, profile_name="flux", build_profile=calibrate)
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from . import _C
from . import adapters as _adapters
from . import sdnq as _sdnq
from ._progress import SetupProgress
from .config import DynamicOffloadConfig, DynamicOffloadSettings, _config_fields
from .profiles import model_class_name

__all__ = ["OffloadResult", "enable_offload", "remove_offload"]

_ATTR = "_ddo_offload"
_REGEX_SPECIALS = set("\\^$.|?*+()[]{}")

RecordEvent = Callable[[str, float, dict], Any]


# ---------------------------------------------------------------------------------------------
# The measured region.
# ---------------------------------------------------------------------------------------------


class ProfileRunContext:
    """``with offload.profile_run() as report:`` -- the measured region.

    The rules: docs/design/0007-named-profiles.md, section 3.

    On a calibration (or pending-probe) run the region is measured and, only when the block
    exits without an exception, saved. On a normal run the stored recommendation was already
    applied by ``enable_offload`` and the region does nothing. ``report`` is a JSON-safe dict,
    updated in place when the block ends, so it reads final afterwards.
    """

    def __init__(self, native_offload: "_C.Offload") -> None:
        self._native = native_offload
        self._run: Optional["_C.ProfileRun"] = None
        self.report: dict[str, Any] = {}

    def __enter__(self) -> dict[str, Any]:
        if self._run is not None:
            raise RuntimeError(
                "this profile_run() context is already open; nested regions are not supported"
            )
        self._run = self._native.profile_run()
        self.report.clear()
        self.report.update(self._run.report())
        return self.report

    def __exit__(self, exc_type, exc, tb) -> bool:
        run, self._run = self._run, None
        if run is None:
            return False
        out_of_memory = isinstance(exc, torch.OutOfMemoryError)
        if exc_type is None:
            final = run.finish()  # raises when saving fails; the report then says "failed"
        else:
            try:
                # Nothing saved: the stored profile stays byte for byte.
                final = run.abort_out_of_memory() if out_of_memory else run.abort()
            except Exception as abort_error:  # never mask the host's exception
                warnings.warn(f"ddo: ending the aborted profile region failed: {abort_error}")
                final = run.report()
        self.report.clear()
        self.report.update(final)
        if out_of_memory and "error" in final:
            # A reused profile that the workload outgrew (Note [A reused profile is checked]).
            raise torch.OutOfMemoryError(final["error"]) from exc
        return False


# ---------------------------------------------------------------------------------------------
# The result.
# ---------------------------------------------------------------------------------------------


class OffloadResult:
    """What ``enable_offload`` returns: the handle of one model's offload.

    ``profile_run()`` opens the measured region; ``report()`` is the JSON-safe report
    (docs/design/0008-loading-and-reports.md, section 2); ``summary()`` one screen for humans;
    ``remove()`` restores the model.
    """

    def __init__(
        self,
        module: nn.Module,
        native: "_C.Offload",
        model_class: str,
        kept: list[dict[str, str]],
        events: list[tuple[str, float, dict]],
    ) -> None:
        self.module = module
        self.model_class = model_class
        self._native = native
        self._kept = kept
        self._events = events
        self._sdnq_modules: list[nn.Module] = []
        # Adapters added and writes through .data while attached (adapters.py).
        self._watch: Optional[_adapters._Watch] = None

    def _install_sdnq_forwards(self, layers: list[tuple], executing: bool) -> None:
        # While the offload executes, SDNQ layers run ddo::sdnq_linear (their packed tensors may
        # be streamed); in plan mode nothing moved and they keep their own forward.
        if not layers or not executing:
            return
        for _, module, code in layers:
            _sdnq.install_forward(module, code)
            self._sdnq_modules.append(module)

    # -- the named-profile API (docs/design/0007-named-profiles.md) ---------------------------
    def profile_run(self) -> ProfileRunContext:
        """The measured region (a context manager yielding the profile report dict)."""
        self._check_active()
        return ProfileRunContext(self._native)

    @property
    def profile_report(self) -> dict[str, Any]:
        """The latest profile report (setup's until a region ends)."""
        return self._native.profile_report()

    def remove(self, clear_weight_cache: bool = False, keep_residents: bool = False) -> None:
        """Restores the model: every tensor ordinary again, on its original device. Idempotent.

        With ``cache_pinned_weights`` the streamed weights stay in the pinned-weight cache (the
        model's weights point at it) for the next attach; ``clear_weight_cache=True`` copies them
        out and drops this model's entry instead. ``keep_residents=True`` (CUDA) leaves the
        resident and small tensors on the GPU for the next ``enable_offload`` of this model,
        which then moves nothing: for a staged flow that releases the denoiser only to run the
        VAE. The module is then split between host and GPU until that attach."""
        for name, value in (("clear_weight_cache", clear_weight_cache),
                            ("keep_residents", keep_residents)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
        _adapters.unwatch(self._watch)
        self._watch = None
        self._native.remove(clear_weight_cache=clear_weight_cache, keep_residents=keep_residents)
        for module in self._sdnq_modules:
            _sdnq.restore_forward(module)
        self._sdnq_modules = []
        if getattr(self.module, _ATTR, None) is self:
            try:
                delattr(self.module, _ATTR)
            except AttributeError:
                pass

    # -- reports ----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._native.active

    def report(self) -> dict[str, Any]:
        """JSON-safe: settings, setup seconds and bytes, residents, pins, decisions, run figures,
        the profile report, and what the Python glue kept out of ddo's hands (``python``)."""
        r = self._native.report()
        r["python"] = {
            "kept_modules": copy.deepcopy(self._kept),
            "setup_events": [
                {"name": n, "seconds": s, "payload": p} for n, s, p in self._events
            ],
        }
        if self._watch is not None:
            r["python"]["adapters_added"] = self._watch.report()
        return r

    def summary(self) -> str:
        text = self._native.summary()
        for kept in self._kept:
            text += f"  kept by the Python glue: {kept['module']} ({kept['reason']})\n"
        return text

    def plan(self) -> dict[str, Any]:
        return self._native.plan()

    @property
    def settings(self) -> DynamicOffloadSettings:
        return DynamicOffloadSettings(self._native.settings())

    def reset_run_stats(self) -> None:
        self._native.reset_run_stats()

    def counters(self) -> dict[str, int]:
        """The running totals without building the report: ``bytes_streamed``,
        ``disk_bytes_read``, ``file_bytes_read``; after ``remove()``, the totals the run ended
        with (its disk reads finished)."""
        return self._native.counters()

    def _check_active(self) -> None:
        if not self._native.active and self._native.report().get("executing", False):
            raise RuntimeError("this offload was removed; call enable_offload again")

    # -- diffusers-dynamic-offloader's result fields (DynamicOffloadApplyResult) --------------------------
    @property
    def route(self) -> str:
        """The route this offload took: dynamic, group_block, group_leaf, device or none."""
        return self._native.report().get("route", "dynamic")

    @property
    def should_move_to_execution_device(self) -> bool:
        """True when ddo placed nothing (plan mode, a disabled preset): the host moves the module."""
        return not self._native.report().get("executing", False)

    @property
    def event_payload(self) -> dict[str, Any]:
        """The JSON-safe report (the library's setup payload); see report()."""
        return self.report()

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return f"<ddo.OffloadResult {self.model_class} {state}>"


# ---------------------------------------------------------------------------------------------
# Gathering the model.
# ---------------------------------------------------------------------------------------------


def _kind(module: nn.Module) -> str:
    # SDNQ layers are classified by _gather first (their layout decides sdnq or other).
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "other"


def _is_plain(t: torch.Tensor) -> bool:
    # Parameters and plain tensors only: a tensor subclass (quantized wrappers, DTensor, lazy
    # UninitializedParameter, ...) has storage ddo cannot re-point safely.
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def _anchored(name: str) -> str:
    return "^" + "".join("\\" + c if c in _REGEX_SPECIALS else c for c in name) + "$"


def _gather(model: nn.Module) -> tuple[list[tuple], list[dict[str, str]], list[tuple]]:
    """The module tree for ddo_torch (``_C.enable_offload_tree``'s 8-tuples: name, class, kind,
    is_leaf, training, tensors, stock class, SDNQ layout code), the modules kept out of its
    hands (with reasons), and the SDNQ layers ddo runs with their layout codes."""
    entries: list[tuple] = []
    kept: list[dict[str, str]] = []
    sdnq_layers: list[tuple] = []
    for name, module in model.named_modules():
        slots = []
        refused = []
        for tname, p in module._parameters.items():
            if p is None:
                continue
            (slots if _is_plain(p) else refused).append((tname, p, True))
        for tname, b in module._buffers.items():
            if b is None:
                continue
            (slots if _is_plain(b) else refused).append((tname, b, False))
        if refused:
            names = ", ".join(f"{t} ({type(x).__name__})" for t, x, _ in refused)
            kept.append(
                {
                    "module": name,
                    "reason": f"tensor_subclass: {names}; left where the host put it",
                }
            )
        is_leaf = not any(child is not None for child in module._modules.values())
        layout = None
        # Before the Linear rule: sdnq's SDNQLinear subclasses nn.Linear, but its weight is packed.
        if _sdnq.is_sdnq_layer(module):
            code = _sdnq.sdnq_layout(module)
            kind = "other" if isinstance(code, str) else "sdnq"
            if kind == "sdnq":
                sdnq_layers.append((name, module, code))
                layout = code
            elif not refused:
                kept.append(
                    {
                        "module": name,
                        "reason": f"{code}; moved to the device whole, its own forward runs",
                        "placed": True,
                    }
                )
        else:
            kind = _kind(module)
        # A Linear subclass streams as a Linear; quantize= keeps it dense (C++ says why).
        stock = kind != "linear" or type(module) is nn.Linear
        entries.append((name, type(module).__qualname__, kind, is_leaf, module.training, slots,
                        stock, layout))
    return entries, kept, sdnq_layers


def _keep_in_fp32(model: nn.Module) -> list[str]:
    """The module names the model keeps at full precision (diffusers' and transformers'
    ``_keep_in_fp32_modules``), for OffloadOptions::keep_dense_modules: C++ matches them."""
    names = getattr(model, "_keep_in_fp32_modules", None) or []
    if isinstance(names, str):
        names = [names]
    return [n for n in names if isinstance(n, str)]


def _refuse_compiled(model: nn.Module) -> None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # pragma: no cover - dynamo unavailable
        OptimizedModule = ()  # type: ignore[assignment]
    if isinstance(model, OptimizedModule):
        raise RuntimeError(
            "enable_offload got a torch.compile'd module (OptimizedModule): ddo intercepts weight "
            "ops at the dispatcher, below what torch.compile traces, so a compiled graph would "
            "not see streamed weights; pass the original module (model._orig_mod) and do not "
            "compile it"
        )
    for name, module in model.named_modules():
        if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None):
            where = f"submodule {name!r}" if name else "the model"
            raise RuntimeError(
                f"enable_offload: {where} was compiled with torch.compile / Module.compile(); "
                "ddo's dispatcher-level interception is not visible to compiled graphs. Enable "
                "offload on an uncompiled model"
            )


def _check_type(name: str, value: Any, types: tuple, what: str) -> None:
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, not {value!r} ({type(value).__name__})")


def _check_text(name: str, value: Any) -> None:
    """A str argument that C++ receives must be text UTF-8 can carry: a lone surrogate
    ('\\ud800', from a mis-decoded file name) would fail in the binding with its signature."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{name}={value!r} is not valid text (character {e.start}, {value[e.start]!r}, is "
                "a lone surrogate); pass a name made of ordinary characters"
            ) from None


def _check_public_args(
    preset: Any, profile_name: Any, build_profile: Any, execution_device: Any, record_event: Any
) -> Optional[str]:
    """Type checks at the public API, naming the argument: without them pybind11
    answers with its private signature, and build_profile="false" would be true."""
    if preset is not None:
        _check_type("preset", preset, (str,), 'a preset name such as "auto" or None')
    if profile_name is not None:
        _check_type("profile_name", profile_name, (str,), 'a str such as "my-workload" or None')
    if isinstance(build_profile, bool) is False:
        raise TypeError(
            f"build_profile must be True or False, not {build_profile!r} "
            f"({type(build_profile).__name__}); a string such as 'false' would count as true"
        )
    if isinstance(execution_device, torch.device):
        execution_device = str(execution_device)
    for name, text in (("preset", preset), ("profile_name", profile_name),
                       ("execution_device", execution_device)):
        _check_text(name, text)
    if execution_device is not None:
        _check_type("execution_device", execution_device, (str,), 'a device such as "cuda:0"')
    if record_event is not None and not callable(record_event):
        raise TypeError(
            f"record_event must be callable(name, seconds, payload), not "
            f"{type(record_event).__name__}"
        )
    return execution_device


def _resolve_route(
    route: Optional[str],
    group_offload: Optional[bool],
    dynamic_offload: Optional[bool],
    offload_type: Optional[str],
) -> Optional[str]:
    """The diffusers-style route arguments as one ddo route (None: the settings decide); the
    rule is C++'s (ddo::core::resolve_route_arguments, config.h)."""
    if route is not None:
        _check_type("route", route, (str,), "a route name")
    if offload_type is not None:
        _check_type("offload_type", offload_type, (str,), "'block_level' or 'leaf_level'")
    as_bool = lambda flag: None if flag is None else bool(flag)  # noqa: E731
    return _C.resolve_route_arguments(
        route, as_bool(group_offload), as_bool(dynamic_offload), offload_type
    )


def _native_settings(
    preset: Optional[str],
    settings: Optional[DynamicOffloadSettings],
    config: Any,
    execution_device: Optional[str],
    env: Optional[Mapping[str, str]] = None,
    wsl: Optional[bool] = None,
) -> dict[str, Any]:
    """The settings arguments of ``_C.enable_offload_tree`` (and of the deferred loader, which
    pins for the device the later attach will use): preset=None means "DDO_PRESET, else auto",
    resolved through the settings loader; so is a replaced environment or a stated platform fact
    (the library's environ= / running_on_wsl=)."""
    if settings is None and (
        (config is None and preset is None) or env is not None or wsl is not None
    ):
        settings = DynamicOffloadSettings.from_env(preset, config, env=env, wsl=wsl)
        config = None
    return dict(
        preset=preset if preset is not None else "auto",
        settings=settings._native if settings is not None else None,
        config=_config_fields(config),
        execution_device=execution_device or "",
    )


def _enable(
    model: nn.Module,
    *,
    preset: Optional[str],
    profile_name: Optional[str],
    build_profile: bool,
    settings: Optional[DynamicOffloadSettings],
    config: Any,
    execution_device: Optional[str],
    record_event: Optional[RecordEvent],
    overrides: dict[str, Any],
    device: Any = None,
    label: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    wsl: Optional[bool] = None,
    load: Optional[dict[str, Any]] = None,
    quantize: Optional[str] = None,
) -> OffloadResult:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"enable_offload takes a torch.nn.Module, not {type(model).__name__}; for a "
            "diffusers pipeline use enable_pipeline_offload"
        )
    if settings is not None and config is not None:
        raise TypeError("pass either settings= or config=, not both")
    execution_device = _check_public_args(
        preset, profile_name, build_profile, execution_device, record_event
    )
    if settings is not None and not isinstance(settings, DynamicOffloadSettings):
        raise TypeError(
            f"settings must be a DynamicOffloadSettings, not {type(settings).__name__}"
        )
    if quantize is not None:
        _check_type("quantize", quantize, (str,), "\"fp8\", \"int8\" or None")
        # C++'s parse (ddo/sdnq/quantize_model.h): a ValueError naming the choices, before
        # anything else runs; "" for "none".
        quantize = quantize if _C.sdnq_quantize_type(quantize) else None
    prepared = _prepare(model, label, record_event, quantize=quantize)
    if prepared.jit and load is not None:
        raise TypeError("loading a checkpoint into a TorchScript module is not supported; "
                        "torch.jit.load the saved module, then call enable_offload on it")
    native_args = dict(
        _native_settings(preset, settings, config, execution_device, env, wsl),
        profile_name=profile_name or "",
        build_profile=build_profile,
        overrides=dict(overrides) or None,
        record_event=prepared.progress,
        device=device,
    )
    prepared.progress.start()
    try:
        # quantize= is C++'s, for both (OffloadOptions::quantize; Note [Quantized dense weights]
        # in torch/src/attach_quantize.cpp): each stock Linear's weight is served from a quantized
        # copy while the model keeps its modules, dtypes and dense weights.
        if prepared.jit:
            native = _C.enable_offload_jit(model, quantize=quantize or "", **native_args)
        else:
            native = _C.enable_offload_tree(prepared.model_class, prepared.entries, load=load,
                                            extra_skip_patterns=prepared.extra_skip,
                                            quantize=quantize or "",
                                            keep_dense_modules=prepared.keep_dense,
                                            **native_args)
    except BaseException:
        prepared.progress.close(failed=True)
        raise
    prepared.progress.close()
    return _finish(prepared, native)


class _Prepared:
    """One module as the Python glue gathered it for ddo._C (``_prepare``): its tree, the modules
    kept out of ddo's hands, its SDNQ layers and its progress line. No decisions: the settings,
    the route and the profile are C++'s."""

    def __init__(self, model: nn.Module, label: Optional[str],
                 record_event: Optional[RecordEvent]) -> None:
        self.model = model
        # A TorchScript module (torch.jit.trace / script / load) is a ScriptModule whose children
        # are RecursiveScriptModules, not nn.Linear: _gather would stream none of it. C++ reads
        # its TorchScript types instead (jit_bindings.cpp), as for a C++ program's
        # torch::jit::Module.
        self.jit = isinstance(model, torch.jit.ScriptModule)
        self.model_class = model_class_name(model)
        self.entries, self.kept, self.sdnq_layers = ([], [], []) if self.jit else _gather(model)
        # Kept modules stay where they are whatever the settings say: C++ appends these after it
        # resolves skip_modules_pattern (OffloadOptions::extra_skip_patterns).
        self.extra_skip = [_anchored(k["module"]) for k in self.kept if not k.get("placed")]
        self.keep_dense = [] if self.jit else _keep_in_fp32(model)
        self.progress = SetupProgress(label or self.model_class, record_event)

    def component(self, name: str) -> dict[str, Any]:
        """The component's arguments for ``_C.enable_pipeline_offload``."""
        return dict(
            name=name,
            model_class="" if self.jit else self.model_class,
            entries=self.entries,
            jit=self.model if self.jit else None,
            extra_skip_patterns=self.extra_skip,
            keep_dense_modules=self.keep_dense,
            record_event=self.progress,
        )


def _prepare(
    model: nn.Module,
    label: Optional[str],
    record_event: Optional[RecordEvent],
    quantize: Optional[str] = None,
) -> _Prepared:
    """Gathers ``model`` for ddo._C after the checks every attach makes: a module without an
    active offload that is not torch.compile'd."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"enable_offload takes a torch.nn.Module, not {type(model).__name__}; for a "
            "diffusers pipeline use enable_pipeline_offload"
        )
    existing = getattr(model, _ATTR, None)
    if isinstance(existing, OffloadResult) and existing.active:
        if quantize is not None:
            attached = existing._native.report()["quantized_compute"]["quantize"]
            raise RuntimeError(
                f"this module already has an active ddo offload (quantize={attached!r}); "
                f"quantize={quantize!r} is applied when an offload attaches, not on top of one: "
                "call remove_offload(model) first, then enable_offload(model, quantize=...)"
            )
        raise RuntimeError(
            "this module already has an active ddo offload; call remove_offload(model) first"
        )
    if not isinstance(model, torch.jit.ScriptModule):
        _refuse_compiled(model)
    return _Prepared(model, label, record_event)


def _finish(prepared: _Prepared, native: "_C.Offload") -> OffloadResult:
    """The OffloadResult over an attached ``native`` offload: SDNQ forwards, the adapter watch,
    and the model's ``_ddo_offload`` attribute."""
    model = prepared.model
    result = OffloadResult(model, native, prepared.model_class, prepared.kept,
                           prepared.progress.events)
    executing = native.report().get("executing", False)
    result._install_sdnq_forwards(prepared.sdnq_layers, executing)
    if executing and not prepared.jit:
        result._watch = _adapters.watch(model, native.report().get("execution_device", "cpu"))
    try:
        object.__setattr__(model, _ATTR, result)
    except Exception:  # a module that forbids attributes still works through the result
        pass
    return result


# ---------------------------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------------------------


def enable_offload(
    model: nn.Module,
    preset: Optional[str] = None,
    profile_name: Optional[str] = None,
    build_profile: bool = False,
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig | Mapping[str, Any]] = None,
    execution_device: Optional[str] = None,
    record_event: Optional[RecordEvent] = None,
    *,
    component: str = "model",
    route: Optional[str] = None,
    group_offload: Optional[bool] = None,
    dynamic_offload: Optional[bool] = None,
    offload_type: Optional[str] = None,
    use_stream: Optional[bool] = None,
    record_stream: Optional[bool] = None,
    group_low_cpu_mem_usage: Optional[bool] = None,
    num_blocks_per_group: Optional[int] = None,
    offload_device: Any = "cpu",
    low_cpu_mem_usage: bool = True,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    dynamic_event_name: Optional[str] = None,
    group_event_name: Optional[str] = None,
    quantize: Optional[str] = None,
    **config_overrides: Any,
) -> OffloadResult:
    """Takes over weight placement of ``model`` (a transformer, UNet, VAE, text encoder, ...):
    an ``nn.Module``, or a TorchScript module (``torch.jit.ScriptModule``: traced, scripted or
    loaded), whose Linear/Conv/Embedding weights ddo finds by TorchScript type.

    preset: ``auto`` (= one_shot_fast), low_ram_safe, wsl_compat, warm_process,
        diffusers_offload_compat, diffusers_leaf_offload_compat, off; None (the default) =
        DDO_PRESET when set, else auto.
    profile_name: the named workload profile; None disables profile lookup.
    build_profile: True for the calibration run (wrap the measured region in profile_run()).
    settings: a resolved ``DynamicOffloadSettings`` (overrides still apply), or
    config: an explicit ``DynamicOffloadConfig`` (replaces defaults, preset and DDO_* variables).
    execution_device: "cuda:N", or "sim" for the host simulation; default the config's (cuda:0).
    record_event: ``callable(name, seconds, payload)`` receiving setup events.
    config_overrides: DynamicOffloadConfig fields by name; unknown names raise TypeError.
    quantize: ``"fp8"`` or ``"int8"``: each ``nn.Linear`` that qualifies computes from a copy of
        its weight quantized to one scale per output row, with the card's low-precision GEMM
        (fp8: sm_89+, int8: sm_80+; elsewhere it dequantizes), and that copy is what ddo places
        and streams: about half the bytes of bf16. The model keeps its modules, dtypes, hooks,
        training flags and dense weights (reads outside the Linear's own ops see the dense
        values; an in-place change such as ``load_state_dict`` is quantized again before the
        next forward), and ``remove()`` gives it back unchanged; host memory holds the dense
        model and the copy. ``report()["quantized_compute"]`` gives each quantized layer's path
        and why, and the Linears kept dense with why (subclasses of nn.Linear, LoRA adapters,
        tied or float64 weights, small or unaligned shapes, ``_keep_in_fp32_modules``). The
        same for a TorchScript module. On a module with an active offload it is refused. A
        named profile is keyed by name and model class only: a bf16 and an fp8 run under one
        name share it (recalibrate, or use another name).

    diffusers-dynamic-offloader's keywords, with its meaning (README "Drop-in for diffusers-dynamic-
    offloader"): ``component`` (its policy, DDO_<COMPONENT>_ROUTE, picks the route; also the
    progress label), ``route`` (auto, dynamic_offload, linear_convolution,
    diffusers_group_offload, none), ``group_offload`` / ``dynamic_offload`` / ``offload_type``
    (block_level, leaf_level), ``use_stream`` (False: no side streams), ``running_on_wsl``,
    ``environ`` (replaces the process environment), ``use_environment`` (False: no DDO_*
    variables), ``apply_hook`` (False: plan only, nothing moves), ``offload_device`` (only the
    CPU: ddo streams from host memory). ``record_stream``, ``low_cpu_mem_usage``,
    ``group_low_cpu_mem_usage`` and the event names are accepted and have no effect: ddo's
    staging owns its streams and memory, and its events have fixed names.
    ``num_blocks_per_group`` must be 1 (ddo's block route streams one block per group).

    Errors: ValueError for bad values, TypeError for arguments of the wrong type (naming the
    argument), RuntimeError for states that do not allow the call (e.g. calibrating on a device
    that cannot measure, a torch.compile'd model), torch.OutOfMemoryError when the device is
    full. A KeyboardInterrupt during setup leaves the model as it was.
    """
    overrides = dict(config_overrides)
    chosen = _resolve_route(route, group_offload, dynamic_offload, offload_type)
    _check_type("component", component, (str,), "a component name such as 'transformer'")
    if num_blocks_per_group is not None and num_blocks_per_group != 1:
        raise ValueError(
            f"num_blocks_per_group={num_blocks_per_group!r} is not supported: ddo's block route "
            "streams one block per group (its prefetch window overlaps the next ones); pass 1"
        )
    if offload_device is not None and str(offload_device) != "cpu":
        raise ValueError(
            f"offload_device={offload_device!r} is not supported: ddo streams weights from host "
            "memory; pass 'cpu'"
        )
    if use_stream is not None:
        _check_type("use_stream", use_stream, (bool,), "True or False")
        overrides.setdefault("use_side_streams", use_stream)
    if not apply_hook:
        overrides["execution_mode"] = "plan"
    env = environ
    if not use_environment:
        env = {}
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"environ must be a mapping of str to str, not {type(env).__name__}")
    if chosen is None and component != "model":
        resolved = settings
        if resolved is None:
            resolved = DynamicOffloadSettings.from_env(
                preset, config, env=env, wsl=running_on_wsl
            )
            settings, config, env, running_on_wsl = resolved, None, None, None
        chosen = resolved.policy_for(component)["route"]
    if chosen is not None:
        overrides["route"] = chosen
    return _enable(
        model,
        preset=preset,
        profile_name=profile_name,
        build_profile=build_profile,
        settings=settings,
        config=config,
        execution_device=execution_device,
        record_event=record_event,
        overrides=overrides,
        label=component if component != "model" else None,
        env=dict(env) if env is not None else None,
        wsl=running_on_wsl,
        quantize=quantize,
    )


def remove_offload(model_or_result: nn.Module | OffloadResult) -> bool:
    """Restores a model offloaded by enable_offload. Returns False when none was attached."""
    if isinstance(model_or_result, OffloadResult):
        model_or_result.remove()
        return True
    result = getattr(model_or_result, _ATTR, None)
    if not isinstance(result, OffloadResult):
        return False
    result.remove()
    return True
