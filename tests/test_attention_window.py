"""``AttentionWindow``: the one window/sink rule that engines, masks and pipelines ask."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import make_engines
from fastgen_diffusers.kv_cache.masks import build_sdpa_mask
from fastgen_diffusers.kv_cache.window import AttentionWindow


def test_a_chunk_of_sink_frames_fits_a_window_it_would_overflow_otherwise():
    # The case that drifted between the pipeline and the engine (issue #13): chunk [0, 3) with sink 3, window 4.
    # Every frame of the chunk is a sink frame, so the chunk sees all of its frames: accepted, everywhere.
    window = AttentionWindow(frames=4, sink=3)
    window.check_chunks([(0, 3)])
    assert all(window.sees(k, 3) for k in range(3))
    with pytest.raises(
        ValueError, match=r"\[3, 6\) does not fit the attention window.*`attention_window` of at least 6"
    ):
        window.check_chunks([(0, 3), (3, 6)])

    model = make_causal_transformer(chunk_size=3, num_layers=1)
    model.set_kv_cache_engines(make_engines(model, "vanilla", window_frames=4, sink_frames=3))
    latents, text = torch.randn(1, 16, 6, 2, 2), torch.randn(1, 8, 32)
    with torch.no_grad():
        model(latents[:, :, :3], torch.full((1,), 500.0), text, store_kv=True)
        with pytest.raises(ValueError, match=r"\[3, 6\) does not fit the attention window"):
            model(latents[:, :, 3:], torch.full((1,), 500.0), text, start_frame=3)


def test_the_rule_in_numbers():
    window = AttentionWindow(frames=5, sink=1)
    assert window.room == 4
    assert window.visible(start_frame=10, first_chunk_frames=2) == (1, 8)
    assert window.visible_frames(10, 2) == 3
    assert window.visible(start_frame=2, first_chunk_frames=2) == (1, 1)  # shorter than the window: everything
    assert window.kept_ranges(0, 2) == [(0, 2)]
    assert window.kept_ranges(8, 12) == [(8, 12)]
    assert window.kept_ranges(6, 12) == [(8, 12)]  # frames 6 and 7 would leave the window at once
    assert window.held_frames(num_frames=12, evicted_before=8) == 5
    assert window.slots(12) == 5 and not window.all_seen_until(6) and window.all_seen_until(5)
    unbounded = AttentionWindow()
    assert unbounded.visible(10, 2) == (0, 0) and unbounded.visible_frames(10, 2) == 10
    assert unbounded.kept_ranges(3, 9) == [(3, 9)] and unbounded.slots(12) == 12
    unbounded.check_chunks([(0, 100)])


def test_bad_settings_name_the_callers_arguments():
    with pytest.raises(ValueError, match="`sink_frames=1` needs a sliding window: set `attention_window`"):
        AttentionWindow(None, 1)
    with pytest.raises(ValueError, match="expected sink_frames < attention_window"):
        AttentionWindow(2, 2)
    with pytest.raises(ValueError, match="`window_frames` must be None or a positive"):
        AttentionWindow.from_arguments(0, 0, frames_name="window_frames")
    with pytest.raises(ValueError, match="`sink_frames` must be a number of latent frames >= 0"):
        AttentionWindow(4, True)
    with pytest.raises(ValueError, match="no longer holds the frames before 8"):
        AttentionWindow(4).check_held(start_frame=8, first_chunk_frames=2, evicted_before=8)
    assert AttentionWindow(4, 1) == AttentionWindow.from_arguments(4, 1) and hash(AttentionWindow(4, 1))


@pytest.mark.parametrize("frames, sink", [(None, 0), (4, 0), (5, 1), (6, 2)])
@pytest.mark.parametrize("start_frame", [0, 1, 2, 4, 9])
def test_the_sdpa_mask_is_the_rule_applied_to_every_query_and_key(frames, sink, start_frame):
    window = AttentionWindow(frames, sink)
    layout = (2, 2, 1)
    mask = build_sdpa_mask(window, start_frame, layout, frame_seqlen=1, device="cpu")[0, 0]
    sink_end, recent_start = window.visible(start_frame, layout[0])
    keys = [*range(sink_end), *range(recent_start, start_frame + sum(layout))]
    ends = [start_frame + 2, start_frame + 2, start_frame + 4, start_frame + 4, start_frame + 5]
    expected = torch.tensor([[bool(window.sees(k, e)) for k in keys] for e in ends])
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("frames, sink", [(None, 0), (5, 1)])
@torch.no_grad()
def test_get_self_prefix_is_the_prefix_the_attention_path_reads(kind, frames, sink):
    model = make_causal_transformer(chunk_size=2, num_layers=1)
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=frames, sink_frames=sink))
    text = torch.randn(1, 8, 32)
    for start in range(0, 10, 2):
        model(torch.randn(1, 16, 2, 2, 2), torch.full((1,), 500.0), text, start_frame=start, store_kv=True)
    engine = model.kv_cache_engines["main"]
    for start in (2, 6, 8):  # chunk boundaries before the end (the static engine's hot path writes at the end)
        if frames is not None and start < 8:
            continue  # evicted
        prefix_key, prefix_value = engine.get_self_prefix(0, "pos", start, first_chunk_frames=2)
        frames = engine.prefix_key_frames("pos", start, 2)
        assert prefix_key.shape[1] == prefix_value.shape[1] == len(frames)  # one token per frame
        assert len(frames) == engine.visible_prefix_frames("pos", start, 2)
