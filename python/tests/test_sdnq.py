"""ddo's SDNQ format against the ``sdnq`` package (0.2.8), the oracle: the same tensors from
ddo's quantizer (ddo::sdnq_quantize) as from ``sdnq_post_load_quant``, the package's layers
dequantized by ddo bit-equal to the package's own dequantizer, and the forward both ways (a
package layer run by ddo::sdnq_linear; ddo's tensors loaded into a package layer). CPU only.

The package is imported here and nowhere in ddo."""

import os

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")  # else a slow compile at import

import pytest
import torch
from torch import nn

from helpers import import_sdnq_oracle  # noqa: E402

sdnq = import_sdnq_oracle()

import ddo  # noqa: E402  (loads libddo_sdnq: the torch.ops.ddo.sdnq_* ops)
from ddo import _C  # noqa: E402
from ddo import sdnq as ddo_sdnq  # noqa: E402

SEED = 7


class Case:
    """One layout: the package's options in ddo's spelling (group -1 default, 0 per row)."""

    def __init__(self, dtype, shape, group=-1, svd=False, transposed=False, rank=8):
        self.dtype, self.shape, self.group = dtype, shape, group
        self.svd, self.transposed, self.rank = svd, transposed, rank

    def __repr__(self):
        out, inp = self.shape
        return (f"{self.dtype}-{out}x{inp}-g{self.group}" + ("-svd" if self.svd else "")
                + ("-T" if self.transposed else ""))


CASES = [
    Case("int8", (64, 128), group=0),
    Case("int8", (33, 200), group=32),  # 32 does not divide 200: the package takes 40
    Case("int8", (32, 3072)),  # default group for 8-bit at 3072 inputs: 1024
    Case("uint8", (48, 320)),
    Case("uint8", (33, 200), group=32),
    Case("int4", (64, 128)),
    Case("int4", (48, 320), group=32),
    Case("uint4", (33, 200)),  # default 64 does not divide 200: the package takes 100
    Case("uint4", (64, 128), group=32),
    Case("uint4", (32, 3072)),
    Case("float8_e4m3fn", (64, 128)),
    Case("float8_e4m3fn", (48, 320), group=32),
    Case("float8_e5m2", (33, 200)),
    Case("int8", (64, 128), transposed=True),  # the int8-matmul layout: weight [in, out]
    Case("int8", (48, 208), transposed=True),
    Case("int8", (40, 128), transposed=True),  # 40 is no multiple of 16: the plain layout
    Case("int8", (64, 256), svd=True),
    Case("uint4", (64, 256), svd=True),  # default group with SVD: 128
    Case("int4", (40, 200), svd=True, rank=48),  # rank above min(out, in): 40
    Case("float8_e4m3fn", (48, 320), svd=True),
]
DTYPES = [torch.bfloat16, torch.float32]


