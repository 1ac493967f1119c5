# Copyright 2025 The fastgen-diffusers authors, the Wan Team and The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""``WanCausalImageToVideoPipeline``: image-to-video (and clip extension) with a causal Wan model.

One pipeline serves the three ways a causal Wan model takes an image; :func:`detect_i2v_layout` reads which one a
checkpoint has from its config and components:

* ``"wan2.1-i2v"`` (Wan2.1 I2V 480P/720P, Wan2.2 I2V layout): ``in_channels = 2 * z_dim + 4``. Every forward of chunk
  ``[s, e)`` gets the 20 condition channels ``[mask(4) | VAE latent of [image, zeros...](16)][:, :, s:e]`` concatenated
  to its latents and, when the transformer has ``image_dim``, the CLIP image tokens, whose K/V are cached beside the
  text K/V.
* ``"ti2v"`` (Wan2.2 TI2V-5B, ``expand_timesteps=True``): latent frame 0 of chunk 0 is the clean image latent at
  timestep 0 (per-frame timesteps), and stays clean.
* ``"t2v-student"`` (Self-Forcing / CausVid style T2V students): the image, or a clip being extended, is VAE-encoded
  and written into the KV cache clean, at timestep 0, as given chunks before the generated ones; with
  ``independent_first_frame`` the image is its own chunk (``[1, c, c, ...]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils import logging, replace_example_docstring
from diffusers.utils.torch_utils import get_module_execution_device
from transformers import AutoTokenizer, CLIPVisionModel, UMT5EncoderModel
from transformers.image_processing_utils import BaseImageProcessor

from ..chunking import check_given_frames
from ..models import AutoencoderTinyWan, WanCausalTransformer3DModel
from ..settings import RolloutSettings
from .pipeline_wan_causal import WanCausalPipeline
from .rollout.call_docs import shared_call_docs
from .rollout.conditioning import Conditioner, FirstFrameConditioner, GivenFramesConditioner, ImageConcatConditioner
from .rollout.core import RolloutShape
from .rollout.options import ImageToVideoOptions
from .video_io.clips import clip_frames, clip_layout
from .video_io.streaming_decode import latent_statistics

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

WAN21_I2V = "wan2.1-i2v"
TI2V = "ti2v"
T2V_STUDENT = "t2v-student"
I2V_LAYOUTS = (WAN21_I2V, TI2V, T2V_STUDENT)

EXAMPLE_DOC_STRING = """
    Examples:
        ```python
        >>> import torch
        >>> from diffusers.utils import export_to_video, load_image
        >>> from fastgen_diffusers import WanCausalImageToVideoPipeline, WanCausalTransformer3DModel

        >>> # A T2V student (Self-Forcing / CausVid) trained with a [1, 3, 3, ...] chunk layout: the image is written
        >>> # into the KV cache as the first chunk. Wan2.1 I2V and Wan2.2 TI2V-5B checkpoints load without overrides.
        >>> path = "path/to/self-forcing-i2v-diffusers"
        >>> transformer = WanCausalTransformer3DModel.from_pretrained(
        ...     path, subfolder="transformer", torch_dtype=torch.bfloat16, independent_first_frame=True
        ... )
        >>> pipe = WanCausalImageToVideoPipeline.from_pretrained(
        ...     path, transformer=transformer, torch_dtype=torch.bfloat16
        ... )
        >>> pipe.to("cuda")
        >>> image = load_image("first_frame.png").resize((832, 480))
        >>> video = pipe(image=image, prompt="a red fox runs through fresh snow", num_frames=85).frames[0]
        >>> export_to_video(video, "fox.mp4", fps=16)
        ```
"""

ImageInput = PIL.Image.Image | np.ndarray | torch.Tensor | list[PIL.Image.Image]


def detect_i2v_layout(transformer_config, vae_config, expand_timesteps: bool) -> str:
    """How a causal Wan model takes an image: one of ``I2V_LAYOUTS`` (see the module docstring).

    Args:
        transformer_config: the transformer's config (``in_channels``, ``out_channels``, ``image_dim``).
        vae_config: the VAE's config (``z_dim``, ``scale_factor_temporal``).
        expand_timesteps: the pipeline's ``expand_timesteps`` (Wan2.2 TI2V-5B).
    """
    in_channels, out_channels = transformer_config.in_channels, transformer_config.out_channels
    z_dim = vae_config.z_dim
    concat_channels = out_channels + vae_config.scale_factor_temporal + z_dim
    if out_channels != z_dim:
        raise ValueError(
            f"The transformer predicts {out_channels} channels but the VAE has z_dim={z_dim}: they must match."
        )
    if in_channels == concat_channels:
        if expand_timesteps:
            raise ValueError(
                f"`expand_timesteps=True` (Wan2.2 TI2V) does not apply to a {in_channels}-channel Wan2.1 I2V "
                "transformer; set `expand_timesteps=False`."
            )
        return WAN21_I2V
    if in_channels == out_channels and transformer_config.image_dim is None:
        return TI2V if expand_timesteps else T2V_STUDENT
    raise ValueError(
        f"This transformer (in_channels={in_channels}, out_channels={out_channels}, "
        f"image_dim={transformer_config.image_dim}) cannot take an image: accepted are in_channels={concat_channels} "
        f"(Wan2.1 I2V, mask and image latent concatenated) or in_channels={out_channels} without image_dim (Wan2.2 "
        "TI2V with `expand_timesteps=True`, or a T2V student)."
    )


class WanCausalImageToVideoPipeline(WanCausalPipeline):
    r"""
    Image-to-video generation (and, for T2V students, clip extension) with a causal Wan model: the video is generated
    chunk by chunk of latent frames on a KV cache, conditioned on an image as the checkpoint's layout prescribes
    (see [`detect_i2v_layout`] and [`~WanCausalImageToVideoPipeline.i2v_layout`]).

    This model inherits from [`WanCausalPipeline`] (prompt encoding, loading, decoding, the shared chunk rollout) and
    conditions the chunks with the [`Conditioner`] of its layout (kept by a kept rollout, which can be continued).

    Args:
        tokenizer ([`T5Tokenizer`], *optional*):
            Tokenizer of [google/umt5-xxl](https://huggingface.co/google/umt5-xxl).
        text_encoder ([`UMT5EncoderModel`], *optional*):
            UMT5 encoder; may be `None` when every call passes `prompt_embeds`.
        vae ([`AutoencoderKLWan`]):
            The Wan VAE (Wan2.1: z_dim 16; Wan2.2 TI2V-5B: z_dim 48, 16x spatial compression).
        scheduler ([`FlowMatchEulerDiscreteScheduler`]):
            The few-step sampler, `FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)`.
        transformer ([`WanCausalTransformer3DModel`]):
            The causal transformer.
        image_processor ([`CLIPImageProcessor`], *optional*):
            CLIP preprocessing; only for Wan2.1 I2V transformers with `image_dim`.
        image_encoder ([`CLIPVisionModel`], *optional*):
            CLIP ViT-H/14 image encoder (its penultimate hidden states); only for Wan2.1 I2V transformers with
            `image_dim`.
        expand_timesteps (`bool`, defaults to `False`):
            Wan2.2 TI2V-5B: the first latent frame is the clean image latent at timestep 0 inside chunk 0.
    """

    model_cpu_offload_seq = "text_encoder->image_encoder->transformer->vae->decoder"
    _needs_wan_vae_for = "the image or clip"
    _optional_components = [
        "tokenizer", "text_encoder", "transformer", "decoder", "image_processor", "image_encoder"
    ]  # fmt: skip
    _options_class = ImageToVideoOptions

    def __init__(
        self,
        tokenizer: AutoTokenizer | None,
        text_encoder: UMT5EncoderModel | None,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchEulerDiscreteScheduler,
        transformer: WanCausalTransformer3DModel,
        image_processor: BaseImageProcessor | None = None,  # CLIPImageProcessor; that name warns without torchvision
        image_encoder: CLIPVisionModel | None = None,
        expand_timesteps: bool = False,
        timesteps: list[float] | None = None,
        context_noise: float = 0.0,
        first_chunk_timesteps: list[float] | None = None,
        attention_window: int | None = None,
        sink_frames: int = 0,
        kv_cache_policy: str | None = None,
        context_frames: int | None = None,
        kv_cache_attention_bias: float | None = None,
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str = "absolute",
        sink_update: str = "fixed",
        sink_decay: float = 0.999,
        # Krea's re-encoded anchor (recompute)
        keep_first_frame: bool = False,
        decoder: AutoencoderTinyWan | None = None,
    ):
        super().__init__(
            tokenizer, text_encoder, vae, scheduler, transformer, timesteps, context_noise, first_chunk_timesteps,
            attention_window, sink_frames, kv_cache_policy, context_frames, kv_cache_attention_bias,
            rope_positions, sink_update, sink_decay, keep_first_frame, decoder,
        )  # fmt: skip
        self.register_modules(image_processor=image_processor, image_encoder=image_encoder)
        self.register_to_config(expand_timesteps=expand_timesteps)

    @property
    def i2v_layout(self) -> str:
        """``"wan2.1-i2v"``, ``"ti2v"`` or ``"t2v-student"``: how this pipeline's transformer takes an image."""
        return detect_i2v_layout(self.transformer.config, self.vae.config, self.config.expand_timesteps)

    @property
    def uses_image_tokens(self) -> bool:
        """Whether the transformer takes CLIP image tokens (`encoder_hidden_states_image`, Wan2.1 I2V)."""
        return self.transformer.config.image_dim is not None

    # ------------------------------------------------------------------ conditioning
    def encode_image(self, pixels: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """CLIP image tokens ``(B, L_img, image_dim)`` (penultimate hidden states) of ``(B, 3, H, W)`` pixels in
        [-1, 1]; ``L_img`` is 257 for CLIP ViT-H/14."""
        device = device or self._execution_device
        inputs = self.image_processor(images=(pixels.float() + 1.0) / 2.0, do_rescale=False, return_tensors="pt")
        inputs = inputs.to(get_module_execution_device(self.image_encoder))
        hidden_states = self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]
        return hidden_states.to(device)

    def encode_video_latents(self, video: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Normalized latents ``(B, z_dim, (F - 1) // 4 + 1, H / s, W / s)`` of ``(B, 3, F, H, W)`` pixels in [-1, 1]
        (the VAE's mode, as diffusers' image-to-video pipelines encode conditions)."""
        vae = self.vae
        video = video.to(get_module_execution_device(vae), dtype=vae.dtype)
        latents = vae.encode(video).latent_dist.mode().to(device, torch.float32)
        mean, std = latent_statistics(vae, latents)
        return (latents - mean) / std

    def prepare_image_condition(self, pixels: torch.Tensor, num_frames: int, device: torch.device) -> torch.Tensor:
        """Wan2.1 I2V condition ``(B, 4 + z_dim, F', h, w)``: the first-frame mask (4 temporal sub-channels, ones on
        latent frame 0 only) and the latent of ``[image, zeros x (num_frames - 1)]`` from ``(B, 3, H, W)`` pixels."""
        batch_size, _, height, width = pixels.shape
        video = torch.cat([pixels[:, :, None], pixels.new_zeros(batch_size, 3, num_frames - 1, height, width)], dim=2)
        latent = self.encode_video_latents(video, device)
        mask = torch.zeros(
            batch_size, self.vae_scale_factor_temporal, *latent.shape[2:], device=device, dtype=latent.dtype
        )
        mask[:, :, 0] = 1.0
        return torch.cat([mask, latent], dim=1)

    def _preprocess_image(self, image: ImageInput, height: int, width: int, batch_size: int) -> torch.Tensor:
        """``(batch_size, 3, height, width)`` pixels in [-1, 1] from one image or one per video."""
        pixels = self.video_processor.preprocess(image, height=height, width=width)
        if pixels.shape[0] == 1:
            pixels = pixels.expand(batch_size, -1, -1, -1)
        return pixels

    # ------------------------------------------------------------------ rollout hooks
    def check_conditioning_inputs(self, options: ImageToVideoOptions, batch_size: int) -> RolloutShape:
        """The image or clip checks ([`check_image_inputs`]); the output size defaults to the image's."""
        height, width = self.check_image_inputs(
            options.image, options.video, options.image_embeds, options.height, options.width, batch_size
        )
        return RolloutShape(height, width, options.num_frames)

    def check_conditioning_fits(self, options: ImageToVideoOptions, bounds: Sequence[tuple[int, int]]) -> None:
        self.check_context_frames(options.video, options.num_frames, bounds, options.chunk_size)

    def prepare_conditioner(
        self, options: ImageToVideoOptions, shape: RolloutShape, batch_size: int, device: torch.device
    ) -> Conditioner:
        """Encode the image or clip into the conditioner of this checkpoint's layout: a clip or a T2V student's
        image are given frames, Wan2.2 TI2V's image its clean first frame, Wan2.1 I2V's image the concatenated
        condition (which grows when the rollout is continued) and the CLIP tokens."""
        height, width = shape.height, shape.width
        if options.video is not None:
            pixels = self.video_processor.preprocess_video(options.video, height=height, width=width).to(device)
            return GivenFramesConditioner(self.encode_video_latents(pixels.expand(batch_size, -1, -1, -1, -1), device))
        pixels = self._preprocess_image(options.image, height, width, batch_size).to(device)
        layout = self.i2v_layout
        if layout == WAN21_I2V:
            image_embeds = None
            if self.uses_image_tokens:
                embeds = options.image_embeds
                embeds = self.encode_image(pixels, device) if embeds is None else embeds.to(device)
                embeds = embeds.expand(batch_size, -1, -1) if embeds.shape[0] == 1 else embeds
                image_embeds = embeds.to(self.transformer.dtype).contiguous()
            temporal = self.vae_scale_factor_temporal

            def encode(num_latent_frames: int) -> torch.Tensor:
                return self.prepare_image_condition(pixels, temporal * (num_latent_frames - 1) + 1, device)

            condition = self.prepare_image_condition(pixels, options.num_frames, device)
            return ImageConcatConditioner(condition, image_embeds, encode)
        image_latents = self.encode_video_latents(pixels[:, :, None], device)
        if layout == TI2V:
            return FirstFrameConditioner(image_latents)
        return GivenFramesConditioner(image_latents)

    # ------------------------------------------------------------------ validation
    def check_image_inputs(
        self,
        image: ImageInput | None,
        video: Any,
        image_embeds: torch.Tensor | None,
        height: int | None,
        width: int | None,
        batch_size: int,
    ) -> tuple[int, int]:
        """Raise ``ValueError`` for image / clip inputs this checkpoint's layout cannot take; returns ``(height,
        width)`` (taken from the image or clip when not given). Runs before any model work; the chunk fit of the
        given frames is checked by :meth:`check_context_frames` once ``num_frames`` is validated."""
        layout = self.i2v_layout
        if (image is None) == (video is None):
            raise ValueError("Pass exactly one of `image` (a first frame) and `video` (a clip to extend).")
        if video is not None and layout != T2V_STUDENT:
            raise ValueError(
                f"`video` (clip extension) applies only to T2V students (layout {T2V_STUDENT!r}); this pipeline's "
                f"layout is {layout!r}: pass `image`."
            )
        if image_embeds is not None and not (layout == WAN21_I2V and self.uses_image_tokens):
            raise ValueError(
                f"`image_embeds` (CLIP tokens) apply only to Wan2.1 I2V transformers with `image_dim`; this "
                f"pipeline's layout is {layout!r} (image_dim={self.transformer.config.image_dim})."
            )
        if layout == WAN21_I2V and self.uses_image_tokens and image_embeds is None:
            if self.image_encoder is None or self.image_processor is None:
                raise ValueError(
                    "This Wan2.1 I2V transformer takes CLIP image tokens (`image_dim` is set) but the pipeline has no "
                    "`image_encoder` / `image_processor`: load them, or pass `image_embeds`."
                )
        if image_embeds is not None:
            image_dim = self.transformer.config.image_dim
            if (
                not isinstance(image_embeds, torch.Tensor)
                or image_embeds.ndim != 3
                or image_embeds.shape[-1] != image_dim
            ):
                shape = tuple(image_embeds.shape) if isinstance(image_embeds, torch.Tensor) else type(image_embeds)
                raise ValueError(f"`image_embeds` must be a (batch, tokens, {image_dim}) tensor, got {shape}.")
            if image_embeds.shape[0] not in (1, batch_size):
                raise ValueError(f"`image_embeds` has batch {image_embeds.shape[0]}; accepted: 1 or {batch_size}.")

        if video is not None:
            name, images = "video", clip_frames(video, "video")
        else:
            name, images = "image", image if isinstance(image, list) else [image]
        if not images:
            raise ValueError("`image` is an empty list; pass one PIL image, or one per video.")
        sizes = set()
        for item in images:
            if isinstance(item, PIL.Image.Image):
                sizes.add((item.height, item.width))
            elif isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim in (3, 4):
                channels_last = isinstance(item, np.ndarray)
                shape = item.shape[-3:-1] if channels_last else item.shape[-2:]
                channels = item.shape[-1] if channels_last else item.shape[-3]
                if channels != 3:
                    layout_name = "(..., H, W, 3)" if channels_last else "(..., 3, H, W)"
                    raise ValueError(f"`{name}` must be RGB {layout_name}, got shape {tuple(item.shape)}.")
                if not channels_last and item.ndim == 4 and image is not None and item.shape[0] not in (1, batch_size):
                    raise ValueError(f"`image` has batch {item.shape[0]}; accepted: 1 or {batch_size}.")
                sizes.add(tuple(int(s) for s in shape))
            else:
                what = type(item).__name__ if not hasattr(item, "shape") else f"shape {tuple(item.shape)}"
                raise ValueError(
                    f"`{name}` must be a PIL image, a (3, H, W) / (B, 3, H, W) tensor or an (H, W, 3) array in "
                    f"[0, 1], or a list of PIL images, got {what}."
                )
        if image is not None and isinstance(image, list) and len(image) not in (1, batch_size):
            raise ValueError(f"`image` is a list of {len(image)} images; accepted: 1 or {batch_size}.")
        if len(sizes) != 1:
            raise ValueError(f"Every frame of `{name}` must have the same size, got {sorted(sizes)}.")
        (image_height, image_width) = sizes.pop()
        multiple = self.vae_scale_factor_spatial * self.transformer.config.patch_size[1]
        resizable = all(isinstance(item, PIL.Image.Image) for item in images)
        if height is None and width is None:
            height, width = image_height, image_width
            if height % multiple or width % multiple:
                raise ValueError(
                    f"`{name}` is {image_height}x{image_width} (H x W), not a multiple of {multiple}: resize it, or "
                    f"pass `height` and `width` (multiples of {multiple}) to resize PIL images."
                )
        elif height is None or width is None:
            raise ValueError("Pass both `height` and `width`, or neither (then the image's size is used).")
        elif (height, width) != (image_height, image_width) and not resizable:
            raise ValueError(
                f"`{name}` is {image_height}x{image_width} (H x W) but `height`x`width` is {height}x{width}: tensors "
                "and arrays are not resampled; pass them at the output size, or pass PIL images."
            )

        return height, width

    def check_context_frames(
        self, video: Any, num_frames: int, bounds: Sequence[tuple[int, int]], chunk_size: int | None
    ) -> None:
        """T2V students: the image (1 frame) or the clip must fill whole chunks of the rollout (its chunks ``bounds``)
        and leave some to generate; raise ``ValueError`` otherwise. Other layouts take no given chunks."""
        if self.i2v_layout != T2V_STUDENT:
            return
        name = "image" if video is None else "video"
        num_pixel_frames = 1 if video is None else clip_layout(video, "video")[0]
        config = self.transformer.config
        check_given_frames(
            name,
            num_pixel_frames,
            num_frames,
            bounds,
            chunk_size or config.chunk_size,
            config.independent_first_frame,
            self.vae_scale_factor_temporal,
        )

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    @replace_example_docstring(EXAMPLE_DOC_STRING)
    @shared_call_docs
    def __call__(
        self,
        image: ImageInput | None = None,
        prompt: str | list[str] | dict[int, str | list[str]] | None = None,
        negative_prompt: str | list[str] | None = None,
        video: list[PIL.Image.Image] | torch.Tensor | np.ndarray | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int = 81,
        num_inference_steps: int | None = None,
        timesteps: Sequence[float] | None = None,
        sigmas: Sequence[float] | None = None,
        first_chunk_timesteps: Sequence[float] | None = None,
        guidance_scale: float = 1.0,
        chunk_size: int | None = None,
        context_noise: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]]
        | PipelineCallback
        | MultiPipelineCallbacks
        | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' signature)
        max_sequence_length: int = 512,
        keep_cache: bool = False,
        recache: bool = False,
        attention_window: int | None = None,
        sink_frames: int | None = None,
        kv_cache_engine: str | None = "static",
        num_videos_per_prompt: int = 1,
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str | None = None,
        sink_update: str | None = None,
        sink_decay: float | None = None,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
        # KV cache policy, attention bias and prompt transitions: conditioned chunks sample sequentially
        kv_cache_policy: str | None = None,
        context_frames: int | None = None,
        kv_cache_attention_bias: float | None = None,
        keep_first_frame: bool | None = None,
        prompt_transition_chunks: int = 0,
        # prompt-switch policies (LongLive, Infinity-RoPE)
        recache_sink: str = "rerun",
        kv_flush: bool = False,
        rope_cut: bool | list[int] = False,
        settings: RolloutSettings | None = None,
    ) -> WanPipelineOutput | tuple:
        r"""
        The call function to the pipeline for generation.

        Args:
            image (`PIL.Image.Image`, `np.ndarray`, `torch.Tensor` or `list[PIL.Image.Image]`, *optional*):
                The first frame: a PIL image, a `(3, H, W)` / `(B, 3, H, W)` tensor in [0, 1], an `(H, W, 3)` array,
                or one PIL image per video. Exactly one of `image` and `video` is required.
            prompt (`str`, `list[str]` or `dict`, *optional*):
                The prompt or prompts to guide the video generation. If not defined, pass `prompt_embeds` instead. A
                dict `{pixel_frame: prompt}` (keys include 0) switches prompts at chunk boundaries, as in
                [`WanCausalPipeline`].
            video (`list[PIL.Image.Image]`, `torch.Tensor` or `np.ndarray`, *optional*):
                T2V students only: a clip of 4k+1 frames to extend (`(F, 3, H, W)` tensor in [0, 1] or `(F, H, W,
                3)` array); its latents must fill whole chunks (e.g. 9 frames = 3 latent frames for 3-frame chunks).
            height (`int`, *optional*):
                Height in pixels, a multiple of the VAE's spatial factor times the patch (16 for Wan2.1, 32 for
                Wan2.2 TI2V-5B); defaults to the image's. PIL images are resized to it; tensors must match it.
            width (`int`, *optional*):
                Width in pixels, as `height`.
            num_frames (`int`, defaults to `81`):
                Number of pixel frames of the output, of the form 4k+1, counting the given image or clip.
            context_noise (`float`, *optional*):
                Timestep of the pass that writes each generated chunk into the KV cache (given chunks are written
                clean, at 0); defaults to the pipeline's stored `context_noise` (0 unless a converted student says
                otherwise).
            latents (`torch.Tensor`, *optional*):
                Initial noise `(B, z_dim, (num_frames - 1) // 4 + 1, height / s, width / s)` of the whole video
                (the frames of given chunks are not used).
            prompt_embeds (`torch.Tensor`, *optional*):
                Pre-generated text embeddings `(B, L, text_dim)`.
            image_embeds (`torch.Tensor`, *optional*):
                Wan2.1 I2V with `image_dim` only: pre-computed CLIP tokens `(B, L_img, image_dim)` (penultimate
                hidden states); the image is then used for the VAE condition only.
            keep_cache (`bool`, defaults to `False`):
                Keep the rollout (KV caches, chunks, image conditioning) after the call, to go on with
                `continue_rollout`, `redo_last_chunk` or `fork_rollout`; by default it is freed.
            kv_cache_policy (`str`, *optional*), context_frames (`int`, *optional*), \
            keep_first_frame (`bool`, *optional*):
                Only `"sequential"` (or `None`): this pipeline conditions its chunks by frame, which the recompute
                and rolling policies do not follow (refused before any work; a stored policy of theirs is left
                out, with its settings).
            {shared_args}

        Examples:

        Returns:
            [`~pipelines.wan.pipeline_output.WanPipelineOutput`] or `tuple`: the frames (`frames`), the given image
            or clip first (as the VAE reconstructs it), or `(frames,)` when `return_dict` is `False`.
        """
        return self.generate_call(locals())
