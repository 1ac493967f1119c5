"""Combinations of the cache features that must compose exactly or be refused before any work: read-time key
positions with calls of several chunks, engines of one model sharing their query positions, a windowed recache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers.kv_cache import make_engines


def _inputs(num_frames: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, num_frames, 4, 4, generator=generator)
    text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(99))
    return x, torch.full((1,), 500.0), text


def _model(kind: str, rope_positions: str, max_frames: int = 12):
    model = make_causal_transformer(chunk_size=3)
    engines = make_engines(
        model, kind, max_frames=max_frames, window_frames=9, sink_frames=3, rope_positions=rope_positions
    )
    model.set_kv_cache_engines(engines)
    return model


def _chunk_by_chunk(model, x, t, text):
    outputs = []
    for start in range(0, x.shape[2], 3):
        chunk = x[:, :, start : start + 3]
        outputs.append(model(chunk, t, text, start_frame=start, return_dict=False)[0])
        model(chunk, t, text, start_frame=start, store_kv=True)
    return torch.cat(outputs, dim=2)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("rope_positions", ["window", "anchor"])
def test_multi_chunk_call_whose_window_slides_is_refused_with_read_time_positions(kind, rope_positions):
    """Keys stored before RoPE are rotated once per call; a 12-frame call under window 9 / sink 3 has a last chunk
    that no longer sees frames the first sees, so chunk by chunk it would position its keys differently (1e-2 off
    before this check). Refused before any work; a call whose window does not slide (6 frames) stays exact."""
    model = _model(kind, rope_positions)
    x, t, text = _inputs(12)
    with pytest.raises(ValueError, match="rotates its keys once"):
        model(x, t, text)
    with pytest.raises(ValueError, match="rotates its keys once"):
        model(x, t, text, store_kv=True)
    assert model.kv_cache_engines["main"].num_stored_frames("pos") == 0
    whole = model(x[:, :, :6], t, text, return_dict=False)[0]
    model.clear_caches()
    torch.testing.assert_close(whole, _chunk_by_chunk(model, x[:, :, :6], t, text), rtol=0, atol=2e-6)
    # one chunk (no mask) is a single rotation: allowed wherever it fits the window
    model.clear_caches()
    model(x[:, :, :9], t, text, chunk_layout=(9,))


@torch.no_grad()
def test_multi_chunk_call_with_absolute_positions_equals_chunk_by_chunk_when_the_window_slides():
    model = _model("static", "absolute")
    x, t, text = _inputs(12)
    whole = model(x, t, text, return_dict=False)[0]
    model.clear_caches()
    torch.testing.assert_close(whole, _chunk_by_chunk(model, x, t, text), rtol=0, atol=2e-6)


@torch.no_grad()
def test_engines_whose_read_time_query_positions_differ_are_refused_before_any_work():
    """The VACE model's two branches rotate one set of queries: with window-relative positions, engines with other
    windows give them other positions once the windows differ in what they see; refused in the call check (nothing
    evicted or stored), while anchor positions (absolute queries) let each branch keep its own window."""
    from test_vace import make_vace, randn

    from fastgen_diffusers.kv_cache import VanillaKVCacheEngine

    def run(rope_positions):
        model = make_vace()
        model.set_kv_cache_engines(
            {
                "main": VanillaKVCacheEngine(window_frames=8, sink_frames=2, rope_positions=rope_positions),
                "vace": VanillaKVCacheEngine(window_frames=6, sink_frames=2, rope_positions=rope_positions),
            }
        )
        text, control = randn(1, 8, 32, seed=1), randn(1, 96, 2, 4, 4, seed=2)
        for start in range(0, 6, 2):  # both windows still see every frame
            x = randn(1, 16, 2, 4, 4, seed=start)
            model(x, torch.zeros(1), text, control_hidden_states=control, start_frame=start, store_kv=True)
        return model, x, text, control

    model, x, text, control = run("window")
    states = {name: engine.tag_state("pos").copy() for name, engine in model.kv_cache_engines.items()}
    with pytest.raises(ValueError, match="different RoPE positions"):
        model(x, torch.zeros(1), text, control_hidden_states=control, start_frame=6)
    assert {name: engine.tag_state("pos") for name, engine in model.kv_cache_engines.items()} == states
    model, x, text, control = run("anchor")
    model(x, torch.zeros(1), text, control_hidden_states=control, start_frame=6)


ROLLBACK_CASES = {
    "window+ema": dict(rope_positions="window", sink_update="ema"),
    "window+int8": dict(rope_positions="window", kv_cache_dtype="int8"),
    "anchor+fp8": dict(rope_positions="anchor", kv_cache_dtype=torch.float8_e4m3fn),
    "absolute+int8": dict(kv_cache_dtype="int8"),
}


@torch.no_grad()
@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("case", list(ROLLBACK_CASES))
def test_a_failed_forward_restores_every_new_piece_of_state(kind, case):
    """Window 9 / sink 3, chunks of 3, frames [0, 12) stored. Calls that fail in the last block after the first one
    ran: a biased denoising call at 12 (evicts frames 6-8: the EMA folds them into the sink; the static engine's
    in-place path, or an 8-bit cache's gathered one, writes the ring), its store, and a re-store of the last chunk.
    Every engine then holds exactly what it held (keys before RoPE, scales, the EMA sink, the window position), and
    the next calls give the numbers of a model that never saw the failures."""
    import copy

    from cache_state import assert_same_state, model_state

    model = make_causal_transformer(chunk_size=3, num_layers=2)
    options = dict(window_frames=9, sink_frames=3, **ROLLBACK_CASES[case])
    model.set_kv_cache_engines(make_engines(model, kind, max_frames=15, **options))
    for start in range(0, 12, 3):
        x, t, text = _inputs(3, start)
        model(x, torch.zeros(1), text, start_frame=start, store_kv=True)
    before = model_state(model)
    untouched = copy.deepcopy(model)
    x, t, text = _inputs(3, 20)

    def fail(module, args):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(fail)
    try:
        for start, store_kv in ((12, False), (12, True), (9, True)):
            with pytest.raises(RuntimeError, match="boom"):
                model(x, t, text, start_frame=start, store_kv=store_kv, kv_cache_attention_bias=0.5)
    finally:
        handle.remove()
    assert_same_state(before, model_state(model))

    def next_calls(m):
        return [
            m(x, t, text, start_frame=12, kv_cache_attention_bias=0.5, return_dict=False)[0],
            m(x, torch.zeros(1), text, start_frame=12, store_kv=True, return_dict=False)[0],
            m(x, t, text, start_frame=15, return_dict=False)[0],
        ]

    for got, expected in zip(next_calls(model), next_calls(untouched)):
        assert torch.equal(got, expected)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_a_windowed_recache_takes_one_chunk_per_call(kind):
    """Inside a windowed recache a call sees the held frames only, which no block mask describes: a call of several
    chunks failed with a shape error inside the first block; it is now a clear error before any work."""
    from cache_state import assert_same_state, model_state

    model = _model(kind, "absolute", max_frames=24)
    for start in range(0, 18, 3):
        x, t, text = _inputs(3, start)
        model(x, torch.zeros(1), text, start_frame=start, store_kv=True)
    engine = model.kv_cache_engines["main"]
    engine.truncate("pos", 3)
    engine.skip_evicted("pos", 12)
    before = model_state(model)
    x, t, text = _inputs(6, 1)
    with pytest.raises(ValueError, match="re-runs one chunk per call"):
        model(x, t, text, start_frame=12)
    assert_same_state(before, model_state(model))
    model(x[:, :, :3], torch.zeros(1), text, start_frame=12, store_kv=True)  # one chunk: served


COMPOSED = {  # engine options, per-call window
    "window-rope+bias": (dict(rope_positions="window"), None),
    "anchor-rope+bias": (dict(rope_positions="anchor"), None),
    "window-rope+ema+bias": (dict(rope_positions="window", sink_update="ema", sink_decay=0.9), None),
    "window-rope+int8+bias": (dict(rope_positions="window", kv_cache_dtype="int8"), None),
    "anchor-rope+call-window+bias": (dict(rope_positions="anchor"), (6, 3)),
    "absolute+call-window+int8+bias": (dict(kv_cache_dtype="int8"), (6, 3)),
}


@torch.no_grad()
@pytest.mark.parametrize("case", list(COMPOSED))
def test_static_in_place_and_vanilla_gathered_paths_agree_on_composed_features(case):
    """Window 9 / sink 3, 6 chunks of 3 (the static ring wraps), two biased denoising calls and a store per chunk.
    The static engine's in-place path reads keys in ring order (rotations and bias per slot), the vanilla one gathers
    them in frame order (an 8-bit cache or a per-call window sends the static engine down the gathered path too):
    the same numbers, and the bias changes them."""
    from fastgen_diffusers.kv_cache import AttentionWindow

    options, call_window = COMPOSED[case]
    call_window = None if call_window is None else AttentionWindow(*call_window)

    def rollout(kind, bias):
        model = make_causal_transformer(chunk_size=3, num_layers=2)
        model.set_kv_cache_engines(make_engines(model, kind, max_frames=18, window_frames=9, sink_frames=3, **options))
        outputs = []
        for start in range(0, 18, 3):
            x, t, text = _inputs(3, start)
            for timestep in (700.0, 400.0):
                outputs.append(
                    model(
                        x,
                        torch.full((1,), timestep),
                        text,
                        start_frame=start,
                        return_dict=False,
                        kv_cache_attention_bias=bias,
                        attention_window=call_window,
                    )[0]  # fmt: skip
                )
            model(x, torch.zeros(1), text, start_frame=start, store_kv=True, attention_window=call_window)
        return torch.stack(outputs)

    static, vanilla = rollout("static", 0.5), rollout("vanilla", 0.5)
    torch.testing.assert_close(static, vanilla, rtol=0, atol=2e-6)
    assert (static - rollout("static", 1.0)).abs().max() > 1e-3


@torch.no_grad()
def test_anchor_positions_past_the_rope_table_say_that_re_basing_does_not_apply():
    """Anchor positions are absolute frames of keys stored before RoPE, which re-basing (a rotation of keys stored
    after RoPE) cannot shift: past the table the call is refused before any work, with or without re-basing on,
    and the message says so; window-relative positions never leave it."""
    for rope_positions, refused in (("anchor", True), ("window", False)):
        model = make_causal_transformer(chunk_size=3, rope_max_seq_len=8)
        model.set_kv_cache_engines(
            make_engines(model, "static", window_frames=6, sink_frames=3, rope_positions=rope_positions)
        )
        model.enable_rope_rebasing()
        x, t, text = _inputs(3)
        for start in (0, 3):
            model(x, torch.zeros(1), text, start_frame=start, store_kv=True)
        if refused:
            with pytest.raises(ValueError, match=r"outside the RoPE table.*does not shift them"):
                model(x, t, text, start_frame=6)
            assert model.kv_cache_engines["main"].num_stored_frames("pos") == 6
        else:
            model(x, t, text, start_frame=6)


@torch.no_grad()
def test_the_vace_model_takes_the_per_call_attention_options():
    """The VACE pipeline's stored ``kv_cache_attention_bias`` reaches its transformer, whose forward lacked the option
    (a TypeError at the first biased forward, after the rollout began): both branches are biased now, the static and
    vanilla engines agree, and a one-chunk layout is the unmasked call."""
    from test_vace import make_vace, randn

    def run(kind, **options):
        model = make_vace()
        model.set_kv_cache_engines(make_engines(model, kind, max_frames=6))
        text, control = randn(1, 8, 32, seed=1), randn(1, 96, 2, 4, 4, seed=2)
        for start in (0, 2):
            x = randn(1, 16, 2, 4, 4, seed=start)
            model(x, torch.zeros(1), text, control_hidden_states=control, start_frame=start, store_kv=True)
        x, control = randn(1, 16, 2, 4, 4, seed=9), randn(1, 96, 2, 4, 4, seed=3)
        t = torch.full((1,), 500.0)
        return model(x, t, text, control_hidden_states=control, start_frame=4, return_dict=False, **options)[0]

    biased = run("static", kv_cache_attention_bias=0.5)
    torch.testing.assert_close(biased, run("vanilla", kv_cache_attention_bias=0.5), rtol=0, atol=2e-6)
    assert (biased - run("static")).abs().max() > 1e-3
    torch.testing.assert_close(run("static", chunk_layout=(2,)), run("static"), rtol=0, atol=0)


def test_a_vace_pipeline_with_a_stored_attention_bias_runs_biased():
    from fastgen_diffusers.testing import tiny_vace_pipeline

    pipe = tiny_vace_pipeline()
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a cat", height=16, width=16, num_frames=21, num_inference_steps=2, output_type="latent")
    plain = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    pipe.register_to_config(kv_cache_attention_bias=0.5)
    biased = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    assert (biased - plain).abs().max() > 1e-4
