#!/usr/bin/env python3
"""A whole generation from a pipeline folder on disk: encode, denoise, decode, written out.

Each component is read from its folder by ddo's loader, used for its stage and released before
the next one is loaded, so the card and the host hold one stage at a time:

    1. encode   the text encoders (FLUX: CLIP-L and T5-XXL; Wan: UMT5-XXL), streamed, released
    2. denoise  the transformer, under a named profile (--profile-name, --calibrate), released
    3. decode   the VAE (tiled when the card is small), released; the image (PNG) or the frames
                (animated WebP, or PNGs in a folder) are written

    # a folder of random weights written from the configs (token ids instead of a tokenizer)
    python examples/python/generate.py --family flux --random /tmp/flux-tiny --size tiny \\
        --device sim --stream-all --output /tmp/flux.png
    python examples/python/generate.py --family wan --random /tmp/wan-tiny --size tiny \\
        --device sim --stream-all --frames 5 --output /tmp/wan.webp
    # a real pipeline folder (tokenizers from the folder), an 8 GiB card, 32 GiB of host RAM
    python examples/python/generate.py --model /models/FLUX.1-dev --vram-cap 8 --host-ram-cap 32 \\
        --prompt "a lighthouse at dusk" --output flux.png

--random DIR writes DIR once (``--size tiny`` for a CPU, ``full`` for FLUX.1-dev / Wan 2.1-14B
shapes) and reuses it afterwards. --no-ddo runs the same stages all resident on the device, the
reference the outputs are compared with; --offload runs them under diffusers' offload routes or
diffusers-dynamic-offloader instead (benchmark W6's other rows; GPU only). --report FILE writes the generation's report (seconds,
bytes read from disk and streamed, peak VRAM and RSS per stage) as JSON.

Every flag is checked before anything is written or loaded (check()): a bad value exits with
code 2 naming the flag and what to pass. Sizes are refused, not rounded, off the multiples the
pipeline needs (FLUX: the VAE's scale x 2, 16 for FLUX.1-dev; Wan: 16), Wan frame counts off
4k + 1 (the VAE's temporal scale), and --output/--report paths that could not be written.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import resource
import sys
import time
from typing import Any, Callable, Optional

import diffusers
import numpy as np
import torch
import transformers

import ddo

# --- the two families ------------------------------------------------------------------------


def _flux_configs(size: str) -> dict[str, Any]:
    """The random FLUX folder's component configs (read by the flag checks before it is written)."""
    if size == "tiny":
        clip = transformers.CLIPTextConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
            pad_token_id=1)
        t5 = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4)
        transformer = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                           attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                           pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        vae = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                   down_block_types=("DownEncoderBlock2D",) * 2,
                   up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4, sample_size=32,
                   scaling_factor=1.5, shift_factor=0.1)
    else:  # FLUX.1-dev's shapes
        clip = transformers.CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, max_position_embeddings=77, projection_dim=768)
        t5 = transformers.T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240,
                                   num_layers=24, num_heads=64, feed_forward_proj="gated-gelu")
        transformer = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                           attention_head_dim=128, num_attention_heads=24,
                           joint_attention_dim=4096, pooled_projection_dim=768,
                           guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        vae = dict(in_channels=3, out_channels=3, latent_channels=16,
                   block_out_channels=(128, 256, 512, 512),
                   down_block_types=("DownEncoderBlock2D",) * 4,
                   up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
                   sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                   use_quant_conv=False, use_post_quant_conv=False)
    return dict(clip=clip, t5=t5, transformer=transformer, vae=vae)


def _random_flux(size: str) -> diffusers.FluxPipeline:
    c = _flux_configs(size)
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=diffusers.AutoencoderKL(**c["vae"]), text_encoder=transformers.CLIPTextModel(c["clip"]),
        tokenizer=None, text_encoder_2=transformers.T5EncoderModel(c["t5"]), tokenizer_2=None,
        transformer=diffusers.FluxTransformer2DModel(**c["transformer"]))


