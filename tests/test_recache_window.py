"""Recache under an attention window (#15 section 4): a prompt switch with ``recache=True`` re-runs only the chunks
the window holds (the sink's and the most recent ones, as LongLive re-runs the last ``min(window, t)`` frames), not
every earlier chunk.

Where it must agree with the old full re-run: a frame's K/V in block ``l`` depend on the block ``l - 1`` K/V of the
frames in its window, which in a full re-run reach, one window per block, back to frames the window has evicted; the
windowed re-run cannot recompute those. So what the next chunk attends to is equal (to float32 rounding) in the sink
(every block: the sink chunk sees only itself), in block 0 (inputs only) and in every block whose chain of windows
stays inside the held chunks: all blocks of the 2-block model with window 9 = sink 3 + 2 chunks (its output equals the
full re-run's), not block 2 of a 3-block model nor block 1 with window 12 (the differences are asserted below).
"""

from __future__ import annotations

import pytest
import torch

from fastgen_diffusers.pipelines import RolloutOptions
from fastgen_diffusers.pipelines.rollout import session as session_module
from fastgen_diffusers.testing import tiny_pipeline

# 24 latent frames in 8 chunks of 3 (chunk k starts at latent frame 3k, pixel frame 12k - 3); window 9 = 3 chunks.
CALL = {"height": 16, "width": 16, "num_frames": 93, "num_inference_steps": 2, "output_type": "latent"}
WINDOW = {"attention_window": 9, "sink_frames": 3}


def _embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(seed))


def _pipe(**overrides):
    pipe = tiny_pipeline(**overrides)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return _pipe()


def _run(pipe, monkeypatch, switch_frame: int, *, full: bool, earlier_switches: tuple[int, ...] = (), **kwargs):
    """Run with one switch (after ``earlier_switches``, pixel frames); return the latents, the transformer forwards
    of the switch and, right after it, the K/V ``[(key, value)]`` per block that the next chunk attends to (sink and
    visible recent frames, frame order)."""
    record = {}
    switch_prompt = session_module.RolloutSession.switch_prompt
    transformer = pipe.transformer
    forward = transformer.forward
    calls = []

    def counting(*args, **kw):
        calls.append(kw.get("start_frame"))
        return forward(*args, **kw)

    def recording(self, prompt_embeds, *, recache):
        before = len(calls)
        switch_prompt(self, prompt_embeds, recache=recache)
        record["forwards"] = len(calls) - before
        engine = transformer.kv_cache_engines["main"]
        start = self.num_latent_frames
        record["seen"] = [engine.get_self_prefix(b, "pos", start, 3) for b in range(engine.num_blocks)]
        record["held_from"] = engine.tag_state("pos").evicted_before

    monkeypatch.setattr(transformer, "forward", counting)
    monkeypatch.setattr(session_module.RolloutSession, "switch_prompt", recording)
    if full:  # the old behaviour: every earlier chunk
        monkeypatch.setattr(session_module.RolloutSession, "recache_chunks", lambda self: (list(self.chunks), []))
        monkeypatch.setattr(session_module.RolloutSession, "forget_evicted", lambda self: None)  # keeps them all
    try:
        latents = pipe(
            prompt_embeds={0: _embeds(1), **{f: _embeds(10 + f) for f in earlier_switches}, switch_frame: _embeds(2)},
            recache=True,
            generator=torch.Generator().manual_seed(0),
            **kwargs,
            **CALL,
        ).frames
    finally:
        monkeypatch.undo()
    return latents, record


