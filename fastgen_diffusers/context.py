"""``CausalContext``: the rollout metadata of one causal forward and the engines it routes to."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .kv_cache import AttentionWindow, BaseKVCacheEngine, CrossKVMode
from .kv_cache.masks import AttentionBias, BlockMaskMemo


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
            ``log(attention_bias)`` to the logits of the cached keys other than the anchor (frame 0) and the query's
            own chunk (:meth:`biased_key_frames`); 1: off, no mask built.
        attention_window: the window this call attends under instead of each engine's own (``None``: the engines'),
            checked by every engine against what it holds.
        query_positions: temporal RoPE positions of the call's frames when the engines store keys before RoPE (set
            by the model from the engines' ``key_positions``); ``None``: absolute frames.
        block_inputs: per branch of ``cache_engines``, what the model prepared for each block's attention in this
            forward (``BlockAttentionInputs`` of :mod:`~fastgen_diffusers.processors.attention`, by block index), read
            by the processors through :meth:`prepared_inputs` / :meth:`at_block`.
        call_plans: per branch, the engine's plan of this call (:meth:`BaseKVCacheEngine.plan_call`), which its
            store after the blocks reads.
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
    block_inputs: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    call_plans: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_multi_chunk(self) -> bool:
        return len(self.chunk_layout) > 1

    def resolve_registered_engine(self, attn: nn.Module) -> BaseKVCacheEngine:
        """The engine that registered ``attn``; an unregistered module is an error, never a guess.

        Ownership is the mark each engine's registration leaves on its modules, shared by every module of a branch:
        a compiled block that resolves its module guards on the branch, not on the module, so one graph serves every
        block of the branch.
        """
        for engine in self.cache_engines.values():
            if engine.owns(attn):
                return engine
        raise RuntimeError(
            f"No KV-cache engine registered this {type(attn).__name__} (branches: {sorted(self.cache_engines)}). "
            "Attach engines with `transformer.set_kv_cache_engines(...)`, which registers the modules each owns."
        )

    def prepared_inputs(self, engine: BaseKVCacheEngine, attn: nn.Module) -> Any:
        """What the model prepared for the attention of ``attn``'s block in ``engine`` (its block index through
        ``engine``)."""
        for name, candidate in self.cache_engines.items():
            if candidate is engine:
                return self.block_inputs[name][engine.block_index(attn)]
        raise RuntimeError(f"This forward has no engine {engine!r} (branches: {sorted(self.cache_engines)}).")

    def at_block(self, block_idx: int) -> CausalBlockView:
        """The view of this forward that the blocks of index ``block_idx`` (of every branch) hand their processors."""
        entries = tuple(
            (engine, self.block_inputs[name][block_idx])
            for name, engine in self.cache_engines.items()
            if block_idx < len(self.block_inputs.get(name, ()))
        )
        return CausalBlockView(self, block_idx, entries)

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
            self.mask_backend,
            self.window_of(engine),
            self.start_frame,
            self.chunk_layout,
            self.frame_seqlen,
            device,
            self.key_plan(engine),
        )

    def key_plan(self, engine: BaseKVCacheEngine):
        """The ledger's plan of the keys this call reads from ``engine`` (frames in order, which are pinned)."""
        return engine.ledger.key_plan(self.cache_tag, self.start_frame, self.chunk_layout, self.attention_window)

    def biased_key_frames(
        self, engine: BaseKVCacheEngine, slot_frames: tuple[int, ...] | None = None
    ) -> tuple[tuple[bool, ...], ...] | None:
        """Which key frames of this call's self-attention get ``log(attention_bias)``: one row of flags per chunk of
        the call (one row for a single-chunk call), a flag per key frame in the order attention reads them.

        The rule (Krea's KV-cache attention bias, extended to every forward an engine serves): on a denoising forward
        (``store_kv=False``; cache passes are never biased), a query of the chunk starting at frame ``s`` biases the
        keys of the frames ``1 <= f < s`` it sees: every cached key except the anchor and its own chunk.

        * The anchor is the sink rule's (:attr:`SinkRule.anchor <fastgen_diffusers.kv_cache.sink.SinkRule.anchor>`):
          the video's first latent frame (frame 0, the first frame the cache holds; under a recompute rollout, the
          first frame of the rebuilt context). Under a window with a sink it is the sink's
          first frame, always visible; the sink's other frames are biased like any past frame. Under a window
          without a sink frame 0 leaves the window, and then every cached key the chunk sees is biased.
        * A call of several chunks: a query's "current chunk" is its own chunk, so the keys of the call's earlier
          chunks count as cached (they are the past of that chunk; run chunk by chunk, they would be in the cache).
          Keys of its own and later chunks are never biased (the later ones are masked anyway).
        * Key order: ``slot_frames`` (a static engine's in-place call: the frame each valid slot holds, ring order
          once a window wraps), else the gathered prefix in frame order followed by the call's frames.

        ``None`` when nothing is biased: the bias is 1, a cache pass, or no visible key qualifies (then no mask is
        built at all).
        """
        if self.attention_bias == 1.0 or self.store_kv:
            return None
        if slot_frames is None:
            prefix = engine.prefix_key_frames(
                self.cache_tag, self.start_frame, self.chunk_layout[0], self.attention_window
            )
            frames = [*prefix, *range(self.start_frame, self.start_frame + self.num_frames)]
        else:
            frames = slot_frames
        starts, start = [], self.start_frame
        for chunk_frames in self.chunk_layout:
            starts.append(start)
            start += chunk_frames
        anchor = engine.ledger.pins(self.attention_window).anchor
        rows = tuple(tuple(anchor < frame < chunk_start for frame in frames) for chunk_start in starts)
        return rows if any(any(row) for row in rows) else None

    def self_attention_masks(
        self, engine: BaseKVCacheEngine, device: torch.device, slot_frames: tuple[int, ...] | None = None
    ) -> tuple[Any, AttentionBias | None]:
        """``(mask, bias)`` of this call's self-attention over ``engine``'s keys (see :meth:`biased_key_frames`).

        Without a bias: ``(self_attention_mask(...), None)`` (``None`` for a single-chunk call or an in-place static
        call, ``slot_frames`` given). With one, on the ``"sdpa"`` mask backend the bias is folded into an additive
        float mask (``(1, 1, 1, Lk)`` for one chunk, the block-causal mask with ``-inf`` plus the bias
        ``(1, 1, L, Lk)`` for several) and the second item is ``None``; on ``"flex"`` the mask is the ``BlockMask``
        (``None`` for one chunk) and the bias an :class:`AttentionBias` for the processor's ``score_mod``.
        """
        biased = self.biased_key_frames(engine, slot_frames)
        if biased is None:
            return (None if slot_frames is not None else self.self_attention_mask(engine, device)), None
        return self.block_masks.bias(
            self.mask_backend,
            self.window_of(engine),
            self.start_frame,
            self.chunk_layout,
            self.frame_seqlen,
            device,
            biased,
            math.log(self.attention_bias),
            self.key_plan(engine) if self.is_multi_chunk else None,
        )


