"""SDNQ checkpoints through ddo's loader: a tiny FLUX transformer quantized by the
``sdnq`` package (the test oracle) and written by its ``save_sdnq_model``, loaded by ddo straight
into place on the sim device, gives the outputs of the package's own ``load_sdnq_model``; the
packed tensors stream as one unit per layer and are read as they lie in the file."""

import os

import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import import_sdnq_oracle, tiny_flux_inputs

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
diffusers = pytest.importorskip("diffusers")
sdnq = import_sdnq_oracle()

STREAM = dict(STREAM_ALL, execution_mode="linear_runtime")


def tiny_flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[8, 8, 16],
    ).to(torch.bfloat16).eval()


LAYOUTS = [
    ("int8", dict()),
    ("uint4", dict(use_svd=True, svd_rank=8)),
    ("int4", dict(group_size=32)),  # two groups per row of the 64-wide layers
    # The int8 matmul layout: weights stored [in, out], one scale per output column.
    ("int8", dict(use_quantized_matmul=True)),
]


@pytest.fixture(scope="module", params=LAYOUTS,
                ids=["int8", "uint4-svd", "int4-group32", "int8-matmul"])
def sdnq_dir(request, tmp_path_factory):
    weights_dtype, kw = request.param
    matmul = bool(kw.get("use_quantized_matmul"))
    root = tmp_path_factory.mktemp(f"sdnq-{weights_dtype}")
    torch.manual_seed(3)
    model = sdnq.sdnq_post_load_quant(
        tiny_flux(), weights_dtype=weights_dtype, torch_dtype=torch.bfloat16,
        minimum_allowed_numel=0, **kw,
    )
    sdnq.save_sdnq_model(model, str(root))
    return root, weights_dtype, matmul


@torch.no_grad()
def test_sdnq_checkpoint_loads_like_the_package(sdnq_dir):
    path, weights_dtype, matmul = sdnq_dir
    package = sdnq.load_sdnq_model(str(path), model_cls=diffusers.FluxTransformer2DModel,
                                   dtype=torch.bfloat16)
    inputs = tiny_flux_inputs(1, torch.bfloat16)
    expected = package(**inputs).sample
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=STREAM, dtype=torch.bfloat16,
    )
    layers = [m for m in loaded.module.modules() if isinstance(m, ddo.sdnq.QuantizedLinear)]
    quantized = [m for m in package.modules() if hasattr(m, "sdnq_dequantizer")]
    assert len(layers) == len(quantized) > 0
    assert all(m.weights_dtype == weights_dtype for m in layers)
    # The int8 matmul layout is run as stored ([in, out], a scale per output column), with the
    # layout code ddo's own quantizer gives that layout; the others are not read as transposed.
    transposed = [m for m in layers if tuple(m.weight.shape) == (m.in_features, m.out_features)
                  and tuple(m.scale.shape) == (1, m.out_features)]
    assert len(transposed) == (len(layers) if matmul else 0)
    for m in transposed:
        assert m.ddo_sdnq_layout == list(ddo._C.sdnq_layout_code(
            "int8", torch.bfloat16, m.out_features, m.in_features, 0, True))
    report = loaded.report()
    assert report["execution_mode"] == "sdnq_runtime", report["execution_mode"]
    # Every file byte read once, straight into place.
    total = sum(t.numel() * t.element_size() for t in package.state_dict().values())
    assert report["setup"]["load"]["bytes"] == total
    got = loaded.module(**inputs).sample
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    loaded.offload.remove()
    # After remove() every tensor is the package's, bit for bit.
    state = package.state_dict()
    for name, t in loaded.module.state_dict().items():
        assert torch.equal(t, state[name]), name


def test_sdnq_layouts_ddo_does_not_read_are_a_clear_error(sdnq_dir, tmp_path):
    path = sdnq_dir[0]
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "quantization_config.json").read_text())
    config["use_hadamard"] = True
    (bad / "quantization_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_hadamard.*loader='library'"):
        ddo.from_pretrained_with_dynamic_offload(
            bad, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
            dynamic_offload_config=STREAM, dtype=torch.bfloat16,
        )
    # A matmul layout in another type than int8 and float8_e4m3fn.
    config.update(use_hadamard=False, use_quantized_matmul=True,
                  quantized_matmul_dtype="float8_e5m2")
    (bad / "quantization_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized_matmul_dtype='float8_e5m2'.*float8_e4m3fn"):
        ddo.from_pretrained_with_dynamic_offload(
            bad, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
            dynamic_offload_config=STREAM, dtype=torch.bfloat16,
        )


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe bad utf-8", b"[" * 100000, b"[1]"])
def test_a_bad_quantization_config_names_its_file(tmp_path, content):
    from ddo.loader import _sdnq_checkpoint_config

    (tmp_path / "quantization_config.json").write_bytes(content)
    with pytest.raises(ValueError, match=r"quantization_config\.json: "):
        _sdnq_checkpoint_config(str(tmp_path))
