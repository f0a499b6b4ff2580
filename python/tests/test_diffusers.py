"""Unmodified diffusers / transformers models (tiny configs, random weights, nothing
downloaded) under ddo on the sim device: outputs bit-equal in fp32, a real diffusers pipeline
routed per component, and the staged flow of
docs/design/0007-named-profiles.md."""

import numpy as np
import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import tiny_flux_inputs

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def tiny_flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()
    inputs = tiny_flux_inputs()
    return model, lambda m: m(**inputs).sample


def tiny_unet():
    model = diffusers.UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        norm_num_groups=4, attention_head_dim=2,
    ).eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 8, 8, generator=g)
    ctx = torch.randn(1, 5, 16, generator=g)
    return model, lambda m: m(x, torch.tensor([10]), encoder_hidden_states=ctx).sample


def tiny_vae():
    model = diffusers.AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=4,
        norm_num_groups=4, sample_size=16,
    ).eval()
    g = torch.Generator().manual_seed(4)
    image = torch.randn(1, 3, 16, 16, generator=g)
    return model, lambda m: m.decode(m.encode(image).latent_dist.mode()).sample


def tiny_clip_text():
    config = transformers.CLIPTextConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
        pad_token_id=1,
    )
    model = transformers.CLIPTextModel(config).eval()
    ids = torch.randint(2, 100, (1, 5), generator=torch.Generator().manual_seed(5))
    return model, lambda m: m(ids).last_hidden_state


@pytest.mark.parametrize("factory", [tiny_flux, tiny_unet, tiny_vae, tiny_clip_text])
@torch.no_grad()
def test_model_outputs_equal_unmanaged(factory):
    model, run = factory()
    expected = run(model)
    offload = ddo.enable_offload(model, preset="auto", **STREAM_ALL)
    assert offload.report()["setup"]["bytes"]["streamed"] > 0
    assert torch.equal(run(model), expected)
    assert torch.equal(run(model), expected)
    assert offload.report()["run"]["intercepted_ops"] > 0
    offload.remove()
    assert torch.equal(run(model), expected)


@torch.no_grad()
def test_flux_with_the_default_preset_thresholds():
    model, run = tiny_flux()
    expected = run(model)
    offload = ddo.enable_offload(model, execution_device="sim")  # preset auto, defaults
    assert torch.equal(run(model), expected)
    offload.remove()


def tiny_dit_pipeline():
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, norm_num_groups=4, num_embeds_ada_norm=10,
    ).eval()
    vae, _ = tiny_vae()
    return diffusers.DiTPipeline(transformer=transformer, vae=vae,
                                 scheduler=diffusers.DDIMScheduler())


def run_pipeline(pipe):
    out = pipe(class_labels=[1], num_inference_steps=2, guidance_scale=1.0, output_type="np",
               generator=torch.Generator().manual_seed(0))
    return out.images


@torch.no_grad()
def test_pipeline_routing(monkeypatch):
    pipe = tiny_dit_pipeline()
    pipe.set_progress_bar_config(disable=True)
    expected = run_pipeline(pipe)

    monkeypatch.setenv("DDO_VAE_ROUTE", "device")
    offload = ddo.enable_pipeline_offload(pipe, preset="auto", **STREAM_ALL)
    assert offload.routes == {"transformer": "dynamic", "vae": "device"}
    assert "scheduler" in offload.skipped and "not an nn.Module" in offload.skipped["scheduler"]
    assert offload.profiled_component == "transformer"
    assert ddo._C.is_managed(pipe.transformer.transformer_blocks[0].ff.net[2].weight)
    assert not ddo._C.is_managed(pipe.vae.decoder.conv_in.weight)
    assert np.array_equal(run_pipeline(pipe), expected)
    report = offload.report()
    assert report["components"]["vae"]["route_policy"] == "device"
    assert "[transformer] route dynamic" in offload.summary()
    offload.remove()
    assert not ddo._C.is_managed(pipe.transformer.transformer_blocks[0].ff.net[2].weight)

    monkeypatch.setenv("DDO_VAE_ROUTE", "none")
    offload = ddo.enable_pipeline_offload(pipe, profile_name="dit", build_profile=True,
                                          **STREAM_ALL)
    assert offload.components["vae"] is None
    with offload.profile_run() as report:
        images = run_pipeline(pipe)
    assert report["status"] == "saved"
    assert ddo.load_profile("dit", "DiTTransformer2DModel") is not None
    assert np.array_equal(images, expected)
    offload.remove()


@torch.no_grad()
def test_pipeline_group_routes_give_equal_results(monkeypatch):
    pipe = tiny_dit_pipeline()
    pipe.set_progress_bar_config(disable=True)
    expected = run_pipeline(pipe)
    monkeypatch.setenv("DDO_TRANSFORMER_ROUTE", "group_block")
    monkeypatch.setenv("DDO_VAE_ROUTE", "group_leaf")
    offload = ddo.enable_pipeline_offload(pipe, **STREAM_ALL)
    assert offload.routes == {"transformer": "group_block", "vae": "group_leaf"}
    assert np.array_equal(run_pipeline(pipe), expected)
    offload.remove()


def test_pipeline_of_plain_module_attributes():
    class Pipe:
        def __init__(self):
            self.transformer = tiny_flux()[0]
            self.tokenizer = "not a module"
            self.scheduler = diffusers.DDIMScheduler()

    pipe = Pipe()
    offload = ddo.enable_pipeline_offload(pipe, **STREAM_ALL)
    assert list(offload.components) == ["transformer"]
    assert set(offload.skipped) == {"tokenizer", "scheduler"}
    offload.remove()


@torch.no_grad()
def staged(te, unet, vae, ids, calibrate=None, name="staged"):
    """Encode, release, denoise (under profile_run when calibrate is not None), release,
    decode -- the staged flow (docs/design/0007-named-profiles.md, section 1)."""
    scheduler = diffusers.DDIMScheduler()
    scheduler.set_timesteps(2)
    managed = calibrate is not None
    report = None

    if managed:
        ddo.enable_offload(te, **STREAM_ALL)
    context = te(ids).last_hidden_state
    if managed:
        ddo.remove_offload(te)  # release the encoder before attaching the denoiser

    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(6))
    if managed:
        offload = ddo.enable_offload(unet, preset="auto", profile_name=name,
                                     build_profile=calibrate, **STREAM_ALL)
        region = offload.profile_run()
    else:
        import contextlib
        region = contextlib.nullcontext({})
    with region as report:
        for t in scheduler.timesteps:
            noise = unet(latents, t, encoder_hidden_states=context).sample
            latents = scheduler.step(noise, t, latents).prev_sample
    if managed:
        ddo.remove_offload(unet)
        ddo.enable_offload(vae, **STREAM_ALL)
    image = vae.decode(latents).sample
    if managed:
        ddo.remove_offload(vae)
    return image, report


def test_staged_flow():
    te, _ = tiny_clip_text()
    te.config.hidden_size  # noqa: B018
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        norm_num_groups=4, attention_head_dim=2,
    ).eval()
    vae, _ = tiny_vae()
    ids = torch.randint(2, 100, (1, 5), generator=torch.Generator().manual_seed(7))

    expected, _ = staged(te, unet, vae, ids)
    image, report = staged(te, unet, vae, ids, calibrate=True)
    assert torch.equal(image, expected)
    assert report["status"] == "saved"
    image, report = staged(te, unet, vae, ids, calibrate=False)
    assert torch.equal(image, expected)
    assert report["status"] == "applied"
    for module in (te, unet, vae):
        assert not hasattr(module, "_ddo_offload")
