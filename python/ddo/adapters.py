"""Adapters (LoRA) and writes to streamed weights while an offload is attached.

Three things the user does to an attached model, as diffusers and PEFT do them
(docs/guide.md, "LoRA and other adapters"):

* ``weight.data += delta`` (PEFT's merge, ``fuse_lora``) and ``weight.data = merged`` (its safe
  merge, ``unfuse_lora``): a streamed Parameter's class becomes ``StreamedParameter`` while
  attached, whose ``.data`` shares the parameter's version counter, so the write is seen by the
  version gate of Note [Weights changed in place] (torch/src/intercept_common.h), and whose
  ``.data = t`` copies ``t`` into ddo's host copy (or refuses, naming the parameter, when ``t``
  has another shape or dtype). Nothing lands on the device: the next acquire copies the new bytes.
* ``load_lora_adapter`` after ``enable_offload``: modules registered into the attached tree are
  noted by torch's global registration hooks, which give the root a forward pre-hook until its
  next forward (no hook otherwise: nothing per op or per step), and that forward places the adapter
  weights (Note [Adapter modules] in core/src/planner_patterns.cpp) on the execution device,
  counted in ``report()["python"]["adapters_added"]``; any other tensor added after the attach is
  an error that says to attach again.
* ``remove()`` gives both back: the Parameter classes, and the added adapter weights on the
  device they came from.

    offload = ddo.enable_offload(transformer, execution_device="cuda")
    transformer.load_lora_adapter(state_dict, adapter_name="style")  # placed at the next forward
    transformer.fuse_lora()  # the fused values reach the streamed copies
    offload.report()["python"]["adapters_added"]  # {"tensors": 4, "bytes": 8192}
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from . import _C

def _to_host(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


class HostData(torch.Tensor):
    """What ``.data`` of a streamed Parameter gives: its host copy (a CPU tensor over ddo's host
    bytes, sharing the Parameter's version counter), where an op's other tensors on the
    execution device are brought to the host first. PEFT's merge computes a LoRA delta where the
    adapters live (the GPU) and adds it in place (``weight.data += delta``), or adds it to a
    clone and assigns that; the write lands in the host copy and the next forward copies it,
    costing no device memory beyond the delta. Results of its ops are HostData too, so a clone
    keeps the rule. Only ``.data`` returns one: a forward reads the Parameter itself, and pays
    nothing for this."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Attribute reads (.device) come here too: the subclass is off for everything below.
        with torch._C.DisableTorchFunctionSubclass():
            host = next((a for a in args if isinstance(a, HostData)), None)
            if host is not None:
                device = host.device
                args = tuple(_to_host(a, device) for a in args)
                kwargs = {k: _to_host(v, device) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not isinstance(out, HostData) and out.is_cpu:
                out = out.as_subclass(HostData)
        return out


class StreamedParameter(nn.Parameter):
    """The class of a streamed Parameter while its offload is attached (an nn.Parameter).

    ``.data`` is a :class:`HostData` over ``detach()``: the same storage and, unlike torch's
    ``.data``, the same version counter, so an in-place write through it reaches the next
    forward, with operands from the execution device brought to the host. ``.data = t`` writes
    ``t``'s values into ddo's host copy; a ``t`` of another shape or dtype is refused, naming
    the parameter."""

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor._make_subclass(HostData, torch.Tensor.detach(self), False)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _assign(self, value)


def _assign(param: nn.Parameter, value: Any) -> None:
    if not _C.is_managed(param):  # not streamed any more: torch's own assignment
        torch._C.TensorBase.data.__set__(param, value)
        return
    name = param.__dict__.get("_ddo_name", "a streamed parameter")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}.data must be set to a tensor, not {type(value).__name__}")
    if value.shape != param.shape or value.dtype != param.dtype:
        raise RuntimeError(
            f"ddo: '{name}.data = t' would give a streamed weight of shape "
            f"{tuple(param.shape)} and dtype {param.dtype} a tensor of shape {tuple(value.shape)} "
            f"and dtype {value.dtype}; ddo serves it from its host copy, which keeps its shape "
            "and dtype. Call remove() on the offload, change the weight, then enable_offload "
            "again"
        )
    host = torch.Tensor.detach(param)
    if (value.data_ptr() == host.data_ptr() and value.stride() == host.stride()
            and value.device == host.device):
        # `weight.data += delta` ends in `weight.data = <the same host copy>`: the in-place op
        # already wrote it and moved the version counter; copying it onto itself would cost one
        # more pass over the weight's bytes per layer of a fuse.
        return
    with torch.no_grad():
        # A write into the host copy through a view that shares the version counter: the next
        # op that reads the weight sees the change (Note [Weights changed in place]).
        host.copy_(value)


# -- modules added after the attach ---------------------------------------------------------------

# The attached trees being watched (_Watch objects); torch's registration hooks are installed while
# this is not empty.
_watches: "weakref.WeakSet[_Watch]" = weakref.WeakSet()
_hook_handles: list = []


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    for watch in list(_watches):
        if module in watch.known_modules:
            watch.mark_dirty()


def _install_hooks() -> None:
    if _hook_handles:
        return
    mod = torch.nn.modules.module
    _hook_handles.append(mod.register_module_module_registration_hook(_on_registration))
    _hook_handles.append(mod.register_module_parameter_registration_hook(_on_registration))
    _hook_handles.append(mod.register_module_buffer_registration_hook(_on_registration))


def _remove_hooks() -> None:
    while _hook_handles:
        _hook_handles.pop().remove()


class _Watch:
    """One attached model: its streamed Parameters' classes, and the tensors added since."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.model = weakref.ref(model)
        self.known_modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet(model.modules())
        # id -> weak reference: a WeakSet would compare two tensors with ==, which is elementwise.
        self.known_tensors: dict[int, weakref.ref] = {}
        self.dirty = False
        self.streamed: list[tuple[nn.Parameter, type]] = []
        # Added adapter tensors and where they were: (module, "_parameters" | "_buffers", key,
        # original device).
        self.added: list[tuple[nn.Module, str, str, torch.device]] = []
        self.added_bytes = 0
        for mname, module in model.named_modules():
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                self._know(p)
                if _C.is_managed(p) and type(p) is nn.Parameter:
                    p.__class__ = StreamedParameter
                    p.__dict__["_ddo_name"] = f"{mname}.{pname}" if mname else pname
                    self.streamed.append((p, nn.Parameter))
            for b in module._buffers.values():
                if b is not None:
                    self._know(b)
        self.pre_hook: Any = None

    def _know(self, t: torch.Tensor) -> None:
        self.known_tensors[id(t)] = weakref.ref(t)

    def _known(self, t: torch.Tensor) -> bool:
        ref = self.known_tensors.get(id(t))
        return ref is not None and ref() is t

    def mark_dirty(self) -> None:
        # The root's pre-hook exists only between a registration and the next forward that
        # places what was added: a model nobody changes runs with no Python hook at all.
        self.dirty = True
        model = self.model()
        if self.pre_hook is None and model is not None:
            self.pre_hook = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.place_added()

    def place_added(self) -> None:
        """Places the adapter tensors added since the attach on the execution device; throws,
        naming them, for any other tensor added."""
        model = self.model()
        if model is None:
            return
        others: list[str] = []
        for mname, module in model.named_modules():
            self.known_modules.add(module)
            for kind in ("_parameters", "_buffers"):
                for key, t in getattr(module, kind).items():
                    if t is None or self._known(t) or _C.is_managed(t):
                        continue
                    # Note [Adapter modules] (core/src/planner_patterns.cpp): the module that
                    # holds the tensor decides, by the rule the planner and quantize= use.
                    if not _C.is_adapter_module(mname):
                        others.append(f"{mname}.{key}" if mname else key)
                        continue
                    self._place(module, kind, key, t)
        if not others:  # else every forward raises until the user attaches again
            self.dirty = False
            if self.pre_hook is not None:
                self.pre_hook.remove()
                self.pre_hook = None
            return
        shown = ", ".join(others[:8]) + (", ..." if len(others) > 8 else "")
        raise RuntimeError(
            f"ddo: {len(others)} tensor(s) were added to the model after enable_offload "
            f"({shown}); ddo places only adapter (LoRA) weights added later. Call remove() on "
            "the offload and enable_offload again, so that the plan includes them"
        )

    def _place(self, module: nn.Module, kind: str, key: str, t: torch.Tensor) -> None:
        original = t.device
        if kind == "_parameters":
            t.data = t.data.to(self.device)
            placed = t
        else:
            placed = t.to(self.device)
            module._buffers[key] = placed
        self._know(placed)
        self.added.append((module, kind, key, original))
        self.added_bytes += placed.numel() * placed.element_size()

    def restore(self) -> None:
        if self.pre_hook is not None:
            self.pre_hook.remove()
            self.pre_hook = None
        for p, cls in self.streamed:
            p.__class__ = cls
            p.__dict__.pop("_ddo_name", None)
        self.streamed = []
        for module, kind, key, original in self.added:
            t = getattr(module, kind).get(key)
            if t is None:
                continue  # deleted since (delete_adapters, unload_lora)
            if kind == "_parameters":
                t.data = t.data.to(original)
            else:
                module._buffers[key] = t.to(original)
        self.added = []

    def report(self) -> dict[str, int]:
        return {"tensors": len(self.added), "bytes": self.added_bytes}


def watch(model: nn.Module, execution_device: str) -> _Watch:
    """Starts watching an attached model (OffloadResult keeps the result; ``unwatch`` ends it)."""
    device = torch.device("cpu" if execution_device.startswith("sim") else execution_device)
    w = _Watch(model, device)
    _watches.add(w)
    _install_hooks()
    return w


def unwatch(w: Optional[_Watch]) -> None:
    if w is None:
        return
    w.restore()
    _watches.discard(w)
    if not _watches:
        _remove_hooks()
