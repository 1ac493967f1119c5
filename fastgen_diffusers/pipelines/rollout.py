"""The chunk-by-chunk causal rollout shared by every causal Wan pipeline (T2V, I2V, VACE, streaming).

The pipelines differ only in how they condition a chunk; the loop itself lives here, once:

```
clear every cache
for each chunk [start, end) of the partition the transformer's mask uses:
    x = noise[:, :, start:end]                       # or the clean latents of a context chunk (no denoising)
    for t in timesteps:                              # e.g. 1000, 937.5, 833.3, 625
        v = transformer(x, t, text, start_frame=start, cache_tag="pos")            # store_kv=False
        v = v_neg + g * (v - v_neg)                  # only when g > 1, v_neg under cache_tag="neg"
        x = scheduler.step(v, t, x)                  # predict x0, re-noise to the next sigma (x0 at the last step)
    transformer(x0 re-noised to context_noise, context_noise, text, start_frame=start, store_kv=True)  # each tag
    yield ChunkOutput(chunk_index, start, end, x0)
free the caches (unless keep_cache)
```

Live generation ([`LiveRolloutMixin`]: ``stream``, prompt switches, continue / redo / fork of a kept rollout) rides on
the same loop: ``prompt_switches`` change the conditional prompt at chunk boundaries, ``resume`` continues a kept
branch instead of clearing the caches.

A pipeline mixes in [`CausalRolloutMixin`] and overrides the hooks it needs:

* [`CausalRolloutMixin.prepare_chunk_inputs`]: extra (or replaced) transformer keyword arguments for one forward of
  one chunk; the I2V pipeline returns ``hidden_states`` with its 20 condition channels concatenated and
  ``encoder_hidden_states_image``, the VACE pipeline its control inputs.
* [`CausalRolloutMixin.context_chunk_latents`]: clean latents for a chunk that is given rather than generated (the
  first frame of image-conditioned students, the frames of a clip being extended); such a chunk only fills the cache.
* [`CausalRolloutMixin.chunk_timestep`] and [`CausalRolloutMixin.after_chunk_step`]: per-frame timesteps of a
  chunk and a fix-up of its latents after each scheduler step (Wan2.2 TI2V's clean first frame).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils.torch_utils import get_module_execution_device, randn_tensor

from ..chunking import chunk_bounds, chunk_layout
from ..kv_cache import ENGINE_KINDS, make_engines
from ..parallel import is_main_process
from .arguments import prepare_call_arguments
from .guard import exclusive_rollout, warn_discarding_kept_rollouts
from .live import MAIN_BRANCH, KeptRollout, LiveRolloutMixin, RolloutChunk, branch_cache_tags
from .streaming_decode import StreamingWanDecoder, denormalize_latents

# Arguments of a pipeline's `__call__` that `rollout` takes as they are (after `prepare_rollout` resolved defaults).
ROLLOUT_CALL_ARGUMENTS = (
    "guidance_scale",
    "context_noise",
    "generator",
    "attention_kwargs",
    "callback_on_step_end",
    "callback_on_step_end_tensor_inputs",
    "keep_cache",
    "recache",
)


@dataclass
class ChunkOutput:
    """One finished chunk of a causal rollout.

    Args:
        chunk_index: position of the chunk in the partition (0 for the first chunk).
        start: absolute index of the chunk's first latent frame.
        end: one past its last latent frame.
        latents: ``(B, C, end - start, H, W)`` clean latents of the chunk (float32, the x0 of the last step).
        is_last: whether it is the last chunk of the rollout.
    """

    chunk_index: int
    start: int
    end: int
    latents: torch.Tensor
    is_last: bool = False


@dataclass
class RolloutRun:
    """A generation prepared by a pipeline's ``prepare_rollout`` (the steps of its ``__call__`` before the denoising
    loop): ``__call__`` and [`LiveRolloutMixin.stream`] both roll it out with ``pipe.rollout(**run.rollout_kwargs)``.

    Use it as a context manager around the rollout: on exit, normal or not, it frees the per-call conditioning the
    pipeline's rollout hooks read (the image inputs of I2V, the control latents of VACE).

    Args:
        pipe: the pipeline that prepared the run.
        rollout_kwargs: keyword arguments of [`CausalRolloutMixin.rollout`], the initial noise ``latents`` included.
        latents: ``(B, C, F, H, W)`` float32 latents of the whole rollout: the initial noise with the given chunks
            filled in; ``__call__`` writes each finished chunk into it before [`finish`] decodes it.
        num_reference_frames: leading latent frames that are not video frames (VACE's reference images): they are
            generated with the video but never decoded.
        release: frees the pipeline's per-call state; ``None`` when it keeps none.
    """

    pipe: CausalRolloutMixin
    rollout_kwargs: dict[str, Any]
    latents: torch.Tensor
    num_reference_frames: int = 0
    release: Callable[[], None] | None = None

    def __enter__(self) -> RolloutRun:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.release is not None:
            self.release()

    def finish(self, output_type: str, return_dict: bool) -> WanPipelineOutput | tuple:
        """Decode ``latents`` without the reference frames, offload the models and return the frames as
        ``__call__`` does: a ``WanPipelineOutput``, or ``(frames,)`` when ``return_dict`` is ``False``."""
        pipe = self.pipe
        video = pipe.decode_latents(self.latents[:, :, self.num_reference_frames :], output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return WanPipelineOutput(frames=video)


class CausalRolloutMixin(LiveRolloutMixin):
    r"""Chunk loop of the causal Wan pipelines, written as a generator that yields each finished chunk.

    The host pipeline provides ``transformer`` (a causal Wan transformer), ``scheduler``
    (`FlowMatchEulerDiscreteScheduler`, ``stochastic_sampling=True`` for the students' few-step update), ``vae``,
    ``video_processor`` and [`~DiffusionPipeline.progress_bar`], and implements [`prepare_rollout`]. ``__call__``
    consumes [`rollout`] to the end; [`LiveRolloutMixin.stream`] hands its chunks out one by one as the rollout
    yields them.
    """

    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]

    # ------------------------------------------------------------------ hooks for the pipeline variants
    def prepare_rollout(self, **call_kwargs) -> RolloutRun:
        """Everything ``__call__`` does before its denoising loop, shared with [`LiveRolloutMixin.stream`].

        Takes the arguments of ``__call__`` but ``return_dict``, all of them by keyword: checks them (before any
        model work), encodes the prompts and the conditioning, prepares the latents and the per-chunk conditioning
        the hooks below read, and configures the KV cache.

        Returns:
            The [`RolloutRun`] to roll out.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement `prepare_rollout`.")

    @exclusive_rollout("pipe(...)")
    def run_call(self, call_arguments: Mapping[str, Any]) -> WanPipelineOutput | tuple:
        """The body of every causal pipeline's ``__call__``, which passes its ``locals()``: prepare, roll out chunk by
        chunk, decode."""
        arguments = {name: value for name, value in call_arguments.items() if name not in ("self", "__class__")}
        arguments = prepare_call_arguments(self, arguments)
        return_dict = arguments.pop("return_dict")
        run = self.prepare_rollout(**arguments)

        # 6. Denoising loop: the causal rollout, chunk by chunk
        with run:
            for chunk in self.rollout(**run.rollout_kwargs):
                run.latents[:, :, chunk.start : chunk.end] = chunk.latents

        # 7. Decode, offload all models
        return run.finish(arguments["output_type"], return_dict)

    def encode_rollout_prompts(
        self,
        prompt: str | list[str] | None,
        negative_prompt: str | list[str] | None,
        prompt_embeds: torch.Tensor | None,
        negative_prompt_embeds: torch.Tensor | None,
        prompt_schedule: Mapping[int, Any],
        guidance_scale: float,
        max_sequence_length: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
        """Prompt and negative prompt embeddings ``(B, L, text_dim)`` in the transformer's dtype (the negative one only
        with CFG), and the embeddings of the prompt schedule's later switches ``{pixel_frame: (B, L, text_dim)}``."""
        self._guidance_scale = guidance_scale
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=self.do_classifier_free_guidance,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        dtype = self.transformer.dtype
        prompt_embeds = prompt_embeds.to(device, dtype)
        if negative_prompt_embeds is not None:
            negative_prompt_embeds = negative_prompt_embeds.to(device, dtype)
        switches = self.encode_prompt_switches(prompt_schedule, prompt_embeds, max_sequence_length, device)
        return prompt_embeds, negative_prompt_embeds, switches

    def plan_chunks(
        self,
        num_latent_frames: int,
        call_arguments: Mapping[str, Any],
        prompt_switches: Mapping[int, torch.Tensor],
        leading_frames: int = 0,
    ) -> tuple[list[tuple[int, int]], dict[int, torch.Tensor]]:
        """The chunk bounds of a rollout of ``num_latent_frames`` and its prompt switches by chunk, then fresh KV-cache
        engines for it (after every check that can raise, so a bad schedule never resets a kept rollout).

        ``call_arguments`` supplies ``chunk_size``, ``kv_cache_engine``, ``attention_window`` and ``sink_frames``;
        ``leading_frames`` latent frames (VACE's reference images) come before the video's frame 0.
        """
        bounds = self.rollout_chunk_bounds(num_latent_frames, call_arguments["chunk_size"])
        video_bounds = [(max(start - leading_frames, 0), end - leading_frames) for start, end in bounds]
        switches_by_chunk = self.prompt_switch_chunks(prompt_switches, video_bounds)
        self.configure_kv_cache(
            call_arguments["kv_cache_engine"],
            call_arguments["attention_window"],
            call_arguments["sink_frames"],
            bounds,
        )
        return bounds, switches_by_chunk

    def rollout_run(
        self,
        call_arguments: Mapping[str, Any],
        video_latents: torch.Tensor,
        *,
        release: Callable[[], None] | None = None,
        num_reference_frames: int = 0,
        **rollout_kwargs: Any,
    ) -> RolloutRun:
        """The [`RolloutRun`] of a prepared call: ``rollout_kwargs`` (the prepared ``latents``, embeddings,
        ``chunk_bounds``, ``schedule``, ``prompt_switches``) plus the call's own ``ROLLOUT_CALL_ARGUMENTS`` taken from
        ``call_arguments`` (the ``locals()`` of ``prepare_rollout``, defaults resolved)."""
        kwargs = {name: call_arguments[name] for name in ROLLOUT_CALL_ARGUMENTS} | rollout_kwargs
        return RolloutRun(self, kwargs, video_latents, num_reference_frames, release)

    def prepare_chunk_inputs(
        self,
        chunk_index: int,
        start: int,
        end: int,
        latents_chunk: torch.Tensor,
        *,
        cache_tag: str,
        store_kv: bool,
    ) -> dict[str, Any]:
        """Transformer keyword arguments for one forward of chunk ``[start, end)``; text-to-video needs none.

        Called before every transformer forward of the chunk (each denoising step, each CFG branch, and the
        cache-filling pass with ``store_kv=True``). The rollout passes ``hidden_states=latents_chunk`` and
        ``encoder_hidden_states`` (the branch's text embeddings); a returned key replaces or adds an argument. The
        returned ``hidden_states`` is cast to the transformer's dtype.

        Args:
            chunk_index: position of the chunk in the partition.
            start: absolute index of the chunk's first latent frame (``end`` is one past its last).
            latents_chunk: ``(B, C, end - start, H, W)`` float32 latents of this forward (noisy, or the clean chunk
                of the cache pass, re-noised when ``context_noise > 0``).
            cache_tag: ``"pos"`` for the conditional branch, ``"neg"`` for the unconditional one.
            store_kv: whether this forward is the cache-filling pass of the chunk.

        Returns:
            A dict of extra transformer arguments, e.g. ``{"hidden_states": torch.cat([latents_chunk, cond], 1),
            "encoder_hidden_states_image": image_embeds}`` for Wan2.1 image-to-video.
        """
        return {}

    def chunk_timestep(self, chunk_index: int, start: int, end: int, timestep: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep for one forward of chunk ``[start, end)``: ``timestep`` ``(B,)`` as it is, or
        per-frame ``(B, end - start)`` (Wan2.2 TI2V keeps its clean first frame at 0). Text-to-video changes nothing.
        """
        return timestep

    def after_chunk_step(self, chunk_index: int, start: int, end: int, latents_chunk: torch.Tensor) -> torch.Tensor:
        """``(B, C, end - start, H, W)`` latents of chunk ``[start, end)`` after a scheduler step, before the callback
        (Wan2.2 TI2V puts its clean first frame back). Text-to-video changes nothing."""
        return latents_chunk

    def context_chunk_latents(self, chunk_index: int, start: int, end: int) -> torch.Tensor | None:
        """Clean ``(B, C, end - start, H, W)`` latents of a chunk that is given rather than generated, or ``None``.

        A context chunk skips denoising: it is written to the cache (the same pass as a generated chunk's clean
        latents) and yielded as it is. Text-to-video generates every chunk.
        """
        return None

    # ------------------------------------------------------------------ planning and validation
    def rollout_chunk_bounds(self, num_latent_frames: int, chunk_size: int | None = None) -> list[tuple[int, int]]:
        """``[start, end)`` latent-frame ranges of the chunks, in the partition the transformer's causal mask uses.

        ``chunk_size`` defaults to the transformer's; the first chunk absorbs the remainder, or is the first frame
        alone when the transformer was trained with ``independent_first_frame``.
        """
        config = self.transformer.config
        chunk_size = config.chunk_size if chunk_size is None else chunk_size
        return chunk_bounds(chunk_layout(num_latent_frames, chunk_size, config.independent_first_frame))

    def configure_kv_cache(
        self,
        kv_cache_engine: str | None,
        attention_window: int | None,
        sink_frames: int,
        chunk_bounds: Sequence[tuple[int, int]],
    ) -> None:
        """Give the transformer fresh engines of kind ``kv_cache_engine`` (``"static"`` or ``"vanilla"``) with the
        sliding window ``attention_window`` / ``sink_frames`` (latent frames), sized for the rollout's chunks.

        ``kv_cache_engine=None`` keeps the engines the transformer has (e.g. ones set with
        ``transformer.set_kv_cache_engines``). Called at the start of a rollout, whose caches are empty anyway.
        """
        self.check_window_fits_chunks(attention_window, sink_frames, chunk_bounds)
        if kv_cache_engine is None:
            return
        warn_discarding_kept_rollouts(self)
        self.discard_rollout()  # kept rollouts live in the engines being replaced
        engines = make_engines(
            self.transformer,
            kv_cache_engine,
            window_frames=attention_window,
            sink_frames=sink_frames,
            max_frames=chunk_bounds[-1][1],
        )
        self.transformer.set_kv_cache_engines(engines)

    def resolve_sampling_defaults(
        self,
        num_inference_steps: int | None,
        timesteps: Sequence[float] | None,
        sigmas: Sequence[float] | None,
        context_noise: float | None,
    ) -> tuple[int, Sequence[float] | None, float]:
        """``(num_inference_steps, timesteps, context_noise)``, the pipeline's stored sampling settings (a converted
        student's ``timesteps`` / ``context_noise``) filling what the call leaves out; else 4 steps and 0."""
        if timesteps is None and sigmas is None and num_inference_steps is None:
            timesteps = self.config.get("timesteps")
        num_inference_steps = 4 if num_inference_steps is None else num_inference_steps
        context_noise = self.config.get("context_noise", 0.0) if context_noise is None else context_noise
        return num_inference_steps, timesteps, context_noise

    @staticmethod
    def check_window_fits_chunks(
        attention_window: int | None, sink_frames: int, chunk_bounds: Sequence[tuple[int, int]]
    ) -> None:
        """Raise ``ValueError`` when a chunk cannot fit in the window beside the sink (checked before any work)."""
        if attention_window is None:
            return
        largest = max(end - start for start, end in chunk_bounds)
        if largest > attention_window - sink_frames:
            raise ValueError(
                f"`attention_window={attention_window}` with `sink_frames={sink_frames}` leaves room for "
                f"{attention_window - sink_frames} frames, but a chunk has {largest} latent frames; use a window of "
                f"at least {largest + sink_frames} frames."
            )

    @staticmethod
    def check_kv_cache_inputs(kv_cache_engine: str | None, attention_window: int | None, sink_frames: int) -> None:
        """Raise ``ValueError`` for an engine kind or window the engines cannot serve."""
        if kv_cache_engine is not None and kv_cache_engine not in ENGINE_KINDS:
            raise ValueError(f"`kv_cache_engine` must be one of {ENGINE_KINDS} or None, got {kv_cache_engine!r}.")
        if kv_cache_engine is None and (attention_window is not None or sink_frames):
            raise ValueError("`attention_window`/`sink_frames` need a `kv_cache_engine` ('static' or 'vanilla').")
        if attention_window is not None and (not isinstance(attention_window, int) or attention_window < 1):
            raise ValueError(
                f"`attention_window` must be a positive number of latent frames or None, got {attention_window!r}."
            )
        if not isinstance(sink_frames, int) or sink_frames < 0:
            raise ValueError(f"`sink_frames` must be a non-negative number of latent frames, got {sink_frames!r}.")
        if sink_frames and (attention_window is None or sink_frames >= attention_window):
            raise ValueError(
                f"`sink_frames={sink_frames}` must be smaller than `attention_window` ({attention_window}): the sink "
                "lives inside the window."
            )

    def check_rollout_inputs(
        self,
        num_latent_frames: int,
        chunk_size: int | None,
        num_inference_steps: int,
        timesteps: Sequence[float] | None,
        sigmas: Sequence[float] | None,
        context_noise: float,
    ) -> None:
        """Raise ``ValueError`` for a chunking, schedule or context timestep the rollout cannot serve."""
        config = self.transformer.config
        if chunk_size is not None and (
            not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
        ):
            raise ValueError(f"`chunk_size` must be a positive number of latent frames or None, got {chunk_size!r}.")
        if num_latent_frames > config.rope_max_seq_len and not getattr(self.transformer, "rope_rebasing", False):
            raise ValueError(
                f"{num_latent_frames} latent frames run past the transformer's RoPE table of "
                f"{config.rope_max_seq_len} frames (`rope_max_seq_len`); ask for fewer `num_frames`, or call "
                "`pipe.transformer.enable_rope_rebasing()` (with an `attention_window`) for longer videos."
            )
        for start, end in self.rollout_chunk_bounds(num_latent_frames, chunk_size):
            served = self.transformer.chunk_layout_for(end - start, start)
            if served != (end - start,):
                raise ValueError(
                    f"`chunk_size={chunk_size}` cannot be served: its chunk of latent frames [{start}, {end}) would "
                    f"be split into causal chunks {served} by the transformer (its chunk_size={config.chunk_size}). "
                    f"Accepted: None (the transformer's {config.chunk_size}) or a size whose chunks stay under "
                    f"{2 * config.chunk_size} latent frames."
                )
        num_train_timesteps = self.scheduler.config.num_train_timesteps
        if timesteps is not None and sigmas is not None:
            raise ValueError("Pass at most one of `timesteps` and `sigmas`, not both.")
        for name, values, upper in (("timesteps", timesteps, num_train_timesteps), ("sigmas", sigmas, 1.0)):
            if values is None:
                continue
            values = [float(v) for v in values]
            if len(values) == 0:
                raise ValueError(f"`{name}` must hold at least one step, got an empty list.")
            if any(not 0.0 <= v <= upper for v in values):
                raise ValueError(f"`{name}` must lie within [0, {upper}], got {values}.")
            if any(b >= a for a, b in zip(values, values[1:])):
                raise ValueError(f"`{name}` must be strictly decreasing, got {values}.")
        if (
            timesteps is None
            and sigmas is None
            and (
                not isinstance(num_inference_steps, int)
                or isinstance(num_inference_steps, bool)
                or num_inference_steps < 1
            )
        ):
            raise ValueError(f"`num_inference_steps` must be a positive integer, got {num_inference_steps!r}.")
        if not 0.0 <= float(context_noise) <= num_train_timesteps:
            raise ValueError(
                f"`context_noise` must be a timestep within [0, {num_train_timesteps}], got {context_noise}."
            )

    def rollout_schedule(
        self,
        num_inference_steps: int,
        timesteps: Sequence[float] | None = None,
        sigmas: Sequence[float] | None = None,
    ) -> dict[str, list[float]]:
        """Arguments of ``scheduler.set_timesteps`` for every chunk.

        * Default: ``sigmas = [1, (N-1)/N, ..., 1/N]`` before the scheduler's shift (4 steps at shift 5 give the
          timesteps 1000, 937.5, 833.3, 625).
        * ``sigmas``: used as given, then shifted by the scheduler like diffusers does.
        * ``timesteps``: model-scale timesteps used as given; the matching sigmas ``t / 1000`` are passed unshifted
          (inverse of the shift) so that the update uses exactly ``sigma = t / 1000``.
        """
        if timesteps is not None:
            shift = self.scheduler.shift
            shifted = np.asarray(timesteps, dtype=np.float64) / self.scheduler.config.num_train_timesteps
            unshifted = shifted / (shift - (shift - 1.0) * shifted)
            return {"sigmas": unshifted.tolist(), "timesteps": [float(t) for t in timesteps]}
        if sigmas is not None:
            return {"sigmas": [float(s) for s in sigmas]}
        return {"sigmas": np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()}

    # ------------------------------------------------------------------ properties for callbacks
    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self._guidance_scale > 1.0

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    @property
    def current_timestep(self) -> torch.Tensor | None:
        return self._current_timestep

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    @property
    def attention_kwargs(self) -> dict[str, Any] | None:
        return self._attention_kwargs

    # ------------------------------------------------------------------ the loop
    def _chunk_forward(
        self,
        latents_chunk: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *,
        chunk_index: int,
        start: int,
        end: int,
        cache_tag: str,
        store_kv: bool,
    ) -> torch.Tensor:
        """One transformer forward of chunk ``[start, end)``: ``(B, C, F, H, W)`` latents to the flow prediction."""
        model_kwargs = {"hidden_states": latents_chunk, "encoder_hidden_states": encoder_hidden_states}
        model_kwargs.update(
            self.prepare_chunk_inputs(chunk_index, start, end, latents_chunk, cache_tag=cache_tag, store_kv=store_kv)
        )
        model_kwargs["hidden_states"] = model_kwargs["hidden_states"].to(self.transformer.dtype)
        return self.transformer(
            timestep=self.chunk_timestep(chunk_index, start, end, timestep),
            start_frame=start,
            cache_tag=cache_tag,
            store_kv=store_kv,
            attention_kwargs=self._attention_kwargs,
            return_dict=False,
            **model_kwargs,
        )[0]

    def rollout(
        self,
        latents: torch.Tensor,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None = None,
        *,
        chunk_bounds: Sequence[tuple[int, int]],
        schedule: dict[str, list[float]],
        guidance_scale: float = 1.0,
        context_noise: float = 0.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        keep_cache: bool = False,
        prompt_switches: Mapping[int, torch.Tensor] | None = None,
        recache: bool = False,
        branch: str = MAIN_BRANCH,
        resume: bool = False,
    ) -> Iterator[ChunkOutput]:
        """Generate the chunks one after the other, yielding each as soon as its clean latents are in the cache.

        Inputs are expected validated (``check_inputs``). Every cache is cleared first. On exit, normal or not, the
        caches are freed unless ``keep_cache`` is set and the rollout finished; an exception, an interruption
        (``self._interrupt = True`` from a callback) or closing the generator early therefore leaves the pipeline
        exactly as fresh as before.

        Args:
            latents: ``(B, C, F, H, W)`` float32 initial noise of the whole video; chunk ``[s, e)`` starts from
                ``latents[:, :, s:e]``.
            prompt_embeds: ``(B, L, text_dim)`` text embeddings in the transformer's dtype.
            negative_prompt_embeds: ``(B, L', text_dim)``, required when ``guidance_scale > 1``.
            chunk_bounds: ``[start, end)`` of every chunk (see [`rollout_chunk_bounds`]).
            schedule: ``scheduler.set_timesteps`` arguments (see [`rollout_schedule`]), applied at every chunk.
            guidance_scale: classifier-free guidance weight; above 1 the unconditional branch runs under
                ``cache_tag="neg"`` with its own caches.
            context_noise: timestep of the cache-filling pass; above 0 the clean chunk is re-noised to it first.
            generator: RNG(s) of the scheduler's re-noising and of the context noise.
            attention_kwargs: passed to the transformer (``scale`` for LoRA).
            callback_on_step_end: ``callback(pipe, step, timestep, callback_kwargs)`` after every denoising step;
                ``step`` counts over chunks x steps and ``"latents"`` is the current chunk ``(B, C, e - s, H, W)``.
            callback_on_step_end_tensor_inputs: names from ``_callback_tensor_inputs`` given to the callback.
            keep_cache: leave the caches filled after a finished rollout and record it as the kept rollout
                ``branch`` (see [`LiveRolloutMixin.continue_rollout`]).
            prompt_switches: ``{chunk_index: (B, L, text_dim) embeddings}``: the conditional branch follows these
                embeddings from that chunk on. The cross K/V of its cache tag are invalidated at the switch.
            recache: at every switch, re-run the cache pass of the earlier chunks under the new prompt (LongLive's
                recache): one extra transformer forward per earlier chunk, no denoising.
            branch: name of the kept rollout this rollout writes (``"main"``: cache tags ``"pos"`` / ``"neg"``).
            resume: continue the kept rollout ``branch`` instead of starting a video: no cache is cleared,
                ``chunk_bounds`` start where the branch ends and chunk indices continue its numbering. An exception or
                an early close leaves the branch to the caller, which restores it (see [`BranchCheckpoint`]).

        Yields:
            [`ChunkOutput`] per finished chunk, in order.
        """
        device = latents.device
        batch_size = latents.shape[0]
        cache_tags = branch_cache_tags(branch) if guidance_scale > 1.0 else branch_cache_tags(branch)[:1]
        prompt_switches = prompt_switches or {}
        self._guidance_scale = guidance_scale
        self._attention_kwargs = attention_kwargs
        self._current_timestep = None
        self._interrupt = False
        num_steps = len(schedule["sigmas"])
        history = list(self.kept_rollout(branch).chunks) if resume else []
        first_index = len(history)
        contexts = [self.context_chunk_latents(i, s, e) for i, (s, e) in enumerate(chunk_bounds, first_index)]
        self._num_timesteps = num_steps * sum(context is None for context in contexts)
        context_timestep = torch.full((batch_size,), float(context_noise), device=device)
        context_sigma = float(context_noise) / self.scheduler.config.num_train_timesteps

        if not resume:
            warn_discarding_kept_rollouts(self)
            self.discard_rollout()
        finished = False
        try:
            with self.progress_bar(total=self._num_timesteps) as progress_bar:
                step = 0
                for chunk_index, (start, end) in enumerate(chunk_bounds, first_index):
                    if self.interrupt:
                        return
                    if chunk_index in prompt_switches:
                        prompt_embeds = prompt_switches[chunk_index]
                        self._switch_prompt(prompt_embeds, history, cache_tags[0], context_timestep, recache)
                    clean = contexts[chunk_index - first_index]
                    if clean is None:
                        latents_chunk = latents[:, :, start:end]
                        self.scheduler.set_timesteps(**schedule, device=device)
                        self.scheduler.set_begin_index(0)
                        for t in self.scheduler.timesteps:
                            if self.interrupt:
                                return
                            self._current_timestep = t
                            timestep = t.expand(batch_size)
                            flow = self._chunk_forward(
                                latents_chunk,
                                timestep,
                                prompt_embeds,
                                chunk_index=chunk_index,
                                start=start,
                                end=end,
                                cache_tag=cache_tags[0],
                                store_kv=False,
                            )
                            if guidance_scale > 1.0:
                                flow_uncond = self._chunk_forward(
                                    latents_chunk,
                                    timestep,
                                    negative_prompt_embeds,
                                    chunk_index=chunk_index,
                                    start=start,
                                    end=end,
                                    cache_tag=cache_tags[1],
                                    store_kv=False,
                                )
                                flow = flow_uncond + guidance_scale * (flow - flow_uncond)
                            latents_chunk = self.scheduler.step(
                                flow.float(), t, latents_chunk, generator=generator, return_dict=False
                            )[0]
                            latents_chunk = self.after_chunk_step(chunk_index, start, end, latents_chunk)

                            if callback_on_step_end is not None:
                                tensors = {
                                    "latents": latents_chunk,
                                    "prompt_embeds": prompt_embeds,
                                    "negative_prompt_embeds": negative_prompt_embeds,
                                }
                                callback_kwargs = {}
                                for name in callback_on_step_end_tensor_inputs:
                                    callback_kwargs[name] = tensors[name]
                                callback_outputs = callback_on_step_end(self, step, t, callback_kwargs)
                                latents_chunk = callback_outputs.pop("latents", latents_chunk)
                                prompt_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)
                                negative_prompt_embeds = callback_outputs.pop(
                                    "negative_prompt_embeds", negative_prompt_embeds
                                )
                            step += 1
                            progress_bar.update()
                        clean = latents_chunk
                    self._current_timestep = None

                    # The last chunk's cache pass only serves a continuation, so it runs only when the cache is kept.
                    if keep_cache or chunk_index < first_index + len(chunk_bounds) - 1:
                        context = clean
                        if context_noise > 0:
                            noise = randn_tensor(clean.shape, generator=generator, device=device, dtype=clean.dtype)
                            context = (1.0 - context_sigma) * clean + context_sigma * noise
                        for cache_tag in cache_tags:
                            self._chunk_forward(
                                context,
                                context_timestep,
                                prompt_embeds if cache_tag == cache_tags[0] else negative_prompt_embeds,
                                chunk_index=chunk_index,
                                start=start,
                                end=end,
                                cache_tag=cache_tag,
                                store_kv=True,
                            )
                        history.append(RolloutChunk(chunk_index, start, end, clean, context))
                    is_last = chunk_index == first_index + len(chunk_bounds) - 1
                    yield ChunkOutput(chunk_index, start, end, clean, is_last)
            finished = True
        finally:
            self._current_timestep = None
            if finished and keep_cache:
                self._kept_rollouts[branch] = KeptRollout(
                    cache_tags=cache_tags,
                    chunks=tuple(history),
                    prompt_embeds=prompt_embeds,
                    negative_prompt_embeds=negative_prompt_embeds,
                    schedule=schedule,
                    guidance_scale=guidance_scale,
                    context_noise=context_noise,
                    attention_kwargs=attention_kwargs,
                )
            elif not resume:
                self.discard_rollout()
            elif finished:
                self.discard_rollout(branch)
            # An unfinished continuation leaves the branch to its caller, which restores it (`BranchCheckpoint`).

    # ------------------------------------------------------------------ output
    def decode_latents(self, latents: torch.Tensor, output_type: str = "np"):
        """``(B, C, F, H, W)`` normalized latents to frames: ``"np"`` ``(B, 4F-3, H*8, W*8, 3)`` floats in [0, 1],
        ``"pt"`` ``(B, 4F-3, 3, H*8, W*8)``, ``"pil"`` lists of PIL images; ``"latent"`` returns ``latents``.

        Under context parallelism only the main process (rank 0 of the transformer's group) decodes; the others return
        ``latents`` without decoding (see :mod:`fastgen_diffusers.parallel`)."""
        if output_type == "latent" or not is_main_process(self.transformer):
            return latents
        vae = self.vae
        if not vae.use_tiling:  # frame by frame like `stream`, so that streamed and returned frames are identical
            with StreamingWanDecoder(vae) as decoder:
                return self.video_processor.postprocess_video(decoder.decode(latents), output_type=output_type)
        latents = denormalize_latents(vae, latents.to(get_module_execution_device(vae), dtype=vae.dtype))
        video = vae.decode(latents, return_dict=False)[0]
        return self.video_processor.postprocess_video(video, output_type=output_type)
