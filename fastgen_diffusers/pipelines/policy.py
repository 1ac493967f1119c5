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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..chunking import ChunkPlan
from .records import ChunkRecord
from .session import RolloutSession
from .sources import NoiseSource


class RolloutPolicy:
    """How a plan of chunks is turned into transformer forwards. Subclasses implement [`run`]."""

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
            prompt_switches: ``{chunk_index: (B, L, text_dim)}``: the conditional prompt from that chunk on.
            recache: re-run the earlier chunks' cache passes under a switched prompt (LongLive's recache).
        """
        raise NotImplementedError


class SequentialPolicy(RolloutPolicy):
    """Today's causal rollout: each chunk is denoised on its own schedule, then written into the cache."""

    def run(
        self,
        pipe,
        session,
        plan,
        source,
        *,
        generator=None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("latents",),
        store_last=False,
        prompt_switches=None,
        recache=False,
    ):
        scheduler = pipe.scheduler
        prompt_switches = prompt_switches or {}
        conditioner = session.conditioner
        pipe._num_timesteps = sum(
            len(schedule["sigmas"]) for span, schedule in plan if conditioner.given_latents(span) is None
        )
        last_index = plan.spans[-1].index
        with pipe.progress_bar(total=pipe._num_timesteps) as progress_bar:
            step = 0
            for span, schedule in plan:
                if pipe.interrupt:
                    return
                if span.index in prompt_switches:
                    session.switch_prompt(prompt_switches[span.index], recache=recache)
                clean = conditioner.given_latents(span)
                if clean is None:
                    latents = source.latents(span)
                    device = latents.device
                    batch_size = latents.shape[0]
                    scheduler.set_timesteps(**schedule, device=device)
                    scheduler.set_begin_index(0)
                    for chunk_step, t in enumerate(scheduler.timesteps):
                        if pipe.interrupt:
                            return
                        pipe._current_timestep = t
                        flow = session.guided_flow(span, latents, t.expand(batch_size), chunk_step)
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
                context = None
                if store_last or span.index < last_index:
                    context = session.store(span, clean, generator)
                yield ChunkRecord(span.index, span.start, span.end, clean, span.index == last_index, context)

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
