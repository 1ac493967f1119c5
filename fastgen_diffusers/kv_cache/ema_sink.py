"""The EMA sink (``sink_update="ema"``, Reward Forcing): frames leaving the window are folded into the sink.

When a call evicts frames ``e`` (exactly ``sink_frames`` of them), every block's sink K and V become
``sink[i] = sink_decay * sink[i] + (1 - sink_decay) * e[i]`` (:func:`ema_update`; the engine applies it when the
call begins, :meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.begin_call`, inside the forward's transaction).
The evictions the update cannot take are refused before any work by the EMA eviction rule, stated once in
:mod:`fastgen_diffusers.settings.window` (:func:`check_ema_eviction`, :func:`check_ema_chunks`; re-exported here).
"""

from __future__ import annotations

import torch

from .window import check_ema_chunks, check_ema_eviction

__all__ = ["check_ema_chunks", "check_ema_eviction", "ema_update"]


def ema_update(sink: torch.Tensor, evicted: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay * sink + (1 - decay) * evicted`` (both ``(B, sink_frames * S, H, D)``)."""
    return decay * sink + (1 - decay) * evicted
