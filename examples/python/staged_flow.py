#!/usr/bin/env python3
"""The staged flow on a diffusers FluxPipeline, with a named workload profile.

The flow and its rules: docs/design/0007-named-profiles.md, section 1.

    1. encode the prompt          (text encoders offloaded), then release the encoders
    2. denoise under profile_run() (the transformer, under the profile name), then release it
    3. decode the latents         (the VAE offloaded), then release it

Run it twice: first with --calibrate (the region is measured and the recommendation saved), then
without (the saved recommendation is applied during enable_offload; profile_run() is a no-op)::

    python examples/python/staged_flow.py --tiny --device sim --calibrate
    python examples/python/staged_flow.py --tiny --device sim
    python examples/python/staged_flow.py --model /models/FLUX.1-dev --calibrate --output out.png

--tiny builds a small FluxPipeline from configs with random weights (nothing is downloaded) and,
having no tokenizers, encodes random token ids instead of a prompt. --model loads a local
pretrained pipeline directory. --device sim runs ddo's host simulation (no GPU needed).
Profiles go to ~/.ddo/profiles, or DDO_PROFILE_DIR.
"""

import argparse
import time

import diffusers
import torch
import transformers

import ddo


def tiny_pipeline() -> diffusers.FluxPipeline:
    """A FluxPipeline small enough for a CPU, random weights, no tokenizers."""
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
        pad_token_id=1))
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=32, scaling_factor=1.5, shift_factor=0.1)
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
        tokenizer=None, text_encoder_2=t5, tokenizer_2=None, transformer=transformer)


def compute_on(pipe, device: str) -> None:
    """diffusers creates latents and ids where the components' first parameters live; weights
    that ddo streams stay host tensors, so tell the pipeline where it computes."""
    cls = type(pipe)
    pipe.__class__ = type(cls.__name__, (cls,),
                          {"_execution_device": property(lambda self: torch.device(device))})


def encode(pipe, args, device):
    """Prompt embeddings: with tokenizers the pipeline's own encode_prompt; the tiny pipeline
    has none, so its encoders read random token ids."""
    if pipe.tokenizer is not None:
        embeds, pooled, _ = pipe.encode_prompt(args.prompt, prompt_2=None, device=device)
        return embeds, pooled
    ids = torch.randint(2, 100, (1, 77), generator=torch.Generator().manual_seed(0)).to(device)
    pooled = pipe.text_encoder(ids).pooler_output
    embeds = pipe.text_encoder_2(ids[:, :32]).last_hidden_state
    return embeds, pooled


def bytes_line(offload) -> str:
    b = offload.report()["setup"]["bytes"]
    return f"resident {b['resident'] / 2**20:.1f} MiB, streamed {b['streamed'] / 2**20:.1f} MiB"


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local pretrained FluxPipeline directory")
    source.add_argument("--tiny", action="store_true", help="tiny random pipeline (no download)")
    p.add_argument("--profile-name", default="staged-flux")
    p.add_argument("--calibrate", action="store_true", help="the calibration run")
    p.add_argument("--device", choices=("cuda", "sim"),
                   default="cuda" if torch.cuda.is_available() else "sim")
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    p.add_argument("--size", type=int, default=None, help="image height and width")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output", help="save the image here (PNG)")
    args = p.parse_args()

    if args.tiny:
        pipe, size = tiny_pipeline(), args.size or 32
    else:
        pipe = diffusers.FluxPipeline.from_pretrained(
            args.model, torch_dtype=torch.bfloat16, local_files_only=True)
        size = args.size or 1024
    pipe.set_progress_bar_config(disable=True)

    # Where ddo executes, and where the host's tensors (latents, embeddings) live.
    if args.device == "sim":
        options, device = {"execution_device": "sim"}, torch.device("cpu")
    else:
        options, device = {}, torch.device("cuda")
        compute_on(pipe, "cuda")
    if args.tiny:
        # The tiny weights are all below the presets' small-tensor threshold (kept resident);
        # stream them anyway so that the calibration has something to measure.
        options["small_tensor_threshold_bytes"] = 0

    # 1. Encode the prompt, then release the text encoders before attaching the denoiser.
    encoders = [ddo.enable_offload(pipe.text_encoder, **options),
                ddo.enable_offload(pipe.text_encoder_2, **options)]
    prompt_embeds, pooled_prompt_embeds = encode(pipe, args, device)
    for offload in encoders:
        offload.remove()
    print(f"encoded: prompt embeddings {tuple(prompt_embeds.shape)}, pooled "
          f"{tuple(pooled_prompt_embeds.shape)}; text encoders released")

    # 2. Denoise: the measured region. Calibration saves the recommendation when the block exits
    #    without an exception; a normal run applied it already in enable_offload.
    offload = ddo.enable_offload(pipe.transformer, preset="auto", profile_name=args.profile_name,
                                 build_profile=args.calibrate, **options)
    print(f"transformer offloaded ({bytes_line(offload)}); profile "
          f"{offload.profile_report.get('status')}")
    start = time.perf_counter()
    with offload.profile_run() as profile_report:
        latents = pipe(prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
                       height=size, width=size, num_inference_steps=args.steps,
                       generator=torch.Generator().manual_seed(0), output_type="latent").images
    seconds = time.perf_counter() - start
    offload.remove()
    budget = profile_report.get("resident_budget_gb")
    print(f"denoised {args.steps} steps: {seconds / args.steps:.3f} s per step; profile "
          f"{profile_report.get('name')!r} {profile_report.get('status')}"
          + (f", resident budget {budget:.2f} GiB" if budget is not None else "")
          + (f" ({profile_report['path']})" if profile_report.get("path") else ""))

    # 3. Decode with the VAE, offloaded on its own.
    vae_offload = ddo.enable_offload(pipe.vae, **options)
    latents = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)
    latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
    vae_offload.remove()
    print(f"decoded: image {tuple(image.shape)}")
    if args.output:
        pipe.image_processor.postprocess(image.float(), output_type="pil")[0].save(args.output)
        print(f"saved {args.output}")


if __name__ == "__main__":
    main()
