"""Sliding window and sink on both engines: the cached rollout equals the full forward under the window mask."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine, expected_self_cache_bytes, make_engines

NUM_FRAMES = 12  # chunk_size 2: six chunks
WINDOWS = [(4, 0), (5, 1), (6, 2)]  # (window_frames, sink_frames)


@pytest.fixture(scope="module")
def model():
    return make_causal_transformer(chunk_size=2)


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(1, 16, NUM_FRAMES, 4, 4, generator=gen)
    timesteps = torch.rand(1, NUM_FRAMES, generator=gen) * 1000
    return latents, timesteps, torch.randn(1, 8, 32, generator=gen)


@torch.no_grad()
def rollout(model, inputs, engine, first=0):
    """A denoising call and a store call per chunk from ``first``; returns the store calls' outputs."""
    latents, timesteps, text = inputs
    outputs = []
    for start in range(first, NUM_FRAMES, 2):
        chunk, t = latents[:, :, start : start + 2], timesteps[:, start : start + 2]
        model(chunk, t, text, start_frame=start)
        outputs.append(model(chunk, t, text, start_frame=start, store_kv=True, return_dict=False)[0])
    return torch.cat(outputs, dim=2)


@torch.no_grad()
def full_forward(model, inputs, engine):
    latents, timesteps, text = inputs
    model.set_kv_cache_engines({"main": engine})
    return model(latents, timesteps, text, return_dict=False)[0]


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("window_frames, sink_frames", WINDOWS)
def test_windowed_rollout_equals_full_forward_under_the_window_mask(model, inputs, kind, window_frames, sink_frames):
    options = {"window_frames": window_frames, "sink_frames": sink_frames}
    full = full_forward(model, inputs, make_engines(model, "vanilla", **options)["main"])
    unwindowed = full_forward(model, inputs, VanillaKVCacheEngine())
    assert (full - unwindowed)[:, :, window_frames:].abs().max() > 1e-3  # the window changes the numbers

    model.set_kv_cache_engines(make_engines(model, kind, **options))
    cached = rollout(model, inputs, model.kv_cache_engines["main"])
    assert (cached - full).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_multi_chunk_call_after_a_windowed_prefix_uses_the_window_mask(model, inputs, kind):
    latents, timesteps, text = inputs
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=5, sink_frames=1))
    reference = rollout(model, inputs, model.kv_cache_engines["main"])
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=5, sink_frames=1))
    with torch.no_grad():
        for start in range(0, 6, 2):
            chunk, t = latents[:, :, start : start + 2], timesteps[:, start : start + 2]
            model(chunk, t, text, start_frame=start, store_kv=True)
        rest = model(latents[:, :, 6:], timesteps[:, 6:], text, start_frame=6, return_dict=False)[0]
    assert (rest - reference[:, :, 6:]).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_windowed_cache_bytes_stay_flat(kind):
    model = make_causal_transformer(chunk_size=2, num_layers=1)
    gen = torch.Generator().manual_seed(5)
    chunk, text = torch.randn(1, 16, 2, 4, 4, generator=gen), torch.randn(1, 8, 32, generator=gen)
    engine = make_engines(model, kind, window_frames=6, sink_frames=2)["main"]
    model.set_kv_cache_engines({"main": engine})
    held, allocated = {}, {}
    with torch.no_grad():
        for index in range(40):
            model(chunk, torch.full((1,), 500.0), text, start_frame=2 * index, store_kv=True)
            held[index + 1], allocated[index + 1] = model.kv_cache_bytes(), engine.allocated_self_cache_bytes()
    assert held[10] == held[40] == expected_self_cache_bytes(1, 1, 2, 6 * 4, 32, torch.float32)
    assert allocated[10] == allocated[40]
    assert engine.held_frames("pos") == 6 and engine.num_stored_frames("pos") == 80


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_a_long_windowed_stream_keeps_a_bounded_list_of_chunk_starts(kind):
    """3,000 chunks through the engine (no model): the tag keeps the chunk starts its window can still use (the
    sink's chunk, the first after it, the held chunks), not one per chunk ever stored; the held chunks still serve a
    redo and a truncation."""
    engine = {"static": StaticKVCacheEngine, "vanilla": VanillaKVCacheEngine}[kind](window_frames=9, sink_frames=3)
    block = torch.nn.Module()
    block.attn1, block.attn2 = torch.nn.Identity(), torch.nn.Identity()
    engine.register_blocks([block])
    layout = {"batch_size": 1, "frame_seqlen": 1, "num_heads": 1, "head_dim": 2, "dtype": torch.float32}
    kv = torch.ones(1, 3, 1, 2)
    for index in range(3000):
        start = 3 * index
        engine.ensure_capacity("pos", **layout, device=torch.device("cpu"), text_len=1, max_frames=start + 3)
        engine.begin_call("pos", start, 3)
        engine.append_self_kv(0, "pos", kv, kv, start)
        engine.commit_store("pos", start, 3)
    state = engine.tag_state("pos")
    assert state.num_frames == 9000 and state.chunk_starts == [0, 3, 8994, 8997]
    engine.check_call("pos", start_frame=8997, chunk_layout=(3,), **layout, device=torch.device("cpu"))  # a redo
    engine.truncate("pos", 8997)
    assert engine.held_frames("pos") == 6 and state.chunk_starts == [0, 3, 8994]


