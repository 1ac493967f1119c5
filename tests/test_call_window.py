"""Per-call attention layout of the causal transformer: a forward's own ``attention_window`` (checked against what the
engines hold, evicting nothing) and ``chunk_layout`` (``(F,)``: one chunk, no mask), and the ``"anchor"`` positions
mode (the sink re-positioned right before the oldest frame attended)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers.kv_cache import AttentionWindow, make_engines
from fastgen_diffusers.kv_cache.positions import anchor_positions

FRAMES = 3


def _inputs(num_frames: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, num_frames, 4, 4, generator=generator)
    text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(99))
    return x, torch.full((1,), 500.0), text


@torch.no_grad()
@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_one_chunk_layout_is_the_unmasked_call(kind):
    """A 9-frame call as one chunk equals the same call on a model whose chunks are 9 frames (no mask), and differs
    from the block-causal 3-frame layout."""
    model = make_causal_transformer(chunk_size=3)
    wide = make_causal_transformer(chunk_size=9)
    for m in (model, wide):
        m.set_kv_cache_engines(make_engines(m, kind, max_frames=12))
    x, t, text = _inputs(9)
    one_chunk = model(x, t, text, chunk_layout=(9,), return_dict=False)[0]
    torch.testing.assert_close(one_chunk, wide(x, t, text, return_dict=False)[0], rtol=0, atol=1e-6)
    assert (one_chunk - model(x, t, text, return_dict=False)[0]).abs().max() > 1e-4


@pytest.mark.parametrize("layout", [(4, 4), (9, 0), [3, 3, "3"], 9, (3.0, 6)])
def test_bad_chunk_layouts_raise(layout):
    model = make_causal_transformer()
    x, t, text = _inputs(9)
    with pytest.raises(ValueError, match="chunk_layout"):
        model(x, t, text, chunk_layout=layout)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_a_call_window_sees_held_frames_only_and_evicts_nothing(kind):
    """Engines hold sink 3 + 9 recent frames; a 3-frame call under (12, 0) sees the 9 frames before it (not the
    sink) and evicts nothing; a window reaching an evicted frame is refused before anything changes."""
    model = make_causal_transformer(chunk_size=FRAMES)
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=12, sink_frames=3, max_frames=30))
    engine = model.kv_cache_engines["main"]
    for chunk in range(6):  # frames 0 .. 17 stored; the engine keeps [0, 3) and [9, 18)
        x, t, text = _inputs(FRAMES, chunk)
        model(x, torch.zeros(1), text, start_frame=FRAMES * chunk, store_kv=True)
    state = engine.tag_state("pos")
    before = (state.num_frames, state.evicted_before)
    x, t, text = _inputs(FRAMES, 7)
    call_window = AttentionWindow(12, 0)
    assert engine.held_visible("pos", 18, FRAMES, call_window) == (0, 9)
    model(x, t, text, start_frame=18, attention_window=call_window)
    assert (state.num_frames, state.evicted_before) == before  # nothing evicted
    with pytest.raises(ValueError, match="no longer holds"):
        model(x, t, text, start_frame=18, attention_window=AttentionWindow(15, 0))  # would need frames 6 .. 8
    with pytest.raises(ValueError, match="AttentionWindow"):
        model(x, t, text, start_frame=18, attention_window=12)
    with pytest.raises(ValueError, match="unbounded"):
        model(x, t, text, start_frame=18, attention_window=AttentionWindow())
    assert (state.num_frames, state.evicted_before) == before


def test_anchor_positions_put_the_sink_before_the_oldest_frame_attended():
    window = AttentionWindow(21, 3)
    # sink, 3 working frames, a 15-frame call at 9: the anchor sits at 3 .. 5 (Rolling Forcing's window 7)
    frames = [0, 1, 2, 6, 7, 8, *range(9, 24)]
    assert anchor_positions(frames, window, 0) == [3, 4, 5, *frames[3:]]
    # nothing cached but the anchor: it stays at 0 .. 2; the anchor's own call too
    assert anchor_positions([0, 1, 2, *range(3, 18)], window, 0) == list(range(18))
    assert anchor_positions([0, 1, 2], window, 0) == [0, 1, 2]
    # without a sink every key is absolute
    assert anchor_positions([3, 4, 5, 6], AttentionWindow(21, 0), 0) == [3, 4, 5, 6]
