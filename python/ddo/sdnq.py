"""SDNQ layers under ddo: recognising them, their layout code, and the forward ddo runs.

A layer quantized by SD.Next's ``sdnq`` package (``SDNQLinear``, a subclass of ``nn.Linear``)
carries ``forward_func`` and ``sdnq_dequantizer`` and its tensors under the package's names
(weight, scale, zero_point, svd_up, svd_down, bias). ddo streams those tensors as one unit per
layer and, while the offload is active, replaces the layer's forward by the ``ddo::sdnq_linear``
op: dequantize on the device (one kernel), then linear — the package's own dequantize path,
bit for bit. ``sdnq`` itself is never imported here: everything is read off the module.

Layouts ddo does not run (Hadamard rotation, codebooks, double-quantized scales, bit widths other
than 4 and 8, convolutions and embeddings) keep their own forward: the Python glue gives them
kind "other", so their tensors are moved to the device once, whole, and the report lists why.

    code = sdnq_layout(layer)            # list[int] for ddo::sdnq_linear, or a reason (str)
    y = torch.ops.ddo.sdnq_linear(x, layer.weight, layer.scale, None, None, None, layer.bias, code)

ddo quantizes too, without the package: :func:`quantize_linear` turns a dense ``nn.Linear`` into a
:class:`QuantizedLinear` holding the tensors ``sdnq`` would make for the same weight and options,
bit for bit (ddo::sdnq_quantize, sdnq/src/quantize.cpp). ddo recognises it by its
``ddo_sdnq_layout`` attribute, the layout code.

    q = quantize_linear(nn.Linear(3072, 3072).bfloat16(), "uint4")   # group 64, the default
    q.ddo_sdnq_layout                   # [2, 3, 15, 3072, 3072, 64, 0, 0]
    y = q(x)                            # dequantize, then linear
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from . import _C

__all__ = [
    "is_sdnq_layer", "sdnq_layout", "dequantize", "quantize_linear", "quantize_model",
    "QuantizedLinear",
]

# Tensors of the format that ddo's dequantize does not read: a layer using one keeps its forward.
_UNSUPPORTED_TENSORS = ("scale_2", "scale_zero_point", "zero_point_scale", "zero_point_2")

_ORIGINAL_FORWARD = "_ddo_sdnq_original_forward"


# The attribute that marks a layer ddo quantized (QuantizedLinear): its layout code.
_DDO_LAYOUT = "ddo_sdnq_layout"


def is_sdnq_layer(module: nn.Module) -> bool:
    """True for a module quantized by the ``sdnq`` package (forward_func + sdnq_dequantizer) or
    by ddo (:class:`QuantizedLinear`, ``ddo_sdnq_layout``)."""
    if isinstance(getattr(module, _DDO_LAYOUT, None), list):
        return True
    return hasattr(module, "forward_func") and hasattr(module, "sdnq_dequantizer")


def sdnq_layout(module: nn.Module) -> Union[list[int], str]:
    """The layout code ddo's op takes for this SDNQ layer, or why ddo cannot run it (a str)."""
    code = getattr(module, _DDO_LAYOUT, None)
    if isinstance(code, list):
        return list(code)
    # The facts of the sdnq package's layer; the rule is C++'s (ddo/sdnq/acceptance.h), the
    # one the loader's SDNQ checkpoints go through.
    d = module.sdnq_dequantizer
    wd = getattr(d, "weights_dtype", None)
    result_dtype = getattr(d, "result_dtype", None)
    features = [f for f in ("use_hadamard", "use_codebook", "use_codebook_scale")
                if getattr(d, f, False)]
    features += [n for n in _UNSUPPORTED_TENSORS if getattr(module, n, None) is not None]
    layout, why = _C.sdnq_accept_layer(
        type(module).__name__,
        isinstance(module, nn.Linear),
        wd if isinstance(wd, str) else "",
        result_dtype if isinstance(result_dtype, torch.dtype) else None,
        [int(v) for v in (getattr(d, "original_shape", ()) or ())],
        int(getattr(d, "group_size", 0) or 0),
        bool(getattr(d, "use_quantized_matmul", False)),
        getattr(module, "svd_up", None) is not None,
        features,
    )
    return list(layout) if not why else why


