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


def expected_kv_cache_bytes(
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    patch_size: tuple[int, ...],
    height: int,
    width: int,
    cached_frames: int,
    text_tokens: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    batch_size: int = 1,
    tags: int = 1,
    vae_scale_factor: int = 8,
) -> tuple[int, int]:
    """``(self, cross)`` bytes of K/V a rollout's engines hold, by the cache formula: ``cached_frames`` latent frames
    (the policy's ``held_frames``) x tokens per latent frame (``height / vae_scale_factor / patch_h`` x ``width /
    vae_scale_factor / patch_w``), in ``cache_dtype`` (an 8-bit cache, plus its scales) or ``dtype``, and the cross
    K/V of ``text_tokens`` text tokens in ``dtype``; each per cache tag (``tags``: two with guidance). The one
    formula the memory plan and the server's admission both use."""
    patch_h, patch_w = patch_size[-2:]
    tokens = cached_frames * (height // vae_scale_factor // patch_h) * (width // vae_scale_factor // patch_w)
    self_bytes = expected_self_cache_bytes(num_layers, batch_size, num_heads, tokens, head_dim, cache_dtype or dtype)
    if cache_dtype is not None:
        self_bytes += expected_scale_bytes(num_layers, batch_size, num_heads, cached_frames)
    cross_bytes = expected_self_cache_bytes(num_layers, batch_size, num_heads, text_tokens, head_dim, dtype)
    return tags * self_bytes, tags * cross_bytes
