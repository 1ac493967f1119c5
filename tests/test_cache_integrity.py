"""Nothing poisons a cache (issue #16, cache integrity 1-3): bad inputs fail before any engine operation, a forward
that fails midway is rolled back exactly (evictions included), and cross K/V reuse is decided by content."""

from __future__ import annotations

import copy

import pytest
import torch
from bench_loader import load_benchmark
from cache_state import assert_same_state, model_state
from conftest import make_causal_transformer

from fastgen_diffusers import make_engines

T = torch.full((1,), 500.0)


def frames(count: int, seed: int) -> torch.Tensor:
    return torch.randn(1, 16, count, 2, 2, generator=torch.Generator().manual_seed(seed))


def text(seed: int = 7, tokens: int = 4, width: int = 32, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


BAD_CALLS = {
    "text width": (dict(encoder_hidden_states=text(width=16)), "`encoder_hidden_states` must have width 32"),
    "text dtype": (dict(encoder_hidden_states=text(dtype=torch.float64)), "`encoder_hidden_states` has dtype"),
    "zero text tokens": (dict(encoder_hidden_states=text(tokens=0)), "`encoder_hidden_states` has zero tokens"),
    "meta text": (dict(encoder_hidden_states=torch.empty(1, 4, 32, device="meta")), "meta device"),
    "text batch": (dict(encoder_hidden_states=torch.zeros(2, 4, 32)), "has batch 2"),
    "channels": (dict(hidden_states=torch.zeros(1, 8, 2, 2, 2)), "`hidden_states` must have 16 channels"),
    "latent dtype": (dict(hidden_states=frames(2, 3).double()), "`hidden_states` has dtype torch.float64"),
    "meta latents": (dict(hidden_states=torch.empty(1, 16, 2, 2, 2, device="meta")), "meta device"),
    "negative start": (dict(start_frame=-2), "`start_frame` must be >= 0"),
    "timestep above 1000": (dict(timestep=torch.full((1,), 1000.5)), r"`timestep` .* in \[0, 1000\]"),
    "negative timestep": (dict(timestep=torch.full((1, 2), -1.0)), r"`timestep` .* in \[0, 1000\]"),
    "nan timestep": (dict(timestep=torch.full((1,), float("nan"))), r"`timestep` .* in \[0, 1000\]"),
    "store_kv not a bool": (dict(store_kv="yes"), "`store_kv` must be True or False"),
    "image without embedder": (dict(encoder_hidden_states_image=torch.zeros(1, 4, 32)), "no image embedder"),
    "hole": (dict(start_frame=6), "leaves a hole"),
}


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
@torch.no_grad()
def test_a_bad_call_fails_clearly_and_leaves_every_cache_as_it_was(kind, case):
    model = make_causal_transformer(chunk_size=2, num_layers=2)
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=4))
    prompt = text()
    for start in (0, 2):
        model(frames(2, start), T, prompt, start_frame=start, store_kv=True)
    expected = model(frames(2, 9), T, prompt, start_frame=4, return_dict=False)[0]
    before = model_state(model)
    overrides, message = BAD_CALLS[case]
    call = dict(hidden_states=frames(2, 9), timestep=T, encoder_hidden_states=prompt, start_frame=4, store_kv=True)
    with pytest.raises(ValueError, match=message):
        model(**{**call, **overrides})
    assert_same_state(before, model_state(model))
    assert torch.equal(model(frames(2, 9), T, prompt, start_frame=4, return_dict=False)[0], expected)


