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
"""``WanCausalVideoToVideoPipeline``: live video-to-video (restyling) with a causal Wan student.

diffusers' ``WanVideoToVideoPipeline(video=..., strength=...)`` noises a whole encoded clip and denoises it at once.
Its causal, streaming counterpart restyles a video chunk by chunk as its frames arrive (a list, or an iterator such
as a webcam reader): each chunk's frames are encoded with the VAE's causal encoder cache carried across chunks
([`StreamingWanEncoder`]), noised to the chunk's strength and denoised from the matching step of the student's
schedule ([`VideoToVideoSource`], [`VideoToVideoPolicy`]), attending to the KV cache of the chunks before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils import logging, replace_example_docstring

from ..chunking import chunk_bounds
from ..settings import RolloutSettings
from .pipeline_wan_causal import WanCausalPipeline
from .rollout.arguments import require_transformer
from .rollout.call_docs import shared_call_docs
from .rollout.conditioning import Conditioner
from .rollout.core import RolloutRun, RolloutShape
from .rollout.guard import exclusive_rollout
from .rollout.options import RolloutOptions
from .rollout.policy_v2v import RecomputeVideoToVideoPolicy, VideoChunkPlan, VideoToVideoPolicy
from .rollout.prompts import check_transition_embeds
from .rollout.strength import StrengthInput, StrengthSchedule
from .rollout.validation import validate_call_arguments
from .rollout.video_latents import VideoToVideoSource
from .video_io.autoencoders import streaming_encoder
from .video_io.video_source import VideoChunker, chunk_num_frames

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

EXAMPLE_DOC_STRING = """
    Examples:
        ```python
        >>> import torch
        >>> from diffusers.utils import export_to_video, load_video
        >>> from fastgen_diffusers import WanCausalVideoToVideoPipeline

        >>> pipe = WanCausalVideoToVideoPipeline.from_pretrained("path/to/self-forcing", dtype=torch.bfloat16)
        >>> pipe.to("cuda")

        >>> frames = load_video("input.mp4")  # PIL images, resized to 832x480
        >>> video = pipe("a watercolor painting of a fox", video=frames, strength=0.7).frames[0]
        >>> export_to_video(video, "restyled.mp4", fps=16)

        >>> # Live: any iterator of frames; each chunk comes out as soon as its frames are in and denoised.
        >>> for chunk in pipe.stream("a watercolor painting of a fox", video=webcam_frames(), strength=0.7):
        ...     show(chunk.frames[0])
        ```
