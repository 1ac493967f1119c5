"""What a prompt switch does to the caches: the plain switch and three training-free policies beside it.

* plain (default): the conditional tag's cross K/V are replaced (the next forward refills them); the self K/V stay.
* ``recache=True`` (LongLive): the self K/V of the earlier chunks are recomputed under the new prompt too.
  ``recache_sink="rerun"`` (default) re-runs the sink's chunks as well, one cache pass per chunk
  ([`RolloutSession.switch_prompt`]); ``recache_sink="keep"`` is LongLive's released setting (``global_sink: true``):
  the sink keeps its K/V from the old prompt and the recent frames the window holds are re-run in **one** forward
  (one chunk, no mask, as LongLive's recache forward attends without one), each seeing the kept sink
  ([`recache_keeping_sink`]).
* ``kv_flush=True`` (Infinity-RoPE's ``kv_flush``): the self K/V are cut to the sink and the last
  [`FLUSH_KEEP_FRAMES`] generated frames, so the new prompt takes effect at once at no extra forward.
* ``rope_cut`` (Infinity-RoPE's scene cut, ``[Ns#]`` in its prompts): the first chunk after a cut switch sits at
  temporal RoPE positions [`ROPE_CUT_POSITION`], +1, ... (queries and its own keys; the cached keys keep theirs), a
  controlled jump inside one stream; the chunks after it are positioned as usual again.

These are the runtime mechanics only: the options and every rule on their combinations are the settings'
([`~fastgen_diffusers.settings.PromptSchedule`], [`~fastgen_diffusers.settings.RolloutSettings.check_prompt_switches`]
and [`~fastgen_diffusers.settings.RolloutSettings.check_chunks`]), checked before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...chunking import ChunkSpan

# Infinity-RoPE's `kv_flush` copies the last 3120 tokens (2 latent frames of 1560) behind the 1-frame sink.
FLUSH_KEEP_FRAMES = 2
# Infinity-RoPE's `rope_cut(..., transition_from=45)`: the cut chunk's frames sit at temporal positions 45, 46, ...
ROPE_CUT_POSITION = 45
# A cache pass stores its chunk's K/V and nothing reads its prediction: the transformer skips what only the
# prediction needs (the last block's attention outputs and feed-forward, the output head).
STORE_ONLY = {"store_only": True}


@dataclass(frozen=True)
class PromptSwitchRule:
    """What a rollout's prompt switches do to the caches (see the module docstring).

    Attributes:
        recache_sink: ``"rerun"`` or ``"keep"``: what a recache does with the sink (only with ``recache=True``).
        kv_flush: cut the self K/V to the sink and the last [`FLUSH_KEEP_FRAMES`] frames at each switch.
        cut_chunks: the chunk indices whose switch is a scene cut (RoPE jump to [`ROPE_CUT_POSITION`]).
    """

    recache_sink: str = "rerun"
    kv_flush: bool = False
    cut_chunks: frozenset[int] = frozenset()


def flush_caches(session: Any) -> None:
    """Infinity-RoPE's KV flush: every tag of ``session`` keeps its sink and last [`FLUSH_KEEP_FRAMES`] frames."""
    for engine in session.transformer.kv_cache_engines.values():
        for cache_tag in session.cache_tags:
            engine.flush(cache_tag, FLUSH_KEEP_FRAMES)


def set_rope_cut(session: Any, position: int | None) -> None:
    """Put the next calls of every tag of ``session`` at ``position`` (a scene cut), or back (``None``)."""
    for engine in session.transformer.kv_cache_engines.values():
        for cache_tag in session.cache_tags:
            engine.set_rope_cut(cache_tag, position)


def require_prefix_sinks(session: Any, cache_tag: str, operation: str) -> None:
    """``ValueError`` (before any change) unless every engine holding ``cache_tag`` pins the video's first frames
    (:meth:`~fastgen_diffusers.kv_cache.sink.SinkRule.require_prefix`): ``operation`` keeps "the sink" as the first
    frames."""
    for engine in session.transformer.kv_cache_engines.values():
        if engine.tag_state(cache_tag) is not None:
            engine.ledger.sink.require_prefix(operation)


def recache_keeping_sink(session: Any, timestep: torch.Tensor, cache_tag: str) -> None:
    """LongLive's recache with ``global_sink: true``: re-run the last ``window - sink`` frames under the new prompt
    in one forward (one chunk: every frame sees the others and the sink), whose K/V from the old prompt stay. When
    the video is still within the window (``t <= window``) LongLive's recache starts at frame 0 and does rewrite the
    sink (its sink guard needs a start past 0): the same here.

    The forward attends as one chunk, but the engines record the rollout's chunk boundaries for the re-run frames
    (the mask layout is not the stored one): the next switch's recache, within ``window - sink`` frames of this one,
    truncates at one of them (inside this forward's frames) as LongLive's does; the frames kept before it are the
    sink's, whose K/V (from this forward, when it started at frame 0) stay as the sink rule says.
    Needs the prefix sink rule ([`require_prefix_sinks`])."""
    require_prefix_sinks(session, cache_tag, "A recache keeping the sink")
    engine = next(e for e in session.transformer.kv_cache_engines.values() if e.tag_state(cache_tag) is not None)
    end = session.num_latent_frames
    # LongLive re-runs frames [end - window, end) into the window's slots and skips the sink's slots when it starts
    # past frame 0: the frames written are the last window - sink ones
    start = end - engine.window.frames + engine.window.sink if end > engine.window.frames else 0
    pieces = [chunk for chunk in session.chunks if chunk.end > start]
    context = torch.cat([chunk.context[:, :, max(start - chunk.start, 0) :] for chunk in pieces], dim=2)
    for each in session.transformer.kv_cache_engines.values():
        if each.tag_state(cache_tag) is not None:
            each.truncate(cache_tag, start)
    span = ChunkSpan(pieces[0].chunk_index, start, end)
    options = {"chunk_layout": (end - start,), **STORE_ONLY}  # the prediction is not read
    session.forward(span, context, timestep, cache_tag=cache_tag, store_kv=True, call_options=options)
    stored_chunks = tuple(min(chunk.end, end) - max(chunk.start, start) for chunk in pieces)
    for each in session.transformer.kv_cache_engines.values():
        if each.tag_state(cache_tag) is not None:
            each.commit_store(cache_tag, start, end - start, stored_chunks)