def fail_in_block(model, index: int):
    def fail(module, args):
        raise RuntimeError("boom")

    return model.blocks[index].register_forward_pre_hook(fail)


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("store_kv", [True, False])
@torch.no_grad()
def test_a_windowed_call_that_fails_midway_restores_the_window_exactly(kind, store_kv):
    # Window 4, chunks of 2: frames [0, 6) stored, frames 2-5 held. A call at 4 of [4, 10) (chunks [4, 6), [6, 8),
    # [8, 10)) evicts up to frame 6 and overwrites the static ring; a call at 4 of [4, 6) replaces the last stored
    # chunk; a call at 6 evicts frames 2-3 and (static engine) writes its K/V into their slots. All fail in block 1,
    # after block 0 has written (and evicted).
    model = make_causal_transformer(chunk_size=2, num_layers=2)
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=4))
    prompt = text()
    for start in (0, 2, 4):
        model(frames(2, start), T, prompt, start_frame=start, store_kv=True)
    before = model_state(model)
    untouched = copy.deepcopy(model)
    expected = untouched(frames(4, 4), T, prompt, start_frame=4, store_kv=True, return_dict=False)[0]

    handle = fail_in_block(model, 1)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(frames(6, 11), T, prompt, start_frame=4, store_kv=store_kv)
        with pytest.raises(RuntimeError, match="boom"):
            model(frames(2, 12), T, prompt, start_frame=4, store_kv=store_kv)
        with pytest.raises(RuntimeError, match="boom"):  # the hot path: evicts frames 2-3 and writes their slots
            model(frames(2, 13), T, prompt, start_frame=6, store_kv=store_kv)
    finally:
        handle.remove()
    assert_same_state(before, model_state(model))
    # the next valid call is served, with the numbers of a cache that never saw the failed calls
    assert torch.equal(model(frames(4, 4), T, prompt, start_frame=4, store_kv=True, return_dict=False)[0], expected)


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_a_failed_call_with_another_prompt_length_keeps_the_filled_cross_kv(kind):
    # A prompt of another length re-sizes the tag's cross entries before the blocks run; the failure undoes it.
    model = make_causal_transformer(chunk_size=2, num_layers=2)
    model.set_kv_cache_engines(make_engines(model, kind))
    prompt = text()
    model(frames(2, 0), T, prompt, store_kv=True)
    before = model_state(model)
    expected = copy.deepcopy(model)(frames(2, 2), T, prompt, start_frame=2, return_dict=False)[0]
    handle = fail_in_block(model, 1)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(frames(2, 2), T, text(tokens=6), start_frame=2, store_kv=True)
    finally:
        handle.remove()
    assert_same_state(before, model_state(model))
    assert (
        model.kv_cache_engines["main"].cross_mode("pos", (prompt, None), store_kv=False, grad_enabled=False) == "read"
    )
    assert torch.equal(model(frames(2, 2), T, prompt, start_frame=2, return_dict=False)[0], expected)


def in_place_edits():
    def through_data(tensor, new):
        tensor.data.copy_(new)
        return tensor

    def through_numpy(tensor, new):
        array = tensor.numpy()
        array[...] = new.numpy()
        return tensor

    return {"data": through_data, "numpy": through_numpy}


@pytest.mark.parametrize("edit", sorted(in_place_edits()))
@torch.no_grad()
def test_cross_kv_reuse_is_decided_by_content(edit):
    model = make_causal_transformer(chunk_size=2, num_layers=2)
    reference = make_causal_transformer(chunk_size=2, num_layers=2)
    prompt, other = text(7), text(8)
    model(frames(2, 0), T, prompt, store_kv=True)
    reference(frames(2, 0), T, prompt.clone(), store_kv=True)
    version = prompt._version
    in_place_edits()[edit](prompt, other)  # the same tensor object, now holding another prompt
    assert prompt._version == version and torch.equal(prompt, other)
    got = model(frames(2, 2), T, prompt, start_frame=2, return_dict=False)[0]
    assert torch.equal(got, reference(frames(2, 2), T, other, start_frame=2, return_dict=False)[0])
    stale = reference(frames(2, 2), T, text(7), start_frame=2, return_dict=False)[0]
    assert (got - stale).abs().max() > 1e-3


def test_the_overhead_benchmark_runs(capsys):
    module = load_benchmark("bench_cache_overhead")
    module.main(["--reps", "1"])
    printed = capsys.readouterr().out
    assert "content key" in printed and "(ratio 0.333)" in printed  # a chunk of 3 frames of a 9-frame window
