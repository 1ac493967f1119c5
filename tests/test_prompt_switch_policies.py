"""The prompt-switch policies' rules (``pipelines/rollout/prompt_switch.py``): refusals before any work, what a KV
flush keeps, where a RoPE cut puts a chunk, and what LongLive's kept sink re-runs. Parity with the authors' code is in
``test_prompt_switch_references.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer, recorded_forwards

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine
from fastgen_diffusers.kv_cache import make_engines
from fastgen_diffusers.testing import TINY_TEXT_DIM, tiny_pipeline

# 45 pixel frames = 12 latent frames = 4 chunks of 3, starting at pixel frames 0, 9, 21, 33
CALL = {"height": 16, "width": 16, "num_frames": 45, "num_inference_steps": 2, "output_type": "latent"}
CHUNK = 3


def embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, TINY_TEXT_DIM, generator=torch.Generator().manual_seed(seed))


A, B, C = embeds(1), embeds(2), embeds(3)
SCHEDULE = {0: A, 21: B, 33: C}  # switches at chunks 2 and 3


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, **kwargs):
    """Latents of a run of ``SCHEDULE`` and its transformer forwards as ``(start_frame, frames, store_kv)``."""
    arguments = {**CALL, "prompt_embeds": SCHEDULE, "generator": torch.Generator().manual_seed(0), **kwargs}
    with recorded_forwards(pipe.transformer) as calls:
        frames = pipe(**arguments).frames
    return frames, [(c.kwargs["start_frame"], c.hidden_states.shape[2], c.kwargs["store_kv"]) for c in calls]


WINDOW = {"attention_window": 6, "sink_frames": 1}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"recache_sink": "maybe"}, "`recache_sink` must be one of ('rerun', 'keep'), got 'maybe'"),
        ({"recache_sink": "keep"}, "set `recache=True` too"),
        ({"recache_sink": "keep", "recache": True}, "set `attention_window` and `sink_frames` > 0"),
        ({"recache_sink": "keep", "recache": True, **WINDOW}, "must be multiples of the chunk size (3)"),
        (
            {
                "recache_sink": "keep",
                "recache": True,
                "attention_window": 9,
                "sink_frames": 3,
                "rope_positions": "window",
                "sink_update": "ema",
            },
            "`recache=True` cannot run under `sink_update='ema'`",
        ),
        ({"kv_flush": 1}, "`kv_flush` must be True or False, got 1"),
        ({"kv_flush": True}, "set `attention_window`"),
        ({"kv_flush": True, "recache": True, **WINDOW}, "use recache=False"),
        ({"kv_flush": True, "kv_cache_policy": "recompute", "context_frames": 3}, "Accepted: kv_cache_policy=None"),
        ({"kv_flush": True, "prompt_transition_chunks": 2, **WINDOW}, "use prompt_transition_chunks=0 with kv_flush"),
        (
            {
                "kv_flush": True,
                "attention_window": 9,
                "sink_frames": 3,
                "rope_positions": "window",
                "sink_update": "ema",
            },
            "use sink_update='fixed'",
        ),
        ({"rope_cut": True, **WINDOW}, "use rope_positions='window' (got 'absolute')"),
        ({"rope_cut": [9], **WINDOW, "rope_positions": "window"}, "frames [9] are not prompt switches"),
        ({"rope_cut": "yes"}, "`rope_cut` must be a bool or a sequence of prompt-switch frames"),
    ],
)
def test_policies_that_cannot_apply_are_refused_before_any_forward(pipe, options, message):
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda *args, **kwargs: pytest.fail("a forward ran before the refusal")
    try:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            pipe(**{**CALL, "prompt_embeds": SCHEDULE}, **options)
    finally:
        pipe.transformer.forward = forward


def stored_rollout(engine_kind: str, window: int, sink: int, chunks: int = 4):
    """A tiny model whose engine stored ``chunks`` chunks of 3 frames (clean cache passes), and its inputs."""
    model = make_causal_transformer(num_layers=1)
    engines = make_engines(model, engine_kind, window_frames=window, sink_frames=sink, rope_positions="window")
    model.set_kv_cache_engines(engines)
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, CHUNK * (chunks + 1), 4, 6, generator=gen)
    text = torch.randn(1, 8, 32, generator=gen)
    with torch.no_grad():
        for chunk in range(chunks):
            start = CHUNK * chunk
            model(latents[:, :, start : start + CHUNK], torch.zeros(1), text, start_frame=start, store_kv=True)
    return model, latents, text


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_flush_keeps_the_sink_and_the_last_two_frames(kind):
    """Window 9, sink 1, 12 frames stored: after ``flush(tag, 2)`` the next chunk (frames 12-14) attends to frame 0
    and frames 10, 11 only (at window slots 0, 1, 2; its own at 3..5) instead of frames 0 and 7..11; the frames
    dropped are no error; once the window slides past them the usual rules are back."""
    model, latents, text = stored_rollout(kind, 9, 1)
    engine = model.kv_cache_engines["main"]
    before = engine.get_self_prefix(0, "pos", 12, CHUNK)[0]  # frames 0, 7..11
    engine.flush("pos", 2)
    assert engine.prefix_key_frames("pos", 12, CHUNK) == [0, 10, 11]
    after = engine.get_self_prefix(0, "pos", 12, CHUNK)[0]
    seqlen = after.shape[1] // 3
    torch.testing.assert_close(after, torch.cat([before[:, :seqlen], before[:, -2 * seqlen :]], 1), rtol=0, atol=0)
    positions = engine.key_positions("pos", 12, CHUNK, CHUNK)
    assert positions.keys == (0, 1, 2, 3, 4, 5) and positions.queries == (3, 4, 5)
    if kind == "static":
        with torch.no_grad():  # the static engine gathers the held frames instead of reading its ring in place
            assert engine.static_call("pos", 12, CHUNK, CHUNK) is None
    with torch.no_grad():
        for chunk in (4, 5, 6):  # the window slides past the dropped frames: frames 10..17 are stored normally
            start = CHUNK * chunk
            x = latents[:, :, :CHUNK] if start >= latents.shape[2] else latents[:, :, start : start + CHUNK]
            model(x, torch.zeros(1), text, start_frame=start, store_kv=True)
    assert engine.prefix_key_frames("pos", 21, CHUNK) == [0, *range(16, 21)]
    if kind == "static":
        with torch.no_grad():
            assert engine.static_call("pos", 21, CHUNK, CHUNK) is not None


def test_flush_gives_both_engines_the_same_next_chunk():
    outputs = []
    for kind in ("static", "vanilla"):
        model, latents, text = stored_rollout(kind, 9, 1)
        model.kv_cache_engines["main"].flush("pos", 2)
        with torch.no_grad():
            outputs.append(model(latents[:, :, 12:15], torch.full((1,), 500.0), text, start_frame=12)[0])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-6)


def test_flush_needs_a_window():
    engine = VanillaKVCacheEngine()
    model = make_causal_transformer(num_layers=1)
    model.set_kv_cache_engines({"main": engine})
    with torch.no_grad():
        model(torch.randn(1, 16, 3, 4, 6), torch.zeros(1), torch.randn(1, 8, 32), start_frame=0, store_kv=True)
    with pytest.raises(ValueError, match="needs an engine with `window_frames`"):
        engine.flush("pos", 2)


def test_rope_cut_moves_the_call_frames_only():
    """With a cut at 45 a call's queries and its own keys sit at 45, 46, 47; the cached keys keep their slots."""
    engine = StaticKVCacheEngine(window_frames=6, sink_frames=1, rope_positions="window")
    model = make_causal_transformer(num_layers=1)
    model.set_kv_cache_engines({"main": engine})
    with torch.no_grad():
        for start in (0, 3, 6):
            model(torch.randn(1, 16, 3, 4, 6), torch.zeros(1), torch.randn(1, 8, 32), start_frame=start, store_kv=True)
    engine.set_rope_cut("pos", 45)
    cut = engine.key_positions("pos", 9, CHUNK, CHUNK)
    assert cut.keys == (0, 1, 2, 45, 46, 47) and cut.queries == (45, 46, 47)
    assert engine.key_positions("pos", 9, CHUNK, CHUNK, in_place=True).queries == (45, 46, 47)
    engine.set_rope_cut("pos", None)
    assert engine.key_positions("pos", 9, CHUNK, CHUNK).queries == (3, 4, 5)
    with pytest.raises(ValueError, match="needs keys stored before RoPE"):
        StaticKVCacheEngine(window_frames=6, sink_frames=1).set_rope_cut("pos", 45)


