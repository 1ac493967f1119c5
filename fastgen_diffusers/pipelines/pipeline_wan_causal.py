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
"""``WanCausalPipeline``: text-to-video with a causal (chunk-by-chunk, KV-cached) Wan student."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLWan, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.loaders import WanLoraLoaderMixin
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.utils import logging, replace_example_docstring
from diffusers.video_processor import VideoProcessor
from transformers import AutoTokenizer, UMT5EncoderModel

from ..hub import HubPipelineMixin
from ..models import AutoencoderTinyWan, WanCausalTransformer3DModel
from ..models.transformer_wan_causal import CAUSAL_CONFIG_KEYS
from ..settings import CONFIG_KEYS, RolloutSettings
from .rollout.call_docs import shared_call_docs, stored_settings_docs
from .rollout.core import OUTPUT_TYPES, RolloutShape
from .rollout.live import LiveRolloutMixin
from .rollout.options import RolloutOptions

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name
# The "Loaded <component> as <class> ..." lines of the components loaded here go where diffusers logs its own.
loading_logger = logging.get_logger(DiffusionPipeline.__module__)

CAUSAL_SHIFT = 5.0
HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision")

EXAMPLE_DOC_STRING = """
    Examples:
        ```python
        >>> import torch
        >>> from diffusers.utils import export_to_video
        >>> from fastgen_diffusers import WanCausalPipeline

        >>> # Any diffusers-format Wan2.1 T2V directory or Hub repo holding a causal student's transformer weights
        >>> # (Self-Forcing, CausVid, ...); the transformer loads as a causal model with the same weights.
        >>> pipe = WanCausalPipeline.from_pretrained("path/to/self-forcing-diffusers", dtype=torch.bfloat16)
        >>> pipe.to("cuda")

        >>> video = pipe(
        ...     "a red fox runs through fresh snow",
        ...     height=480,
        ...     width=832,
        ...     num_frames=81,
        ...     generator=torch.Generator().manual_seed(0),
        ... ).frames[0]
        >>> export_to_video(video, "fox.mp4", fps=16)
        ```
"""


def _model_config(transformer: WanTransformer3DModel, drop: Sequence[str] = ()) -> dict[str, Any]:
    return {key: value for key, value in transformer.config.items() if not key.startswith("_") and key not in drop}


def _share_weights(source: WanTransformer3DModel, target_cls: type, config: dict[str, Any]) -> WanTransformer3DModel:
    """A ``target_cls`` model built on ``config`` whose parameters are ``source``'s tensors (no copy)."""
    with init_empty_weights():
        target = target_cls.from_config(config)
    target.load_state_dict(source.state_dict(), strict=True, assign=True)
    return target.train(source.training)


def causal_transformer_from_wan(transformer: WanTransformer3DModel, **causal_config) -> WanCausalTransformer3DModel:
    """A [`WanCausalTransformer3DModel`] sharing the parameters of a plain ``WanTransformer3DModel`` (no copy).

    ``causal_config`` sets ``chunk_size`` / ``independent_first_frame`` (defaults 3 / False).
    """
    return _share_weights(transformer, WanCausalTransformer3DModel, {**_model_config(transformer), **causal_config})


def wan_transformer_from_causal(transformer: WanCausalTransformer3DModel) -> WanTransformer3DModel:
    """A plain (bidirectional) ``WanTransformer3DModel`` sharing the parameters of a causal one (no copy)."""
    return _share_weights(transformer, WanTransformer3DModel, _model_config(transformer, drop=CAUSAL_CONFIG_KEYS))


def causal_scheduler_from_config(config: dict[str, Any]) -> FlowMatchEulerDiscreteScheduler:
    """The students' few-step sampler from a saved scheduler config.

    A `FlowMatchEulerDiscreteScheduler` config that already has ``stochastic_sampling`` is kept as it is (a causal
    pipeline saved it); any other (Wan's `UniPCMultistepScheduler`, a deterministic Euler) becomes
    ``FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)``.
    """
    if config.get("_class_name") == FlowMatchEulerDiscreteScheduler.__name__:
        if config.get("stochastic_sampling"):
            return FlowMatchEulerDiscreteScheduler.from_config(config)
        return FlowMatchEulerDiscreteScheduler.from_config(config, shift=CAUSAL_SHIFT, stochastic_sampling=True)
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=config.get("num_train_timesteps", 1000), shift=CAUSAL_SHIFT, stochastic_sampling=True
    )