@pytest.mark.parametrize("engine", ["static", "vanilla"])
@pytest.mark.parametrize("switch_chunk", [6, 7])
def test_windowed_recache_runs_the_window_and_equals_a_full_rerun(pipe, monkeypatch, engine, switch_chunk):
    frame = 12 * switch_chunk - 3
    window = {"kv_cache_engine": engine, **WINDOW}
    fast, fast_record = _run(pipe, monkeypatch, frame, full=False, **window)
    slow, slow_record = _run(pipe, monkeypatch, frame, full=True, **window)
    assert fast_record["forwards"] == 9 // 3  # the chunks of the window: the sink's and the two most recent
    assert slow_record["forwards"] == switch_chunk
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6)  # measured: 0 (vanilla), <= 3e-7 (static)
    for (fast_k, fast_v), (slow_k, slow_v) in zip(fast_record["seen"], slow_record["seen"]):
        torch.testing.assert_close(fast_k, slow_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(fast_v, slow_v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("engine", ["static", "vanilla"])
def test_a_second_windowed_recache_runs_the_window_and_equals_a_full_rerun(pipe, monkeypatch, engine):
    """The first windowed recache skips the evicted frames; the second truncates at the sink again (it failed once:
    the skipped frames were no chunk boundary)."""
    window = {"kv_cache_engine": engine, **WINDOW}
    fast, fast_record = _run(pipe, monkeypatch, 81, full=False, earlier_switches=(45,), **window)
    slow, slow_record = _run(pipe, monkeypatch, 81, full=True, earlier_switches=(45,), **window)
    assert (fast_record["forwards"], slow_record["forwards"]) == (3, 7)  # the second switch: at chunk 7
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6)


@pytest.mark.parametrize("engine", ["static", "vanilla"])
def test_recache_before_any_eviction_reruns_everything(pipe, monkeypatch, engine):
    window = {"kv_cache_engine": engine, **WINDOW}
    fast, record = _run(pipe, monkeypatch, 21, full=False, **window)  # chunk 2: nothing evicted yet
    slow, _ = _run(pipe, monkeypatch, 21, full=True, **window)
    assert record["forwards"] == 2 and torch.equal(fast, slow)


def test_recache_without_window_reruns_every_chunk(pipe, monkeypatch):
    _, record = _run(pipe, monkeypatch, 69, full=False, kv_cache_engine="static")
    assert record["forwards"] == 6


@pytest.mark.parametrize("engine", ["static", "vanilla"])
@pytest.mark.parametrize(
    ("num_layers", "window_frames", "switch_chunk", "exact_blocks"),
    [(3, 9, 6, 2), (2, 12, 7, 1)],
    ids=["3 blocks, window 9", "2 blocks, window 12"],
)
def test_where_a_windowed_recache_cannot_equal_a_full_rerun(
    monkeypatch, engine, num_layers, window_frames, switch_chunk, exact_blocks
):
    """The sink (every block) and the first ``exact_blocks`` blocks of what the next chunk sees are equal; past them
    the full re-run's K/V went through frames the window had evicted (window 9: block 2 of frames [15, 18) read
    block 1 of [12, 15), which the full re-run computed from the evicted [9, 12); window 12: block 1 of [15, 18)
    read block 0 of the evicted [9, 12) directly)."""
    pipe = _pipe(num_layers=num_layers)
    window = {"kv_cache_engine": engine, "attention_window": window_frames, "sink_frames": 3}
    frame = 12 * switch_chunk - 3
    fast, fast_record = _run(pipe, monkeypatch, frame, full=False, **window)
    slow, slow_record = _run(pipe, monkeypatch, frame, full=True, **window)
    assert fast_record["forwards"] == window_frames // 3 and slow_record["forwards"] == switch_chunk
    assert torch.equal(fast[:, :, : 3 * switch_chunk], slow[:, :, : 3 * switch_chunk])  # before the switch
    seen_frames = 3 + window_frames - 3 - 3  # the sink and the recent frames of the next chunk's window
    tokens = fast_record["seen"][0][0].shape[1] // seen_frames
    sink = slice(0, 3 * tokens)
    for block, ((fast_k, fast_v), (slow_k, slow_v)) in enumerate(zip(fast_record["seen"], slow_record["seen"])):
        torch.testing.assert_close(fast_k[:, sink], slow_k[:, sink], rtol=0, atol=1e-6)
        torch.testing.assert_close(fast_v[:, sink], slow_v[:, sink], rtol=0, atol=1e-6)
        if block < exact_blocks:
            torch.testing.assert_close(fast_k, slow_k, rtol=0, atol=1e-6)
            torch.testing.assert_close(fast_v, slow_v, rtol=0, atol=1e-6)
        else:
            assert not torch.allclose(fast_k, slow_k, atol=1e-4)
    assert not torch.allclose(fast[:, :, 3 * switch_chunk :], slow[:, :, 3 * switch_chunk :], atol=1e-6)


# ------------------------------------------------------------------------------------------------ held history
def _held_bytes(session) -> int:
    return sum(t.numel() * t.element_size() for t in session.held_tensors())


def _long_stream(pipe, monkeypatch, *, prune: bool, num_chunks: int = 60):
    """A windowed rollout of ``num_chunks`` chunks with a recached prompt switch every 10 chunks: its latents and the
    bytes its session holds after each chunk."""
    if not prune:
        monkeypatch.setattr(session_module.RolloutSession, "forget_evicted", lambda self: None)
    switches = {12 * k - 3: _embeds(k) for k in range(10, num_chunks, 10)}
    options = RolloutOptions(
        prompt_embeds={0: _embeds(0), **switches},
        recache=True,
        context_noise=100.0,  # the cache input is a re-noised copy: a chunk holds its latents and that copy
        height=16,
        width=16,
        num_frames=4 * 3 * num_chunks - 3,
        num_inference_steps=1,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **WINDOW,
    )
    try:
        run = pipe.prepare_rollout(options)
        latents, held = [], []
        for chunk in run.chunks():
            latents.append(chunk.latents)
            held.append(_held_bytes(run.session))
    finally:
        monkeypatch.undo()
    return torch.cat(latents, dim=2), held


def test_a_long_windowed_stream_with_recache_holds_flat_history_and_the_same_output(pipe, monkeypatch):
    """The session keeps the chunks a recache can re-run (the sink's and the ones the window holds), not all."""
    fast, held = _long_stream(pipe, monkeypatch, prune=True)
    slow, held_all = _long_stream(pipe, monkeypatch, prune=False)
    chunk_bytes = held_all[0]  # latents + re-noised cache input of one chunk
    assert chunk_bytes == 2 * 1 * 16 * 3 * 2 * 2 * 4
    # window 9 = sink chunk + 2 recent ones: from chunk 3 on the session holds 3 chunks (the last one is not stored)
    assert held[:4] == [chunk_bytes, 2 * chunk_bytes, 3 * chunk_bytes, 3 * chunk_bytes]
    assert set(held[2:-1]) == {3 * chunk_bytes} and len(held) == 60
    assert held_all[-2] == 59 * chunk_bytes  # what the session held before: every chunk
    assert torch.equal(fast, slow)


def test_a_kept_windowed_rollout_drops_only_the_evicted_cache_inputs(monkeypatch):
    """A kept rollout keeps every chunk's latents (a continuation returns the whole video) but only the cache inputs
    a recache can use; continue (with a recache), redo and fork give exactly what they gave with every input kept."""

    def scenario(prune: bool):
        pipe = _pipe()
        if not prune:
            monkeypatch.setattr(session_module.RolloutSession, "forget_evicted", lambda self: None)
        try:
            call = {**CALL, "num_frames": 4 * 3 * 6 - 3}
            pipe(prompt_embeds=_embeds(0), keep_cache=True, context_noise=100.0, generator=_gen(0), **WINDOW, **call)
            main = pipe.kept_rollout("main")
            contexts = sum(chunk.context is not None for chunk in main.chunks)
            pipe.fork_rollout("b")
            more = {"num_frames": 24, "output_type": "latent", "generator": _gen(1)}
            a = pipe.continue_rollout(prompt_embeds=_embeds(2), recache=True, **more).frames
            b = pipe.continue_rollout(branch="b", **more).frames
            c = pipe.redo_last_chunk(prompt_embeds=_embeds(3), recache=True, output_type="latent", generator=_gen(2))
            d = pipe.continue_rollout(branch="b", prompt_embeds=_embeds(4), recache=True, **more).frames
            held = [len(pipe.kept_rollout(branch).chunks) for branch in ("main", "b")]
            return contexts, held, [a, b, c.frames, d]
        finally:
            monkeypatch.undo()

    contexts, held, fast = scenario(prune=True)
    all_contexts, all_held, slow = scenario(prune=False)
    assert (contexts, all_contexts) == (3, 6)  # the sink chunk and the 2 the window holds, of 6
    assert held == all_held == [8, 10]  # every chunk's latents
    for x, y in zip(fast, slow):
        assert torch.equal(x, y)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_recache_under_an_ema_sink_is_refused_before_any_forward(pipe):
    """The EMA sink holds the frames that left the window, folded in; a recache cannot rebuild them (re-running the
    sink's chunk drops them: a switch to the same prompt moved the next chunk by 1e-2), so it is refused, in a call
    and in a continuation, before any forward."""
    ema = {**WINDOW, "rope_positions": "window", "sink_update": "ema", "sink_decay": 0.9}
    calls, forward = [], pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        with pytest.raises(ValueError, match="`recache=True` cannot run under `sink_update='ema'`"):
            pipe(**CALL, **ema, prompt_embeds={0: _embeds(0), 57: _embeds(0)}, recache=True)
        assert calls == []
        pipe(**{**CALL, "num_frames": 45}, **ema, prompt_embeds=_embeds(0), keep_cache=True)
        calls.clear()
        with pytest.raises(ValueError, match="`recache=True` cannot run under `sink_update='ema'`"):
            pipe.continue_rollout(12, prompt_embeds=_embeds(0), recache=True, output_type="latent")
        assert calls == []
    finally:
        del pipe.transformer.forward
        pipe.discard_rollout()
