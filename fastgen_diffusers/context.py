"""``CausalContext``: the rollout metadata of one causal forward and the engines it routes to."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .kv_cache import AttentionWindow, BaseKVCacheEngine, CrossKVMode
from .kv_cache.masks import BlockMaskMemo


@dataclass
class CausalContext:
    """Everything a causal attention processor needs to know about the forward it runs in.

    Attributes:
        cache_engines: the model's engine branches (``{"main": ...}`` or ``{"main": ..., "vace": ...}``).
        cache_tag: cache namespace of this forward (``"pos"``, ``"neg"``, ...).
        store_kv: whether this forward appends its self K/V (and fills empty cross K/V).
        start_frame: absolute latent index of the first frame of this call.
        num_frames: latent frames in this call.
        frame_seqlen: tokens per latent frame after patching.
        chunk_layout: frame counts of the chunks this call is split into (block-causal inside the call).
        image_context_length: image tokens that precede the text tokens in the cross-attention context (Wan2.1 I2V).
        cross_modes: ``id(engine) -> CrossKVMode``, decided once per forward by the model.
        mask_backend: ``"sdpa"`` (boolean mask) or ``"flex"`` (FlexAttention ``BlockMask``) for multi-chunk calls.
        block_masks: the memo the masks of multi-chunk calls come from (the model's, kept across forwards).
        committed: set once the forward's cache writes are committed; a gradient-checkpointing recompute of its
            blocks then writes nothing again.
        attention_bias: Krea's KV-cache attention bias in ``(0, 1]``: a denoising forward (``store_kv=False``) adds
            ``log(attention_bias)`` to the logits of the cached keys after the first frame (the anchor); 1: off.
        attention_window: the window this call attends under instead of each engine's own (``None``: the engines'),
            checked by every engine against what it holds.
        query_positions: temporal RoPE positions of the call's frames when the engines store keys before RoPE (set
            by the model from the engines' ``key_positions``); ``None``: absolute frames.
    """

    cache_engines: Mapping[str, BaseKVCacheEngine]
    cache_tag: str = "pos"
    store_kv: bool = False
    start_frame: int = 0
    num_frames: int = 1
    frame_seqlen: int = 1
    chunk_layout: tuple[int, ...] = (1,)
    image_context_length: int = 0
    cross_modes: dict[int, CrossKVMode] = field(default_factory=dict)
    mask_backend: str = "sdpa"
    block_masks: BlockMaskMemo = field(default_factory=BlockMaskMemo)
    committed: bool = False
    attention_bias: float = 1.0
    attention_window: AttentionWindow | None = None
    query_positions: tuple[int, ...] | None = None

    @property
    def is_multi_chunk(self) -> bool:
        return len(self.chunk_layout) > 1

    def resolve_registered_engine(self, attn: nn.Module) -> BaseKVCacheEngine:
        """The engine that registered ``attn``; an unregistered module is an error, never a guess."""
        for engine in self.cache_engines.values():
            if engine.owns(attn):
                return engine
        raise RuntimeError(
            f"No KV-cache engine registered this {type(attn).__name__} (branches: {sorted(self.cache_engines)}). "
            "Attach engines with `transformer.set_kv_cache_engines(...)`, which registers the modules each owns."
        )

    def cross_mode(self, engine: BaseKVCacheEngine) -> CrossKVMode:
        return self.cross_modes.get(id(engine), CrossKVMode.COMPUTE)

    def window_of(self, engine: BaseKVCacheEngine) -> AttentionWindow:
        """The window this call attends under in ``engine``: the call's own, else the engine's."""
        return engine.window if self.attention_window is None else self.attention_window

    def self_attention_mask(self, engine: BaseKVCacheEngine, device: torch.device) -> Any:
        """Block-causal mask over ``[visible prefix | this call]`` for a multi-chunk call, ``None`` otherwise.

        A single-chunk call needs no mask: its queries see every visible prefix key and every key of the call. Under
        a windowed engine the mask is the equivalent window-and-sink mask (keys in frame order, as the engine's
        concatenating path lays them out).
        """
        if not self.is_multi_chunk:
            return None
        return self.block_masks.get(
            self.mask_backend, self.window_of(engine), self.start_frame, self.chunk_layout, self.frame_seqlen, device
        )

    def self_attention_bias(self, engine: BaseKVCacheEngine, device: torch.device) -> torch.Tensor | None:
        """Additive float mask ``(1, 1, 1, P + L)`` over ``[cached frames 0 .. start_frame | this call]``: 0 on the
        first cached frame (the anchor) and on the call's keys, ``log(attention_bias)`` on the other cached keys.

        ``None`` (no mask at all) when the bias is 1, on a cache pass, or when no cached key is biased.
        """
        if self.attention_bias == 1.0 or self.store_kv:
            return None
        if self.window_of(engine).bounded or self.is_multi_chunk:
            raise ValueError(
                "`kv_cache_attention_bias` is defined on single-chunk forwards over an unwindowed cache (the "
                "recompute policy's); this forward has a sliding window or several chunks."
            )
        prefix = self.start_frame * self.frame_seqlen
        if prefix <= self.frame_seqlen:
            return None
        bias = torch.zeros(1, 1, 1, prefix + self.num_frames * self.frame_seqlen, device=device)
        bias[..., self.frame_seqlen : prefix] = math.log(self.attention_bias)
        return bias