def test_visible_prefix_reflects_the_window():
    engine = StaticKVCacheEngine(window_frames=5, sink_frames=1)
    assert engine.visible_window(start_frame=10, first_chunk_frames=2) == (1, 8)
    assert engine.visible_prefix_frames("pos", 10, 2) == 3  # sink 0, frames 8 and 9; own 2: 5 in total
    assert engine.visible_prefix_frames("pos", 2, 2) == 2  # everything while the video is shorter than the window
    assert VanillaKVCacheEngine().visible_prefix_frames("pos", 10, 2) == 10


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_a_call_that_needs_evicted_frames_raises(model, inputs, kind):
    latents, timesteps, text = inputs
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=4))
    reference = rollout(model, inputs, model.kv_cache_engines["main"])
    engine = model.kv_cache_engines["main"]
    engine.rewind("pos", 2)  # frames [8, 10) are still held: re-running the last chunk works
    with torch.no_grad():
        last = model(latents[:, :, 10:], timesteps[:, 10:], text, start_frame=10, store_kv=True, return_dict=False)[0]
    assert (last - reference[:, :, 10:]).abs().max() <= 1e-5
    engine.rewind("pos", 4)  # stored frames [0, 8): the window of a chunk at 8 needs frames 6 and 7, evicted
    with torch.no_grad(), pytest.raises(ValueError, match="no longer holds the frames before 8"):
        model(latents[:, :, 8:10], timesteps[:, 8:10], text, start_frame=8)


def test_bad_window_settings_raise():
    with pytest.raises(ValueError, match="sink_frames < window_frames"):
        StaticKVCacheEngine(window_frames=2, sink_frames=2)
    with pytest.raises(ValueError, match="needs a sliding window"):
        VanillaKVCacheEngine(sink_frames=1)
    with pytest.raises(ValueError, match="window_frames"):
        VanillaKVCacheEngine(window_frames=0)
    model = make_causal_transformer(chunk_size=3, num_layers=1)
    model.set_kv_cache_engines({"main": StaticKVCacheEngine(window_frames=3, sink_frames=1)})
    latents, text = torch.randn(1, 16, 6, 4, 4), torch.randn(1, 8, 32)
    with torch.no_grad():
        model(latents[:, :, :3], torch.full((1,), 500.0), text, store_kv=True)  # frame 0 is a sink frame: fits
        with pytest.raises(ValueError, match="does not fit the attention window"):
            model(latents[:, :, 3:], torch.full((1,), 500.0), text, start_frame=3)
