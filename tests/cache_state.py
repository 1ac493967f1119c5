"""An exact, comparable picture of everything a causal model's engines hold (for "the cache is unchanged" checks)."""

from __future__ import annotations

import dataclasses

import torch


def held_frame_numbers(engine, state) -> list[int]:
    """Frames of a tag the engine holds: the sink and the frames not evicted (every stored frame without a window)."""
    window = engine.window
    if not window.bounded:
        return list(range(state.num_frames))
    sink = list(range(min(window.sink, state.num_frames)))
    return sink + list(range(max(window.sink, state.evicted_before), state.num_frames))


def engine_state(engine) -> dict:
    """Tag bookkeeping, the K/V of every held frame of every block and tag, and the cross entries with their source."""
    picture = {}
    for tag, state in engine._tags.items():
        frames = {}
        for block_idx in range(engine.num_blocks):
            for frame in held_frame_numbers(engine, state):
                prefix = engine.get_self_prefix(block_idx, tag, start_frame=frame + 1, first_chunk_frames=0)
                key, value = (t[:, -state.frame_seqlen :].clone() for t in prefix)
                frames[(block_idx, frame)] = (key, value)
        cross = [
            (entry.is_init, [t.clone() for t in entry.tensors()])
            for entry in (per_tag.get(tag) for per_tag in engine._cross_kv)
            if entry is not None
        ]
        source = engine.cross.sources.get(tag)
        picture[tag] = (
            dataclasses.astuple(state),
            frames,
            cross,
            None if source is None else [None if t is None else t.clone() for t in source._copies],
        )
    return picture


def model_state(model) -> dict:
    return {name: engine_state(engine) for name, engine in model.kv_cache_engines.items()}


def assert_same_state(before: dict, after: dict) -> None:
    """Exact equality (``torch.equal`` for tensors) of two :func:`model_state` pictures."""

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a, b)
            )
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    assert same(before, after), "the cache changed"