def test_kv_flush_in_a_pipeline(pipe):
    """Window 6, sink 1 (Infinity-RoPE's): the flush keeps what the next chunk would see anyway, so it equals the plain
    switch bit for bit; window 9: it drops frames the next chunks would see, at no extra forward."""
    plain, plain_calls = run(pipe, **WINDOW)
    flushed, flushed_calls = run(pipe, kv_flush=True, **WINDOW)
    assert torch.equal(plain, flushed) and plain_calls == flushed_calls
    wide = {"attention_window": 9, "sink_frames": 1}
    plain, plain_calls = run(pipe, **wide)
    flushed, flushed_calls = run(pipe, kv_flush=True, **wide)
    assert plain_calls == flushed_calls
    assert torch.equal(plain[:, :, :6], flushed[:, :, :6])  # chunks before the first switch
    assert (plain[:, :, 6:] - flushed[:, :, 6:]).abs().max() > 1e-4


@pytest.mark.parametrize("kv_flush", [False, True])
def test_kv_flush_runs_at_each_switch_and_keeps_what_the_next_chunk_sees(pipe, monkeypatch, kv_flush):
    """Window 6, sink 1 (Infinity-RoPE's; the reference recording cannot tell the flush from no flush): with
    ``kv_flush=True`` the pipeline flushes every tag once at each switch (chunks 2 and 3, frames 6 and 9) keeping 2
    frames; the held frames after the flush are the sink and the last 2 frames, the very frames the next chunk would
    have seen without it. Without ``kv_flush`` no flush runs."""
    from fastgen_diffusers.kv_cache.base import EngineViews

    flushes, flush = [], EngineViews.flush

    def spy(self, cache_tag, keep_frames):
        start = self.num_stored_frames(cache_tag)
        seen = self.prefix_key_frames(cache_tag, start, CHUNK)
        flush(self, cache_tag, keep_frames)
        flushes.append((cache_tag, keep_frames, start, seen, self.prefix_key_frames(cache_tag, start, CHUNK)))

    monkeypatch.setattr(EngineViews, "flush", spy)
    run(pipe, kv_flush=kv_flush, **WINDOW)
    if not kv_flush:
        assert flushes == []
        return
    assert [(keep, start) for _, keep, start, _, _ in flushes] == [(2, 6), (2, 9)]
    assert [(seen, held) for _, _, _, seen, held in flushes] == [([0, 4, 5], [0, 4, 5]), ([0, 7, 8], [0, 7, 8])]


