"""Window-relative RoPE (keys stored before RoPE, rotated at read time by their slot) and the EMA sink.

Parity with Reward Forcing's own code is in ``test_rf_references.py``; here: the options' checks, the positions each
engine gives (the static engine's ring order included), equality with absolute positions until the window slides,
transactions (a failed forward restores the sink), the rules on evictions, the pipeline surface, and a 2001-frame
stream in flat memory that never re-bases.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine
from fastgen_diffusers.kv_cache import ROPE_POSITION_MODES, expected_self_cache_bytes, make_engines
from fastgen_diffusers.models.rope import CausalRotaryTables
from fastgen_diffusers.testing import tiny_pipeline

ENGINES = {"static": StaticKVCacheEngine, "vanilla": VanillaKVCacheEngine}
REWARD = {"window_frames": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"}
CHUNK = 3


def test_rotations_at_positions_match_the_contiguous_grid():
    """``tables.at_positions(range(s, s + F))`` is ``tables(s, F)`` bit for bit; other orders pick the same rows."""
    tables = CausalRotaryTables(attention_head_dim=16, patch_size=(1, 2, 2), max_seq_len=32)
    contiguous = tables(5, 3, 2, 4, "cpu")
    assert torch.equal(tables.at_positions(range(5, 8), 2, 4, "cpu"), contiguous)
    per_frame = contiguous.view(3, 8, -1)
    shuffled = tables.at_positions([7, 5, 5], 2, 4, "cpu").view(3, 8, -1)
    assert torch.equal(shuffled, per_frame[[2, 0, 0]])
    with pytest.raises(ValueError, match=r"Temporal RoPE positions \[0, 32\] fall outside"):
        tables.at_positions([0, 32], 2, 4, "cpu")


@pytest.mark.parametrize("kind", sorted(ENGINES))
@pytest.mark.parametrize(
    "options, message",
    [
        ({"rope_positions": "slot"}, "`rope_positions` must be one of ('absolute', 'window', 'anchor')"),
        ({"rope_positions": "window"}, "positions keys within the sliding window and its sink: set `window_frames`"),
        ({**REWARD, "sink_update": "mean"}, "`sink_update` must be one of ('fixed', 'ema')"),
        ({**REWARD, "sink_frames": 0}, "set `sink_frames` > 0"),
        (
            {**REWARD, "rope_positions": "absolute"},
            "needs keys stored before RoPE: use rope_positions in ('window', 'anchor')",
        ),
        ({**REWARD, "sink_decay": 1.0}, "`sink_decay` must be a number in (0, 1)"),
        ({**REWARD, "sink_decay": 0}, "`sink_decay` must be a number in (0, 1)"),
        ({**REWARD, "sink_decay": True}, "`sink_decay` must be a number in (0, 1)"),
        ({**REWARD, "sink_decay": "0.9"}, "`sink_decay` must be a number in (0, 1)"),
    ],
)
def test_engine_options_are_checked_in_the_constructor(kind, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ENGINES[kind](**options)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_engines(make_causal_transformer(num_layers=1), kind, **options)


def test_positions_are_slots_of_the_window_in_the_order_the_engine_returns_keys():
    """Frame-order keys ``[sink | recent | call]`` sit at ``0 .. k-1``; the static engine's in-place path returns its
    ring, whose order is not frame order once it wraps, with the same position per frame."""
    static = StaticKVCacheEngine(**REWARD)
    expected_queries = {0: (0, 1, 2), 3: (3, 4, 5), 6: (6, 7, 8), 9: (6, 7, 8), 300: (6, 7, 8)}
    for start, queries in expected_queries.items():
        positions = static.key_positions("pos", start, CHUNK, CHUNK)
        assert positions.keys == tuple(range(min(start + CHUNK, 9))) and positions.queries == queries
    # chunk 5 (frames 15-17) writes ring slots 3-5; frames 12-14 sit in slots 6-8
    ring = static.key_positions("pos", 15, CHUNK, CHUNK, in_place=True)
    assert ring.keys == (0, 1, 2, 6, 7, 8, 3, 4, 5) and ring.queries == (6, 7, 8)
    assert static.key_positions("pos", 12, CHUNK, CHUNK, in_place=True).keys == tuple(range(9))
    # absolute positions: every key at its frame (the default engines never ask, they store keys after RoPE)
    absolute = StaticKVCacheEngine(window_frames=9, sink_frames=3)
    assert not absolute.keys_before_rope and StaticKVCacheEngine(**REWARD).keys_before_rope
    assert absolute.key_positions("pos", 15, CHUNK, CHUNK).keys == (0, 1, 2, 12, 13, 14, 15, 16, 17)
    assert absolute.key_positions("pos", 15, CHUNK, CHUNK, in_place=True).keys == (0, 1, 2, 15, 16, 17, 12, 13, 14)
    with pytest.raises(ValueError, match="no in-place attention path"):
        VanillaKVCacheEngine(**REWARD).key_positions("pos", 15, CHUNK, CHUNK, in_place=True)
    assert ROPE_POSITION_MODES["window"].bounded and not ROPE_POSITION_MODES["absolute"].bounded


@torch.no_grad()
def rollout(model, num_chunks, *, fail_at=None):
    """Two denoising calls and a store per chunk on fixed inputs; every output, and the layer-0 sink after each
    chunk. ``fail_at=(chunk, kind)`` makes that call's second block raise (the call is then re-run)."""
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, CHUNK * num_chunks, 4, 6, generator=gen)
    text = torch.randn(1, 8, 32, generator=gen)
    outputs, sinks = [], []
    engine = model.kv_cache_engines["main"]
    for chunk in range(num_chunks):
        start = CHUNK * chunk
        x = latents[:, :, start : start + CHUNK]
        for step, t in enumerate((1000.0, 500.0, 0.0)):
            if fail_at == (chunk, step):
                before = (engine.get_self_prefix(0, "pos", 3, CHUNK), engine.tag_state("pos").copy())
                handle = model.blocks[1].register_forward_pre_hook(lambda *args: 1 / 0)
                with pytest.raises(ZeroDivisionError):
                    model(x, torch.tensor([t]), text, start_frame=start, store_kv=step == 2)
                handle.remove()
                after = (engine.get_self_prefix(0, "pos", 3, CHUNK), engine.tag_state("pos"))
                assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1]
            out = model(x, torch.tensor([t]), text, start_frame=start, store_kv=step == 2, return_dict=False)[0]
            outputs.append(out)
        sinks.append(engine.get_self_prefix(0, "pos", 3, CHUNK)[0].clone())
    return torch.cat(outputs, dim=2), sinks


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_window_positions_equal_absolute_ones_until_the_window_slides(kind):
    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=9, sink_frames=3))
    absolute, _ = rollout(model, 5)
    model.set_kv_cache_engines(make_engines(model, kind, **REWARD, sink_decay=0.5))
    window, sinks = rollout(model, 5)
    per_chunk = 3 * CHUNK
    assert (window[:, :, : 3 * per_chunk] - absolute[:, :, : 3 * per_chunk]).abs().max() <= 1e-5
    assert (window[:, :, 3 * per_chunk :] - absolute[:, :, 3 * per_chunk :]).abs().max() > 1e-3
    assert torch.equal(sinks[1], sinks[2]) and not torch.equal(sinks[2], sinks[3])  # the EMA runs from chunk 3 on


