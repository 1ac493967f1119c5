"""Admission of sessions by the memory their KV caches will need (the cache formula) against the server's budget."""

from __future__ import annotations

from typing import Any

import torch

from ..kv_cache.accounting import expected_kv_cache_bytes
from ..settings import RolloutSettings


def session_cache_bytes(
    transformer: Any, rollout: RolloutSettings, height: int, width: int, num_latent_frames: int, text_tokens: int
) -> int:
    """Bytes of self and cross K/V that a session holds at most, by the cache formula: the latent frames the engines
    allocate under the rollout's policy (``held_frames``: the video, its window, or context + chunk) x tokens per
    frame, per cache tag (two with guidance), plus the cross K/V of ``text_tokens`` text tokens.

    Args:
        transformer: the causal transformer (its config and dtype).
        rollout: the session's resolved [`RolloutSettings`] (the pipeline's stored ones under the call's).
        height, width: the video's size in pixels.
        num_latent_frames: the rollout's latent frames.
        text_tokens: the text encoder's tokens (the cross K/V length).
    """
    config = transformer.config
    frames = rollout.active_policy.held_frames(num_latent_frames, config.chunk_size, rollout.cache.attention_window)
    guidance = rollout.sampling.guidance_scale
    self_bytes, cross_bytes = expected_kv_cache_bytes(
        num_layers=config.num_layers,
        num_heads=config.num_attention_heads,
        head_dim=config.attention_head_dim,
        patch_size=config.patch_size,
        height=height,
        width=width,
        cached_frames=frames,
        text_tokens=text_tokens,
        dtype=transformer.dtype,
        cache_dtype=None if rollout.cache.kv_cache_dtype is None else torch.int8,  # 8-bit: one byte, either kind
        tags=2 if guidance is not None and guidance > 1 else 1,
    )
    return self_bytes + cross_bytes


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in MiB or GiB, for messages."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


class CacheBudget:
    """The bytes of KV cache the server lets its sessions hold together; sessions reserve their share on start."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.reserved: dict[int, int] = {}  # session id -> bytes

    def reserve(self, session_id: int, num_bytes: int) -> None:
        """Reserve ``num_bytes`` for a session (replacing its earlier reservation).

        Raises:
            ValueError: the session does not fit, naming the budget and what is held.
        """
        held = sum(b for s, b in self.reserved.items() if s != session_id)
        if held + num_bytes > self.budget_bytes:
            others = len([s for s in self.reserved if s != session_id])
            raise ValueError(
                f"This session's KV cache needs {format_bytes(num_bytes)}, but the server's cache budget is "
                f"{format_bytes(self.budget_bytes)} (--cache-budget-gb) with {format_bytes(held)} held by {others} "
                "other session(s). Lower height/width, the frame count or set an attention_window, or try later."
            )
        self.reserved[session_id] = num_bytes

    def release(self, session_id: int) -> None:
        self.reserved.pop(session_id, None)