def install_forward(module: nn.Module, code: list[int]) -> None:
    """Serves ``module`` through ddo::sdnq_linear until :func:`restore_forward`.

    The closure holds the module's own Parameter objects: ddo re-points them in place
    (``set_data``), so it always sees where the tensors live now. One op call per forward, no
    attribute lookups.
    """
    # The overload itself: calling the packet resolves the overload on every call (about 5 us
    # of host time per Linear, measured on the CPU).
    op = torch.ops.ddo.sdnq_linear.default
    weight = module.weight
    scale = module.scale
    zero_point = getattr(module, "zero_point", None)
    svd_up = getattr(module, "svd_up", None)
    svd_down = getattr(module, "svd_down", None)
    bias = module.bias

    def forward(input: torch.Tensor) -> torch.Tensor:
        return op(input, weight, scale, zero_point, svd_up, svd_down, bias, code)

    if _ORIGINAL_FORWARD not in module.__dict__:
        object.__setattr__(module, _ORIGINAL_FORWARD, module.__dict__.get("forward"))
    object.__setattr__(module, "forward", forward)


def restore_forward(module: nn.Module) -> None:
    if _ORIGINAL_FORWARD not in module.__dict__:
        return
    original = module.__dict__.pop(_ORIGINAL_FORWARD)
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        object.__setattr__(module, "forward", original)


def dequantize(module: nn.Module) -> torch.Tensor:
    """The layer's dequantized [out, in] weight, computed by ddo (its kernel on CUDA)."""
    code = sdnq_layout(module)
    if isinstance(code, str):
        raise ValueError(f"ddo cannot dequantize this layer: {code}")
    return torch.ops.ddo.sdnq_dequantize(
        module.weight,
        module.scale,
        getattr(module, "zero_point", None),
        getattr(module, "svd_up", None),
        getattr(module, "svd_down", None),
        code,
    )


