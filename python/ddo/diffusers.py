"""enable_pipeline_offload: one settings object over a diffusers pipeline's components.

Every ``nn.Module`` component (transformer, unet, vae, text_encoder, ...) takes the route its
policy names -- ``DDO_<COMPONENT>_ROUTE`` (dynamic, group_block, group_leaf, device, none) or the
settings' own route -- and is offloaded by the same C++ enable_offload as a single model, on one
shared execution device. Schedulers, tokenizers, feature extractors and other non-modules are
skipped and listed. The profile options apply to the pipeline's denoisers on the dynamic route
(``transformer``, ``transformer_2``, ``unet``, ``prior``, ...; else the first component on the
dynamic route; ``profile_component`` names one or a list): the first keeps ``profile_name``, each
further one gets ``<profile_name>.<component>``, and one ``profile_run()`` measures them all and
splits the measured room between them::

    offload = ddo.enable_pipeline_offload(pipe, profile_name="wan-5s",
                                          build_profile=calibrate)
    with offload.profile_run() as profile_report:
        video = pipe(prompt, num_inference_steps=40).frames[0]
    profile_report["components"]["transformer_2"]["name"]   # "wan-5s.transformer_2"

The loop is C++'s (``enable_pipeline_components``, ddo/torch/enable_offload.h; the routing rule
``route_pipeline`` in ddo/torch/pipeline_offload.h): Python gathers each component as
``enable_offload`` does (its module tree, the modules it keeps, its progress line) and makes one
call, which resolves the settings with the overrides, routes, opens the shared device, attaches
each component and restores those done when one fails. ``PipelineOffloadResult`` is a view over
the C++ result. A TorchScript component (a traced or loaded ``torch.jit.ScriptModule`` is an
nn.Module too) takes the same route through ``enable_offload``'s TorchScript path.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from . import _C
from .api import (
    OffloadResult,
    ProfileRunContext,
    RecordEvent,
    _check_public_args,
    _finish,
    _native_settings,
    _prepare,
)
from .config import DynamicOffloadConfig, DynamicOffloadSettings
from .generation import GenerationMeter

__all__ = [
    "GenerationContext", "PipelineOffloadResult", "enable_pipeline_offload", "pipeline_components",
]


def pipeline_components(pipeline: Any) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """(name -> nn.Module in the pipeline's order, name -> why skipped) for a pipeline.

    A diffusers ``DiffusionPipeline`` lists its parts in ``.components``; any other object is
    read through its attributes (``vars``), so a plain namespace of modules works too.
    """
    raw = getattr(pipeline, "components", None)
    if not isinstance(raw, Mapping):
        if isinstance(pipeline, Mapping):
            raw = pipeline
        elif isinstance(pipeline, nn.Module) or not hasattr(pipeline, "__dict__"):
            raise TypeError(
                "enable_pipeline_offload takes a pipeline (a diffusers DiffusionPipeline, an "
                f"object with nn.Module attributes or a dict of them), not {type(pipeline).__name__}"
                "; for one model use enable_offload"
            )
        else:
            raw = {k: v for k, v in vars(pipeline).items() if not k.startswith("_")}
    modules: dict[str, nn.Module] = {}
    skipped: dict[str, str] = {}
    for name, value in raw.items():
        if isinstance(value, nn.Module):
            modules[name] = value
        elif value is None:
            skipped[name] = "absent (None)"
        else:
            skipped[name] = f"not an nn.Module ({type(value).__name__})"
    return modules, skipped


class PipelineOffloadResult:
    """A view over the C++ PipelineOffload (``ddo._C.enable_pipeline_offload``): the offloads of
    a pipeline's components; ``profile_run()`` measures every profiled denoiser in one region."""

    def __init__(
        self,
        native: "_C.PipelineOffload",
        components: dict[str, Optional[OffloadResult]],
        skipped: dict[str, str],
        modules: Optional[dict[str, nn.Module]] = None,
    ) -> None:
        self._native = native
        self.components = components  # name -> OffloadResult, None on the "none" route
        self.routes = {name: native.route_of(name) for name in native.component_names()}
        self.skipped = skipped
        # The components the profile options apply to (the denoisers) and their profile names.
        self.profiled_components = list(native.profiled_components)
        self.profiled_component = self.profiled_components[0] if self.profiled_components else ""
        self.profile_names = {n: native.profile_name_of(n) for n in self.profiled_components}
        self.modules = dict(modules or {})  # name -> the component module, every route

    # A read-only mapping of component name -> OffloadResult, as diffusers-dynamic-offloader's
    # enable_pipeline_offload returns a dict of its results.
    def __getitem__(self, name: str) -> Optional[OffloadResult]:
        return self.component(name)

    def __iter__(self):
        return iter(self.components)

    def __len__(self) -> int:
        return len(self.components)

    def __contains__(self, name: object) -> bool:
        return name in self.components

    def keys(self):
        return self.components.keys()

    def values(self):
        return self.components.values()

    def items(self):
        return self.components.items()

    def get(self, name: str, default: Any = None) -> Optional[OffloadResult]:
        return self.components.get(name, default)

    def component(self, name: str) -> Optional[OffloadResult]:
        if name not in self.components:
            raise _C.NotFoundError(
                f"pipeline has no offloaded component {name!r}; components: "
                f"{', '.join(self.components)}"
            )
        return self.components[name]

    def profile_run(self) -> ProfileRunContext:
        """One measured region over every profiled denoiser (PipelineOffload::profile_run): its
        report is the first denoiser's, with ``report["components"][name]`` for each."""
        return ProfileRunContext(self._native)

    def generation(self) -> "GenerationContext":
        """``with offloads.generation() as gen:`` -- one generation's report in ``gen.report``.

        Each component's forward is one stage (timed with the device synchronized at its
        boundaries); the report gives seconds per stage and in all, the bytes each component
        streamed and read from disk, peak VRAM and peak RSS (ddo/torch/generation.h).
        """
        return GenerationContext(self)

    def remove(self) -> None:
        """Restores every component, in reverse order (PipelineOffload::remove), then each
        result's Python side (SDNQ forwards, the adapter watch)."""
        self._native.remove()
        for offload in reversed(list(self.components.values())):
            if offload is not None:
                offload.remove()

    def report(self) -> dict[str, Any]:
        r = self._native.report()
        for name, offload in self.components.items():
            if offload is not None:
                r["components"][name] = dict(offload.report(), route_policy=self.routes[name])
        r["skipped"] = dict(self.skipped)
        return r

    def summary(self) -> str:
        out = []
        for name, offload in self.components.items():
            profile = self.profile_names.get(name)
            named = f", profile {profile!r}" if profile else ""
            out.append(f"[{name}] route {self.routes[name]}{named}\n")
            if offload is not None:
                out.append(offload.summary())
        for name, why in self.skipped.items():
            out.append(f"[{name}] skipped: {why}\n")
        return "".join(out)

    def __repr__(self) -> str:
        routes = ", ".join(f"{k}={v}" for k, v in self.routes.items())
        return f"<ddo.PipelineOffloadResult {routes}>"


class GenerationContext:
    """``with offloads.generation() as gen: pipe(...)`` -- see PipelineOffloadResult.generation.

    While open, a forward pre-hook and a forward hook on each component module begin and end its
    stage in the C++ GenerationMeter; on exit the hooks are removed and ``report`` (a dict) holds
    the generation's report, also when the block raised.
    """

    def __init__(self, offloads: PipelineOffloadResult) -> None:
        self._offloads = offloads
        self._meter: Optional[GenerationMeter] = None
        self._hooks: list[Any] = []
        self.report: dict[str, Any] = {}

    def __enter__(self) -> "GenerationContext":
        if self._meter is not None:
            raise RuntimeError("this generation() context is already open")
        self._meter = GenerationMeter(self._offloads.components)
        self.report.clear()
        meter = self._meter
        for name, module in self._offloads.modules.items():
            def begin(_module, _args, stage=name):
                meter.begin_stage(stage)

            def end(_module, _args, _output, stage=name):
                meter.end_stage(stage)

            self._hooks.append(module.register_forward_pre_hook(begin))
            self._hooks.append(module.register_forward_hook(end, always_call=True))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        meter, self._meter = self._meter, None
        if meter is not None:
            self.report.update(meter.finish())
        return False


def enable_pipeline_offload(
    pipeline: Any,
    preset: Optional[str] = None,
    profile_name: Optional[str] = None,
    build_profile: bool = False,
    settings: Optional[DynamicOffloadSettings] = None,
    config: Optional[DynamicOffloadConfig | Mapping[str, Any]] = None,
    execution_device: Optional[str] = None,
    record_event: Optional[RecordEvent] = None,
    profile_component: Optional[str | list[str]] = None,
    *,
    components: Any = None,
    offload_device: Any = "cpu",
    low_cpu_mem_usage: bool = True,
    running_on_wsl: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    use_environment: bool = True,
    apply_hook: bool = True,
    **config_overrides: Any,
) -> PipelineOffloadResult:
    """Offloads every nn.Module component of ``pipeline`` with one settings object.

    Arguments as for ``enable_offload``; ``profile_component`` names the component (or a list of
    components) the profile options apply to (default: the denoisers on the dynamic route, else
    the first component on the dynamic route); the first keeps ``profile_name``, each further one
    is profiled as ``<profile_name>.<component>`` (``result.profile_names``). A failure on one
    component restores the ones already done. The result also reads as a dict of component name ->
    OffloadResult (diffusers-dynamic-offloader returns a dict).

    diffusers-dynamic-offloader's keywords: ``components`` (a mapping of name -> module, or the names of
    the pipeline's components to handle), ``running_on_wsl``, ``environ``, ``use_environment``,
    ``apply_hook`` and ``offload_device`` as for ``enable_offload``; ``low_cpu_mem_usage`` is
    accepted and has no effect.
    """
    execution_device = _check_public_args(
        preset, profile_name, build_profile, execution_device, record_event
    )
    modules, skipped = pipeline_components(pipeline)
    if components is not None:
        if isinstance(components, Mapping):
            modules = {k: v for k, v in components.items() if isinstance(v, nn.Module)}
        else:
            names = list(components)
            missing = [n for n in names if n not in modules]
            if missing:
                raise _C.NotFoundError(
                    f"components {missing} are not nn.Module components of the pipeline; "
                    f"components: {', '.join(modules)}"
                )
            modules = {n: modules[n] for n in names}
    if offload_device is not None and str(offload_device) != "cpu":
        raise ValueError(
            f"offload_device={offload_device!r} is not supported: ddo streams weights from host "
            "memory; pass 'cpu'"
        )
    if not apply_hook:
        config_overrides["execution_mode"] = "plan"
    env = {} if not use_environment else environ
    if settings is not None and config is not None:
        raise TypeError("pass either settings= or config=, not both")
    if settings is not None and not isinstance(settings, DynamicOffloadSettings):
        raise TypeError(
            f"settings must be a DynamicOffloadSettings, not {type(settings).__name__}"
        )

    # Python gathers each component (no decisions); C++ resolves the settings with the
    # overrides, routes, opens the shared device, attaches each component on its route and
    # restores those done when one fails (Note [The pipeline loop] in
    # torch/src/pipeline_offload.cpp).
    prepared = {
        name: _prepare(module, name, record_event) for name, module in modules.items()
    }
    native = _C.enable_pipeline_offload(
        [p.component(name) for name, p in prepared.items()],
        **_native_settings(preset, settings, config, execution_device,
                           dict(env) if env is not None else None, running_on_wsl),
        overrides=dict(config_overrides) or None,
        profile_name=profile_name or "",
        build_profile=build_profile,
        profile_component=profile_component,
    )
    try:
        done = {
            name: None if native.component(name) is None
            else _finish(prepared[name], native.component(name))
            for name in modules
        }
    except BaseException:
        native.remove()
        raise
    return PipelineOffloadResult(native, done, skipped, modules)