@stored_settings_docs
class WanCausalPipeline(HubPipelineMixin, DiffusionPipeline, WanLoraLoaderMixin, LiveRolloutMixin):
    r"""
    Text-to-video generation with a causal Wan student (Self-Forcing, CausVid, ...): the video is generated chunk by
    chunk of latent frames, each chunk attending to the KV cache of the chunks before it.

    This model inherits from [`DiffusionPipeline`]. Check the superclass documentation for the generic methods
    implemented for all pipelines (downloading, saving, running on a particular device, etc.). The rollout (prepare
    template, session, policy) is [`CausalRolloutMixin`]'s, shared with the image-to-video and VACE pipelines.

    Args:
        tokenizer ([`T5Tokenizer`], *optional*):
            Tokenizer of [google/umt5-xxl](https://huggingface.co/google/umt5-xxl).
        text_encoder ([`UMT5EncoderModel`], *optional*):
            UMT5 encoder; may be `None` when every call passes `prompt_embeds` (and `negative_prompt_embeds` for
            CFG).
        vae ([`AutoencoderKLWan`]):
            Variational Auto-Encoder (VAE) Model to encode and decode videos to and from latent representations.
        scheduler ([`FlowMatchEulerDiscreteScheduler`]):
            The few-step sampler, `FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)`: predict x0,
            then re-noise with fresh noise.
        transformer ([`WanCausalTransformer3DModel`], *optional*):
            The causal transformer. A plain `WanTransformer3DModel` is converted (weights shared) by
            [`~WanCausalPipeline.from_pretrained`] and [`~WanCausalPipeline.from_pipe`]. `None` (with `vae` and
            `scheduler` `None` too, as diffusers allows) builds a pipeline that serves `encode_prompt` alone.
        {shared_args}
        decoder ([`AutoencoderTinyWan`], *optional*):
            A decode-only tiny decoder (TAEHV, e.g. `AutoencoderTinyWan.from_single_file("taew2_1.pth")`) for the
            frames of `stream()`: fast previews, while `__call__` still decodes with `vae`. To decode (and encode)
            everything with the tiny autoencoder, pass it as `vae` instead.

    A pipeline runs one rollout at a time: its KV caches live in the transformer. A call while a `stream()` of the same
    pipeline (or of one sharing its transformer) is open, or from a second thread while one runs, raises a
    `RuntimeError` at once; use one pipeline per thread.
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae->decoder"
    _optional_components = ["tokenizer", "text_encoder", "transformer", "decoder"]
    _transformer_class = WanCausalTransformer3DModel
    # What the pipeline encodes with `vae` beyond what the tiny autoencoder can (None: it takes either autoencoder)
    _needs_wan_vae_for: str | None = None

    def __init__(
        self,
        tokenizer: AutoTokenizer | None,
        text_encoder: UMT5EncoderModel | None,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchEulerDiscreteScheduler,
        transformer: WanCausalTransformer3DModel,
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
        arguments = locals()
        super().__init__()
        if transformer is not None and not isinstance(transformer, self._transformer_class):
            raise ValueError(
                f"`transformer` must be a {self._transformer_class.__name__}, got {type(transformer).__name__}. Load "
                f"with `{type(self).__name__}.from_pretrained` / `.from_pipe`, which convert a plain Wan transformer, "
                "or convert it with `causal_transformer_from_wan` / `causal_transformer_from_wan_vace` (weights are "
                "shared)."
            )
        if self._needs_wan_vae_for is not None and isinstance(vae, AutoencoderTinyWan):
            raise ValueError(
                f"`vae` must be the Wan VAE (AutoencoderKLWan) for {type(self).__name__}: it encodes "
                f"{self._needs_wan_vae_for} with the VAE's latent distribution and statistics, which the tiny "
                "autoencoder (AutoencoderTinyWan) does not have. Pass the tiny one as the decode-only `decoder=` "
                "component instead (fast `stream()` previews; `__call__` decodes with `vae`)."
            )
        if decoder is not None and not isinstance(decoder, AutoencoderTinyWan):
            raise ValueError(
                f"`decoder` must be an AutoencoderTinyWan (a decode-only tiny decoder for streams) or None, got "
                f"{type(decoder).__name__}"
            )
        self.register_modules(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
            scheduler=scheduler,
            decoder=decoder,
        )
        # The student's sampling settings (written by `fastgen-diffusers convert`): used when a call names none.
        stored = {key: arguments[key] for key in CONFIG_KEYS}
        for key in ("timesteps", "first_chunk_timesteps"):
            stored[key] = None if stored[key] is None else list(stored[key])
        self.register_to_config(**stored)
        self.check_stored_settings()
        self._init_rollout_state()
        self.vae_scale_factor_temporal = self.vae.config.scale_factor_temporal if getattr(self, "vae", None) else 4
        self.vae_scale_factor_spatial = self.vae.config.scale_factor_spatial if getattr(self, "vae", None) else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    def check_stored_settings(self) -> None:
        """Raise ``ValueError`` for stored settings (the pipeline config) that every call would refuse, the
        transformer's chunking included: the pipeline fails to load instead of failing every call."""
        stored = RolloutSettings.from_config(self.config)
        transformer = getattr(self, "transformer", None)
        if transformer is not None:
            config = transformer.config
            stored.cache.check_chunk_size(config.chunk_size, config.independent_first_frame)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> WanCausalPipeline:
        r"""Load a causal pipeline from a diffusers Wan directory or Hub repo (the layout `WanPipeline` saves).

        Unless given as `transformer=`, the `transformer` subfolder loads as the class's causal transformer
        (`_transformer_class`: [`WanCausalTransformer3DModel`], or the VACE one; bit-identical weights; a saved
        causal config keeps its `chunk_size`), after diffusers has loaded and checked the other components
        (`variant=`, Hub files). Unless given as `scheduler=`, the scheduler is built by
        [`causal_scheduler_from_config`] from the saved one. Every other argument is
        [`DiffusionPipeline.from_pretrained`]'s.
        """
        hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
        load_transformer = "transformer" not in kwargs
        if "scheduler" not in kwargs:
            config = FlowMatchEulerDiscreteScheduler.load_config(
                pretrained_model_name_or_path, subfolder="scheduler", **hub_kwargs
            )
            kwargs["scheduler"] = causal_scheduler_from_config(config)
            scheduler_class = type(kwargs["scheduler"]).__name__
            loading_logger.info(
                f"Loaded scheduler as {scheduler_class} from `scheduler` subfolder of {pretrained_model_name_or_path}."
            )
        # The tiny autoencoder (`vae` or the decode-only `decoder`) is ours: loaded here, diffusers would want code.
        index = cls.load_config(pretrained_model_name_or_path, **hub_kwargs)
        for name in ("vae", "decoder"):
            entry = index.get(name)
            if name not in kwargs and isinstance(entry, (list, tuple)) and entry[1] == AutoencoderTinyWan.__name__:
                kwargs[name] = AutoencoderTinyWan.from_pretrained(
                    pretrained_model_name_or_path, subfolder=name, **hub_kwargs
                )
        # diffusers loads (and checks: `variant`, the Hub, the offline cache) every other component first.
        pipe = super().from_pretrained(pretrained_model_name_or_path, **{"transformer": None, **kwargs})
        if load_transformer:
            dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))  # diffusers 0.42 renamed `torch_dtype`
            if isinstance(dtype, dict):
                dtype = dtype.get("transformer", dtype.get("default"))
            model_kwargs = {key: kwargs[key] for key in ("variant", "use_safetensors") if key in kwargs}
            transformer = cls._transformer_class.from_pretrained(
                pretrained_model_name_or_path, subfolder="transformer", dtype=dtype, **model_kwargs, **hub_kwargs
            )
            pipe.register_modules(transformer=transformer)
            pipe.check_stored_settings()
            loading_logger.info(
                f"Loaded transformer as {type(transformer).__name__} from `transformer` subfolder of "
                f"{pretrained_model_name_or_path}."
            )
        return pipe

    @classmethod
    def from_pipe(cls, pipeline: DiffusionPipeline, **kwargs) -> WanCausalPipeline:
        r"""Build from another pipeline's components, e.g. a `WanPipeline` (no extra memory).

        A plain `WanTransformer3DModel` becomes a [`WanCausalTransformer3DModel`] sharing its parameters, and a
        scheduler without `stochastic_sampling` is replaced by the causal one (see
        [`causal_scheduler_from_config`]). The way back: `WanPipeline.from_pipe(pipe,
        transformer=wan_transformer_from_causal(pipe.transformer))`.
        """
        transformer = getattr(pipeline, "transformer", None)
        if "transformer" not in kwargs and type(transformer) is WanTransformer3DModel:
            kwargs["transformer"] = causal_transformer_from_wan(transformer)
        scheduler = getattr(pipeline, "scheduler", None)
        if "scheduler" not in kwargs and scheduler is not None:
            kwargs["scheduler"] = causal_scheduler_from_config(dict(scheduler.config))
        return super().from_pipe(pipeline, **kwargs)

    # ------------------------------------------------------------------ prompts and latents (diffusers' Wan code)
    _get_t5_prompt_embeds = WanPipeline._get_t5_prompt_embeds  # ftfy-guarded prompt cleaning, re-zeroed padding
    encode_prompt = WanPipeline.encode_prompt
    prepare_latents = WanPipeline.prepare_latents

    def check_inputs(self, options: RolloutOptions, shape: RolloutShape, batch_size: int) -> None:
        """Raise ``ValueError`` naming the argument and the accepted values; runs before any model work.

        ``shape`` is what the call generates (VACE counts its reference images in ``shape.num_frames``) and
        ``batch_size`` the batch of its prompt ([`CausalRolloutMixin.batch_size_of`]).
        """
        o = options
        prompt, negative_prompt, prompt_embeds, negative_prompt_embeds = (
            o.prompt, o.negative_prompt, o.prompt_embeds, o.negative_prompt_embeds
        )  # fmt: skip
        height, width, num_frames = shape.height, shape.width, shape.num_frames
        multiple = self.vae_scale_factor_spatial * self.transformer.config.patch_size[1]
        if height % multiple != 0 or width % multiple != 0 or height <= 0 or width <= 0:
            raise ValueError(
                f"`height` and `width` must be positive multiples of {multiple}, got {height} and {width}."
            )
        temporal = self.vae_scale_factor_temporal
        if not isinstance(num_frames, int) or num_frames < 1 or num_frames % temporal != 1:
            raise ValueError(
                f"`num_frames` must be of the form {temporal}k+1 (1, {temporal + 1}, {2 * temporal + 1}, ..., 81), "
                f"got {num_frames!r}."
            )
        num_latent_frames = (num_frames - 1) // temporal + 1
        self.check_rollout_inputs(
            num_latent_frames,
            o.chunk_size,
            rope_positions=o.rope_positions,
            positions_bounded=o.settings is not None and o.settings.active_policy.bounds_positions,
        )

        if prompt is not None and prompt_embeds is not None:
            raise ValueError("Pass either `prompt` or `prompt_embeds`, not both.")
        if prompt is None and prompt_embeds is None:
            raise ValueError("Pass one of `prompt` (a string or a list of strings) or `prompt_embeds`.")
        if prompt is not None and not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ValueError(f"`prompt` must be a string or a non-empty list of strings, got {type(prompt).__name__}.")
        if negative_prompt is not None and negative_prompt_embeds is not None:
            raise ValueError("Pass either `negative_prompt` or `negative_prompt_embeds`, not both.")
        if negative_prompt is not None and not isinstance(negative_prompt, (str, list)):
            raise ValueError(f"`negative_prompt` must be a string or a list of strings, got {type(negative_prompt)}.")
        if prompt is not None and (self.text_encoder is None or self.tokenizer is None):
            raise ValueError(
                "`prompt` needs a `text_encoder` and a `tokenizer`; this pipeline has none: pass "
                "`prompt_embeds` instead."
            )

        text_dim = self.transformer.config.text_dim
        for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if embeds is None:
                continue
            if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3 or embeds.shape[-1] != text_dim:
                got = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
                raise ValueError(
                    f"`{name}` must be a (batch, tokens, {text_dim}) tensor (the transformer's `text_dim`), got {got}."
                )
            if embeds.shape[0] != batch_size:
                raise ValueError(f"`{name}` has batch {embeds.shape[0]}, but the prompt batch is {batch_size}.")

        if o.guidance_scale > 1.0 and negative_prompt_embeds is None:
            if self.text_encoder is None or self.tokenizer is None:
                raise ValueError(
                    f"`guidance_scale={o.guidance_scale}` (> 1, classifier-free guidance) needs a negative prompt: "
                    "pass `negative_prompt_embeds` (this pipeline has no text encoder), or use `guidance_scale=1.0`."
                )
            if isinstance(negative_prompt, list) and len(negative_prompt) != batch_size:
                raise ValueError(
                    f"`negative_prompt` has {len(negative_prompt)} entries but the prompt batch is {batch_size}: pass "
                    f"one negative prompt, or a list of {batch_size}."
                )

        if isinstance(o.generator, list) and len(o.generator) != batch_size:
            raise ValueError(
                f"`generator` is a list of {len(o.generator)} generators, but the batch is {batch_size}: pass one "
                f"generator or a list of {batch_size}."
            )
        if o.output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {o.output_type!r}.")
        if o.callback_on_step_end_tensor_inputs is not None:
            unknown = [k for k in o.callback_on_step_end_tensor_inputs if k not in self._callback_tensor_inputs]
            if unknown:
                raise ValueError(
                    f"`callback_on_step_end_tensor_inputs` must be in {self._callback_tensor_inputs}, got {unknown}."
                )
        if o.latents is not None:
            expected = (
                batch_size,
                self.transformer.config.out_channels,
                num_latent_frames,
                height // self.vae_scale_factor_spatial,
                width // self.vae_scale_factor_spatial,
            )
            if tuple(o.latents.shape) != expected:
                raise ValueError(
                    f"`latents` must have shape {expected} (B, C, F, H, W), got {tuple(o.latents.shape)}."
                )
        if not isinstance(o.max_sequence_length, int) or o.max_sequence_length < 1:
            raise ValueError(f"`max_sequence_length` must be a positive integer, got {o.max_sequence_length!r}.")

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    @replace_example_docstring(EXAMPLE_DOC_STRING)
    @shared_call_docs
    def __call__(
        self,
        prompt: str | list[str] | dict[int, str | list[str]] | None = None,
        negative_prompt: str | list[str] | None = None,
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
        prompt_embeds: torch.Tensor | dict[int, torch.Tensor] | None = None,
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
        attention_window: int | None = None,
        sink_frames: int | None = None,
        kv_cache_engine: str | None = "static",
        num_videos_per_prompt: int = 1,
        kv_cache_policy: str | None = None,
        context_frames: int | None = None,
        kv_cache_attention_bias: float | None = None,
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str | None = None,
        sink_update: str | None = None,
        sink_decay: float | None = None,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
        # Krea's re-encoded anchor (recompute) and prompt transitions
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
            {shared_args}

        Examples:

        Returns:
            [`~pipelines.wan.pipeline_output.WanPipelineOutput`] or `tuple`: the generated frames (`frames`), or
            `(frames,)` when `return_dict` is `False`. An interrupted rollout returns the finished chunks; the
            latent frames of unfinished chunks are left at their initial noise.
        """
        return self.generate_call(locals())
