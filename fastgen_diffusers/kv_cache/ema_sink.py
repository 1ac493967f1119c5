"""The EMA sink (``sink_update="ema"``, Reward Forcing): frames leaving the window are folded into the sink.

When a call evicts frames ``e`` (exactly ``sink_frames`` of them), every block's sink K and V become
``sink[i] = sink_decay * sink[i] + (1 - sink_decay) * e[i]`` (:func:`ema_update`; the engine applies it when the
call begins, :meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.begin_call`, inside the forward's transaction).
The checks here refuse, before any work, the evictions the update cannot take (:func:`check_ema_eviction`,
:func:`check_ema_chunks` for a whole rollout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .window import AttentionWindow


def ema_update(sink: torch.Tensor, evicted: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay * sink + (1 - decay) * evicted`` (both ``(B, sink_frames * S, H, D)``)."""
    return decay * sink + (1 - decay) * evicted


def check_ema_eviction(
    window: AttentionWindow, start_frame: int, chunk_layout: Sequence[int], evicted_before: int, store_kv: bool
) -> int:
    """Raise ``ValueError`` unless the EMA sink can take what a call evicts; returns the new ``evicted_before``.

    ``sink_update="ema"`` folds the frames a call evicts when it begins into the sink frame by frame, so every
    eviction must remove exactly ``sink`` frames (Reward Forcing: chunks of the sink's size), and a store of several
    chunks must not evict more when it ends. A different count is refused rather than guessed (Reward Forcing's code
    would copy the evicted frames over the sink then, a case its released setting never reaches).
    """
    _, recent_start = window.visible(start_frame, chunk_layout[0])
    first = max(window.sink, evicted_before)
    evicted = recent_start - first
    if 0 < evicted != window.sink:
        raise ValueError(
            f"`sink_update='ema'` folds the frames leaving the window into the sink frame by frame, so every eviction "
            f"must remove exactly sink_frames={window.sink} frames; the chunk at latent frame {start_frame} evicts "
            f"{evicted} (frames [{first}, {recent_start})). Use chunks of {window.sink} frames (a latent frame count "
            "that is a multiple of them, so that no chunk absorbs a remainder) with the window minus the sink a "
            "multiple of them (Reward Forcing: chunks of 3, window 9, sink 3), or sink_update='fixed'."
        )
    end_frame = start_frame + sum(chunk_layout)
    if store_kv and len(chunk_layout) > 1 and window.recent_start(end_frame) > max(first, recent_start):
        raise ValueError(
            f"`sink_update='ema'` updates the sink when a call begins; a store of several chunks "
            f"({tuple(chunk_layout)} frames at latent frame {start_frame}) would evict more frames when it ends. "
            "Store one chunk per call once the window slides, or use sink_update='fixed'."
        )
    return max(evicted_before, recent_start)


def check_ema_chunks(window: AttentionWindow, chunk_bounds: Sequence[tuple[int, int]]) -> None:
    """:func:`check_ema_eviction` for a rollout of one-chunk calls ``chunk_bounds`` (checked before any work)."""
    evicted_before = 0
    for start, end in chunk_bounds:
        evicted_before = check_ema_eviction(window, start, (end - start,), evicted_before, store_kv=True)
