"""The video-to-video policy: chunks planned as the input video arrives, each denoised from its strength's step.

A text-to-video plan knows its chunks up front. A live video does not: [`VideoToVideoPolicy`] runs an open-ended
[`VideoChunkPlan`], taking each chunk from a [`VideoToVideoSource`] as its frames arrive:

```
for each input chunk [start, end) (read, encoded, strength s_k picked, when its frames are there):
    set the chunk's schedule; keep its last int(N * s_k) steps, from step b
    x = (1 - sigma_b) * encoded + sigma_b * noise    # encoded itself when no step is kept, noise when all are
    for t in timesteps[b:]:
        x = scheduler.step(transformer(x, t, text, start_frame=start, cache_tag="pos"), t, x)   # CFG as usual
    transformer(x re-noised to context_noise, context_noise, text, start_frame=start, store_kv=True)
    yield ChunkRecord(chunk_index, start, end, x)
```

At strength 1 every chunk runs the whole schedule from its noise, exactly like [`SequentialPolicy`]; the one
difference is that the cache pass of the last chunk of a live video runs too (the policy cannot know a chunk is the
last before the video ends), which changes no output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..chunking import ChunkSpan
from .policy import SequentialPolicy
from .records import ChunkRecord
from .video_latents import VideoToVideoSource


@dataclass(frozen=True)
class VideoChunkPlan:
    """The schedules of an open-ended rollout whose chunks come from its source.

    Args:
        schedule: ``scheduler.set_timesteps`` arguments of every chunk.
        first_schedule: those of chunk 0 when it differs (Causal Forcing++).
        num_chunks: the number of chunks when known (a list of frames), ``None`` for a live iterator.
    """

    schedule: Mapping[str, Any]
    first_schedule: Mapping[str, Any] | None = None
    num_chunks: int | None = None

    def schedule_of(self, chunk_index: int) -> Mapping[str, Any]:
        if chunk_index == 0 and self.first_schedule is not None:
            return self.first_schedule
        return self.schedule


class VideoToVideoPolicy(SequentialPolicy):
    """Sequential chunks taken from the input video as it arrives: each is noised to its strength, denoised from the
    matching step, then cached."""

    def run(
        self,
        pipe,
        session,
        plan: VideoChunkPlan,
        source: VideoToVideoSource,
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
        pipe._num_timesteps = 0  # grows chunk by chunk: a live video's length is unknown
        with pipe.progress_bar(total=0) as progress_bar:
            step = 0
            for chunk in source:
                if pipe.interrupt:
                    return
                span = ChunkSpan(chunk.index, chunk.start, chunk.end)
                is_last = plan.num_chunks is not None and span.index == plan.num_chunks - 1
                if span.index in prompt_switches:
                    session.switch_prompt(prompt_switches[span.index], recache=recache)
                scheduler.set_timesteps(**plan.schedule_of(span.index), device=source.device)
                latents, begin_index = source.start(chunk, scheduler.sigmas, scheduler.order)
                timesteps = scheduler.timesteps[begin_index:]
                pipe._num_timesteps += len(timesteps)
                progress_bar.total += len(timesteps)
                scheduler.set_begin_index(begin_index)
                batch_size = latents.shape[0]
                for chunk_step, t in enumerate(timesteps):
                    if pipe.interrupt:
                        return
                    pipe._current_timestep = t
                    flow = session.guided_flow(span, latents, t.expand(batch_size), chunk_step)
                    latents = scheduler.step(flow.float(), t, latents, generator=generator, return_dict=False)[0]
                    latents = conditioner.after_step(span, latents)
                    if callback_on_step_end is not None:
                        latents = self._callback(
                            pipe, session, step, t, latents, callback_on_step_end, callback_on_step_end_tensor_inputs
                        )
                    step += 1
                    progress_bar.update()
                pipe._current_timestep = None
                context = None
                if store_last or not is_last:
                    context = session.store(span, latents, generator)
                yield ChunkRecord(span.index, span.start, span.end, latents, is_last, context)
