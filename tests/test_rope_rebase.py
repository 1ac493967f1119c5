"""RoPE past its table: a clear error by default, re-basing (re-rotating the cached keys) on request.

The tiny model has a 16-position table instead of Wan's 1024: the mechanism is the same, the test is fast.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import make_engines

TABLE = 16
NUM_FRAMES = 40  # past the table twice


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(6)
    latents = torch.randn(1, 16, NUM_FRAMES, 4, 4, generator=gen)
    timesteps = torch.rand(1, NUM_FRAMES, generator=gen) * 1000
    return latents, timesteps, torch.randn(1, 8, 32, generator=gen)


@torch.no_grad()
def rollout(model, inputs, num_frames=NUM_FRAMES):
    latents, timesteps, text = inputs
    outputs = []
    for start in range(0, num_frames, 2):
        chunk, t = latents[:, :, start : start + 2], timesteps[:, start : start + 2]
        model(chunk, t, text, start_frame=start)
        outputs.append(model(chunk, t, text, start_frame=start, store_kv=True, return_dict=False)[0])
    return torch.cat(outputs, dim=2)


@pytest.mark.parametrize("kind, window", [("static", {"window_frames": 6, "sink_frames": 2}), ("vanilla", {})])
def test_rebasing_keeps_generating_past_the_table_with_the_numbers_of_a_longer_table(inputs, kind, window):
    short = make_causal_transformer(chunk_size=2, num_layers=1, rope_max_seq_len=TABLE)
    long = make_causal_transformer(chunk_size=2, num_layers=1, rope_max_seq_len=1024)
    long.load_state_dict(short.state_dict())
    short.enable_rope_rebasing()
    short.set_kv_cache_engines(make_engines(short, kind, **window))
    long.set_kv_cache_engines(make_engines(long, kind, **window))

    rebased = rollout(short, inputs)
    reference = rollout(long, inputs)
    assert short.kv_cache_engines["main"].rope_offset("pos") == 32  # re-based at frames 16 and 32
    assert (rebased - reference).abs().max() <= 1e-5


def test_without_rebasing_the_call_past_the_table_raises_before_running(inputs):
    model = make_causal_transformer(chunk_size=2, num_layers=1, rope_max_seq_len=TABLE)
    rollout(model, inputs, num_frames=TABLE)
    engine = model.kv_cache_engines["main"]
    held = engine.self_cache_bytes()
    latents, timesteps, text = inputs
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[16, 18\).*enable_rope_rebasing"):
        model(latents[:, :, 16:18], timesteps[:, 16:18], text, start_frame=TABLE, store_kv=True)
    assert engine.num_stored_frames("pos") == TABLE and engine.self_cache_bytes() == held


def test_rebasing_back_to_an_earlier_frame_after_a_rewind(inputs):
    short = make_causal_transformer(chunk_size=2, num_layers=1, rope_max_seq_len=TABLE)
    short.enable_rope_rebasing()
    reference = rollout(short, inputs, num_frames=20)
    engine = short.kv_cache_engines["main"]
    assert engine.rope_offset("pos") == 16
    engine.rewind("pos", 8)  # frames [0, 12): the next call fits the table again at its absolute position
    latents, timesteps, text = inputs
    with torch.no_grad():
        replay = short(latents[:, :, 12:14], timesteps[:, 12:14], text, start_frame=12, store_kv=True)[0]
    assert engine.rope_offset("pos") == 12
    assert (replay - reference[:, :, 12:14]).abs().max() <= 1e-5