@pytest.mark.parametrize("kind", sorted(ENGINES))
@pytest.mark.parametrize("step", [0, 2])
def test_a_failed_forward_restores_the_ema_sink(kind, step):
    """The first call of chunk 3 updates the sink (and evicts) inside the forward's transaction: when a block fails,
    the sink and the tag are as before, and the rollout then equals one that never failed."""
    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_kv_cache_engines(make_engines(model, kind, **REWARD, sink_decay=0.5))
    clean, clean_sinks = rollout(model, 5)
    model.set_kv_cache_engines(make_engines(model, kind, **REWARD, sink_decay=0.5))
    failed, failed_sinks = rollout(model, 5, fail_at=(3, step))
    assert torch.equal(clean, failed)
    assert all(torch.equal(a, b) for a, b in zip(clean_sinks, failed_sinks))


@pytest.mark.parametrize("kind", sorted(ENGINES))
@torch.no_grad()
def test_evictions_the_ema_sink_cannot_take_are_refused_before_anything_changes(kind):
    model = make_causal_transformer(chunk_size=CHUNK)
    # window 10, sink 3: the chunk at frame 9 evicts 2 frames, not 3
    model.set_kv_cache_engines(make_engines(model, kind, **{**REWARD, "window_frames": 10}))
    x, text = torch.randn(1, 16, CHUNK, 4, 6), torch.randn(1, 8, 32)
    for start in (0, 3, 6):
        model(x, torch.zeros(1), text, start_frame=start, store_kv=True)
    engine = model.kv_cache_engines["main"]
    state = engine.tag_state("pos").copy()
    with pytest.raises(
        ValueError, match=r"must remove exactly sink_frames=3 frames; the chunk at latent frame 9 evicts 2"
    ):
        model(x, torch.zeros(1), text, start_frame=9)
    assert engine.tag_state("pos") == state
    # a store of several chunks would evict more when it ends than when it begins
    model.set_kv_cache_engines(make_engines(model, kind, **REWARD))
    for start in (0, 3, 6, 9):
        model(x, torch.zeros(1), text, start_frame=start, store_kv=True)
    with pytest.raises(ValueError, match="a store of several chunks"):
        model(torch.cat([x, x], dim=2), torch.zeros(1), text, start_frame=12, store_kv=True)
    # without a store the EMA rule has nothing against it, but the window slides inside the call: read-time positions
    # would differ from chunk by chunk (tests/test_core_combinations.py)
    with pytest.raises(ValueError, match="rotates its keys once"):
        model(torch.cat([x, x], dim=2), torch.zeros(1), text, start_frame=12)


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_inference_steps": 1, "output_type": "latent"}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rope_positions": "window"}, "set `attention_window` as well"),
        ({"attention_window": 9, "sink_frames": 3, "sink_update": "ema"}, "needs keys stored before RoPE"),
        ({"attention_window": 9, "rope_positions": "window", "sink_update": "ema"}, "set `sink_frames` > 0"),
        ({**dict(attention_window=9, sink_frames=3, rope_positions="window"), "sink_decay": 1.5}, r"in \(0, 1\)"),
        ({"rope_positions": "window", "kv_cache_engine": None}, "with kv_cache_engine=None set them on your own"),
        ({"rope_positions": "column", "attention_window": 9}, "must be one of"),
        # 16 latent frames: the first chunk absorbs one, so chunk [7, 10) evicts one frame
        (
            {
                "num_frames": 61,
                "attention_window": 9,
                "sink_frames": 3,
                "rope_positions": "window",
                "sink_update": "ema",
            },
            "the chunk at latent frame 7 evicts 1",
        ),
        ({"rope_positions": "window", "attention_window": 9, "kv_cache_policy": "recompute"}, "recompute"),
    ],
)
def test_pipelines_refuse_combinations_that_cannot_work_before_any_forward(pipe, options, message):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            pipe(**{**CALL, "num_frames": 21, **options})
        with pytest.raises(ValueError, match=message):
            next(iter(pipe.stream(**{**CALL, "num_frames": 21, **options})))
    finally:
        handle.remove()
    assert not calls


