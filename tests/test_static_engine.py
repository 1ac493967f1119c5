"""StaticKVCacheEngine: preallocated, in place, and the same numbers and contract as the vanilla engine."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine, expected_self_cache_bytes, make_engines

NUM_FRAMES = 11  # chunk_size 3: chunks (5, 3, 3)


@pytest.fixture(scope="module")
def model():
    return make_causal_transformer(chunk_size=3)


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 16, NUM_FRAMES, 4, 6, generator=gen)
    timesteps = torch.rand(2, NUM_FRAMES, generator=gen) * 1000
    return latents, timesteps, torch.randn(2, 8, 32, generator=gen)


def chunk_bounds(model, num_frames=NUM_FRAMES):
    bounds, start = [], 0
    for frames in model.chunk_layout_for(num_frames):
        bounds.append((start, start + frames))
        start += frames
    return bounds


@torch.no_grad()
def rollout(model, inputs, engine):
    """A denoising call then a store call per chunk; returns the store calls' outputs, concatenated over frames."""
    latents, timesteps, text = inputs
    model.set_kv_cache_engines({"main": engine})
    outputs = []
    for start, end in chunk_bounds(model):
        chunk, t = latents[:, :, start:end], timesteps[:, start:end]
        model(chunk, t, text, start_frame=start, return_dict=False)
        outputs.append(model(chunk, t, text, start_frame=start, store_kv=True, return_dict=False)[0])
    return torch.cat(outputs, dim=2)


def test_static_equals_vanilla_equals_full_block_causal_forward(model, inputs):
    latents, timesteps, text = inputs
    with torch.no_grad():
        model.set_kv_cache_engines({"main": VanillaKVCacheEngine()})
        full = model(latents, timesteps, text, return_dict=False)[0]
    vanilla = rollout(model, inputs, VanillaKVCacheEngine())
    static = rollout(model, inputs, StaticKVCacheEngine())
    assert (vanilla - full).abs().max() <= 1e-5
    assert (static - full).abs().max() <= 1e-5
    assert (static - vanilla).abs().max() <= 1e-5


def test_hot_call_attends_to_a_view_of_the_preallocated_buffer(model, inputs):
    latents, timesteps, text = inputs
    engine = StaticKVCacheEngine(max_frames=NUM_FRAMES)
    model.set_kv_cache_engines({"main": engine})
    with torch.no_grad():
        model(latents[:, :, :5], timesteps[:, :5], text, store_kv=True)
    buffers = [(entry["pos"].key.data_ptr(), entry["pos"].value.data_ptr()) for entry in engine._self_kv]
    assert engine.allocated_self_cache_bytes() == expected_self_cache_bytes(2, 2, 2, NUM_FRAMES * 6, 32, torch.float32)

    # The next chunk writes its K/V into slots 5..7 of the buffers and attends to their first 8 frames' tokens.
    with torch.no_grad():
        call = engine.static_call("pos", start_frame=5, num_frames=3, first_chunk_frames=3)
    key_cache, value_cache = engine.static_buffers(0, "pos")
    assert (key_cache.data_ptr(), value_cache.data_ptr()) == buffers[0]
    assert call.write_index.tolist() == list(range(5 * 6, 8 * 6)) and call.valid_tokens == 8 * 6
    assert call.slot_frames == tuple(range(8))

    with torch.no_grad():
        for start, end in chunk_bounds(model)[1:]:
            model(latents[:, :, start:end], timesteps[:, start:end], text, start_frame=start)
            model(latents[:, :, start:end], timesteps[:, start:end], text, start_frame=start, store_kv=True)
    assert [(e["pos"].key.data_ptr(), e["pos"].value.data_ptr()) for e in engine._self_kv] == buffers


