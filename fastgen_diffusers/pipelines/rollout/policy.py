"""Rollout policies: which transformer forwards run, on which frames, at which timesteps, with which ``store_kv``.

A policy runs a [`ChunkPlan`] on a [`RolloutSession`] and yields a [`ChunkRecord`] per finished chunk. The
pipeline's ``__call__``, ``stream``, ``continue_rollout``, ``redo_last_chunk`` (and forks, through them) all run
a policy; a new sampling policy (Krea's recompute before each chunk, Rolling Forcing's window of staggered chunks) is
a new subclass of [`RolloutPolicy`] here, not a branch in the loop.

[`SequentialPolicy`], chunk after chunk:

```
for each chunk [start, end) of the plan:
    x = source[start:end]                            # or the given latents of a chunk (no denoising)
    for t in the chunk's timesteps:                  # e.g. 1000, 937.5, 833.3, 625
        v = transformer(x, t, text, start_frame=start, cache_tag="pos")            # store_kv=False
        v = v_neg + g * (v - v_neg)                  # only when g > 1, v_neg under cache_tag="neg"
        x = scheduler.step(v, t, x)                  # predict x0, re-noise to the next sigma (x0 at the last step)
    transformer(x0 re-noised to context_noise, context_noise, text, start_frame=start, store_kv=True)  # each tag
    yield ChunkRecord(chunk_index, start, end, x0)
```

The loop is [`SequentialPolicy.run_chunks`]; ``run`` gives it the plan's chunks, each starting from its noise at step
0. A subclass gives it other chunks and starting latents: [`VideoToVideoPolicy`] (``policy_v2v.py``) the chunks of the
input video as they arrive, each starting from its strength's step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from ...chunking import ChunkPlan, ChunkSpan, OpenEndedChunkPlan
from .records import ChunkRecord
from .session import RolloutSession
from .sources import NoiseSource


class RolloutPolicy:
    """How a plan of chunks is turned into transformer forwards. Subclasses implement [`run`]."""

    # Whether [`run`] serves an [`OpenEndedChunkPlan`] (an endless stream: chunks asked for one by one, none last).
    runs_open_ended_plans: bool = False

    def run(
        self,
        pipe: Any,
        session: RolloutSession,
        plan: ChunkPlan,
        source: NoiseSource,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        store_last: bool = False,
        prompt_switches: Mapping[int, torch.Tensor] | None = None,
        recache: bool = False,
    ) -> Iterator[ChunkRecord]:
        """Run ``plan`` on ``session``, yielding each chunk as soon as it is finished (the last one with
        ``is_last=True``); an interruption (``pipe._interrupt``) stops without yielding the last chunk.

        Args:
            pipe: the pipeline (its ``scheduler``, ``progress_bar`` and the diffusers callback state).
            session: the rollout's state; its caches hold the chunks before the plan.
            plan: the chunks to run and their schedules.
            source: the starting latents of each generated chunk.
            generator: RNG(s) of the scheduler's re-noising and of the context noise.
            callback_on_step_end: ``callback(pipe, step, timestep, callback_kwargs)`` after every denoising step.
            callback_on_step_end_tensor_inputs: names from ``pipe._callback_tensor_inputs`` given to the callback.
            store_last: run the last chunk's cache pass too (it only serves a continuation).
            prompt_switches: ``{chunk_index: (B, L, text_dim)}``: the conditional prompt from that chunk on (blended
                in over the session's ``prompt_transition_chunks``, see [`RolloutSession.begin_chunk`]).
            recache: re-run the earlier chunks' cache passes under a switched prompt (LongLive's recache).
        """
        raise NotImplementedError


class SequentialPolicy(RolloutPolicy):
    """Today's causal rollout: each chunk is denoised on its own schedule, then written into the cache.

    [`run`] hands the plan's chunks to [`run_chunks`], the chunk loop; a subclass whose chunks are not known up front
    (video-to-video) hands it its own chunks and starting latents, and a policy that treats the cache differently
    around a chunk (Krea's recompute) overrides [`chunk_position`] / [`finish_chunk`]: the loop stays one.
    """

    runs_open_ended_plans = True

    def run(self, pipe, session, plan, source, **options):
        # An open-ended plan's chunks come as they are asked for: none is the last, the steps are unknown.
        open_ended = isinstance(plan, OpenEndedChunkPlan)
        last_index = None if open_ended else plan.spans[-1].index
        num_timesteps = None
        if not open_ended:
            conditioner = session.conditioner
            num_timesteps = sum(
                len(schedule["sigmas"]) for span, schedule in plan if conditioner.given_latents(span) is None
            )
        chunks = (
            (span, span.index == last_index, partial(self._noise_start, pipe.scheduler, source, span, schedule))
            for span, schedule in plan
        )
        yield from self.run_chunks(pipe, session, chunks, num_timesteps, **options)

    @staticmethod
    def _noise_start(scheduler, source, span, schedule) -> tuple[torch.Tensor, int]:
        """Set ``schedule`` on the scheduler; ``span`` starts from its noise, at step 0."""
        latents = source.latents(span)
        scheduler.set_timesteps(**schedule, device=latents.device)
        return latents, 0

    def run_chunks(
        self,
        pipe: Any,
        session: RolloutSession,
        chunks: Iterable[tuple[ChunkSpan, bool, Callable[[], tuple[torch.Tensor, int]]]],
        num_timesteps: int | None,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        store_last: bool = False,
        prompt_switches: Mapping[int, torch.Tensor] | None = None,
        recache: bool = False,
    ) -> Iterator[ChunkRecord]:
        """The chunk loop of [`run`] (the module docstring's pseudocode) on ``chunks``, read one at a time.

        Args:
            chunks: ``(span, is_last, start)`` of each chunk; ``start()`` (called only for a chunk the conditioner
                does not give) sets the chunk's schedule on ``pipe.scheduler`` and returns its starting latents and
                the index of its first step: the chunk runs ``scheduler.timesteps[begin_index:]``.
            num_timesteps: the denoising steps of all the chunks, or ``None`` when unknown (an open-ended rollout:
                ``pipe._num_timesteps`` and the progress bar's total then grow by each chunk's steps as it starts).
            The other arguments are [`RolloutPolicy.run`]'s.
        """
        scheduler = pipe.scheduler
        prompt_switches = {} if prompt_switches is None else prompt_switches  # read per chunk: a live switch counts
        conditioner = session.conditioner
        pipe._num_timesteps = 0 if num_timesteps is None else num_timesteps
        with pipe.progress_bar(total=pipe._num_timesteps) as progress_bar:
            step = 0
            for span, is_last, start in chunks:
                if pipe.interrupt:
                    return
                session.begin_chunk(span.index, prompt_switches.get(span.index), recache=recache)
                position = self.chunk_position(session, span)
                clean = conditioner.given_latents(span)
                if clean is None:
                    latents, begin_index = start()
                    timesteps = scheduler.timesteps[begin_index:]
                    if num_timesteps is None:
                        pipe._num_timesteps += len(timesteps)
                        progress_bar.total += len(timesteps)
                    scheduler.set_begin_index(begin_index)
                    batch_size = latents.shape[0]
                    for chunk_step, t in enumerate(timesteps):
                        if pipe.interrupt:
                            return
                        pipe._current_timestep = t
                        flow = session.guided_flow(position, latents, t.expand(batch_size), chunk_step)
                        latents = scheduler.step(flow.float(), t, latents, generator=generator, return_dict=False)[0]
                        latents = conditioner.after_step(span, latents)
                        if callback_on_step_end is not None:
                            latents = self._callback(
                                pipe,
                                session,
                                step,
                                t,
                                latents,
                                callback_on_step_end,
                                callback_on_step_end_tensor_inputs,
                            )
                        step += 1
                        progress_bar.update()
                    clean = latents
                pipe._current_timestep = None
                context = self.finish_chunk(session, span, clean, store=store_last or not is_last, generator=generator)
                yield ChunkRecord(span.index, span.start, span.end, clean, is_last, context)

    def chunk_position(self, session: RolloutSession, span: ChunkSpan) -> ChunkSpan:
        """Where ``span``'s denoising forwards sit (its frames and RoPE positions), decided before its first step: the
        span itself here; a policy that rebuilds the cache before each chunk (recompute) moves it."""
        return span

    def finish_chunk(
        self, session: RolloutSession, span: ChunkSpan, clean: torch.Tensor, *, store: bool, generator
    ) -> torch.Tensor | None:
        """After ``span`` is denoised to ``clean``: its cache pass (when ``store``), returning what was written."""
        return session.store(span, clean, generator) if store else None

    @staticmethod
    def _callback(pipe, session, step, t, latents, callback, tensor_inputs) -> torch.Tensor:
        """Run diffusers' step-end callback; it may replace the chunk's latents and the prompt embeddings."""
        tensors = {
            "latents": latents,
            "prompt_embeds": session.prompt_embeds,
            "negative_prompt_embeds": session.negative_prompt_embeds,
        }
        outputs = callback(pipe, step, t, {name: tensors[name] for name in tensor_inputs})
        session.prompt_embeds = outputs.pop("prompt_embeds", session.prompt_embeds)
        session.negative_prompt_embeds = outputs.pop("negative_prompt_embeds", session.negative_prompt_embeds)
        return outputs.pop("latents", latents)
