"""Byte accounting of KV caches: the cache formula and the bytes tensors hold."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def expected_self_cache_bytes(
    num_layers: int, batch_size: int, num_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The cache formula: 2 (K and V) x layers x batch x heads x cached tokens x head_dim x bytes per element (1 for
    an 8-bit cache, whose scales :func:`expected_scale_bytes` counts)."""
    return (
        2 * num_layers * batch_size * num_heads * num_tokens * head_dim * torch.empty((), dtype=dtype).element_size()
    )


def expected_scale_bytes(num_layers: int, batch_size: int, num_heads: int, num_frames: int) -> int:
    """The scales of an 8-bit cache: 2 (K and V) x layers x batch x heads x cached frames x 4 (one float32 per
    sample, frame and head)."""
    return 2 * num_layers * batch_size * num_heads * num_frames * 4


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the elements of ``tensors`` (views counted at their own size)."""
    return sum(t.numel() * t.element_size() for t in tensors)
