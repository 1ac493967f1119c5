"""The attention inputs of one causal forward: what every block's attention reads, and what the model stores after.

A causal forward decides everything about its attention once, before its blocks run and outside any compiled region
(:meth:`~fastgen_diffusers.models.transformer_wan_causal.CausalWanMixin._begin_forward`), so that the blocks run pure
tensor code; after they ran, it stores what they handed back. This module holds both halves, per engine branch and
block:

* :func:`build_attention_inputs`: one :class:`~fastgen_diffusers.processors.attention.BlockAttentionInputs` per block.
  Each engine plans the call once (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.plan_call`) and gives each
  block the view its self-attention reads (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.cache_view`: the
  storage read in place, or the visible prefix gathered right before the block runs), under the block-causal mask
  and the attention bias over the keys in the order the view returns them
  (:meth:`~fastgen_diffusers.context.CausalContext.self_attention_masks`); cross-attention reads, fills or computes
  its K/V by the engine's mode. Nothing here asks which storage an engine has.
* :func:`key_rotations` / :func:`query_rotations`: for engines that store keys before RoPE, the rotation of every key
  attended, at the positions the engine's positions mode gives them in the order it returns them
  (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.key_positions`; ``(1, Lk, 1, D/2, 2)`` real pairs, for a
  storage read in place one per slot, identity past the valid ones), and of the call's queries.
* :func:`store_attention_outputs`: the stores and cross fills of a forward once its blocks have run (the model then
  commits, or rolls every engine back on failure).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..context import CausalContext
from ..kv_cache import BaseKVCacheEngine, CrossKVMode
from ..kv_cache.cross import ConditioningKey
from ..kv_cache.plan import CallPlan
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
    inputs, plans = {}, {}
    for name, engine in engines.items():
        plan = plans[name] = engine.plan_call(
            ctx.cache_tag, ctx.start_frame, ctx.num_frames, ctx.chunk_layout[0], ctx.attention_window
        )
        mask, bias = ctx.self_attention_masks(engine, device, plan.slot_frames)
        key_rotary = None
        if engine.keys_before_rope:
            key_rotary = key_rotations(engine, ctx, rotary_tables, grid, device, plan)
        mode = ctx.cross_mode(engine)
        store = ctx.store_kv and not ctx.committed
        per_block = []
        for block_idx in range(engine.num_blocks):
            cache = engine.cache_view(block_idx, plan, store=store)
            self_attn = SelfAttentionInputs(cache, mask=mask, bias=bias, key_rotary=key_rotary)
            cross_attn = CrossAttentionInputs(mode, ctx.image_context_length)
            if mode is CrossKVMode.READ:
                entry = engine.cross.get(block_idx, ctx.cache_tag)
                cross_attn.key, cross_attn.value = entry.key, entry.value
                cross_attn.key_img, cross_attn.value_img = entry.key_img, entry.value_img
            per_block.append(BlockAttentionInputs(self_attn, cross_attn, ctx.num_frames))
        inputs[name] = per_block
    ctx.call_plans = plans
    return inputs


def key_rotations(
    engine: BaseKVCacheEngine,
    ctx: CausalContext,
    rotary_tables: CausalRotaryTables,
    grid: tuple[int, int],
    device: torch.device,
    plan: CallPlan,
) -> torch.Tensor:
    """``(1, Lk, 1, D/2, 2)`` rotations of the keys ``engine`` returns for the call ``plan``, in its order (one per
    key slot of the plan when it reads more slots than keys: identity past the valid ones); records the call's
    query positions on ``ctx``."""
    positions = engine.key_positions(
        ctx.cache_tag,
        ctx.start_frame,
        ctx.num_frames,
        ctx.chunk_layout[0],
        in_place=plan.in_place,
        attention_window=ctx.attention_window,
    )
    ctx.query_positions = positions.queries
    keys = positions.keys
    if plan.key_slots is not None:
        keys = keys + (0,) * (plan.key_slots - len(keys))
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

    Each engine stores the self K/V from its blocks' cache views
    (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.store`: written in place, only recorded; handed back,
    appended); cross K/V computed in :attr:`CrossKVMode.FILL` are kept with the conditioning that filled
    them. Once committed, a gradient-checkpointing recompute of the blocks (in backward) stores nothing again.
    """
    fills = any(ctx.cross_mode(engine) is CrossKVMode.FILL for engine in engines.values())
    source = ConditioningKey(*conditioning) if fills else None  # built before any commit
    for name, engine in engines.items():
        per_block = attention_inputs[name]
        if ctx.store_kv:
            engine.store(ctx.call_plans[name], [inputs.self_attn.cache for inputs in per_block], ctx.chunk_layout)
        if ctx.cross_mode(engine) is CrossKVMode.FILL:
            for block_idx, inputs in enumerate(per_block):
                # a copy: under CUDA graphs the filled K/V are graph outputs that a later replay may overwrite
                kept = [None if t is None else t.clone() for t in inputs.cross_attn.filled]
                engine.cross.set(block_idx, ctx.cache_tag, *kept)
                inputs.cross_attn.filled = None
            engine.cross.mark_filled(ctx.cache_tag, source)
    ctx.committed = True
