"""Live generation on top of the causal rollout: streaming, prompt switching, and continue / redo / branch.

* [`LiveRolloutMixin.stream`] takes the arguments of the pipeline's ``__call__`` and yields a [`StreamChunk`] as soon
  as each chunk is done: its clean latents and its frames, decoded by [`StreamingWanDecoder`] so that the
  concatenated frames equal the frames of ``pipe(...)`` exactly.
* Prompt schedules: ``prompt={0: "a cat", 48: "a dog"}`` (pixel frame -> prompt) switches the conditional prompt at
  the first chunk that starts at or after each frame. The switch invalidates the cross K/V of the conditional cache
  tag; with ``recache=True`` the self K/V of the chunks before the switch are recomputed under the new prompt too
  (LongLive's recache), so the next chunks attend to a history encoded under the prompt they follow.
* Kept rollouts: ``pipe(..., keep_cache=True)`` keeps the KV caches and the chunks' latents as the branch ``"main"``;
  [`LiveRolloutMixin.continue_rollout`] appends frames, [`LiveRolloutMixin.redo_last_chunk`] rewinds the caches by
  the last chunk and generates it again, [`LiveRolloutMixin.fork_rollout`] copies a branch (caches included) so that
  several continuations share one prefix.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from ..chunking import chunk_bounds, chunk_layout
from ..parallel import is_main_process
from .arguments import prepare_call_arguments
from .guard import BranchCheckpoint, exclusive_rollout
from .streaming_decode import StreamingWanDecoder
from .validation import validate_call_arguments

if TYPE_CHECKING:
    from .rollout import ChunkOutput

OUTPUT_TYPES = ("np", "pil", "pt", "latent")

MAIN_BRANCH = "main"


def branch_cache_tags(branch: str) -> tuple[str, str]:
    """``(conditional, unconditional)`` cache tags of a rollout branch: ``("pos", "neg")`` for ``"main"``."""
    return ("pos", "neg") if branch == MAIN_BRANCH else (f"{branch}/pos", f"{branch}/neg")


@dataclass(frozen=True)
class RolloutChunk:
    """A finished chunk of a kept rollout.

    Args:
        index: position of the chunk in the rollout.
        start: absolute index of its first latent frame (``end`` is one past its last).
        latents: ``(B, C, end - start, H, W)`` clean latents.
        context: ``(B, C, end - start, H, W)`` input of its cache pass (``latents``, re-noised when the rollout's
            ``context_noise > 0``); a recache runs it again under a new prompt.
    """

    index: int
    start: int
    end: int
    latents: torch.Tensor
    context: torch.Tensor


@dataclass(frozen=True)
class KeptRollout:
    """What a rollout left behind with ``keep_cache=True``: its cache tags and everything needed to go on.

    The KV caches themselves stay in the transformer's engines under ``cache_tags``.
    """

    cache_tags: tuple[str, ...]
    chunks: tuple[RolloutChunk, ...]
    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    schedule: dict[str, list[float]]
    guidance_scale: float
    context_noise: float
    attention_kwargs: dict[str, Any] | None

    @property
    def num_latent_frames(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    @property
    def latents(self) -> torch.Tensor:
        """``(B, C, F, H, W)`` clean latents of the whole rollout so far."""
        return torch.cat([chunk.latents for chunk in self.chunks], dim=2)


@dataclass
class StreamChunk:
    """One chunk of a streamed video.

    Args:
        chunk_index: position of the chunk in the rollout.
        start: absolute index of its first latent frame (``end`` is one past its last).
        latents: ``(B, C, end - start, H, W)`` clean latents of the chunk.
        frames: the chunk's new pixel frames in the requested ``output_type`` (``"np"``: ``(B, f, H*8, W*8, 3)``,
            ``"pt"``: ``(B, f, 3, H*8, W*8)``, ``"pil"``: lists of images), ``None`` for ``"latent"``; ``f`` is
            ``4 * (end - start) - 3`` for the first chunk and ``4 * (end - start)`` after it.
        frame_start: index in the whole video of the first of these pixel frames.
    """

    chunk_index: int
    start: int
    end: int
    latents: torch.Tensor
    frames: Any
    frame_start: int


class LiveRolloutMixin:
    """Streaming, prompt schedules and kept-rollout editing for the pipelines of [`CausalRolloutMixin`]."""

    # Whether the pipeline's per-chunk conditioning (the rollout hooks) survives its ``__call__``, so that a kept
    # rollout can be continued. Text-to-video conditions on the prompt only.
    _resumable_rollouts = False

    # ------------------------------------------------------------------ streaming
    @exclusive_rollout("stream()")
    def stream(self, *args, **kwargs) -> Iterator[StreamChunk]:
        r"""Generate like ``__call__`` (same arguments), yielding each chunk as soon as it is done.

        The stream prepares the call like ``__call__`` ([`CausalRolloutMixin.prepare_rollout`]) and iterates the
        rollout generator itself, in the caller's thread: chunk ``k + 1`` is computed only when the next chunk is
        asked for, so nothing runs while the caller holds a chunk. Frames are decoded per chunk with a VAE feature
        cache carried across chunks: ``np.concatenate([c.frames for c in pipe.stream(...)], axis=1)`` equals
        ``pipe(...).frames`` exactly. Closing the generator early (``break``, ``.close()``, an exception in the
        consumer) closes the rollout, which frees the caches: the pipeline is then as fresh as before. With
        ``keep_cache=True`` the rollout is kept once the last chunk is handed out. While a stream is open (from its
        first chunk to its end or close) it holds the KV caches: calling the pipeline, its kept-rollout methods or
        another stream raises a ``RuntimeError`` naming it. ``return_dict`` is ignored. Every step runs under
        ``torch.no_grad`` as ``__call__`` does; the caller's grad mode is left as it is between chunks.

        Yields:
            [`StreamChunk`] per chunk, in order.
        """
        bound = inspect.signature(self.__call__).bind(*args, **kwargs)
        bound.apply_defaults()
        call_kwargs = dict(bound.arguments)
        del call_kwargs["return_dict"]
        call_kwargs = prepare_call_arguments(self, call_kwargs)
        output_type = call_kwargs["output_type"]
        run = self.prepare_rollout(**call_kwargs)  # validates `output_type` before any model work
        decode = output_type != "latent" and is_main_process(self.transformer)  # under context parallelism rank 0
        with (
            run,
            closing(self.rollout(**run.rollout_kwargs)) as chunks,
            StreamingWanDecoder(self.vae) if decode else nullcontext() as decoder,
        ):
            while True:
                # Grad mode is thread-local: a generator enters `no_grad` around each step, never across a `yield`.
                with torch.no_grad():
                    chunk = next(chunks, None)
                    if chunk is None:
                        return
                    if chunk.is_last:  # let the rollout finish: a consumer that stops now keeps a kept rollout
                        next(chunks, None)
                    streamed = self._stream_chunk(chunk, run.num_reference_frames, decoder, output_type)
                yield streamed

    def _stream_chunk(
        self, chunk: ChunkOutput, num_reference_frames: int, decoder: StreamingWanDecoder | None, output_type: str
    ) -> StreamChunk:
        """Decode the video frames of a finished chunk (the first ``num_reference_frames`` latent frames of the
        rollout excluded) into a [`StreamChunk`]; ``decoder`` is ``None`` when nothing is decoded."""
        if decoder is None:
            return StreamChunk(chunk.chunk_index, chunk.start, chunk.end, chunk.latents, None, 0)
        latents = chunk.latents[:, :, max(0, num_reference_frames - chunk.start) :]
        frame_start = decoder.num_decoded_frames
        frames = None
        if latents.shape[2] > 0:
            frames = self.video_processor.postprocess_video(decoder.decode(latents), output_type=output_type)
        return StreamChunk(chunk.chunk_index, chunk.start, chunk.end, chunk.latents, frames, frame_start)

    # ------------------------------------------------------------------ prompt schedules
    @staticmethod
    def split_prompt_schedule(prompt: Any, prompt_embeds: Any) -> tuple[Any, Any, dict[int, Any]]:
        """Split a prompt schedule into the prompt of frame 0 and the later switches.

        ``prompt`` (or ``prompt_embeds``) may be a dict ``{pixel_frame: prompt}`` whose keys include 0; anything else
        is returned as it is with no switches.

        Returns:
            ``(prompt, prompt_embeds, switches)``: the frame-0 entry in place of the dict and ``{frame: prompt or
            (B, L, text_dim) embeddings}`` for the frames after 0.
        """
        name, schedule = ("prompt", prompt) if isinstance(prompt, Mapping) else ("prompt_embeds", prompt_embeds)
        if not isinstance(schedule, Mapping):
            return prompt, prompt_embeds, {}
        frames = list(schedule)
        if any(isinstance(f, bool) or not isinstance(f, int) or f < 0 for f in frames) or 0 not in schedule:
            raise ValueError(
                f"A `{name}` schedule must map pixel frames (ints >= 0, 0 included) to prompts, e.g. "
                f"{{0: 'a cat', 48: 'a dog'}}; got the keys {frames}."
            )
        switches = {frame: schedule[frame] for frame in sorted(frames) if frame > 0}
        if name == "prompt":
            return schedule[0], prompt_embeds, switches
        return prompt, schedule[0], switches

    def encode_prompt_switches(
        self,
        switches: Mapping[int, Any],
        prompt_embeds: torch.Tensor,
        max_sequence_length: int,
        device: torch.device,
    ) -> dict[int, torch.Tensor]:
        """Encode the prompts of ``switches`` (``{pixel_frame: prompt or embeddings}``) like the frame-0 prompt.

        Args:
            prompt_embeds: ``(B, L, text_dim)`` embeddings of the frame-0 prompt: every switch must match its batch
                and width.

        Returns:
            ``{pixel_frame: (B, L', text_dim)}`` in the transformer's dtype.
        """
        encoded = {}
        for frame, value in switches.items():
            if isinstance(value, torch.Tensor):
                embeds = value
            else:
                embeds = self.encode_prompt(
                    prompt=value,
                    do_classifier_free_guidance=False,
                    max_sequence_length=max_sequence_length,
                    device=device,
                )[0]
            if (
                embeds.ndim != 3
                or embeds.shape[0] != prompt_embeds.shape[0]
                or embeds.shape[2] != prompt_embeds.shape[2]
            ):
                raise ValueError(
                    f"The prompt at frame {frame} encodes to {tuple(embeds.shape)}, but the frame-0 prompt to "
                    f"{tuple(prompt_embeds.shape)}: a switch must keep the batch and the text width."
                )
            encoded[frame] = embeds.to(device, self.transformer.dtype)
        return encoded

    def prompt_switch_chunks(
        self, switches: Mapping[int, torch.Tensor], bounds: Sequence[tuple[int, int]]
    ) -> dict[int, torch.Tensor]:
        """Map ``{pixel_frame: embeddings}`` to ``{chunk_index: embeddings}``: a switch takes effect at the first
        chunk whose first pixel frame is at or after its frame (latent frame ``s >= 1`` starts at pixel ``4s - 3``)."""
        temporal = self.vae_scale_factor_temporal
        firsts = [0 if start == 0 else temporal * start - (temporal - 1) for start, _ in bounds]
        by_chunk: dict[int, torch.Tensor] = {}
        for frame, embeds in switches.items():
            index = next((i for i, first in enumerate(firsts) if first >= frame), None)
            if index is None:
                raise ValueError(
                    f"The prompt switch at pixel frame {frame} is past the last chunk, which starts at pixel frame "
                    f"{firsts[-1]}; chunks start at pixel frames {firsts}."
                )
            if index in by_chunk:
                raise ValueError(
                    f"Two prompt switches take effect at the same chunk (starting at pixel frame {firsts[index]}); "
                    f"chunks start at pixel frames {firsts}: keep one switch per chunk."
                )
            by_chunk[index] = embeds
        return by_chunk

    def _switch_prompt(
        self,
        prompt_embeds: torch.Tensor,
        history: Sequence[RolloutChunk],
        cache_tag: str,
        context_timestep: torch.Tensor,
        recache: bool,
    ) -> None:
        """Condition ``cache_tag`` on ``prompt_embeds`` from the next chunk on.

        The tag's cross K/V are invalidated (the next cache pass refills them). With ``recache``, every chunk of
        ``history`` runs its cache pass again under the new prompt, in order (``store_kv=True`` replaces what the
        tag held from that chunk on): one transformer forward per earlier chunk, no denoising.
        """
        for engine in self.transformer.kv_cache_engines.values():
            engine.invalidate_cross(cache_tag)
        if not recache:
            return
        for chunk in history:
            self._chunk_forward(
                chunk.context,
                context_timestep,
                prompt_embeds,
                chunk_index=chunk.index,
                start=chunk.start,
                end=chunk.end,
                cache_tag=cache_tag,
                store_kv=True,
            )

    # ------------------------------------------------------------------ kept rollouts
    @property
    def rollout_branches(self) -> list[str]:
        """Names of the kept rollouts (``"main"`` after ``pipe(..., keep_cache=True)``, then the forks)."""
        return list(self.__dict__.get("_kept_rollouts", {}))

    def kept_rollout(self, branch: str = MAIN_BRANCH) -> KeptRollout:
        """The [`KeptRollout`] of ``branch``; ``ValueError`` when there is none."""
        kept = self.__dict__.get("_kept_rollouts", {})
        if branch not in kept:
            raise ValueError(
                f"No kept rollout on branch {branch!r} (kept: {sorted(kept)}): run the pipeline with "
                "`keep_cache=True` first, or fork an existing branch."
            )
        return kept[branch]

    def discard_rollout(self, branch: str | None = None) -> None:
        """Free the caches of ``branch`` (every kept rollout when ``None``)."""
        kept = self.__dict__.setdefault("_kept_rollouts", {})
        if branch is None:
            self.transformer.clear_caches()
            kept.clear()
            return
        for engine in self.transformer.kv_cache_engines.values():
            for tag in branch_cache_tags(branch):
                engine.clear(tag)
        kept.pop(branch, None)

    @exclusive_rollout("fork_rollout()")
    def fork_rollout(self, branch: str, source: str = MAIN_BRANCH) -> None:
        """Copy the kept rollout ``source`` (its KV caches under new tags, its latents) to a new branch ``branch``.

        Both branches then continue independently from the shared prefix ([`continue_rollout`] and
        [`redo_last_chunk`] take ``branch=``), like llama.cpp's ``seq_cp``. The copy shares the stored K/V tensors
        (they are never written in place), so a fork costs no cache memory until the branches diverge.
        """
        kept = self.kept_rollout(source)
        if branch in self.rollout_branches:
            raise ValueError(f"Branch {branch!r} exists already (kept: {self.rollout_branches}); pick a new name.")
        target_tags = branch_cache_tags(branch)[: len(kept.cache_tags)]
        for engine in self.transformer.kv_cache_engines.values():
            for source_tag, target_tag in zip(kept.cache_tags, target_tags):
                if engine.tag_state(source_tag) is not None:
                    engine.copy_tag(source_tag, target_tag)
        self._kept_rollouts[branch] = replace(kept, cache_tags=target_tags)

    @exclusive_rollout("continue_rollout()")
    @torch.no_grad()
    def continue_rollout(
        self,
        num_frames: int,
        prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        recache: bool = False,
        chunk_size: int | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        branch: str = MAIN_BRANCH,
        max_sequence_length: int = 512,
    ) -> WanPipelineOutput | tuple:
        r"""Append ``num_frames`` pixel frames to the kept rollout ``branch``, attending to its KV caches.

        Args:
            num_frames (`int`):
                New pixel frames, a positive multiple of 4 (each new latent frame decodes to 4).
            prompt (`str` or `list[str]`, *optional*):
                A new prompt from the first new chunk on (a prompt switch); by default the rollout's last prompt.
            prompt_embeds (`torch.Tensor`, *optional*):
                `(B, L, text_dim)` embeddings of the new prompt, instead of `prompt`.
            recache (`bool`, defaults to `False`):
                With a new prompt, recompute the self K/V of the kept chunks under it first (one forward per chunk).
            chunk_size (`int`, *optional*):
                Latent frames per new chunk; defaults to the transformer's.
            generator (`torch.Generator`, *optional*):
                RNG of the new frames' noise and of the re-noising.
            latents (`torch.Tensor`, *optional*):
                `(B, C, num_frames // 4, H, W)` noise of the new frames.
            output_type (`str`, defaults to `"np"`):
                As in `__call__`.
            return_dict (`bool`, defaults to `True`):
                Whether to return a `WanPipelineOutput` instead of a tuple.
            branch (`str`, defaults to `"main"`):
                The kept rollout to extend.
            max_sequence_length (`int`, defaults to `512`):
                Text tokens of the new prompt's encoding.

        Returns:
            The frames of the whole video of the branch so far (all chunks, decoded at once), as `__call__` returns.
        """
        kept = self.kept_rollout(branch)
        temporal = self.vae_scale_factor_temporal
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1 or num_frames % temporal:
            raise ValueError(f"`num_frames` must be a positive multiple of {temporal}, got {num_frames!r}.")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"`chunk_size` must be a positive number of latent frames or None, got {chunk_size!r}.")
        chunk_size = self.transformer.config.chunk_size if chunk_size is None else chunk_size
        start = kept.num_latent_frames
        bounds = [(start + s, start + e) for s, e in chunk_bounds(chunk_layout(num_frames // temporal, chunk_size))]
        for s, e in bounds:
            if self.transformer.chunk_layout_for(e - s, s) != (e - s,):
                raise ValueError(
                    f"`chunk_size={chunk_size}` cannot be served by the transformer at frames [{s}, {e})."
                )
        return self._resume_rollout(
            branch, bounds, kept.chunks[-1].latents.shape, prompt, prompt_embeds, recache, generator, latents,
            output_type, return_dict, max_sequence_length,
        )  # fmt: skip

    @exclusive_rollout("redo_last_chunk()")
    @torch.no_grad()
    def redo_last_chunk(
        self,
        prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        recache: bool = False,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        branch: str = MAIN_BRANCH,
        max_sequence_length: int = 512,
    ) -> WanPipelineOutput | tuple:
        r"""Rewind the kept rollout ``branch`` by its last chunk and generate that chunk again.

        The caches of the branch's tags are truncated at the chunk's first frame (`BaseKVCacheEngine.truncate`), so
        the new chunk attends to exactly the history the old one saw. With the same `generator` seed (and the same
        prompt) as the call that made the chunk from a fresh generator, the chunk comes out identical; another seed or
        prompt gives another take. Arguments as in [`continue_rollout`]; `latents` is `(B, C, F_chunk, H, W)`.

        Returns:
            The frames of the whole video of the branch, with the new last chunk.
        """
        kept = self.kept_rollout(branch)
        if not kept.chunks:
            raise ValueError(f"The kept rollout on branch {branch!r} holds no chunk to redo.")
        last = kept.chunks[-1]

        def drop_last_chunk() -> None:  # runs once every input is checked, so a bad input leaves the chunk kept
            for engine in self.transformer.kv_cache_engines.values():
                for tag in kept.cache_tags:
                    engine.truncate(tag, last.start)
            self._kept_rollouts[branch] = replace(kept, chunks=kept.chunks[:-1])

        return self._resume_rollout(
            branch, [(last.start, last.end)], last.latents.shape, prompt, prompt_embeds, recache, generator, latents,
            output_type, return_dict, max_sequence_length, before_rollout=drop_last_chunk,
        )  # fmt: skip

    def _resume_rollout(
        self,
        branch: str,
        bounds: Sequence[tuple[int, int]],
        kept_shape: torch.Size,
        prompt: str | list[str] | None,
        prompt_embeds: torch.Tensor | None,
        recache: bool,
        generator: torch.Generator | list[torch.Generator] | None,
        latents: torch.Tensor | None,
        output_type: str,
        return_dict: bool,
        max_sequence_length: int,
        before_rollout: Callable[[], None] | None = None,
    ) -> WanPipelineOutput | tuple:
        """Run the rollout on ``bounds`` after the kept chunks of ``branch`` and decode the branch's whole video.

        ``kept_shape`` is the ``(B, C, F, H, W)`` shape of a kept chunk's latents (the new noise has its B, C, H, W).
        ``before_rollout`` runs once every input is checked and encoded, right before the rollout (``redo`` drops
        the chunk it regenerates there, so that a bad input leaves the kept rollout as it was).
        """
        if not self._resumable_rollouts:
            raise NotImplementedError(
                f"{type(self).__name__} conditions its chunks on inputs of its `__call__` that are not kept: kept "
                "rollouts can be continued with the text-to-video WanCausalPipeline."
            )
        validate_call_arguments(
            {
                "prompt": prompt,
                "prompt_embeds": prompt_embeds,
                "recache": recache,
                "generator": generator,
                "latents": latents,
                "return_dict": return_dict,
                "max_sequence_length": max_sequence_length,
            }
        )
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("Pass either `prompt` or `prompt_embeds`, not both.")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        config = self.transformer.config
        if bounds[-1][1] > config.rope_max_seq_len and not getattr(self.transformer, "rope_rebasing", False):
            raise ValueError(
                f"Continuing to latent frame {bounds[-1][1]} runs past the RoPE table of {config.rope_max_seq_len} "
                "frames; call `pipe.transformer.enable_rope_rebasing()` (with an `attention_window`) to go on."
            )
        kept = self.kept_rollout(branch)
        device = self._execution_device
        new_embeds = None
        if prompt is not None or prompt_embeds is not None:
            new_embeds = self.encode_prompt_switches(
                {0: prompt_embeds if prompt is None else prompt}, kept.prompt_embeds, max_sequence_length, device
            )[0]
        batch, channels, _, height, width = kept_shape
        shape = (batch, channels, bounds[-1][1] - bounds[0][0], height, width)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"`latents` must have shape {shape} (B, C, F, H, W), got {tuple(latents.shape)}.")
        past = torch.zeros(shape[:2] + (bounds[0][0],) + shape[3:], device=device, dtype=torch.float32)
        # A continuation that fails or is interrupted puts the branch back as it was, so that a retry works.
        rewrites_prefix = before_rollout is not None or (recache and new_embeds is not None)
        with BranchCheckpoint(self, branch, rewrites_prefix) as checkpoint:
            if before_rollout is not None:
                before_rollout()
            kept = self.kept_rollout(branch)
            switches = {} if new_embeds is None else {len(kept.chunks): new_embeds}
            for _ in self.rollout(
                torch.cat([past, latents.to(device, torch.float32)], dim=2),
                kept.prompt_embeds,
                kept.negative_prompt_embeds,
                chunk_bounds=bounds,
                schedule=kept.schedule,
                guidance_scale=kept.guidance_scale,
                context_noise=kept.context_noise,
                generator=generator,
                attention_kwargs=kept.attention_kwargs,
                keep_cache=True,
                prompt_switches=switches,
                recache=recache,
                branch=branch,
                resume=True,
            ):
                pass
            checkpoint.commit_if(self.kept_rollout(branch).num_latent_frames == bounds[-1][1])
        video = self.decode_latents(self.kept_rollout(branch).latents, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return WanPipelineOutput(frames=video)


def stream_to_video(pipe: LiveRolloutMixin, path: str, fps: int = 16, **call_kwargs) -> tuple[int, float, float]:
    """Stream ``pipe(**call_kwargs)`` into an mp4 at ``path``, writing each chunk's frames as soon as they come.

    Uses imageio's ffmpeg writer (batch element 0). Prints the time to the first frames.

    Returns:
        ``(num_frames, seconds_to_first_frames, total_seconds)``.
    """
    import imageio

    start = time.perf_counter()
    first = None
    num_frames = 0
    with imageio.get_writer(path, fps=fps) as writer:
        for chunk in pipe.stream(**{**call_kwargs, "output_type": "np"}):
            for frame in chunk.frames[0]:
                writer.append_data((frame * 255).round().astype("uint8"))
            num_frames += len(chunk.frames[0])
            if first is None:
                first = time.perf_counter() - start
                print(f"First {num_frames} frames after {first:.2f} s.")
    return num_frames, first, time.perf_counter() - start