def test_rope_cut_in_a_pipeline(pipe):
    """The cut changes the cut chunk and what follows, not the chunks before it; True cuts at every switch."""
    window = {**WINDOW, "rope_positions": "window"}
    plain, _ = run(pipe, **window)
    cut, _ = run(pipe, rope_cut=[33], **window)
    assert torch.equal(plain[:, :, :9], cut[:, :, :9])
    assert (plain[:, :, 9:] - cut[:, :, 9:]).abs().max() > 1e-4
    every, _ = run(pipe, rope_cut=True, **window)
    assert torch.equal(plain[:, :, :6], every[:, :, :6]) and (every[:, :, 6:9] - cut[:, :, 6:9]).abs().max() > 1e-4


def test_recache_keeping_the_sink_runs_one_forward_per_switch(pipe):
    """``recache_sink='keep'`` (window 6, sink 3): the switch at frame 6 (within the window) re-runs frames 0..5 in one
    forward, sink included, as LongLive's recache from frame 0 does; the switch at frame 9 re-runs the window's 3
    non-sink frames 6..8 and keeps the sink's K/V. ``"rerun"`` re-runs chunk by chunk, and the results differ."""
    window = {"attention_window": 6, "sink_frames": 3, "recache": True}
    rerun, rerun_calls = run(pipe, **window)
    kept, kept_calls = run(pipe, recache_sink="keep", **window)
    stores = [call[:2] for call in kept_calls if call[2]]
    assert stores == [(0, 3), (3, 3), (0, 6), (6, 3), (6, 3)]
    assert len(kept_calls) < len(rerun_calls)
    assert torch.equal(rerun[:, :, :6], kept[:, :, :6]) and (rerun[:, :, 6:] - kept[:, :, 6:]).abs().max() > 1e-4


def test_recache_keeping_the_sink_at_switches_closer_than_the_window(pipe):
    """Window 12, sink 3 (9 recent frames), 21 latent frames: the switch at frame 12 re-runs frames 0..11 in one
    forward; the switch at frame 15 then truncates inside those frames (at frame 6) and re-runs 6..14, as LongLive's
    does; a blended transition (a recache at each of its chunks) too. The frames before the second switch equal a run
    with the first switch only; the runs are finite and deterministic."""
    call = {"num_frames": 81, "recache": True, "recache_sink": "keep", "attention_window": 12, "sink_frames": 3}

    def latents(schedule, **kwargs):
        """The latents and the stores ``(start_frame, frames)`` of the run (the last chunk runs no cache pass)."""
        frames, calls = run(pipe, prompt_embeds=schedule, **call, **kwargs)
        return frames, [(start, count) for start, count, store in calls if store]

    chunk_stores = [(0, 3), (3, 3), (6, 3), (9, 3)]
    both, stores = latents({0: A, 45: B, 57: C})
    # switch at 12: frames 0..11 in one forward; switch at 15: truncated at 6, frames 6..14 in one forward
    assert stores == [*chunk_stores, (0, 12), (12, 3), (6, 9), (15, 3)]
    first, stores = latents({0: A, 45: B})
    assert stores == [*chunk_stores, (0, 12), (12, 3), (15, 3)]
    assert torch.isfinite(both).all() and torch.equal(both, latents({0: A, 45: B, 57: C})[0])
    assert torch.equal(both[:, :, :15], first[:, :, :15]) and (both[:, :, 15:] - first[:, :, 15:]).abs().max() > 1e-4
    blended, stores = latents({0: A, 45: B}, prompt_transition_chunks=2)
    assert stores == [*chunk_stores, (0, 12), (12, 3), (6, 9), (15, 3)]  # a recache at each of the blend's chunks
    assert torch.isfinite(blended).all() and torch.equal(blended[:, :, :12], first[:, :, :12])