class QuantizedLinear(nn.Linear):
    """A Linear quantized by ddo, in the ``sdnq`` package's format.

    Its parameters carry the package's names (weight, scale, zero_point, svd_up, svd_down, bias;
    the unused ones are ``None``), so its tensors load into a package layer and back. It has no
    ``forward_func`` nor ``sdnq_dequantizer``: ``ddo_sdnq_layout`` (the layout code) is what ddo
    reads, and the forward is one ddo::sdnq_linear call.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tensors: dict,
        layout: list[int],
        bias: Optional[torch.Tensor] = None,
        weights_dtype: str = "",
    ) -> None:
        # nn.Module's initialiser, not nn.Linear's: that one would allocate a dense weight.
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        for name in ("weight", "scale", "zero_point", "svd_up", "svd_down"):
            t = tensors.get(name)
            self.register_parameter(name, None if t is None else nn.Parameter(t, requires_grad=False))
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.ddo_sdnq_layout = [int(v) for v in layout]
        self.weights_dtype = weights_dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.ddo.sdnq_linear.default(
            input, self.weight, self.scale, self.zero_point, self.svd_up, self.svd_down, self.bias,
            self.ddo_sdnq_layout,
        )

    def extra_repr(self) -> str:
        group = self.ddo_sdnq_layout[5]
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights_dtype or '?'}, "
            f"group_size={group if group else 'per row'}, svd={self.svd_up is not None}"
        )


@torch.no_grad()
def quantize_linear(
    linear: nn.Linear,
    weights_dtype: str = "int8",
    group_size: int = -1,
    use_svd: bool = False,
    svd_rank: int = 32,
    *,
    svd_steps: int = 8,
    transposed: bool = False,
    result_dtype: Optional[torch.dtype] = None,
    quantized_matmul: bool = False,
) -> QuantizedLinear:
    """Quantizes ``linear`` as ``sdnq.sdnq_post_load_quant`` would, bit for bit.

    ``group_size``: -1 the package's default for the type (64 for 4-bit types, 1024 for 8-bit
    ones from 2048 inputs up, doubled with SVD), 0 one scale per row, > 0 about that many inputs
    per scale (the package's rule picks a divisor of in_features). ``transposed`` asks for the
    int8-matmul layout (the package's use_quantized_matmul); it falls back to the plain layout
    where the package does. With ``use_svd`` the factors are randomized: seed
    ``torch.manual_seed`` the same way as for the package to get the same bits.
    ``result_dtype`` defaults to the weight's dtype (the package's torch_dtype).
    ``quantized_matmul`` (int8 or float8_e4m3fn, one scale per row, plain storage) makes a layer
    that computes with a quantized GEMM where the card has one (ddo/sdnq/quantized_matmul.h):
    the layer :func:`quantize_model` makes, and the computation ``enable_offload(...,
    quantize=...)`` serves a dense Linear's weight with (from a copy, without replacing it).
    """
    if not isinstance(linear, nn.Linear) or is_sdnq_layer(linear):
        raise TypeError(f"quantize_linear takes a dense nn.Linear, got {type(linear).__name__}")
    weight, scale, zero_point, svd_up, svd_down, layout = torch.ops.ddo.sdnq_quantize(
        linear.weight.detach(),
        weights_dtype,
        group_size,
        use_svd,
        svd_rank,
        transposed,
        svd_steps,
        result_dtype,
        quantized_matmul,
    )
    tensors = dict(weight=weight, scale=scale, zero_point=zero_point, svd_up=svd_up, svd_down=svd_down)
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return QuantizedLinear(
        linear.in_features, linear.out_features, tensors, list(layout), bias, weights_dtype
    )


def quantize_model(model: nn.Module, quantize: str) -> dict[str, str]:
    """Replaces each dense ``nn.Linear`` of ``model`` that qualifies by a quantized-matmul
    :class:`QuantizedLinear` (``quantize`` "fp8" or "int8": one scale per output row, the plain
    layout, computed by the card's low-precision GEMM where it has one); returns the Linears kept
    dense, with why. An explicit offline tool for a model that should stay quantized (a resident
    fp8 model); ``enable_offload(..., quantize=...)`` does not use it: it keeps the model's modules
    and serves their weights from quantized copies. The weight rules are C++'s
    (ddo/sdnq/quantize_model.h, through ddo._C.sdnq_quantize_skip). Each dense weight is released as
    its layer is replaced, so the peak is the model plus one layer.

        skipped = quantize_model(transformer, "fp8")      # {"proj_out": "a dimension is ..."}
        transformer.cuda()                                 # resident fp8, no offload
    """
    weights_dtype = _C.sdnq_quantize_type(quantize)  # "fp8" -> "float8_e4m3fn"
    if not weights_dtype:
        return {}
    skipped: dict[str, str] = {}
    targets = []
    # Modules the model declares precision-sensitive (diffusers' and transformers' attribute, matched
    # as their loaders match it: a component of the module's name). Wan's time embedder is one;
    # its forward also casts the timestep to its first parameter's dtype.
    full_precision = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:  # subclasses (sdnq's, LoRA wrappers) have own forwards
            continue
        kept = next((k for k in full_precision if k in name.split(".")), None)
        if kept is not None:
            skipped[name] = f"the model keeps it at full precision (_keep_in_fp32_modules: {kept})"
            continue
        reason = _C.sdnq_quantize_skip(
            quantize, module.out_features, module.in_features, module.weight.dtype
        )
        if reason:
            skipped[name] = reason
        else:
            targets.append(name)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child)
        setattr(parent, child, quantize_linear(dense, weights_dtype, 0, quantized_matmul=True))
    return skipped
