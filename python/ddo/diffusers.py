"""enable_pipeline_offload: one settings object over a diffusers pipeline's components.

Every ``nn.Module`` component (transformer, unet, vae, text_encoder, ...) takes the route its
policy names -- ``DDO_<COMPONENT>_ROUTE`` (dynamic, group_block, group_leaf, device, none) or the
settings' own route -- and is offloaded by the same C++ enable_offload as a single model, on one
shared execution device. Schedulers, tokenizers, feature extractors and other non-modules are
skipped and listed. The profile options apply to one component: ``profile_component``, else the
first on the dynamic route (the denoiser in diffusers' component order)::

    offload = ddo.enable_pipeline_offload(pipe, profile_name="my-workload",
                                          build_profile=calibrate)
    with offload.profile_run() as profile_report:
        image = pipe(prompt, num_inference_steps=28).images[0]

The routing (which component takes which route, which one is profiled, the shared device) is
C++'s ``route_pipeline`` (ddo/torch/pipeline_offload.h), the rule
ddo::adapter::enable_pipeline_offload follows too; Python gathers the components and calls it.
The per-component work is the C++ enable_offload. A TorchScript component (a traced or
loaded ``torch.jit.ScriptModule`` is an nn.Module too) takes the same route through
``enable_offload``'s TorchScript path.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from . import _C
from .api import OffloadResult, ProfileRunContext, RecordEvent, _check_public_args, _enable
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
    """The offloads of a pipeline's components; ``profile_run()`` measures the profiled one."""

    def __init__(
        self,
        components: dict[str, Optional[OffloadResult]],
        routes: dict[str, str],
        skipped: dict[str, str],
        profiled: str,
        modules: Optional[dict[str, nn.Module]] = None,
    ) -> None:
        self.components = components  # name -> OffloadResult, None on the "none" route
        self.routes = routes
        self.skipped = skipped
        self.profiled_component = profiled
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
        offload = self.components.get(self.profiled_component) if self.profiled_component else None
        if offload is None:
            raise RuntimeError(
                "profile_run() on a pipeline without a component on the dynamic route; route the "
                "denoiser (e.g. transformer) to dynamic offload"
            )
        return offload.profile_run()

    def generation(self) -> "GenerationContext":
        """``with offloads.generation() as gen:`` -- one generation's report in ``gen.report``.

        Each component's forward is one stage (timed with the device synchronized at its
        boundaries); the report gives seconds per stage and in all, the bytes each component
        streamed and read from disk, peak VRAM and peak RSS (ddo/torch/generation.h).
        """
        return GenerationContext(self)

    def remove(self) -> None:
        """Restores every component, in reverse order."""
        for offload in reversed(list(self.components.values())):
            if offload is not None:
                offload.remove()

    def report(self) -> dict[str, Any]:
        comps = {}
        for name, offload in self.components.items():
            one = offload.report() if offload is not None else {}
            one["route_policy"] = self.routes[name]
            comps[name] = one
        return {
            "profiled_component": self.profiled_component,
            "components": comps,
            "skipped": dict(self.skipped),
        }

    def summary(self) -> str:
        out = []
        for name, offload in self.components.items():
            out.append(f"[{name}] route {self.routes[name]}\n")
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
    profile_component: Optional[str] = None,
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

    Arguments as for ``enable_offload``; ``profile_component`` names the component the profile
    options apply to (default: the first on the dynamic route). A failure on one component
    restores the ones already done. The result also reads as a dict of component name ->
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
    if settings is None:
        settings = DynamicOffloadSettings.from_env(
            preset,
            config,
            env=dict(env) if env is not None else None,
            wsl=running_on_wsl,
            **config_overrides,
        )
    elif not isinstance(settings, DynamicOffloadSettings):
        raise TypeError(
            f"settings must be a DynamicOffloadSettings, not {type(settings).__name__}"
        )
    elif config_overrides:
        settings = settings.with_overrides(**config_overrides)

    # The routing rule is C++'s (route_pipeline, ddo/torch/pipeline_offload.h), the one
    # ddo::adapter::enable_pipeline_offload follows: Python only gathered the components.
    routing = _C.route_pipeline(
        settings._native, list(modules), profile_component or "", execution_device or ""
    )
    routes = {c["name"]: c["route"] for c in routing["components"]}
    # Each component's settings (its route, the shared device, the profile options on the
    # profiled one only) are C++'s too: PipelineRouting::settings_for.
    component_settings = dict(zip(routes, routing["settings"]))
    profiled = routing["profiled"]
    device_name = routing["execution_device"]
    device = (
        _C.open_execution_device(device_name, settings.config.to_dict())
        if routing["open_device"]
        else None
    )

    done: dict[str, Optional[OffloadResult]] = {}
    try:
        for name, module in modules.items():
            route = routes[name]
            if route == "none":
                done[name] = None
                continue
            is_profiled = name == profiled
            done[name] = _enable(
                module,
                preset=None,
                profile_name=profile_name if is_profiled else None,
                build_profile=build_profile if is_profiled else False,
                settings=DynamicOffloadSettings(component_settings[name]),
                config=None,
                execution_device=device_name,
                record_event=record_event,
                overrides={},
                device=device,
                label=name,
            )
    except BaseException:
        for offload in reversed(list(done.values())):
            if offload is not None:
                offload.remove()
        raise
    return PipelineOffloadResult(done, routes, skipped, profiled, modules)
