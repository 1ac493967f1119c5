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

The loop is [`SequentialPolicy.run_chunks`]: the policy only gives it the chunks as they arrive and, through the
source, each chunk's starting latents and first step.

At strength 1 every chunk runs the whole schedule from its noise, exactly like [`SequentialPolicy`]; the one
difference is that the cache pass of the last chunk of a live video runs too (the policy cannot know a chunk is the
last before the video ends), which changes no output. [`RecomputeVideoToVideoPolicy`] runs the same chunks under
Krea's recompute (``kv_cache_policy="recompute"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...chunking import ChunkSpan
from .policy import SequentialPolicy
from .policy_recompute import RecomputePolicy
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

    def run(self, pipe, session, plan: VideoChunkPlan, source: VideoToVideoSource, **options):
        def chunks():
            for chunk in source:
                span = ChunkSpan(chunk.index, chunk.start, chunk.end)
                is_last = plan.num_chunks is not None and span.index == plan.num_chunks - 1
                yield span, is_last, partial(self._video_start, pipe.scheduler, source, chunk, plan)

        # the steps grow chunk by chunk: a live video's length is unknown
        yield from self.run_chunks(pipe, session, chunks(), None, **options)

    @staticmethod
    def _video_start(scheduler, source, chunk, plan) -> tuple[torch.Tensor, int]:
        """Set ``chunk``'s schedule on the scheduler; the chunk starts from its input noised to its strength, at the
        matching step."""
        scheduler.set_timesteps(**plan.schedule_of(chunk.index), device=source.device)
        return source.start(chunk, scheduler.sigmas, scheduler.order)


class RecomputeVideoToVideoPolicy(RecomputePolicy, VideoToVideoPolicy):
    """Video-to-video under Krea's recompute (what Krea's server runs on a webcam): the chunks of
    [`VideoToVideoPolicy`], each noised to its strength, with the cache rebuilt over the clean context before each
    chunk and no cache pass after it ([`RecomputePolicy`]; the anchor is re-encoded from the decoded output, as
    Krea does)."""