def test_buffers_grow_by_doubling_when_no_capacity_is_given(model, inputs):
    engine = StaticKVCacheEngine()
    latents, timesteps, text = inputs
    model.set_kv_cache_engines({"main": engine})
    capacities = []
    with torch.no_grad():
        for start in range(9):
            model(latents[:, :, :1], timesteps[:, :1], text, start_frame=start, store_kv=True)
            capacities.append(engine._self_kv[0]["pos"].key.shape[1] // 6)
    assert sorted(set(capacities)) == [1, 2, 4, 8, 16]


def test_cache_bytes_follow_the_formula_on_cached_tokens(model, inputs):
    engine = StaticKVCacheEngine(max_frames=64)
    rollout(model, inputs, engine)
    held = expected_self_cache_bytes(2, 2, 2, NUM_FRAMES * 6, 32, torch.float32)
    assert engine.self_cache_bytes() == model.kv_cache_bytes() == held
    assert engine.allocated_self_cache_bytes() == expected_self_cache_bytes(2, 2, 2, 64 * 6, 32, torch.float32)
    engine.rewind("pos", 3)
    assert engine.self_cache_bytes() == expected_self_cache_bytes(2, 2, 2, 8 * 6, 32, torch.float32)


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_rewind_copy_tag_and_replacing_a_stored_chunk_match_a_fresh_rollout(model, inputs, kind):
    latents, timesteps, text = inputs
    reference = rollout(model, inputs, make_engines(model, kind)["main"])
    engine = model.kv_cache_engines["main"]
    with torch.no_grad():
        # store garbage as the last chunk, then replace it by re-running it (a stored chunk start)
        model(latents[:, :, 8:] * 3, timesteps[:, 8:], text, start_frame=8, store_kv=True)
        model(latents[:, :, 5:8] + 1, timesteps[:, 5:8], text, start_frame=5, store_kv=True)
        assert engine.num_stored_frames("pos") == 8
        model(latents[:, :, 5:8], timesteps[:, 5:8], text, start_frame=5, store_kv=True)
        engine.copy_tag("pos", "fork")
        model(latents[:, :, 8:] - 1, timesteps[:, 8:], text, start_frame=8, cache_tag="fork", store_kv=True)
        last = model(latents[:, :, 8:], timesteps[:, 8:], text, start_frame=8, return_dict=False)[0]
        engine.rewind("fork", 3)
        fork_last = model(latents[:, :, 8:], timesteps[:, 8:], text, start_frame=8, cache_tag="fork")[0]
    assert (last - reference[:, :, 8:]).abs().max() <= 1e-5
    assert (fork_last - reference[:, :, 8:]).abs().max() <= 1e-5


def test_aborted_store_leaves_the_cache_as_before(model, inputs):
    latents, timesteps, text = inputs
    reference = rollout(model, inputs, StaticKVCacheEngine())
    engine = model.kv_cache_engines["main"]
    engine.rewind("pos", 3)

    def fail(module, args):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(fail)  # block 0 has written the new chunk by then
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
            model(latents[:, :, 8:] * 5, timesteps[:, 8:], text, start_frame=8, store_kv=True)
    finally:
        handle.remove()
    assert engine.num_stored_frames("pos") == 8
    with torch.no_grad():
        last = model(latents[:, :, 8:], timesteps[:, 8:], text, start_frame=8, return_dict=False)[0]
    assert (last - reference[:, :, 8:]).abs().max() <= 1e-5


def test_gradient_calls_do_not_write_into_the_buffers(model, inputs):
    latents, timesteps, text = inputs
    model.set_kv_cache_engines({"main": StaticKVCacheEngine()})
    with torch.no_grad():
        model(latents[:, :, :5], timesteps[:, :5], text, store_kv=True)
    out = model(latents[:, :, 5:8], timesteps[:, 5:8], text, start_frame=5, return_dict=False)[0]
    out.square().mean().backward()
    assert model.blocks[0].attn1.to_q.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_a_hole_is_still_an_error(model, inputs):
    latents, timesteps, text = inputs
    model.set_kv_cache_engines({"main": StaticKVCacheEngine()})
    with torch.no_grad(), pytest.raises(ValueError, match="leaves a hole"):
        model(latents[:, :, :3], timesteps[:, :3], text, start_frame=3)


def test_bad_capacity_is_rejected():
    with pytest.raises(ValueError, match="max_frames"):
        StaticKVCacheEngine(max_frames=0)
    with pytest.raises(ValueError, match="kind"):
        make_engines(make_causal_transformer(num_layers=1), kind="paged")


def test_a_store_in_the_fast_path_copies_each_chunk_once(model, inputs):
    """The fast path writes a call's K/V into their slots to attend (in the attention, at the slots of
    ``static_call``); its store then has nothing left to copy."""
    engine = StaticKVCacheEngine(NUM_FRAMES)
    writes, static_calls = [], []
    write, static_call = engine._write, engine.static_call
    engine._write = lambda *args: (writes.append(args[-1]), write(*args))
    engine.static_call = lambda *args: static_calls.append(static_call(*args)) or static_calls[-1]
    rollout(model, inputs, engine)
    # per chunk: the denoising call and the store call take the fast path; the stores copy nothing
    assert len(static_calls) == 2 * len(chunk_bounds(model)) and None not in static_calls
    assert writes == []
    vanilla = rollout(model, inputs, VanillaKVCacheEngine())
    static = rollout(model, inputs, StaticKVCacheEngine(NUM_FRAMES))
    assert (static - vanilla).abs().max() <= 1e-5