def dense_weight(shape, dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * 0.05
    w[3] = 0  # a row of zeros: scale 0, quantized 0
    w[5, : shape[1] // 2] = 0  # zero groups in a non-zero row
    w[7, 0] = 4.0  # an outlier
    return w.to(dtype)


def dense_linear(case, dtype):
    out, inp = case.shape
    lin = nn.Linear(inp, out, bias=True, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(dense_weight(case.shape, dtype))
        lin.bias.copy_(torch.linspace(-1, 1, out))
    return lin


def package_layer(case, dtype, seed=SEED):
    """The package's quantized layer for the case (seeded right before, for the SVD)."""
    model = nn.Sequential(dense_linear(case, dtype))
    torch.manual_seed(seed)
    model = sdnq.sdnq_post_load_quant(
        model,
        weights_dtype=case.dtype,
        torch_dtype=dtype,
        add_skip_keys=False,
        group_size={-1: 0, 0: -1}.get(case.group, case.group),
        use_svd=case.svd,
        svd_rank=case.rank,
        use_quantized_matmul=case.transposed,
        minimum_allowed_numel=0,  # the test layers are small
    )
    layer = model[0]
    assert hasattr(layer, "sdnq_dequantizer"), f"the package did not quantize {case}"
    return layer


def ddo_quantize(case, dtype, seed=SEED):
    torch.manual_seed(seed)
    return torch.ops.ddo.sdnq_quantize(
        dense_weight(case.shape, dtype), case.dtype, case.group, case.svd, case.rank,
        case.transposed,
    )


NAMES = ("weight", "scale", "zero_point", "svd_up", "svd_down")


def bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def assert_same(name, got, want):
    assert (got is None) == (want is None), f"{name}: ddo {got is None}, package {want is None}"
    if got is None:
        return
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, package {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, package {tuple(want.shape)}"
    diff = int((bits(got) != bits(want)).sum())
    assert torch.equal(bits(got), bits(want)), f"{name}: {diff} of {got.numel()} values differ"


def package_dequantize(layer):
    # The int8-matmul layout dequantizes to [in, out] unless told skip_quantized_matmul (which
    # on the plain layout would transpose instead).
    d = layer.sdnq_dequantizer
    matmul = d.use_quantized_matmul and not d.re_quantize_for_matmul
    return d(**{n: getattr(layer, n, None) for n in NAMES}, skip_quantized_matmul=matmul)


def x_for(case, dtype):
    g = torch.Generator().manual_seed(2)
    return torch.randn(3, 5, case.shape[1], generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_quantizer_gives_the_package_tensors(case, dtype):
    layer = package_layer(case, dtype)
    weight, scale, zero_point, svd_up, svd_down, code = ddo_quantize(case, dtype)
    for name, got in zip(NAMES, (weight, scale, zero_point, svd_up, svd_down)):
        assert_same(name, got, getattr(layer, name, None))
    # The layout code ddo returns is the one it reads off the package's layer.
    want = ddo_sdnq.sdnq_layout(layer)
    if isinstance(want, list):
        assert list(code) == want
    d = layer.sdnq_dequantizer
    assert list(code)[5] == max(d.group_size, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_ddo_dequantizes_package_layers_bit_for_bit(case, dtype):
    layer = package_layer(case, dtype)
    code = ddo_sdnq.sdnq_layout(layer)
    if case.transposed and case.svd:
        assert isinstance(code, str)
        return
    assert isinstance(code, list), code
    got = torch.ops.ddo.sdnq_dequantize(*(getattr(layer, n, None) for n in NAMES), code)
    want = package_dequantize(layer)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"max diff {float((got.float() - want.float()).abs().max())}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_forward_both_ways(case, dtype):
    x = x_for(case, dtype)
    # A package layer run by ddo's op equals the layer's own forward.
    layer = package_layer(case, dtype)
    code = ddo_sdnq.sdnq_layout(layer)
    with torch.no_grad():
        want = layer(x)
        got = torch.ops.ddo.sdnq_linear(x, *(getattr(layer, n, None) for n in NAMES),
                                        layer.bias, code)
    assert torch.equal(got, want), f"max diff {float((got.float() - want.float()).abs().max())}"

    # ddo's layer, its tensors loaded into a package layer quantized with another seed (other
    # SVD factors): the package computes what ddo computes.
    q = ddo_sdnq.quantize_linear(dense_linear(case, dtype), case.dtype, case.group, case.svd,
                                 case.rank, transposed=case.transposed)
    other = package_layer(case, dtype, seed=SEED + 1)
    with torch.no_grad():
        for name in NAMES + ("bias",):
            t = getattr(q, name)
            if t is not None:
                getattr(other, name).data = t.detach().clone()
        assert torch.equal(other(x), q(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 128), (256, 512)], ids=str)
def test_int8_matmul_layout_against_the_package_forward(shape, dtype):
    # On the GPU with Triton the package's forward on this layout quantizes the activations and
    # multiplies int8 by int8, which differs from ddo's dequantize path by rounding. On the CPU
    # (no Triton; these tests) it dequantizes too, and the two matmuls differ only in the layout
    # of the weight they are handed: bf16 measured bit-equal everywhere; f32 bit-equal on one CPU
    # and 4.8e-7 apart (relative to the largest output) on another, whose GEMM sums in another
    # order. So bf16 asserts equality and f32 a bound on summation-order rounding.
    case = Case("int8", shape, transposed=True)
    layer = package_layer(case, dtype)
    assert layer.sdnq_dequantizer.use_quantized_matmul and layer.weight.shape == shape[::-1]
    code = ddo_sdnq.sdnq_layout(layer)
    assert code[6] == 1  # transposed
    x = x_for(case, dtype)
    with torch.no_grad():
        want = layer(x)
        got = torch.ops.ddo.sdnq_linear(x, layer.weight, layer.scale, None, None, None, layer.bias,
                                        code)
    rel = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    if dtype == torch.float32:
        assert rel <= 4 * torch.finfo(torch.float32).eps * shape[1] ** 0.5, (
            f"int8-matmul forward differs from ddo's by {rel:.2e} (relative), more than "
            "summation-order rounding")
    else:
        assert torch.equal(got, want), (
            f"int8-matmul forward differs from ddo's by {rel:.2e} (relative)")


def test_quantize_linear_gives_a_layer_ddo_recognises():
    torch.manual_seed(0)
    dense = nn.Linear(3072, 64).to(torch.bfloat16)
    q = ddo_sdnq.quantize_linear(dense, "uint4")
    assert isinstance(q, ddo_sdnq.QuantizedLinear) and isinstance(q, nn.Linear)
    assert not hasattr(q, "forward_func") and not hasattr(q, "sdnq_dequantizer")
    assert ddo_sdnq.is_sdnq_layer(q)
    assert ddo_sdnq.sdnq_layout(q) == [2, 3, 15, 64, 3072, 64, 0, 0]  # uint4, bf16, group 64
    names = [n for n, _ in q.named_parameters()]
    assert names == ["weight", "scale", "zero_point", "bias"]
    assert q.weight.shape == (64 * 3072 // 2,) and q.scale.shape == (64, 48, 1)
    x = torch.randn(2, 3072).to(torch.bfloat16)
    want = nn.functional.linear(x, ddo_sdnq.dequantize(q), q.bias)
    assert torch.equal(q(x), want)
    # 8-bit types: 1024 inputs per group from 2048 inputs up, per row below.
    assert ddo_sdnq.quantize_linear(dense, "int8").ddo_sdnq_layout[5] == 1024
    assert ddo_sdnq.quantize_linear(nn.Linear(1536, 32), "int8").ddo_sdnq_layout[5] == 0
    with pytest.raises(TypeError, match="dense nn.Linear"):
        ddo_sdnq.quantize_linear(q)


def test_quantize_refuses_what_the_layout_cannot_hold():
    # ddo::Error(kInvalidArgument) reaches Python as ValueError, through the dispatcher too.
    w = torch.randn(64, 128)
    with pytest.raises(ValueError, match='"int3" is not supported'):
        torch.ops.ddo.sdnq_quantize(w, "int3")
    with pytest.raises(ValueError, match="needs type int8"):
        torch.ops.ddo.sdnq_quantize(w, "uint4", transposed=True)
    with pytest.raises(ValueError, match="drop transposed or use_svd"):
        torch.ops.ddo.sdnq_quantize(w, "int8", use_svd=True, transposed=True)
    with pytest.raises(ValueError, match="odd number of elements"):
        torch.ops.ddo.sdnq_quantize(torch.randn(3, 5), "uint4")


@torch.no_grad()
def test_ddo_quantized_model_streams_under_enable_offload():
    # A model whose Linears ddo quantized (no sdnq layer in it) takes the SDNQ runtime: one
    # unit per layer, the output of the unmanaged model bit for bit.
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(torch.bfloat16)
    model = nn.Sequential(
        ddo_sdnq.quantize_linear(dense[0], "uint4"), dense[1],
        ddo_sdnq.quantize_linear(dense[2], "int8", group_size=0),
    ).eval()
    x = torch.randn(2, 8, 128).to(torch.bfloat16)
    ref = model(x)
    offload = ddo.enable_offload(
        model, preset="one_shot_fast", execution_device="sim", auto_budget_policy="off",
        resident_module_budget_gb=0.0, small_tensor_threshold_bytes=1024,
        always_resident_modules_pattern=[],
    )
    report = offload.report()
    assert report["execution_mode"] == "sdnq_runtime"
    plan = next(e for e in report["python"]["setup_events"] if e["name"] == "plan")
    assert plan["payload"]["stream_units"] == 2  # one per quantized layer
    # The packed weights, scales and zero points stream; the biases are small, moved once.
    packed = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
                 if not n.endswith("bias"))
    assert report["plan"]["streamed_bytes"] == packed
    assert _C.is_managed(model[0].weight) and _C.is_managed(model[0].zero_point)
    assert torch.equal(model(x), ref)
    assert offload.report()["run"]["acquires"] == 2
    offload.remove()
    assert torch.equal(model(x), ref)


def test_rules_are_functions_of_C_and_only_compute_is_an_op():
    # Note [Metadata through _C] in python/src/sdnq_bindings.cpp: torch.ops.ddo holds the ops
    # that compute on tensors; what Python asks about is a function of ddo._C over the same C++.
    for op in ("sdnq_linear", "sdnq_dequantize", "sdnq_quantize"):
        assert hasattr(torch.ops.ddo, op), op
    for name in ("sdnq_accept_layer", "sdnq_stored_layout", "sdnq_quantize_type",
                 "sdnq_quantize_skip", "sdnq_layout_code", "sdnq_linear_path"):
        assert not hasattr(torch.ops.ddo, name), name
        assert callable(getattr(ddo._C, name)), name
    assert ddo._C.sdnq_quantize_type("fp8") == "float8_e4m3fn"
    assert ddo._C.sdnq_quantize_type("none") == ""
    with pytest.raises(ValueError, match=r'quantize="int3" is not a choice; use "fp8"'):
        ddo._C.sdnq_quantize_type("int3")
    assert ddo._C.sdnq_quantize_skip("int8", 256, 256, torch.bfloat16) == ""
    assert "multiple of 16" in ddo._C.sdnq_quantize_skip("int8", 250, 256, torch.bfloat16)
    assert ddo._C.sdnq_stored_layout(True, 64, 32, [32, 64], [1, 64]) == (0, True)
    code = ddo._C.sdnq_layout_code("int8", torch.bfloat16, 64, 32, 0, True)
    layout, why = ddo._C.sdnq_accept_layer("SDNQLinear", True, "int8", torch.bfloat16, [64, 32], 0,
                                           True, False, [])
    assert (layout, why) == (code, "")
    layout, why = ddo._C.sdnq_accept_layer("SDNQConv2d", False, "int8", None, [64, 32], 0, False,
                                           False, [])
    assert layout == [] and why
    path, why = ddo._C.sdnq_linear_path(code, torch.float32, "cpu")
    assert (path, why) == ddo._C.sdnq_linear_path(code, torch.float32, torch.device("cpu"), 4096)
