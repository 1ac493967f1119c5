"""Krea's KV-cache recompute: before each chunk the cache is rebuilt over a few clean context frames.

[`RecomputePolicy`], chunk after chunk (krea-ai/realtime-video ``recompute_kv_cache``, scope's
``RecomputeKVCacheBlock``):

```
for each chunk [start, end) of the plan:
    if it is not the first chunk:
        context = [anchor, last (context_frames - 1) latent frames]     # clean latents
        for each tag: clear the tag, then
            transformer(context, context_noise, text, start_frame=0, store_kv=True)      # positions 0 .. C-1
    x = source[start:end]
    for t in the chunk's timesteps:
        v = transformer(x, t, text, start_frame=C or 0, cache_tag)                     # positions C .. C+n-1
        x = scheduler.step(v, t, x)
    yield ChunkRecord(chunk_index, start, end, x0)                                       # no cache pass after it
```

So the cache never holds more than ``context_frames`` frames plus the chunk being denoised, and RoPE positions stay
below ``context_frames + chunk`` however long the video. The anchor is the first latent frame of the video
(Krea's ``keep_first_frame``, the default here); Krea re-encodes a decoded frame once the first frame has left the
context, which a caller can supply with ``anchor=`` (a callable ``(chunk_index, last_chunk) -> (B, C, 1, H, W)``).
The cache pass runs at the session's context timestep (``context_noise``; Krea's is 0) on the clean frames.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..chunking import ChunkSpan
from .policy import SequentialPolicy
from .policy_rolling import ROLLING
from .session import RolloutSession

RECOMPUTE = "recompute"
KV_CACHE_POLICIES = ("sequential", RECOMPUTE, ROLLING)


def check_recompute_inputs(
    kv_cache_policy: str | None,
    context_frames: int | None,
    attention_window: int | None,
    sink_frames: int | None,
    keep_cache: bool,
    recache: bool,
    kv_cache_attention_bias: float | None = None,
) -> None:
    """Raise ``ValueError`` for a ``kv_cache_policy`` / ``context_frames`` / bias combination the policies cannot
    serve."""
    if kv_cache_policy is not None and kv_cache_policy not in KV_CACHE_POLICIES:
        raise ValueError(f"`kv_cache_policy` must be one of {KV_CACHE_POLICIES} or None, got {kv_cache_policy!r}.")
    recompute = kv_cache_policy == RECOMPUTE
    if kv_cache_attention_bias is not None:
        bias = kv_cache_attention_bias
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not 0.01 <= float(bias) <= 1.0:
            raise ValueError(f"`kv_cache_attention_bias` must be a number in [0.01, 1], got {bias!r}.")
        if float(bias) != 1.0 and not recompute:
            raise ValueError("`kv_cache_attention_bias` below 1 needs `kv_cache_policy='recompute'`.")
    if not recompute:
        if context_frames is not None:
            raise ValueError("`context_frames` needs `kv_cache_policy='recompute'`.")
        return
    if context_frames is None or isinstance(context_frames, bool) or not isinstance(context_frames, int):
        raise ValueError(f"`context_frames` must be a positive integer under recompute, got {context_frames!r}.")
    if context_frames < 1:
        raise ValueError(f"`context_frames` must be >= 1, got {context_frames}.")
    if attention_window is not None or sink_frames:
        raise ValueError(
            "`kv_cache_policy='recompute'` bounds the cache itself: it cannot be combined with `attention_window` / "
            "`sink_frames`."
        )
    if keep_cache or recache:
        raise ValueError("`kv_cache_policy='recompute'` does not support `keep_cache` or `recache` yet.")


@dataclass
class ContextFrames:
    """The finished frames a recompute rollout builds its next context from (kept on the session)."""

    first: torch.Tensor | None = None  # (B, C, 1, H, W): the video's first latent frame
    recent: torch.Tensor | None = None  # (B, C, <= context_frames, H, W): the last frames
    last_chunk: torch.Tensor | None = None  # (B, C, F_chunk, H, W)
    num_frames: int = 0

    def add(self, clean: torch.Tensor, context_frames: int) -> None:
        """Take a finished chunk ``clean`` ``(B, C, F_chunk, H, W)``, keeping only what a context can use."""
        if self.first is None:
            self.first = clean[:, :, :1]
        recent = clean if self.recent is None else torch.cat([self.recent, clean], dim=2)
        self.recent = recent[:, :, max(recent.shape[2] - context_frames, 0) :]
        self.last_chunk = clean
        self.num_frames += clean.shape[2]


class RecomputePolicy(SequentialPolicy):
    """Krea's recompute rollout (see the module docstring).

    Args:
        context_frames: latent frames the cache is rebuilt over before each chunk (the anchor included).
        anchor: ``(chunk_index, last_chunk (B, C, F_chunk, H, W)) -> (B, C, 1, H, W)``: the anchor of a chunk once
            ``2 * context_frames`` latent frames are done (Krea re-encodes a decoded frame there); ``None`` keeps the
            video's first latent frame as the anchor for ever (Krea's ``keep_first_frame``).
        kv_cache_attention_bias: in ``[0.01, 1]``: during denoising forwards the logits of cached keys other than
            the anchor frame get ``log(bias)`` added (1: off, no mask at all).
    """

    def __init__(
        self,
        context_frames: int = 3,
        *,
        anchor: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        kv_cache_attention_bias: float = 1.0,
    ) -> None:
        check_recompute_inputs(RECOMPUTE, context_frames, None, 0, False, False, kv_cache_attention_bias)
        self.context_frames = context_frames
        self.anchor = anchor
        self.kv_cache_attention_bias = float(kv_cache_attention_bias)

    def context_of(
        self, chunk_index: int, first: torch.Tensor, recent: torch.Tensor, num_frames: int, last_chunk: torch.Tensor
    ) -> torch.Tensor:
        """The clean context before chunk ``chunk_index`` once ``num_frames`` latent frames are done (``recent``:
        the last ``context_frames`` of them): all of them while they are at most ``context_frames``, else the anchor
        + the last ``context_frames - 1`` frames. The anchor is the first frame, or ``anchor(chunk_index,
        last_chunk)`` from ``num_frames >= 2 * context_frames`` on (Krea's rule: the first frame has left the
        context)."""
        c = self.context_frames
        if num_frames <= c:
            return recent
        anchor = first
        if self.anchor is not None and num_frames >= 2 * c:
            anchor = self.anchor(chunk_index, last_chunk).to(first)
        return torch.cat([anchor, recent[:, :, recent.shape[2] - (c - 1) :]], dim=2)

    def rebuild(self, session: RolloutSession, span: ChunkSpan, context: torch.Tensor) -> None:
        """Clear every tag of ``session`` and write ``context`` at positions ``0 .. C-1`` (one cache pass a tag)."""
        for engine in session.transformer.kv_cache_engines.values():
            for tag in session.cache_tags:
                engine.clear(tag)
        window = ChunkSpan(span.index, 0, context.shape[2])
        timestep = session.context_timestep(context.shape[0], context.device)
        for cache_tag in session.cache_tags:
            session.forward(window, context, timestep, cache_tag=cache_tag, store_kv=True)

    def run(self, pipe, session, plan, source, **options):
        """[`SequentialPolicy.run`] with the cache rebuilt before each chunk and no cache pass after it; a prompt
        switch needs no recache (the next rebuild runs under the new prompt). The frames the next context needs live
        on the session (``session.policy_state``), so one policy object can serve several rollouts at once."""
        session.attention_bias = self.kv_cache_attention_bias
        session.policy_state = ContextFrames()
        yield from super().run(pipe, session, plan, source, **{**options, "recache": False})

    def chunk_position(self, session: RolloutSession, span: ChunkSpan) -> ChunkSpan:
        """Rebuild the cache over the clean context (not before the first chunk), then sit the chunk right after it."""
        done: ContextFrames = session.policy_state
        if done.first is None:
            return span
        context = self.context_of(span.index, done.first, done.recent, done.num_frames, done.last_chunk)
        self.rebuild(session, span, context)
        start = context.shape[2]
        return ChunkSpan(span.index, start, start + span.end - span.start)

    def finish_chunk(
        self, session: RolloutSession, span: ChunkSpan, clean: torch.Tensor, *, store: bool, generator
    ) -> None:
        """No cache pass (the next rebuild replaces this chunk's noisy K/V); remember the frames the next context
        needs."""
        session.policy_state.add(clean, self.context_frames)
        session.record(span, clean, None)
        return None