"""


@dataclass(kw_only=True)
class VideoToVideoOptions(RolloutOptions):
    """[`RolloutOptions`] plus the input video and strength of [`WanCausalVideoToVideoPipeline.__call__`]."""

    video: Iterable[Any] | None = None
    strength: StrengthInput = 0.8
    height: int | None = None
    width: int | None = None


class WanCausalVideoToVideoPipeline(WanCausalPipeline):
    r"""
    Video-to-video generation with a causal Wan student: a video, given whole or arriving frame by frame, is
    restyled chunk by chunk under a prompt.

    The components and stored sampling settings are [`WanCausalPipeline`]'s (load a student the same way, or build
    it with `WanCausalVideoToVideoPipeline.from_pipe(t2v_pipe)`). Chunk ``k`` of ``n`` latent frames takes the next
    ``1 + 4(n - 1)`` (first chunk) or ``4n`` input frames; its latents are ``(1 - s) * encoded + s * noise`` with ``s``
    the sigma of the first step its strength keeps (diffusers' trim: the last ``int(N * strength)`` of ``N`` steps),
    and it is denoised from that step. Strength 0 returns the input's latents; strength 1 is text-to-video from the
    same noise.
    """

    _options_class = VideoToVideoOptions
    default_policy = VideoToVideoPolicy()
    recompute_policy_class = RecomputeVideoToVideoPolicy
    supports_keep_cache = False

    # ------------------------------------------------------------------ the prepare template, for an open-ended video
    def video_chunker(self, options: VideoToVideoOptions) -> VideoChunker:
        """The [`VideoChunker`] of the call's ``video`` in this transformer's chunks (first chunk 1 latent frame with
        ``independent_first_frame``), its first chunk read and checked."""
        config = self.transformer.config
        chunk_size = config.chunk_size if options.chunk_size is None else options.chunk_size
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"`chunk_size` must be a positive number of latent frames or None, got {chunk_size!r}.")
        if options.video is None:
            raise ValueError("Pass `video`: a list of frames or an iterator yielding them.")
        chunker = VideoChunker(
            options.video,
            chunk_latent_frames=chunk_size,
            first_chunk_latent_frames=1 if config.independent_first_frame else chunk_size,
            height=options.height,
            width=options.width,
            size_multiple=self.vae_scale_factor_spatial * config.patch_size[1],
            temporal_factor=self.vae_scale_factor_temporal,
        )
        chunker.read_first_chunk()
        return chunker

    @staticmethod
    def video_chunk_bounds(chunker: VideoChunker, min_pixel_frame: int = 0) -> list[tuple[int, int]]:
        """``[start, end)`` of the video's chunks: all of them for a list; for an iterator the first chunk and as
        many more as it takes to start at or after pixel frame ``min_pixel_frame`` (to place prompt switches)."""
        layout = chunker.latent_layout()
        if layout is None:
            layout = [chunker.first_chunk_latent_frames]
            first_pixel = chunk_num_frames(layout[0], True, chunker.temporal_factor)
            while first_pixel < min_pixel_frame:
                layout.append(chunker.chunk_latent_frames)
                first_pixel += chunker.chunk_num_frames(1)
            layout.append(chunker.chunk_latent_frames)
        return chunk_bounds(tuple(layout))

    def check_noise(self, latents: torch.Tensor | None, shape: RolloutShape, batch_size: int, known: bool) -> None:
        """Raise ``ValueError`` unless ``latents`` is ``None`` or ``(B, C, F, h, w)`` noise of the call's batch and
        frame size, covering the video (``known``: a list) or at least its first chunk (an iterator)."""
        if latents is None:
            return
        num_latent_frames = (shape.num_frames - 1) // self.vae_scale_factor_temporal + 1
        expected = (
            batch_size,
            self.transformer.config.out_channels,
            shape.height // self.vae_scale_factor_spatial,
            shape.width // self.vae_scale_factor_spatial,
        )
        got = tuple(latents.shape)
        if (
            not isinstance(latents, torch.Tensor)
            or latents.ndim != 5
            or got[:2] + got[3:] != expected
            or (known and got[2] != num_latent_frames)
            or got[2] < num_latent_frames
        ):
            frames = num_latent_frames if known else f">={num_latent_frames}"
            raise ValueError(
                f"`latents` must be noise of shape ({expected[0]}, {expected[1]}, {frames}, {expected[2]}, "
                f"{expected[3]}) (B, C, F, H, W), got {got}."
            )

    def validate_options(self, options: VideoToVideoOptions) -> VideoToVideoOptions:
        """The call's options with every argument's type and values checked ([`validate_call_arguments`], the
        table every pipeline uses) before any work; ``video`` (frames or a live iterator) is checked as its frames
        are read ([`VideoChunker`])."""
        require_transformer(self)
        arguments = {field.name: getattr(options, field.name) for field in fields(options) if field.name != "video"}
        return replace(options, **validate_call_arguments(arguments))

    @torch.no_grad()
    def prepare_rollout(self, options: VideoToVideoOptions) -> RolloutRun:
        """Check every input before any model work (reading an iterator's first chunk of frames to do so), encode the
        prompts, configure the KV cache and open the session; the video itself is read, encoded and noised chunk by
        chunk while the rollout runs."""
        options = self.resolve_options(self.validate_options(options))

        # 1. Check inputs. Raise error if not correct
        prompt, prompt_embeds, prompt_schedule = self.split_prompt_schedule(options.prompt, options.prompt_embeds)
        options = replace(options, prompt=prompt, prompt_embeds=prompt_embeds)
        if options.keep_cache:
            raise ValueError("`keep_cache` is not supported for video-to-video: its input cannot be continued.")
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        strength = StrengthSchedule(options.strength)
        chunker = self.video_chunker(options)
        known = chunker.num_chunks is not None
        num_frames = chunker.num_used_frames if known else chunker.chunk_num_frames(0)
        shape = RolloutShape(chunker.height, chunker.width, num_frames)
        self.check_inputs(replace(options, latents=None, num_frames=num_frames), shape, batch_size)
        self.check_noise(options.latents, shape, batch_size, known)
        bounds = self.video_chunk_bounds(chunker, max(prompt_schedule, default=0))
        ema_bounds = bounds
        if not known and options.attention_window is not None:
            # An iterator's chunks after the first all have one size, so the chunks up to a few past the first full
            # window meet every eviction the stream will: check them before the first forward.
            horizon = options.attention_window + 3 * chunker.chunk_latent_frames
            ema_bounds = self.video_chunk_bounds(chunker, chunk_num_frames(horizon, True, chunker.temporal_factor))
        options.settings.check_chunks(ema_bounds, chunker.chunk_latent_frames, complete=known)

        # 2. Encode input prompt
        device = self._execution_device
        prompt_embeds, negative_prompt_embeds, prompt_switches = self.encode_call_prompts(
            options, prompt, prompt_embeds, prompt_schedule, device
        )
        switches = self.prompt_switch_chunks(prompt_switches, bounds)
        check_transition_embeds(options.prompt_transition_chunks, prompt_embeds, switches)

        # 3. Prepare timesteps (set on the scheduler again at every chunk); the video is encoded chunk by chunk
        schedule, first_schedule = self.call_schedules(options)
        plan = VideoChunkPlan(schedule, first_schedule, chunker.num_chunks)
        source = VideoToVideoSource(
            chunker,
            streaming_encoder(self.vae),
            strength,
            batch_size=batch_size,
            device=device,
            generator=options.generator,
            noise=None if options.latents is None else options.latents.to(device, torch.float32),
        )

        # 4. Fresh KV-cache engines (sized for a list; a static engine grows for a live video) and the session
        self.configure_rollout_cache(options, bounds, open_ended=not known)
        # keep_cache is refused above: the session keeps what a live switch's recache needs (`run.switch_prompt`)
        switch_rule = self.prompt_switch_rule(options, bounds)
        session = self.open_call_session(
            options, Conditioner(), prompt_embeds, negative_prompt_embeds, schedule, first_schedule, switch_rule
        )
        return RolloutRun(self, session, plan, source, options, switches, 0, self.select_policy(options))

    @exclusive_rollout("pipe(...)")
    def generate(self, options: VideoToVideoOptions) -> WanPipelineOutput | tuple:
        """The body of ``__call__``: prepare, restyle chunk by chunk, each chunk decoded as it comes (as in
        [`CausalRolloutMixin.run_and_decode_chunks`])."""
        run = self.prepare_rollout(options)
        chunks, pixels = self.run_and_decode_chunks(run)
        if not chunks:
            raise RuntimeError("The rollout was interrupted before its first chunk finished: no frames to return.")
        return self.finish_output(
            torch.cat([chunk.latents for chunk in chunks], dim=2),
            run.options.output_type,
            run.options.return_dict,
            pixels=pixels if all(p is not None for p in pixels) else None,
        )

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    @replace_example_docstring(EXAMPLE_DOC_STRING)
    @shared_call_docs
    def __call__(
        self,
        prompt: str | list[str] | dict[int, str | list[str]] | None = None,
        video: Iterable[Any] | None = None,
        strength: StrengthInput = 0.8,
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        timesteps: Sequence[float] | None = None,
        sigmas: Sequence[float] | None = None,
        first_chunk_timesteps: Sequence[float] | None = None,
        guidance_scale: float = 1.0,
        chunk_size: int | None = None,
        context_noise: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | Mapping[int, torch.Tensor] | None = None,
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
        recache: bool = False,
        attention_window: int | None = None,
        sink_frames: int | None = None,
        kv_cache_engine: str | None = "static",
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str | None = None,
        sink_update: str | None = None,
        sink_decay: float | None = None,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
        # Krea's recompute (and its attention bias, its re-encoded anchor) and prompt transitions
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
        The call function to the pipeline for video-to-video generation. It takes the arguments of
        [`WanCausalPipeline.__call__`] except `num_frames` (the video's length decides), `num_videos_per_prompt` and
        `keep_cache` (a restyled input cannot be continued).

        Args:
            prompt (`str`, `list[str]` or `dict`, *optional*):
                The prompt or prompts to guide the restyling, or a schedule `{pixel_frame: prompt}` as in
                [`WanCausalPipeline.__call__`]. If not defined, pass `prompt_embeds` instead.
            video (`list` or iterator of frames):
                The input video: a list of frames, a `(F, H, W, 3)` array / `(F, 3, H, W)` tensor, or an iterator
                yielding frames as they arrive (a webcam). Frames are RGB PIL images, `(H, W, 3)` numpy arrays or
                `(3, H, W)` tensors, uint8 or floats in [0, 1], all of one size (multiples of 16; resize them first,
                e.g. with `VideoProcessor.preprocess_video`). Chunk `k` of `n` latent frames takes the next
                `1 + 4(n - 1)` (first chunk) or `4n` frames; a video that ends inside a chunk gives the chunks it
                completes, and the remaining frames are dropped with a warning.
            strength (`float`, callable, `dict` or `MotionAwareStrength`, defaults to `0.8`):
                How much of each input chunk is replaced, in [0, 1]: the chunk is noised to the first of the last
                `int(N * strength)` of its `N` steps and denoised from there. 0 returns the input's latents, 1 is
                text-to-video. A callable `chunk_index -> strength`, a schedule `{chunk_index: strength}` (each value
                from its chunk on, chunk 0 included) or a [`MotionAwareStrength`] controller (lower strength when the
                input moves fast) set it per chunk.
            height (`int`, *optional*), width (`int`, *optional*):
                The frame size every frame must have; defaults to the first frame's.
            latents (`torch.Tensor`, *optional*):
                Noise `(B, 16, F, height // 8, width // 8)` to noise the chunks with (chunk `[s, e)` takes
                `latents[:, :, s:e]`); `F` the video's latent frames for a list, at least the first chunk's for an
                iterator (whose video must not outgrow it). Defaults to fresh noise from `generator`, chunk by chunk.
            kv_cache_policy (`str`, *optional*), context_frames (`int`, *optional*), \
            kv_cache_attention_bias (`float`, *optional*), keep_first_frame (`bool`, *optional*):
                Krea's recompute, as in [`WanCausalPipeline.__call__`] (what Krea's server runs on a webcam): each
                input chunk, noised to its strength, denoises after a cache rebuilt over `context_frames` clean
                frames of the output (the anchor re-encoded from the decoded output unless `keep_first_frame`).
            {shared_args}

        Examples:

        Returns:
            [`~pipelines.wan.pipeline_output.WanPipelineOutput`] or `tuple`: the restyled frames (`frames`, the
            frames of the complete chunks), or `(frames,)` when `return_dict` is `False`.
        """
        return self.generate_call(locals())
