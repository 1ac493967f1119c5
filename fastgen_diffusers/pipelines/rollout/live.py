"""Live generation on top of the causal rollout: streaming, prompt switching, and continue / redo / branch.

* [`LiveRolloutMixin.stream`] takes the arguments of the pipeline's ``__call__`` and yields a [`ChunkRecord`] as soon
  as each chunk is done: its clean latents and its frames, decoded by [`StreamingWanDecoder`] so that the
  concatenated frames equal the frames of ``pipe(...)`` exactly.
* Prompt schedules: ``prompt={0: "a cat", 48: "a dog"}`` (pixel frame -> prompt) switches the conditional prompt at
  the first chunk that starts at or after each frame. The switch invalidates the cross K/V of the conditional cache
  tag; with ``recache=True`` the self K/V of the chunks before the switch are recomputed under the new prompt too
  (LongLive's recache), so the next chunks attend to a history encoded under the prompt they follow.
* Kept rollouts: ``pipe(..., keep_cache=True)`` keeps the rollout's [`RolloutSession`] (its KV caches, chunks and
  conditioner) as the branch ``"main"``; [`LiveRolloutMixin.continue_rollout`] appends frames,
  [`LiveRolloutMixin.redo_last_chunk`] rewinds the caches by the last chunk and generates it again,
  [`LiveRolloutMixin.fork_rollout`] copies a branch (caches included) so that several continuations share one prefix.
  Every pipeline's sessions keep their conditioner (image, clip or control), so I2V and VACE rollouts continue too.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, nullcontext
from dataclasses import replace

import torch
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils import logging
from diffusers.utils.torch_utils import randn_tensor

from ...chunking import ChunkPlan, chunk_bounds, chunk_layout
from ...parallel import is_main_process
from ...settings import PromptSchedule
from ...settings.cache import check_recache_keeps_sink, check_rope_table
from ..video_io.autoencoders import streaming_decoder
from ..video_io.streaming_decode import StreamingWanDecoder
from ..video_io.streaming_tiny import StreamingTinyWanDecoder
from .core import OUTPUT_TYPES, CausalRolloutMixin, RolloutRun
from .guard import BranchCheckpoint, exclusive_rollout
from .options import RolloutOptions
from .policy_recompute import RecomputePolicy
from .prompts import check_transition_embeds
from .records import ChunkRecord, RolloutChunk, StreamChunk
from .session import MAIN_BRANCH, RolloutSession, branch_cache_tags
from .sources import NoiseSource
from .validation import validate_call_arguments

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

KeptRollout = RolloutSession  # a kept rollout is its session

__all__ = [
    "MAIN_BRANCH",
    "OUTPUT_TYPES",
    "KeptRollout",
    "LiveRolloutMixin",
    "RolloutChunk",
    "StreamChunk",
    "branch_cache_tags",
    "stream_to_video",
]


class LiveRolloutMixin(CausalRolloutMixin):
    """Streaming and kept-rollout editing (continue, redo, fork) on top of [`CausalRolloutMixin`]."""

    # ------------------------------------------------------------------ streaming
    @property
    def stream_decoder(self):
        """The model that decodes the frames of [`stream`]: the decode-only ``decoder`` component when set, else
        ``vae``."""
        decoder = getattr(self, "decoder", None)
        return self.vae if decoder is None else decoder

    @exclusive_rollout("stream()")
    def stream(self, *args, **kwargs) -> Iterator[ChunkRecord]:
        r"""Generate like ``__call__`` (same arguments), yielding each chunk as soon as it is done.

        The stream prepares the call like ``__call__`` ([`CausalRolloutMixin.prepare_rollout`]) and iterates the
        rollout generator itself, in the caller's thread: chunk ``k + 1`` is computed only when the next chunk is
        asked for, so nothing runs while the caller holds a chunk. Frames are decoded per chunk with a VAE feature
        cache carried across chunks: ``np.concatenate([c.frames for c in pipe.stream(...)], axis=1)`` equals
        ``pipe(...).frames`` exactly. With a decode-only ``decoder`` component (the tiny [`AutoencoderTinyWan`]), the
        stream's frames are that decoder's (fast previews; ``pipe(...)`` still decodes with ``vae``).
        Closing the generator early (``break``, ``.close()``, an exception in the
        consumer) closes the rollout, which frees the caches: the pipeline is then as fresh as before. With
        ``keep_cache=True`` the rollout is kept once the last chunk is handed out. While a stream is open (from its
        first chunk to its end or close) it holds the KV caches: calling the pipeline, its kept-rollout methods or
        another stream raises a ``RuntimeError`` naming it. ``return_dict`` is ignored. Every step runs under
        ``torch.no_grad`` as ``__call__`` does; the caller's grad mode is left as it is between chunks. The stream
        holds no chunk after handing it out (unless ``keep_cache`` or a recache needs them), so a long windowed
        stream runs in flat memory.

        Yields:
            [`ChunkRecord`] per chunk, in order, with its ``frames`` and ``frame_start``.
        """
        run = self.prepare_rollout(self.stream_options(*args, **kwargs))  # checks `output_type` before model work
        yield from self.stream_run(run)

    def stream_options(self, *args, **kwargs) -> RolloutOptions:
        """The options of a call with the arguments of ``__call__`` (defaults filled), for [`prepare_rollout`]."""
        bound = inspect.signature(self.__call__).bind(*args, **kwargs)
        bound.apply_defaults()
        return self._options_class(**bound.arguments)

    def stream_run(self, run: RolloutRun) -> Iterator[ChunkRecord]:
        """The body of [`stream`]: roll out a prepared ``run`` chunk by chunk, decoding each chunk's frames.

        Unguarded: the caller owns the transformer's caches (``stream`` holds them; a server gives each session a
        transformer of its own). Keeping ``run`` lets the caller change the prompt while it streams
        ([`RolloutRun.switch_prompt`])."""
        output_type = run.options.output_type
        decode = output_type != "latent" and is_main_process(self.transformer)  # under context parallelism rank 0
        with (
            closing(run.chunks()) as chunks,
            streaming_decoder(self.stream_decoder) if decode else nullcontext() as decoder,
        ):
            while True:
                # Grad mode is thread-local: a generator enters `no_grad` around each step, never across a `yield`.
                with torch.no_grad():
                    chunk = next(chunks, None)
                    if chunk is None:
                        return
                    streamed = self._stream_chunk(chunk, run.num_reference_frames, decoder, output_type)
                yield streamed

    def _stream_chunk(
        self,
        chunk: ChunkRecord,
        num_reference_frames: int,
        decoder: StreamingWanDecoder | StreamingTinyWanDecoder | None,
        output_type: str,
    ) -> ChunkRecord:
        """Decode the video frames of a finished chunk (the first ``num_reference_frames`` latent frames of the
        rollout excluded) into its record; ``decoder`` is ``None`` when nothing is decoded."""
        pixels = chunk.pixels
        chunk = replace(chunk, context=None, pixels=None)
        if decoder is None:
            return chunk
        latents = chunk.latents[:, :, max(0, num_reference_frames - chunk.start) :]
        first = max(chunk.start - num_reference_frames, 0)  # the chunk's first video latent frame
        frame_start = (
            0 if first == 0 else self.vae_scale_factor_temporal * first - (self.vae_scale_factor_temporal - 1)
        )
        frames = None
        if latents.shape[2] > 0:
            if pixels is None or decoder.vae is not self.vae:  # unless the policy decoded it with the VAE already
                pixels = decoder.decode(latents)
            frames = self.video_processor.postprocess_video(pixels, output_type=output_type)
        return replace(chunk, frames=frames, frame_start=frame_start)

    # ------------------------------------------------------------------ kept rollouts
    @exclusive_rollout("fork_rollout()")
    def fork_rollout(self, branch: str, source: str = MAIN_BRANCH) -> None:
        """Copy the kept rollout ``source`` (its KV caches under new tags, its chunks, its conditioner) to a new
        branch ``branch``.

        Both branches then continue independently from the shared prefix ([`continue_rollout`] and
        [`redo_last_chunk`] take ``branch=``), like llama.cpp's ``seq_cp``. Memory: the static engine clones the
        source's cache buffers (a fork costs the source's cache bytes at once), the vanilla engine shares the stored
        K/V tensors (never written in place) until the branches diverge; the chunk latents are shared.
        """
        kept = self.kept_rollout(source)
        if branch in self.rollout_branches:
            raise ValueError(f"Branch {branch!r} exists already (kept: {self.rollout_branches}); pick a new name.")
        self._sessions[branch] = kept.fork(branch)

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
            The frames of the whole video of the branch so far (all chunks, decoded at once, reference frames left
            out), as `__call__` returns.
        """
        kept = self.kept_rollout(branch)
        temporal = self.vae_scale_factor_temporal
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1 or num_frames % temporal:
            raise ValueError(f"`num_frames` must be a positive multiple of {temporal}, got {num_frames!r}.")
        self.check_chunk_size(chunk_size)
        chunk_size = self.transformer.config.chunk_size if chunk_size is None else chunk_size
        start = kept.num_latent_frames
        bounds = [(start + s, start + e) for s, e in chunk_bounds(chunk_layout(num_frames // temporal, chunk_size))]
        self.check_chunks_served(chunk_size, bounds)
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
        prompt) as the call that made the chunk from a fresh generator, the chunk comes out identical (true of a chunk
        made by `continue_rollout`; the last chunk of a `pipe(...)` call drew its noise after the earlier chunks', so
        a fresh generator gives another take of it); another seed or prompt gives another take. Arguments as in
        [`continue_rollout`]; `latents` is `(B, C, F_chunk, H, W)`.

        Returns:
            The frames of the whole video of the branch, with the new last chunk.
        """
        kept = self.kept_rollout(branch)
        if not kept.chunks:
            raise ValueError(f"The kept rollout on branch {branch!r} holds no chunk to redo.")
        last = kept.chunks[-1]

        def drop_last_chunk() -> None:  # runs once every input is checked, so a bad input leaves the chunk kept
            kept.truncate(last.start)

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
        """Run the policy on ``bounds`` after the kept chunks of ``branch`` and decode the branch's whole video.

        ``kept_shape`` is the ``(B, C, F, H, W)`` shape of a kept chunk's latents (the new noise has its B, C, H, W).
        ``before_rollout`` runs once every input is checked and encoded, right before the rollout (``redo`` drops
        the chunk it regenerates there, so that a bad input leaves the kept rollout as it was).
        """
        session = self.kept_rollout(branch)
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
        if recache and isinstance(session.policy, RecomputePolicy):
            raise ValueError(
                f"`recache=True` has nothing to do on the kept rollout {branch!r}: it runs `kv_cache_policy="
                "'recompute'`, which rebuilds the cache under the current prompt before every chunk. Accepted: "
                "recache=False."
            )
        if recache:  # the kept rollout's prompt-switch options with this recache (a KV flush replaces it)
            PromptSchedule(recache=True, kv_flush=session.switch_rule.kv_flush)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        config = self.transformer.config
        engines = self.transformer.kv_cache_engines.values()
        for engine in engines:
            check_recache_keeps_sink(engine.sink_update, recache and (prompt is not None or prompt_embeds is not None))
            check_rope_table(
                bounds[-1][1],
                config.rope_max_seq_len,
                engine.rope_positions,
                positions_bounded=isinstance(session.policy, RecomputePolicy),
                rope_rebasing=getattr(self.transformer, "rope_rebasing", False),
            )
        device = self._execution_device
        new_embeds = None
        if prompt is not None or prompt_embeds is not None:
            new_embeds = self.encode_prompt_switches(
                {0: prompt_embeds if prompt is None else prompt}, session.prompt_embeds, max_sequence_length, device
            )[0]
            check_transition_embeds(session.prompt_transition_chunks, session.prompt_embeds, {0: new_embeds})
        batch, channels, _, height, width = kept_shape
        shape = (batch, channels, bounds[-1][1] - bounds[0][0], height, width)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"`latents` must have shape {shape} (B, C, F, H, W), got {tuple(latents.shape)}.")
        # A continuation that fails or is interrupted puts the branch back as it was, so that a retry works.
        rewrites_prefix = before_rollout is not None or (recache and new_embeds is not None)
        with BranchCheckpoint(self, branch, rewrites_prefix) as checkpoint:
            session.conditioner.extend(bounds[-1][1])
            if before_rollout is not None:
                before_rollout()
            first_index = session.num_chunks
            switches = {} if new_embeds is None else {first_index: new_embeds}
            plan = ChunkPlan.from_bounds(
                bounds, session.schedule, first_index=first_index, first_schedule=session.first_schedule
            )
            for _ in self.run_policy(
                session,
                plan,
                NoiseSource(latents.to(device, torch.float32), start_frame=bounds[0][0]),
                generator=generator,
                keep_cache=True,
                prompt_switches=switches,
                recache=recache,
                resume=True,
            ):
                pass
            checkpoint.commit_if(session.num_latent_frames == bounds[-1][1])
        return self.finish_output(session.video_latents, output_type, return_dict)


def stream_to_video(
    pipe: LiveRolloutMixin,
    path: str,
    fps: int = 16,
    on_first_frames: Callable[[int, float], None] | None = None,
    **call_kwargs,
) -> tuple[int, float, float]:
    """Stream ``pipe(**call_kwargs)`` into an mp4 at ``path``, writing each chunk's frames as soon as they come.

    Uses imageio's ffmpeg writer (batch element 0). ``on_first_frames(num_frames, seconds)`` is called once the first
    frames are written (the CLI prints the time to them); by default it is logged.

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
                if on_first_frames is None:
                    logger.info(f"First {num_frames} frames after {first:.2f} s.")
                else:
                    on_first_frames(num_frames, first)
    return num_frames, first, time.perf_counter() - start