def test_a_2001_frame_stream_runs_in_flat_memory_without_rebasing(pipe):
    """667 chunks of 3 latent frames (past the tiny model's 1024-position RoPE table, re-basing off), window 9, sink 3,
    window-relative RoPE and the EMA sink: the cache holds the same bytes (the formula over 9 frames) from the third
    chunk on, the buffers never grow, and positions never re-base."""
    assert pipe.transformer.config.rope_max_seq_len == 1024 and not pipe.transformer.rope_rebasing
    options = {"attention_window": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"}
    latent_frames = 2001
    held, allocated, offsets, ends = [], [], set(), []
    for record in pipe.stream(**CALL, num_frames=4 * (latent_frames - 1) + 1, chunk_size=CHUNK, **options):
        engine = pipe.transformer.kv_cache_engines["main"]
        held.append(engine.self_cache_bytes())
        allocated.append(engine.allocated_self_cache_bytes())
        offsets.add(engine.rope_offset("pos"))
        ends.append(record.end)
    assert ends[-1] == latent_frames and len(ends) == latent_frames // CHUNK
    window_bytes = expected_self_cache_bytes(2, 1, 2, 9, 32, torch.float32)  # 1 token per frame at 16x16 pixels
    assert set(held[2:-1]) == {window_bytes}  # the last chunk is not stored: it holds the sink and 3 frames
    assert set(allocated) == {window_bytes} and offsets == {0}
