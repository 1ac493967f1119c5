"""``WanCausalVACEPipeline``: controllable (VACE) video generation with a causal Wan student, chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import PIL.Image
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanVACETransformer3DModel
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.pipelines.wan.pipeline_wan_vace import WanVACEPipeline
from transformers import AutoTokenizer, UMT5EncoderModel

from ..models import AutoencoderTinyWan, VACEHintCache, WanCausalVACETransformer3DModel
from ..settings import RolloutSettings
from .pipeline_wan_causal import WanCausalPipeline, _model_config, _share_weights
from .rollout.call_docs import shared_call_docs
from .rollout.conditioning import VACEConditioner
from .rollout.core import RolloutShape
from .rollout.options import VACEOptions
from .video_io.clips import clip_layout, first_frames

REFERENCE_MODES = ("RGB", "L")


def causal_transformer_from_wan_vace(
    transformer: WanVACETransformer3DModel, **causal_config
) -> WanCausalVACETransformer3DModel:
    """A [`WanCausalVACETransformer3DModel`] sharing the parameters of a plain ``WanVACETransformer3DModel``."""
    config = {**_model_config(transformer), **causal_config}
    return _share_weights(transformer, WanCausalVACETransformer3DModel, config)


class WanCausalVACEPipeline(WanCausalPipeline):
    r"""
    Controllable video generation (VACE: a control video, its mask and reference images) with a causal Wan VACE
    student, chunk by chunk of latent frames on the KV caches of the ``"main"`` and ``"vace"`` branches.

    Same conventions as [`WanCausalPipeline`] (loading, prompts, schedule, CFG, outputs, errors; the rollout is the
    shared rollout of [`CausalRolloutMixin`]; a kept rollout can be continued past the control video, which then
    grows with black frames under a white mask). The control inputs are prepared as [`WanVACEPipeline`] does (its own
    methods): the masked inactive/reactive VAE latents (32 channels), the mask folded to 64 channels (latent frame by
    latent frame, [`prepare_masks`], so a chunk's control never depends on the call's length), and reference
    images prepended along time as extra leading latent frames, which are generated with the video and dropped
    before decoding. Each forward of chunk ``[s, e)`` receives the control latents ``[:, :, s:e]``.

    Args:
        tokenizer ([`T5Tokenizer`], *optional*): Tokenizer of UMT5.
        text_encoder ([`UMT5EncoderModel`], *optional*): UMT5 encoder (optional with `prompt_embeds`).
        vae ([`AutoencoderKLWan`]): encodes the control video and reference images, decodes the result.
        scheduler ([`FlowMatchEulerDiscreteScheduler`]): the few-step sampler (`stochastic_sampling=True`).
        transformer ([`WanCausalVACETransformer3DModel`]): the causal VACE transformer.
    """

    _transformer_class = WanCausalVACETransformer3DModel
    _needs_wan_vae_for = "the control video and reference images"
    _options_class = VACEOptions

    def __init__(
        self,
        tokenizer: AutoTokenizer | None,
        text_encoder: UMT5EncoderModel | None,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchEulerDiscreteScheduler,
        transformer: WanCausalVACETransformer3DModel,
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

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pipe(cls, pipeline: DiffusionPipeline, **kwargs) -> WanCausalVACEPipeline:
        r"""Build from another pipeline's components, e.g. a `WanVACEPipeline` (no extra memory): a plain
        `WanVACETransformer3DModel` becomes a [`WanCausalVACETransformer3DModel`] sharing its parameters."""
        transformer = getattr(pipeline, "transformer", None)
        if "transformer" not in kwargs and type(transformer) is WanVACETransformer3DModel:
            kwargs["transformer"] = causal_transformer_from_wan_vace(transformer)
        return super().from_pipe(pipeline, **kwargs)

    # ------------------------------------------------------------------ control inputs (diffusers' VACE code)
    preprocess_conditions = WanVACEPipeline.preprocess_conditions
    prepare_video_latents = WanVACEPipeline.prepare_video_latents

    def prepare_masks(
        self,
        mask: torch.Tensor,
        reference_images: list[list[torch.Tensor]] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """[`WanVACEPipeline.prepare_masks`] latent frame by latent frame: latent frame ``i`` takes the mask of its
        own pixel frames (frame 0 for the first, ``[4i - 3, 4i]`` after it), so a chunk's control does not depend on
        the length of the call (diffusers resamples the whole mask over time, nearest-exact, so a time-varying mask
        would give the first chunks of a 21- and a 45-frame call, or a kept rollout and its continuation, different
        masks). ``mask`` is ``(1, 1, F, H, W)`` pixels, ``F = 1 + 4k``; returns ``(1, 64, refs + 1 + k, h, w)``."""
        temporal = self.vae_scale_factor_temporal
        groups = [mask[:, :, :1]] + [mask[:, :, s : s + temporal] for s in range(1, mask.shape[2], temporal)]
        folded = [WanVACEPipeline.prepare_masks(self, groups[0], reference_images, generator)]
        folded += [WanVACEPipeline.prepare_masks(self, group, [[]], generator) for group in groups[1:]]  # no refs
        return torch.cat(folded, dim=2)

    def check_vace_inputs(
        self,
        video: Any,
        mask: Any,
        reference_images: PIL.Image.Image | list[PIL.Image.Image] | list[list[PIL.Image.Image]] | None,
        conditioning_scale: float | Sequence[float] | torch.Tensor,
        height: int,
        width: int,
        num_frames: int,
        vace_hint_refresh_interval: int,
        allow_lossy: bool,
    ) -> int:
        """Raise ``ValueError`` for control inputs the rollout cannot use; returns the number of reference images."""
        for name, frames in (("video", video), ("mask", mask)):
            if frames is None:
                continue
            count, channels, frame_height, frame_width = clip_layout(frames, name)
            if (frame_height, frame_width) != (height, width):
                raise ValueError(
                    f"`{name}` frames must be {height}x{width} (height x width, the output size), got "
                    f"{frame_height}x{frame_width}; resize them first."
                )
            if count < num_frames:
                raise ValueError(f"`{name}` has {count} frames, which does not cover `num_frames={num_frames}`.")
            allowed = (3,) if name == "video" else (1, 3)
            if channels not in allowed:
                raise ValueError(
                    f"`{name}` frames must have {' or '.join(map(str, allowed))} channels, got {channels}."
                )
        if mask is not None and video is None:
            raise ValueError("`mask` can only be passed together with `video`.")

        if reference_images is None:
            references = []
        elif isinstance(reference_images, PIL.Image.Image):
            references = [reference_images]
        elif (
            isinstance(reference_images, list) and len(reference_images) == 1 and isinstance(reference_images[0], list)
        ):
            references = reference_images[0]
        elif isinstance(reference_images, list):
            references = reference_images
        else:
            raise ValueError(
                "`reference_images` must be a PIL image, a list of PIL images or a list holding one list of PIL "
                f"images, got {type(reference_images).__name__}."
            )
        for image in references:
            if not isinstance(image, PIL.Image.Image) or image.mode not in REFERENCE_MODES or min(image.size) < 1:
                described = f"a {image.mode} {image.size} image" if isinstance(image, PIL.Image.Image) else image
                raise ValueError(
                    f"Every reference image must be a non-empty PIL image in mode {REFERENCE_MODES}, got "
                    f"{described}; convert it with `image.convert('RGB')`."
                )

        num_layers = len(self.transformer.config.vace_layers)
        if not isinstance(conditioning_scale, (int, float)):
            count = torch.as_tensor(conditioning_scale).numel()
            if count != num_layers:
                raise ValueError(
                    f"`conditioning_scale` must be a float or one value per VACE layer ({num_layers}), got {count}."
                )
        if not isinstance(vace_hint_refresh_interval, int) or vace_hint_refresh_interval < 1:
            raise ValueError(
                f"`vace_hint_refresh_interval` must be a positive int, got {vace_hint_refresh_interval!r}."
            )
        if vace_hint_refresh_interval > 1 and not allow_lossy:
            raise ValueError(
                f"`vace_hint_refresh_interval={vace_hint_refresh_interval}` reuses VACE hints across denoising steps, "
                "which changes the output (lossy); pass `allow_lossy=True` to enable it."
            )
        return len(references)

    def prepare_control_latents(
        self,
        video: Any,
        mask: Any,
        reference_images: Any,
        height: int,
        width: int,
        num_frames: int,
        device: torch.device,
    ) -> torch.Tensor:
        """``(1, 96, num_refs + latent frames, H/8, W/8)`` control latents, built as [`WanVACEPipeline`] does. A
        ``video`` / ``mask`` shorter than ``num_frames`` (a continued rollout) is padded with black frames under a
        white mask (generate freely)."""
        video, mask = first_frames(video, num_frames), first_frames(mask, num_frames, fill=1.0)
        video, mask, references = self.preprocess_conditions(
            video, mask, reference_images, 1, height, width, num_frames, torch.float32, device
        )
        latents = self.prepare_video_latents(video, mask, references, None, device)
        return torch.cat([latents, self.prepare_masks(mask, references, None)], dim=1)

    # ------------------------------------------------------------------ rollout hooks
    def check_conditioning_inputs(self, options: VACEOptions, batch_size: int) -> RolloutShape:
        """The control checks ([`check_vace_inputs`]); reference images add leading latent frames."""
        num_refs = self.check_vace_inputs(
            options.video,
            options.mask,
            options.reference_images,
            options.conditioning_scale,
            options.height,
            options.width,
            options.num_frames,
            options.vace_hint_refresh_interval,
            options.allow_lossy,
        )
        total_frames = options.num_frames + num_refs * self.vae_scale_factor_temporal
        return RolloutShape(options.height, options.width, total_frames, num_refs)

    def prepare_conditioner(
        self, options: VACEOptions, shape: RolloutShape, batch_size: int, device: torch.device
    ) -> VACEConditioner:
        """The control latents (one control video, shared by the batch), the per-layer scale and the hint cache;
        the control grows (black frames, white mask) when the rollout is continued past the control video."""
        temporal = self.vae_scale_factor_temporal
        dtype = self.transformer.dtype

        def encode(num_latent_frames: int) -> torch.Tensor:
            num_frames = temporal * (num_latent_frames - shape.num_reference_frames - 1) + 1
            control = self.prepare_control_latents(
                options.video, options.mask, options.reference_images, shape.height, shape.width, num_frames, device
            )
            return control.to(dtype).expand(batch_size, -1, -1, -1, -1)

        hint_cache = None
        if options.vace_hint_refresh_interval > 1:
            hint_cache = VACEHintCache(options.vace_hint_refresh_interval, allow_lossy=options.allow_lossy)
        control = encode((shape.num_frames - 1) // temporal + 1)
        return VACEConditioner(control, options.conditioning_scale, hint_cache, encode)

    @torch.no_grad()
    @shared_call_docs
    def __call__(
        self,
        prompt: str | list[str] | dict[int, str | list[str]] | None = None,
        negative_prompt: str | list[str] | None = None,
        video: Any = None,
        mask: Any = None,
        reference_images: PIL.Image.Image | list[PIL.Image.Image] | list[list[PIL.Image.Image]] | None = None,
        conditioning_scale: float | Sequence[float] | torch.Tensor = 1.0,
        height: int = 480,
        width: int = 832,
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
        vace_hint_refresh_interval: int = 1,
        allow_lossy: bool = False,
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
        Generate a video steered by a control video, its mask and reference images.

        Args:
            video (list of PIL images, `(F, 3, H, W)` tensor or `(F, H, W, 3)` array in [0, 1], *optional*):
                The control video at the output size, at least `num_frames` frames (later ones are ignored);
                zeros when omitted, as in `WanVACEPipeline`.
            mask (same types, 1 or 3 channels, *optional*):
                White where the video is to be generated, black where `video` is kept; all white when omitted.
            reference_images (`PIL.Image.Image` or a list of them, *optional*):
                Images letterboxed onto a white canvas and prepended as leading latent frames (dropped from the
                output).
            conditioning_scale (`float`, a list or a tensor of one value per VACE layer, defaults to `1.0`):
                Scale of each VACE layer's hint.
            vace_hint_refresh_interval (`int`, defaults to `1`):
                1 recomputes the VACE hints at every forward (exact). K > 1 reuses a chunk's hints for the
                denoising steps between refreshes every K steps, skipping the VACE layers there (lossy; needs
                `allow_lossy=True`). Cache-filling passes always recompute them.
            allow_lossy (`bool`, defaults to `False`):
                Required for `vace_hint_refresh_interval > 1`.
            kv_cache_policy (`str`, *optional*), context_frames (`int`, *optional*), \
            keep_first_frame (`bool`, *optional*):
                Only `"sequential"` (or `None`): this pipeline conditions its chunks by frame, which the recompute
                and rolling policies do not follow (refused before any work; a stored policy of theirs is left
                out, with its settings).
            {shared_args}

        Returns:
            [`~pipelines.wan.pipeline_output.WanPipelineOutput`] or `tuple`, as [`WanCausalPipeline`].
        """
        return self.generate_call(locals())
