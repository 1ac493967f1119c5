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

Every combination that cannot apply is refused before any work ([`check_prompt_switch_inputs`]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...chunking import ChunkSpan

RECACHE_SINKS = ("rerun", "keep")
# Infinity-RoPE's `kv_flush` copies the last 3120 tokens (2 latent frames of 1560) behind the 1-frame sink.
FLUSH_KEEP_FRAMES = 2
# Infinity-RoPE's `rope_cut(..., transition_from=45)`: the cut chunk's frames sit at temporal positions 45, 46, ...
ROPE_CUT_POSITION = 45


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


def check_prompt_switch_inputs(
    *,
    recache: bool,
    recache_sink: Any,
    kv_flush: Any,
    rope_cut: Any,
    prompt_schedule: Mapping[int, Any] | None,
    kv_cache_policy: str | None,
    attention_window: int | None,
    sink_frames: int | None,
    chunk_size: int,
    rope_positions: str | None,
    sink_update: str | None,
    prompt_transition_chunks: int,
) -> None:
    """Raise ``ValueError`` (naming the argument and what it accepts) for a prompt-switch policy that cannot apply."""
    if recache_sink not in RECACHE_SINKS:
        raise ValueError(f"`recache_sink` must be one of {RECACHE_SINKS}, got {recache_sink!r}.")
    if not isinstance(kv_flush, bool):
        raise ValueError(f"`kv_flush` must be a bool, got {kv_flush!r}.")
    cut_frames = rope_cut_frames(rope_cut, prompt_schedule)
    sink = sink_frames or 0
    if recache_sink == "keep":
        if not recache:
            raise ValueError("`recache_sink='keep'` says what a recache does with the sink: set `recache=True` too.")
        if attention_window is None or sink == 0:
            raise ValueError(
                "`recache_sink='keep'` keeps the sink's K/V at a recache of the frames the window holds: set "
                "`attention_window` and `sink_frames` > 0 (LongLive: 12 and 3), or use recache_sink='rerun'."
            )
        if sink % chunk_size or (attention_window - sink) % chunk_size:
            raise ValueError(
                f"`recache_sink='keep'` re-runs the window's non-sink frames from a chunk boundary: `sink_frames` "
                f"({sink}) and `attention_window - sink_frames` ({attention_window - sink}) must be multiples of the "
                f"chunk size ({chunk_size})."
            )
    if not (kv_flush or cut_frames):
        return
    policy = "kv_flush" if kv_flush else "rope_cut"
    if kv_cache_policy not in (None, "sequential"):
        raise ValueError(
            f"`{policy}` edits the cache of a chunk-by-chunk rollout at a prompt switch; "
            f"`kv_cache_policy={kv_cache_policy!r}` rebuilds or rolls it. Accepted: kv_cache_policy=None or "
            "'sequential'."
        )
    if prompt_transition_chunks and prompt_transition_chunks > 1:
        raise ValueError(
            f"`{policy}` acts at the chunk a prompt takes effect; `prompt_transition_chunks="
            f"{prompt_transition_chunks}` blends it in over several: use prompt_transition_chunks=0 with {policy}."
        )
    if kv_flush:
        if recache:
            raise ValueError("`kv_flush=True` replaces the recache (no forward at a switch): use recache=False.")
        if attention_window is None:
            raise ValueError(
                "`kv_flush=True` keeps the sink and the last frames of a sliding window: set `attention_window` "
                "(Infinity-RoPE: 6, with sink_frames=1)."
            )
        if sink_update == "ema":
            raise ValueError(
                "`kv_flush=True` drops frames an EMA sink (`sink_update='ema'`) folds in: use sink_update='fixed'."
            )
    if cut_frames and rope_positions != "window":
        raise ValueError(
            f"`rope_cut` moves a chunk's frames to other temporal positions at read time, which needs keys stored "
            f"before RoPE and positions within the window: use rope_positions='window' (got {rope_positions!r})."
        )


def rope_cut_frames(rope_cut: Any, prompt_schedule: Mapping[int, Any] | None) -> tuple[int, ...]:
    """The pixel frames of the prompt switches that are scene cuts: ``True`` every switch, ``False`` / ``None`` none,
    or a sequence of switch frames (keys of the prompt schedule other than 0)."""
    switches = sorted(frame for frame in (prompt_schedule or {}) if frame != 0)
    if rope_cut is None or rope_cut is False:
        return ()
    if rope_cut is True:
        if not switches:
            raise ValueError("`rope_cut=True` cuts at every prompt switch: give a prompt schedule {frame: prompt}.")
        return tuple(switches)
    if isinstance(rope_cut, (str, bytes)) or not isinstance(rope_cut, Sequence):
        raise ValueError(f"`rope_cut` must be a bool or a sequence of prompt-switch frames, got {rope_cut!r}.")
    frames = tuple(rope_cut)
    unknown = [frame for frame in frames if isinstance(frame, bool) or frame not in switches]
    if unknown:
        raise ValueError(f"`rope_cut` frames {unknown} are not prompt switches; the schedule switches at {switches}.")
    return frames


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


def recache_keeping_sink(session: Any, timestep: torch.Tensor, cache_tag: str) -> None:
    """LongLive's recache with ``global_sink: true``: re-run the last ``window - sink`` frames under the new prompt
    in one forward (one chunk: every frame sees the others and the sink), whose K/V from the old prompt stay. When
    the video is still within the window (``t <= window``) LongLive's recache starts at frame 0 and does rewrite the
    sink (its sink guard needs a start past 0): the same here."""
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
    session.forward(
        span, context, timestep, cache_tag=cache_tag, store_kv=True, call_options={"chunk_layout": (end - start,)}
    )