@dataclass(frozen=True, eq=False)
class CausalBlockView:
    """One block index's view of a forward's :class:`CausalContext`: what a causal block hands its processors.

    A processor resolves its engine with :meth:`resolve_registered_engine` (the context's, for the module it runs
    for) and reads that engine's inputs with :meth:`prepared_inputs`. The view holds, per engine, the inputs prepared
    for its blocks of index ``block_idx`` (``blocks[i]`` of ``"main"`` and ``vace_blocks[i]`` of ``"vace"`` share a
    view; each processor picks its own engine's). Eager, the module's block index is looked up through the engine and
    must be the view's; traced code skips that lookup, so that a compiled block keys on its branch's engine and not
    on its module, and one graph serves every block.

    Attributes:
        context: the forward's context.
        block_idx: the branch-local block index this view serves.
        entries: ``(engine, prepared inputs)`` of the engines that have a block ``block_idx``.
    """

    context: CausalContext
    block_idx: int
    entries: tuple[tuple[BaseKVCacheEngine, Any], ...]

    def resolve_registered_engine(self, attn: nn.Module) -> BaseKVCacheEngine:
        """:meth:`CausalContext.resolve_registered_engine` of the forward."""
        return self.context.resolve_registered_engine(attn)

    def prepared_inputs(self, engine: BaseKVCacheEngine, attn: nn.Module) -> Any:
        """The inputs prepared for ``attn``'s block in ``engine``."""
        if not torch.compiler.is_compiling():
            block_idx = engine.block_index(attn)
            if block_idx != self.block_idx:
                raise RuntimeError(
                    f"{type(attn).__name__} is block {block_idx} of its engine, but runs with the view of block "
                    f"{self.block_idx}: run each block with `causal_context=context.at_block(its index)`."
                )
        for owner, inputs in self.entries:
            if owner is engine:
                return inputs
        raise RuntimeError(f"Block {self.block_idx} has no attention inputs prepared for {engine!r}.")
