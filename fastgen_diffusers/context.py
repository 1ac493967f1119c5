"""``CausalContext``: the rollout metadata of one causal forward and the engines it routes to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .kv_cache import BaseKVCacheEngine, CrossKVMode
from .kv_cache.masks import MASK_BACKENDS, BlockMaskMemo  # noqa: F401  (MASK_BACKENDS: re-exported)


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

    def self_attention_mask(self, engine: BaseKVCacheEngine, device: torch.device) -> Any:
        """Block-causal mask over ``[visible prefix | this call]`` for a multi-chunk call, ``None`` otherwise.

        A single-chunk call needs no mask: its queries see every visible prefix key and every key of the call. Under
        a windowed engine the mask is the equivalent window-and-sink mask (keys in frame order, as the engine's
        concatenating path lays them out).
        """
        if not self.is_multi_chunk:
            return None
        return self.block_masks.get(
            self.mask_backend, engine.window, self.start_frame, self.chunk_layout, self.frame_seqlen, device
        )