def _wan_configs(size: str) -> dict[str, Any]:
    """The random Wan folder's component configs (read by the flag checks before it is written)."""
    if size == "tiny":
        umt5 = transformers.UMT5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                       num_heads=4, relative_attention_num_buckets=8)
        transformer = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                           in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                           num_layers=2, rope_max_seq_len=32)
        # One 2x downsample in space and time, so the scale factors the pipeline reads say 2
        # (the class defaults, 8 and 4, are Wan 2.1's VAE); else 32x32 would decode to 8x8.
        vae = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                   temperal_downsample=[True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                   scale_factor_spatial=2, scale_factor_temporal=2)
    else:  # Wan 2.1-14B's shapes
        umt5 = transformers.UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240,
                                       num_layers=24, num_heads=64,
                                       feed_forward_proj="gated-gelu")
        transformer = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                           in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                           ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                           qk_norm="rms_norm_across_heads", eps=1e-6)
        vae = {}
    return dict(umt5=umt5, transformer=transformer, vae=vae)


def _random_wan(size: str) -> diffusers.WanPipeline:
    c = _wan_configs(size)
    return diffusers.WanPipeline(
        tokenizer=None, text_encoder=transformers.UMT5EncoderModel(c["umt5"]),
        vae=diffusers.AutoencoderKLWan(**c["vae"]), transformer=diffusers.WanTransformer3DModel(
            **c["transformer"]), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


FAMILIES = {
    # family: (pipeline class, random pipeline, text encoders (folder, class), transformer, VAE)
    "flux": (diffusers.FluxPipeline, _random_flux,
             [("text_encoder", transformers.CLIPTextModel),
              ("text_encoder_2", transformers.T5EncoderModel)],
             diffusers.FluxTransformer2DModel, diffusers.AutoencoderKL),
    "wan": (diffusers.WanPipeline, _random_wan, [("text_encoder", transformers.UMT5EncoderModel)],
            diffusers.WanTransformer3DModel, diffusers.AutoencoderKLWan),
}


def write_random_folder(family: str, size: str, folder: str, dtype: torch.dtype) -> None:
    """A pipeline folder of random weights (no tokenizers), written once."""
    if os.path.exists(os.path.join(folder, "model_index.json")):
        return
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # full size: built in bf16, never in float32
    try:
        pipe = FAMILIES[family][1](size)
    finally:
        torch.set_default_dtype(previous)
    pipe.save_pretrained(folder, max_shard_size="2GB" if size == "full" else "200KB")
    del pipe
    gc.collect()


def vae_factors(family: str, vae: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal): how many pixels and frames one latent holds, as the pipeline reads
    them from the VAE config (FLUX: 2 per downsample block; Wan: its scale factors)."""
    if family == "flux":
        return 2 ** (len(vae["block_out_channels"]) - 1), 1
    down = vae["temperal_downsample"]
    return (vae.get("scale_factor_spatial") or 2 ** len(down),
            vae.get("scale_factor_temporal") or 2 ** sum(down))


# --- the flags, checked before anything is written or loaded --------------------------------


def _with_defaults(cls: Any, config: dict[str, Any]) -> dict[str, Any]:
    """A config as the class reads it: the keys it leaves out take the constructor's defaults."""
    params = inspect.signature(cls.__init__).parameters.values()
    defaults = {q.name: q.default for q in params if q.default is not inspect.Parameter.empty}
    return {**defaults, **config}


def _folder_family(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The folder's family from its model_index.json; --family for a --random folder not yet
    written. A --family that contradicts an existing folder is refused."""
    folder = args.model or args.random
    flag = f"--model {folder}" if args.model else f"--random {folder}"
    index = os.path.join(folder, "model_index.json")
    if args.random and not os.path.exists(index):
        if os.path.exists(folder) and not os.path.isdir(folder):
            p.error(f"{flag}: a file, not a folder; pass a folder path (written once, then "
                    f"reused)")
        return args.family or "flux"
    if not os.path.isdir(folder):
        p.error(f"{flag}: no such folder; pass a FluxPipeline or WanPipeline folder (the one "
                f"holding model_index.json)")
    try:
        with open(index) as f:
            name = json.load(f)["_class_name"]
    except FileNotFoundError:
        p.error(f"{flag}: the folder has no model_index.json; pass a diffusers pipeline folder "
                f"(FluxPipeline or WanPipeline), or --random DIR to write a random one")
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"{flag}: its model_index.json names no pipeline (_class_name: "
                f"{type(e).__name__}: {e}); pass a FluxPipeline or WanPipeline folder")
    family = next((f for f, entry in FAMILIES.items() if entry[0].__name__ == name), None)
    if family is None:
        p.error(f"{flag}: a {name}; generate.py runs FluxPipeline and WanPipeline folders")
    if args.family is not None and args.family != family:
        p.error(f"--family {args.family}: {folder} holds a {name} (its model_index.json); leave "
                f"--family out or pass --family {family}, or a new --random folder for "
                f"{args.family}")
    return family


def _configs(p: argparse.ArgumentParser, args: argparse.Namespace, folder: str,
             family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The VAE's and the transformer's configs: the folder's, or the random ones it will get."""
    _, _, _, transformer_cls, vae_cls = FAMILIES[family]
    if not os.path.exists(os.path.join(folder, "model_index.json")):
        c = (_flux_configs if family == "flux" else _wan_configs)(args.size)
        return _with_defaults(vae_cls, c["vae"]), _with_defaults(transformer_cls, c["transformer"])
    out = []
    for sub, cls in (("vae", vae_cls), ("transformer", transformer_cls)):
        try:
            out.append(_with_defaults(cls, dict(cls.load_config(os.path.join(folder, sub)))))
        except (OSError, ValueError) as e:
            p.error(f"{folder}: no readable {sub}/config.json ({e}); a {family} pipeline folder "
                    f"holds one per component")
    return out[0], out[1]


def _nearest(value: int, step: int, first: int) -> str:
    """The valid values nearest to value among first, first + step, ... ("4 or 8")."""
    below = first + max(0, (value - first) // step) * step
    return f"{below}" if value <= first else f"{below} or {below + step}"


def _check_writable(p: argparse.ArgumentParser, flag: str, path: str, folder_ok: bool) -> None:
    """Refuses a path the finished generation could not be written to."""
    if folder_ok and (path.endswith(("/", os.sep)) or os.path.isdir(path)):
        # A folder of PNGs: written with makedirs, so the nearest existing folder must take it.
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            p.error(f"{flag} {path}: {existing} is not a writable folder; pick another path")
        return
    if os.path.isdir(path):
        p.error(f"{flag} {path}: a folder; pass a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: the folder {parent} does not exist; create it or pick a path "
                f"in an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and
                                                    not os.access(path, os.W_OK)):
        p.error(f"{flag} {path}: not writable; pick a path you can write")


def _check_output(p: argparse.ArgumentParser, args: argparse.Namespace, family: str) -> None:
    from PIL import Image

    _check_writable(p, "--output", args.output, folder_ok=True)
    if args.output.endswith(("/", os.sep)) or os.path.isdir(args.output):
        return
    Image.init()
    ext = os.path.splitext(args.output)[1].lower()
    fmt = Image.registered_extensions().get(ext)
    if fmt is None or fmt not in Image.SAVE:
        p.error(f"--output {args.output}: Pillow writes no {ext or 'extensionless'} files; end "
                f"it in .png (an image), .webp (frames) or / (a folder of PNGs)")
    if family == "wan" and args.frames > 1 and fmt not in Image.SAVE_ALL:
        p.error(f"--output {args.output}: {fmt} holds one image and Wan writes {args.frames} "
                f"frames; end it in .webp, or / for a folder of PNGs")


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag, before anything is written or loaded; a bad one is parser.error (exit 2)
    naming the flag, the value and what to pass. Fills in the family and the defaults."""
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: a generation takes at least 1 denoising step; pass 1 or "
                f"more, or leave it out (2 at --size tiny, else FLUX 28, Wan 20)")
    if args.fps <= 0:
        p.error(f"--fps {args.fps}: frames per second must be positive; pass e.g. 16 (the "
                f"default)")
    for flag, cap in (("--vram-cap", args.vram_cap), ("--host-ram-cap", args.host_ram_cap)):
        if cap is not None and cap <= 0:
            p.error(f"{flag} {cap}: GiB must be positive; leave it out for no cap")
    if args.size is not None and not args.random:
        p.error(f"--size {args.size} sizes the folder --random writes; --model's folder has its "
                f"own size: leave --size out")
    if args.random and args.size is None:
        args.size = "tiny"
    if args.offload != "ddo":
        # The others run without ddo: its options would be ignored, so they are refused.
        route = "--no-ddo" if args.offload == "resident" else f"--offload {args.offload}"
        for flag, given in (("--quantize", args.quantize), ("--profile-name", args.profile_name),
                            ("--calibrate", args.calibrate), ("--stream-all", args.stream_all),
                            ("--host-ram-cap", args.host_ram_cap)):
            if given:
                p.error(f"{flag} is a ddo option and {route} runs without ddo; leave {flag} out "
                        f"or use --offload ddo")
        if args.offload == "resident" and args.vram_cap is not None:
            p.error(f"--vram-cap caps ddo or the other offloads; {route} keeps everything "
                    f"resident: leave --vram-cap out")
    if args.calibrate and not args.profile_name:
        p.error("--calibrate measures and saves a named profile: pass --profile-name NAME with "
                "it")
    folder = args.model or args.random
    family = _folder_family(p, args)
    vae, transformer = _configs(p, args, folder, family)
    spatial, temporal = vae_factors(family, vae)
    if family == "flux":
        # FluxPipeline packs 2x2 latents into one token and floors any other size.
        multiple = spatial * 2
        why = f"FLUX takes multiples of {multiple} (the VAE's {spatial}x times 2x2 packing)"
    else:
        # WanPipeline refuses sizes off multiples of 16; the transformer patches the latents.
        patch = transformer["patch_size"]
        multiple = math.lcm(16, spatial * patch[1], spatial * patch[2])
        why = f"Wan takes multiples of {multiple}"
    for flag, value in (("--height", args.height), ("--width", args.width)):
        if value is not None and (value <= 0 or value % multiple):
            p.error(f"{flag} {value}: {why}; pass {flag} {_nearest(value, multiple, multiple)}")
    if family == "wan" and (args.frames < 1 or (args.frames - 1) % temporal):
        # WanPipeline rounds other counts down (any below 1 to 1) with only a log warning.
        p.error(f"--frames {args.frames}: Wan takes {temporal}k + 1 frames (the VAE keeps the "
                f"first and packs each {temporal} after it into one latent); pass --frames "
                f"{_nearest(args.frames, temporal, 1)}")
    if args.output:
        _check_output(p, args, family)
    if args.report:
        _check_writable(p, "--report", args.report, folder_ok=False)
    args.family = family
    tiny = args.size == "tiny" and args.random
    default_size = (32 if tiny else 1024) if family == "flux" else (32 if tiny else 480)
    if args.height is None:
        args.height = default_size
    if args.width is None:
        args.width = default_size if family == "flux" else (32 if tiny else 832)
    if args.steps is None:
        args.steps = 2 if tiny else 28 if family == "flux" else 20


# --- stages ----------------------------------------------------------------------------------

OFFLOAD_ROUTES = ("ddo", "resident", "diffusers-group-leaf", "diffusers-model",
                  "diffusers-sequential", "diffusers-dynamic-offloader")


def load_other(route: str, cls: Any, path: str, dtype: torch.dtype, device: torch.device) -> Any:
    """A component loaded and placed by someone other than ddo (benchmark W6's other rows)."""
    if route == "diffusers-dynamic-offloader":
        import diffusers_dynamic_offloader as ddol

        loaded = ddol.from_pretrained_with_dynamic_offload(
            path, model_loader=cls, apply_dynamic=True, torch_dtype=dtype)
        return loaded.module
    module = cls.from_pretrained(path, torch_dtype=dtype).eval()
    if route in ("resident", "diffusers-model"):
        # Model offload moves each whole component to the card for its stage; the staged flow
        # releases it after, as enable_model_cpu_offload does between components.
        return module.to(device)
    if route == "diffusers-group-leaf":
        module.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                    offload_type="leaf_level", use_stream=True,
                                    record_stream=True)
        return module
    if route == "diffusers-sequential":
        import accelerate

        accelerate.cpu_offload(module, execution_device=device)
        return module
    raise ValueError(f"unknown offload route {route!r}")



class Stages:
    """Loads one component at a time (ddo's loader, or all resident with --no-ddo) and keeps the
    report of each stage."""

    def __init__(self, args: argparse.Namespace, folder: str) -> None:
        self.args = args
        self.folder = folder
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.report: dict[str, Any] = {"stages": {}}
        # ddo's per-generation report over the stages (ddo/torch/generation.h): seconds per
        # stage, bytes each component streamed and read, peak VRAM and RSS.
        self.meter = ddo.GenerationMeter(cuda_device="cuda:0" if self.cuda else None)
        self._loaded: list[tuple[str, Any]] = []

    def load(self, sub: str, cls: Any, **ddo_options: Any) -> tuple[Any, Any]:
        path = os.path.join(self.folder, sub)
        if self.args.offload != "ddo":
            return load_other(self.args.offload, cls, path, self.args.dtype, self.device), None
        loaded = ddo.from_pretrained_with_dynamic_offload(
            path, model_loader=cls, apply_dynamic=True, dtype=self.args.dtype,
            execution_device="sim" if self.args.device == "sim" else None, **ddo_options)
        if loaded.offload is not None:
            self.meter.add(sub, loaded.offload)
            self._loaded.append((sub, loaded.offload))
        return loaded.module.eval(), loaded.offload

    @contextlib.contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        entry: dict[str, Any] = {"read_bytes": 0, "disk_bytes_read": 0, "streamed_bytes": 0}
        offloads: list[Any] = []
        start = time.perf_counter()
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        self.meter.begin_stage(name)
        yield offloads
        self.meter.end_stage(name)
        if self.cuda:
            torch.cuda.synchronize()
        entry["seconds"] = time.perf_counter() - start
        for sub, offload in self._loaded:
            # Removed first: its disk tier's reader threads may still be reading ahead, and the
            # totals after remove() are final, so the stage and the meter see the same figures.
            offload.remove()
            totals = offload.counters()
            entry["read_bytes"] += offload.report()["setup"].get("load", {}).get("bytes", 0)
            entry["disk_bytes_read"] += totals["disk_bytes_read"]
            entry["streamed_bytes"] += totals["bytes_streamed"]
            self.meter.drop(sub)
        self._loaded.clear()
        offloads.clear()
        gc.collect()
        if self.cuda:
            entry["peak_vram_gb"] = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.empty_cache()
        entry["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        self.report["stages"][name] = entry
        print(f"[{name}] {entry['seconds']:.2f} s, read {_size(entry['read_bytes'])}, streamed "
              f"{_size(entry['streamed_bytes'])}", file=sys.stderr, flush=True)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def token_ids(folder: str, sub: str, prompt: str, length: int, vocab: int) -> torch.Tensor:
    """The prompt's ids through the folder's tokenizer; random ids where it has none."""
    path = os.path.join(folder, sub)
    if os.path.isdir(path):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        return tokenizer(prompt, padding="max_length", max_length=length, truncation=True,
                         return_tensors="pt").input_ids
    return torch.randint(2, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def encode(st: Stages, family: str, prompt: str) -> dict[str, torch.Tensor]:
    """Stage 1: the pipeline's prompt embeddings, each encoder loaded, run and released."""
    out: dict[str, torch.Tensor] = {}
    tiny = st.args.random and st.args.size == "tiny"  # a real folder gets full prompts
    with st.stage("encode") as offloads:
        for sub, cls in FAMILIES[family][2]:
            encoder, offload = st.load(sub, cls)
            offloads.append(offload)
            vocab = encoder.config.vocab_size
            if sub == "text_encoder" and family == "flux":  # CLIP-L: pooled
                ids = token_ids(st.folder, "tokenizer", prompt, 77, vocab).to(st.device)
                out["pooled_prompt_embeds"] = encoder(ids).pooler_output
            else:  # T5-XXL / UMT5-XXL: the sequence
                tok = "tokenizer_2" if family == "flux" else "tokenizer"
                ids = token_ids(st.folder, tok, prompt, 32 if tiny else 512, vocab).to(st.device)
                out["prompt_embeds"] = encoder(ids).last_hidden_state
                if family == "wan":
                    neg = token_ids(st.folder, tok, "", 32 if tiny else 512, vocab).to(st.device)
                    out["negative_prompt_embeds"] = encoder(neg).last_hidden_state
            del encoder
    return out


def _compute_on(pipe: Any, device: torch.device) -> None:
    """diffusers makes latents where the components' first parameters live; streamed weights
    stay host tensors, so the pipeline is told where it computes."""
    cls = type(pipe)
    pipe.__class__ = type(cls.__name__, (cls,), {"_execution_device": property(lambda s: device)})


def denoise(st: Stages, family: str, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stage 2: the steps, the transformer under the named profile; returns packed latents."""
    args = st.args
    pipe_cls, _, _, transformer_cls, vae_cls = FAMILIES[family]
    vae_config = vae_cls.load_config(os.path.join(st.folder, "vae"))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(
        os.path.join(st.folder, "scheduler"))
    with st.stage("denoise") as offloads:
        options = {}
        if not args.no_ddo and args.profile_name:
            options = dict(profile_name=args.profile_name, build_profile=args.calibrate)
        if args.quantize and not args.no_ddo:
            options["quantize"] = args.quantize
        transformer, offload = st.load("transformer", transformer_cls, **options)
        offloads.append(offload)
        generator = torch.Generator().manual_seed(args.seed)
        measured = offload is not None and args.profile_name
        run = offload.profile_run() if measured else contextlib.nullcontext()
        if family == "flux":
            pipe = pipe_cls(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                            text_encoder_2=None, tokenizer_2=None, transformer=transformer)
            pipe.vae_scale_factor = vae_factors(family, vae_config)[0]
            pipe.image_processor = diffusers.image_processor.VaeImageProcessor(
                vae_scale_factor=pipe.vae_scale_factor * 2)
        else:
            pipe = pipe_cls(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                            scheduler=scheduler)
            pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = vae_factors(
                family, vae_config)
        pipe.set_progress_bar_config(disable=not sys.stderr.isatty())
        _compute_on(pipe, st.device)
        call = dict(height=args.height, width=args.width, num_inference_steps=args.steps,
                    generator=generator, output_type="latent", **embeds)
        if family == "wan":
            call["num_frames"] = args.frames
        with run as profile:
            result = pipe(**call)
        if measured:
            st.report["profile"] = dict(profile)
        latents = result.images if family == "flux" else result.frames
        del pipe, transformer
    st.report["denoise_seconds_per_step"] = st.report["stages"]["denoise"]["seconds"] / args.steps
    return latents


def decode(st: Stages, family: str, latents: torch.Tensor) -> np.ndarray:
    """Stage 3: the VAE; returns the images or frames as uint8 [n, h, w, 3]."""
    args = st.args
    vae_cls = FAMILIES[family][4]
    with st.stage("decode") as offloads:
        vae, offload = st.load("vae", vae_cls)
        offloads.append(offload)
        if args.vae_tiling == "on" or (args.vae_tiling == "auto" and st.cuda and
                                       (args.vram_cap or 24) <= 16):
            vae.enable_tiling()
        if family == "flux":
            factor = 2 ** (len(vae.config.block_out_channels) - 1)
            z = diffusers.FluxPipeline._unpack_latents(latents, args.height, args.width, factor)
            z = z / vae.config.scaling_factor + vae.config.shift_factor
            pixels = vae.decode(z.to(vae.dtype), return_dict=False)[0]  # [1, 3, h, w]
        else:
            mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
            z = latents.to(vae.dtype) * std.to(latents) + mean.to(latents)
            pixels = vae.decode(z, return_dict=False)[0][0].transpose(0, 1)  # [f, 3, h, w]
        del vae
    images = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu().numpy()


def write(images: np.ndarray, output: str, fps: int) -> None:
    from PIL import Image

    frames = [Image.fromarray(a) for a in images]
    if output.endswith(("/", os.sep)) or os.path.isdir(output):
        os.makedirs(output, exist_ok=True)
        for i, frame in enumerate(frames):
            frame.save(os.path.join(output, f"{i:04d}.png"))
    elif len(frames) == 1:
        frames[0].save(output)
    else:  # animated WebP
        frames[0].save(output, save_all=True, append_images=frames[1:],
                       duration=max(1, 1000 // fps), loop=0, lossless=True)


# --- the command -----------------------------------------------------------------------------


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a FluxPipeline or WanPipeline folder")
    source.add_argument("--random", metavar="DIR", help="write (once) and use a random folder")
    p.add_argument("--family", choices=sorted(FAMILIES),
                   help="the pipeline --random writes (default flux); an existing folder's "
                        "model_index.json decides, and a --family against it is refused")
    p.add_argument("--size", choices=("tiny", "full"),
                   help="with --random: the folder's size (default tiny)")
    p.add_argument("--device", choices=("cuda", "sim"),
                   default="cuda" if torch.cuda.is_available() else "sim")
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    p.add_argument("--height", type=int, help="pixels: FLUX and Wan take multiples of 16 "
                   "(of 4 for the tiny random FLUX)")
    p.add_argument("--width", type=int, help="as --height")
    p.add_argument("--frames", type=int, default=21,
                   help="Wan: frames, 4k + 1 (2k + 1 for the tiny random Wan); FLUX ignores it")
    p.add_argument("--steps", type=int, help="denoising steps, 1 or more")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vram-cap", type=float, help="GiB of the card ddo may use (vram_cap_gb)")
    p.add_argument("--host-ram-cap", type=float,
                   help="GiB of host RAM for weights (host_ram_cap_gb); the rest stays on disk")
    p.add_argument("--quantize", choices=("fp8", "int8"), help="the transformer's Linears")
    p.add_argument("--profile-name", help="the denoise stage's named profile")
    p.add_argument("--calibrate", action="store_true", help="measure and save that profile")
    p.add_argument("--stream-all", action="store_true",
                   help="stream every weight (tiny models: the presets keep small ones resident)")
    p.add_argument("--vae-tiling", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--no-ddo", action="store_true", help="all resident, the reference")
    p.add_argument("--offload", choices=OFFLOAD_ROUTES, default="ddo",
                   help="who offloads (benchmark W6 compares them): ddo; resident (= --no-ddo); "
                        "diffusers' group offload at leaf level with streams, its model offload "
                        "(whole components moved per stage), its sequential offload (accelerate); "
                        "or diffusers-dynamic-offloader from PyPI. --vram-cap caps the others "
                        "through torch.cuda.set_per_process_memory_fraction")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 (cuda) or float32 (sim)")
    p.add_argument("--fps", type=int, default=16, help="the animated WebP's frames per second")
    p.add_argument("--output", help="a .png, a .webp (frames) or a folder (PNGs)")
    p.add_argument("--report", help="write the generation's report (JSON) here")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    if args.no_ddo:
        args.offload = "resident"
    args.no_ddo = args.offload != "ddo"  # every stage-level ddo option is off for the others
    if args.offload not in ("ddo", "resident") and args.device != "cuda":
        p.error(f"--offload {args.offload} runs on a GPU only (--device cuda)")
    check(p, args)
    return args


def generate(argv: Optional[list[str]] = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Runs one generation; returns the images (uint8 [n, h, w, 3]) and the report."""
    args = parse(argv)  # every flag checked (check()); nothing written or loaded before
    folder, family = args.model or args.random, args.family
    if args.random:
        write_random_folder(family, args.size, folder, args.dtype)
    env = {"DDO_VRAM_CAP_GB": args.vram_cap, "DDO_HOST_RAM_CAP_GB": args.host_ram_cap}
    if args.stream_all:
        env.update(DDO_SMALL_TENSOR_THRESHOLD_KB=0, DDO_AUTO_BUDGET_POLICY="off",
                   DDO_RESIDENT_MODULE_BUDGET_GB=0, DDO_ALWAYS_RESIDENT_MODULE_PATTERNS="")
    if args.offload not in ("ddo", "resident") and args.vram_cap:
        # ddo emulates the card through vram_cap_gb; the others get the allocator's cap.
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap * 2**30 / total))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items() if v is not None})
    try:
        st = Stages(args, folder)
        start = time.perf_counter()
        with torch.no_grad():
            embeds = encode(st, family, args.prompt)
            latents = denoise(st, family, embeds)
            images = decode(st, family, latents)
        st.report["seconds"] = time.perf_counter() - start
        st.report["generation"] = st.meter.finish()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # The size written: the image's own (equal to --height/--width, which check() holds to
    # the pipeline's multiples).
    st.report.update(family=family, folder=folder, device=args.device, ddo=not args.no_ddo,
                     offload=args.offload,
                     height=int(images.shape[1]), width=int(images.shape[2]), steps=args.steps,
                     frames=len(images), vram_cap_gb=args.vram_cap,
                     host_ram_cap_gb=args.host_ram_cap, quantize=args.quantize)
    if args.output:
        write(images, args.output, args.fps)
        st.report["output"] = args.output
    if args.report:
        with open(args.report, "w") as f:
            json.dump(st.report, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in st.report.items() if k not in ("stages", "generation")},
                     default=str))
    return images, st.report


if __name__ == "__main__":
    generate()
