"""The attention inputs of one causal forward: what every block's attention reads, and what the model stores after.

A causal forward decides everything about its attention once, before its blocks run and outside any compiled region
(:meth:`~fastgen_diffusers.models.transformer_wan_causal.CausalWanMixin._begin_forward`), so that the blocks run pure
tensor code; after they ran, it stores what they handed back. This module holds both halves, per engine branch and
block:

* :func:`build_attention_inputs`: one :class:`~fastgen_diffusers.processors.attention.BlockAttentionInputs` per block.
  Self-attention reads either the static engine's fixed buffers with the call's slots (a call at the end of the
  cache, ``static_call``) or the visible prefix gathered right before the block runs, under the block-causal mask
  and the attention bias over the keys in the order attention reads them
  (:meth:`~fastgen_diffusers.context.CausalContext.self_attention_masks`); cross-attention reads, fills or computes
  its K/V by the engine's mode.
* :func:`key_rotations` / :func:`query_rotations`: for engines that store keys before RoPE, the rotation of every key
  attended, at the positions the engine's positions mode gives them in the order it returns them
  (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.key_positions`; ``(1, Lk, 1, D/2, 2)`` real pairs, for the
  static buffers one per slot, identity past the valid ones), and of the call's queries.
* :func:`store_attention_outputs`: the stores and cross fills of a forward once its blocks have run (the model then
  commits, or rolls every engine back on failure).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from ..context import CausalContext
from ..kv_cache import BaseKVCacheEngine, CrossKVMode
from ..kv_cache.cross import ConditioningKey
from ..processors.attention import BlockAttentionInputs, CrossAttentionInputs, SelfAttentionInputs
from .rope import CausalRotaryTables


def build_attention_inputs(
    engines: Mapping[str, BaseKVCacheEngine],
    ctx: CausalContext,
    rotary_tables: CausalRotaryTables,
    grid: tuple[int, int],
    device: torch.device,
) -> dict[str, list[BlockAttentionInputs]]:
    """Per branch of ``engines``, one :class:`BlockAttentionInputs` per block (after every engine's ``begin_call``).

    ``grid`` is the post-patch ``(H', W')``. Engines that store keys before RoPE also record the call's query
    positions on ``ctx.query_positions`` (the call check made sure every engine gives the same).
    """
    inputs = {}
    for name, engine in engines.items():
        static = engine.static_call(
            ctx.cache_tag, ctx.start_frame, ctx.num_frames, ctx.chunk_layout[0], ctx.attention_window
        )
        mask, bias = ctx.self_attention_masks(engine, device, None if static is None else static.slot_frames)
        key_rotary = None
        if engine.keys_before_rope:
            key_rotary = key_rotations(engine, ctx, rotary_tables, grid, device, in_place=static is not None)
        mode = ctx.cross_mode(engine)
        per_block = []
        for block_idx in range(engine.num_blocks):
            if static is not None:
                key_cache, value_cache = engine.static_buffers(block_idx, ctx.cache_tag)
                self_attn = SelfAttentionInputs(
                    key_cache,
                    value_cache,
                    static=True,
                    write_index=static.write_index,
                    valid_length=static.valid_length,
                    mask=mask,
                    bias=bias,
                    key_rotary=key_rotary,
                )
            else:
                load_prefix = functools.partial(
                    engine.get_self_prefix,
                    block_idx,
                    ctx.cache_tag,
                    ctx.start_frame,
                    ctx.chunk_layout[0],
                    ctx.attention_window,
                )
                self_attn = SelfAttentionInputs(
                    mask=mask,
                    store=ctx.store_kv and not ctx.committed,
                    load_prefix=load_prefix,
                    bias=bias,
                    key_rotary=key_rotary,
                )
            cross_attn = CrossAttentionInputs(mode, ctx.image_context_length)
            if mode is CrossKVMode.READ:
                entry = engine.get_cross_kv(block_idx, ctx.cache_tag)
                cross_attn.key, cross_attn.value = entry.key, entry.value
                cross_attn.key_img, cross_attn.value_img = entry.key_img, entry.value_img
            per_block.append(BlockAttentionInputs(self_attn, cross_attn, ctx.num_frames))
        inputs[name] = per_block
    return inputs


def key_rotations(
    engine: BaseKVCacheEngine,
    ctx: CausalContext,
    rotary_tables: CausalRotaryTables,
    grid: tuple[int, int],
    device: torch.device,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """``(1, Lk, 1, D/2, 2)`` rotations of the keys ``engine`` returns for this call, in its order (``in_place``: one
    per slot of the static buffers, the fixed shape, identity past the valid slots); records the call's query
    positions on ``ctx``."""
    positions = engine.key_positions(
        ctx.cache_tag,
        ctx.start_frame,
        ctx.num_frames,
        ctx.chunk_layout[0],
        in_place=in_place,
        attention_window=ctx.attention_window,
    )
    ctx.query_positions = positions.queries
    keys = positions.keys
    if in_place:
        slots = engine.static_buffers(0, ctx.cache_tag)[0].shape[1] // ctx.frame_seqlen
        keys = keys + (0,) * (slots - len(keys))
    return torch.view_as_real(rotary_tables.at_positions(keys, *grid, device))


def query_rotations(
    ctx: CausalContext, rotary_tables: CausalRotaryTables, grid: tuple[int, int], device: torch.device
) -> torch.Tensor:
    """``(1, F*S, 1, D/2, 2)`` rotations of the call's queries at ``ctx.query_positions`` (keys before RoPE)."""
    return torch.view_as_real(rotary_tables.at_positions(ctx.query_positions, *grid, device))


def store_attention_outputs(
    engines: Mapping[str, BaseKVCacheEngine],
    ctx: CausalContext,
    conditioning: tuple,
    attention_inputs: dict[str, list[BlockAttentionInputs]],
) -> None:
    """Store what the blocks handed back and mark ``ctx`` committed (the caller rolls back if this fails).

    Self K/V of a static call are already in their slots (only the bookkeeping is left); other stores append the K/V
    each block handed back; cross K/V computed in :attr:`CrossKVMode.FILL` are kept with the conditioning that filled
    them. Once committed, a gradient-checkpointing recompute of the blocks (in backward) stores nothing again.
    """
    fills = any(ctx.cross_mode(engine) is CrossKVMode.FILL for engine in engines.values())
    source = ConditioningKey(*conditioning) if fills else None  # built before any commit
    for name, engine in engines.items():
        per_block = attention_inputs[name]
        if ctx.store_kv:
            if per_block and per_block[0].self_attn.static:
                engine.commit_static_store(ctx.cache_tag, ctx.start_frame, ctx.num_frames)
            else:
                for block_idx, inputs in enumerate(per_block):
                    self_attn = inputs.self_attn
                    engine.append_self_kv(
                        block_idx, ctx.cache_tag, self_attn.new_key, self_attn.new_value, ctx.start_frame
                    )
                    self_attn.new_key = self_attn.new_value = None
            engine.commit_store(ctx.cache_tag, ctx.start_frame, ctx.num_frames, ctx.chunk_layout)
        if ctx.cross_mode(engine) is CrossKVMode.FILL:
            for block_idx, inputs in enumerate(per_block):
                # a copy: under CUDA graphs the filled K/V are graph outputs that a later replay may overwrite
                kept = [None if t is None else t.clone() for t in inputs.cross_attn.filled]
                engine.set_cross_kv(block_idx, ctx.cache_tag, *kept)
                inputs.cross_attn.filled = None
            engine.mark_cross_filled(ctx.cache_tag, source)
    ctx.committed = True
