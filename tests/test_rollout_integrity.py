"""Cache integrity across calls: an open stream and a second thread are refused at once, a failed or interrupted
continuation keeps the prefix it started from, and a new video warns once before it discards kept rollouts."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import PIL.Image
import pytest
import torch

from fastgen_diffusers import WanCausalImageToVideoPipeline, WanCausalPipeline, WanCausalVideoToVideoPipeline
from fastgen_diffusers.testing import tiny_components, tiny_pipeline, tiny_transformer, tiny_vace_pipeline

CALL = {"height": 16, "width": 16, "num_frames": 25, "num_inference_steps": 2, "output_type": "latent"}
# 7 latent frames in chunks [0, 4) and [4, 7)


def _embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(seed))


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def pipe() -> WanCausalPipeline:
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------- one rollout at a time
def test_a_call_while_a_stream_is_open_is_refused_at_once_and_the_stream_goes_on(pipe):
    expected = pipe(prompt_embeds=_embeds(1), generator=_seed(0), **CALL).frames
    stream = pipe.stream(prompt_embeds=_embeds(1), generator=_seed(0), **CALL)
    chunks = [next(stream)]
    with pytest.raises(RuntimeError, match=r"`pipe\(\.\.\.\)` was called while a `stream\(\)` of this "):
        pipe(prompt_embeds=_embeds(2), **CALL)
    with pytest.raises(RuntimeError, match=r"`stream\(\)` was called while a `stream\(\)`"):
        next(pipe.stream(prompt_embeds=_embeds(2), **CALL))
    chunks += list(stream)
    torch.testing.assert_close(torch.cat([c.latents for c in chunks], dim=2), expected, rtol=0, atol=0)
    pipe(prompt_embeds=_embeds(2), **CALL)  # the finished stream holds nothing


def test_a_closed_or_dropped_stream_frees_the_pipeline(pipe):
    stream = pipe.stream(prompt_embeds=_embeds(1), **CALL)
    next(stream)
    stream.close()
    pipe(prompt_embeds=_embeds(2), **CALL)
    stream = pipe.stream(prompt_embeds=_embeds(1), **CALL)
    next(stream)
    del stream  # garbage collection closes the generator
    pipe(prompt_embeds=_embeds(2), **CALL)


def test_kept_rollout_methods_are_refused_while_a_stream_is_open(pipe):
    pipe(prompt_embeds=_embeds(1), keep_cache=True, **CALL)
    stream = pipe.stream(prompt_embeds=_embeds(1), **CALL | {"num_frames": 5})
    with pytest.warns(UserWarning, match="discards the kept rollouts"):
        next(stream)
    for method, args in ((pipe.continue_rollout, (12,)), (pipe.redo_last_chunk, ()), (pipe.fork_rollout, ("b",))):
        with pytest.raises(RuntimeError, match="`stream\\(\\)` of this WanCausalPipeline"):
            method(*args)
    stream.close()


def test_a_rollout_generator_holds_the_caches_like_a_stream(pipe):
    """The low-level ``rollout()`` generator is guarded as ``stream()`` is, in both directions."""
    latents = torch.randn(1, 16, 7, 2, 2, generator=_seed(0))
    bounds, schedule = [(0, 4), (4, 7)], pipe.rollout_schedule(2)
    expected = list(pipe.rollout(latents, _embeds(1), chunk_bounds=bounds, schedule=schedule, generator=_seed(1)))
    run = pipe.rollout(latents, _embeds(1), chunk_bounds=bounds, schedule=schedule, generator=_seed(1))
    chunks = [next(run)]
    busy = r"was called while a `rollout\(\)` of this WanCausalPipeline \(or of a pipeline sharing its transformer\)"
    with pytest.raises(RuntimeError, match=r"`pipe\(\.\.\.\)` " + busy):
        pipe(prompt_embeds=_embeds(2), **CALL)
    with pytest.raises(RuntimeError, match=r"`stream\(\)` " + busy):
        next(pipe.stream(prompt_embeds=_embeds(2), **CALL))
    with pytest.raises(RuntimeError, match=r"`rollout\(\)` " + busy):
        next(pipe.rollout(latents, _embeds(2), chunk_bounds=bounds, schedule=schedule))
    with pytest.raises(RuntimeError, match=r"`discard_rollout\(\)` " + busy):
        pipe.discard_rollout()
    chunks += list(run)
    for got, want in zip(chunks, expected, strict=True):
        assert torch.equal(got.latents, want.latents)  # the refused calls touched nothing
    stream = pipe.stream(prompt_embeds=_embeds(1), **CALL)
    next(stream)
    with pytest.raises(RuntimeError, match=r"`rollout\(\)` was called while a `stream\(\)`"):
        next(pipe.rollout(latents, _embeds(2), chunk_bounds=bounds, schedule=schedule))
    stream.close()
    pipe.discard_rollout()  # free again


def test_discard_rollout_is_refused_while_a_stream_is_open_and_the_stream_goes_on(pipe):
    expected = pipe(prompt_embeds=_embeds(1), generator=_seed(0), **CALL).frames
    pipe(prompt_embeds=_embeds(3), keep_cache=True, **CALL)
    stream = pipe.stream(prompt_embeds=_embeds(1), generator=_seed(0), **CALL)
    with pytest.warns(UserWarning, match="discards the kept rollouts"):
        chunks = [next(stream)]
    for branch in (None, "main"):
        with pytest.raises(RuntimeError, match=r"`discard_rollout\(\)` was called while a `stream\(\)` of this "):
            pipe.discard_rollout(branch)
    chunks += list(stream)
    assert torch.equal(torch.cat([c.latents for c in chunks], dim=2), expected)


def test_discard_rollout_from_a_callback_is_refused(pipe):
    def callback(pipe, step, timestep, callback_kwargs):
        pipe.discard_rollout()
        return callback_kwargs

    with pytest.raises(RuntimeError, match=r"`discard_rollout\(\)` was called from inside a running `pipe\(\.\.\.\)`"):
        pipe(prompt_embeds=_embeds(1), callback_on_step_end=callback, **CALL)


def test_a_video_to_video_call_while_its_stream_is_open_is_refused():
    pipe = WanCausalVideoToVideoPipeline(**tiny_components())
    pipe.set_progress_bar_config(disable=True)
    video = [np.zeros((32, 32, 3), dtype=np.uint8)] * 13
    call = {"prompt_embeds": _embeds(1), "num_inference_steps": 2, "strength": 0.5, "output_type": "latent"}
    stream = pipe.stream(video=video, **call)
    next(stream)
    with pytest.raises(RuntimeError, match=r"`pipe\(\.\.\.\)` was called while a `stream\(\)` of this Wan"):
        pipe(video=video, **call)
    stream.close()
    assert pipe(video=video, **call).frames.isfinite().all()


def _blocking_call(pipe, entered: threading.Event, release: threading.Event, results: list) -> threading.Thread:
    """A thread running ``pipe(...)`` that waits inside its first denoising step until ``release`` is set."""

    def callback(pipe, step, timestep, callback_kwargs):
        entered.set()
        release.wait(timeout=60)
        return callback_kwargs

    def run():
        results.append(pipe(prompt_embeds=_embeds(1), callback_on_step_end=callback, **CALL).frames)

    thread = threading.Thread(target=run, name="worker")
    thread.start()
    assert entered.wait(timeout=60)
    return thread


@pytest.mark.parametrize("share", ["same pipeline", "from_pipe"])
def test_a_second_thread_is_refused_with_one_pipeline_per_thread(pipe, share):
    other = pipe if share == "same pipeline" else WanCausalPipeline.from_pipe(pipe)
    entered, release, results = threading.Event(), threading.Event(), []
    thread = _blocking_call(pipe, entered, release, results)
    try:
        with pytest.raises(RuntimeError, match="runs in thread 'worker': one pipeline per thread"):
            other(prompt_embeds=_embeds(2), **CALL)
        with pytest.raises(RuntimeError, match="one pipeline per thread"):
            next(other.stream(prompt_embeds=_embeds(2), **CALL))
    finally:
        release.set()
        thread.join(timeout=60)
    assert results and results[0].isfinite().all()
    other(prompt_embeds=_embeds(2), **CALL)  # free again


def test_separate_pipelines_run_in_two_threads(pipe):
    other = tiny_pipeline()
    other.set_progress_bar_config(disable=True)
    expected = other(prompt_embeds=_embeds(2), generator=_seed(0), **CALL).frames
    entered, release, results = threading.Event(), threading.Event(), []
    thread = _blocking_call(pipe, entered, release, results)
    try:
        torch.testing.assert_close(other(prompt_embeds=_embeds(2), generator=_seed(0), **CALL).frames, expected)
    finally:
        release.set()
        thread.join(timeout=60)
    assert results


def test_a_call_from_a_callback_is_refused(pipe):
    def callback(pipe, step, timestep, callback_kwargs):
        pipe(prompt_embeds=_embeds(2), **CALL)
        return callback_kwargs

    with pytest.raises(RuntimeError, match=r"from inside a running `pipe\(\.\.\.\)`"):
        pipe(prompt_embeds=_embeds(1), callback_on_step_end=callback, **CALL)
    pipe(prompt_embeds=_embeds(1), **CALL)


# -------------------------------------------------------------------------------- failed continuations keep the prefix
class FailAt:
    """A transformer pre-hook raising ``error`` at its ``at``-th forward (1-based), counting from installation."""

    def __init__(self, transformer, at: int, error: type[BaseException] = RuntimeError):
        self.count, self.at, self.error = 0, at, error
        self.handle = transformer.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.count += 1
        if self.count == self.at:
            raise self.error("stop here")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


ENGINE_SETUPS = {
    "static": {},
    "vanilla": {"kv_cache_engine": "vanilla"},
    "static-window": {"attention_window": 6, "sink_frames": 1},
    "vanilla-window": {"kv_cache_engine": "vanilla", "attention_window": 6, "sink_frames": 1},
}


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
@pytest.mark.parametrize(
    "continuation",
    [
        {},
        {"prompt_embeds": _embeds(5)},
        {"prompt_embeds": _embeds(5), "recache": True},
    ],
    ids=["same prompt", "prompt switch", "recache"],
)
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_failed_continuation_keeps_its_prefix_and_a_retry_works(pipe, setup, continuation, error):
    pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL, **ENGINE_SETUPS[setup])
    pipe.fork_rollout("reference")
    kept = pipe.kept_rollout()
    engines = pipe.transformer.kv_cache_engines.values()
    stored = [(engine.num_stored_frames("pos"), engine.cache_bytes("pos")) for engine in engines]
    with FailAt(pipe.transformer, at=4, error=error), pytest.raises(error, match="stop here"):
        pipe.continue_rollout(24, generator=_seed(3), **continuation)  # 2 new chunks: fails after the first
    assert pipe.kept_rollout() is kept
    assert [(engine.num_stored_frames("pos"), engine.cache_bytes("pos")) for engine in engines] == stored
    assert all(engine.tag_state("__checkpoint__/pos") is None for engine in engines)  # no backup left behind
    retried = pipe.continue_rollout(24, generator=_seed(3), **continuation).frames
    expected = pipe.continue_rollout(24, generator=_seed(3), branch="reference", **continuation).frames
    np.testing.assert_array_equal(retried, expected)


def test_an_interrupted_continuation_returns_the_kept_video_and_keeps_the_prefix(pipe):
    pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL)
    pipe.fork_rollout("reference")
    kept = pipe.kept_rollout()

    def interrupt(module, args):  # what a callback or another thread does: set the pipeline's interrupt flag
        pipe._interrupt = True

    handle = pipe.transformer.register_forward_pre_hook(interrupt)
    try:
        frames = pipe.continue_rollout(24, generator=_seed(3), output_type="latent").frames
    finally:
        handle.remove()
    assert pipe.kept_rollout() is kept
    torch.testing.assert_close(frames, kept.latents, rtol=0, atol=0)
    retried = pipe.continue_rollout(24, generator=_seed(3), output_type="latent").frames
    expected = pipe.continue_rollout(24, generator=_seed(3), output_type="latent", branch="reference").frames
    torch.testing.assert_close(retried, expected, rtol=0, atol=0)


@pytest.mark.parametrize("setup", ["static", "vanilla-window"])
def test_a_failed_redo_keeps_the_chunk_it_was_redoing(pipe, setup):
    pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL, **ENGINE_SETUPS[setup])
    pipe.fork_rollout("reference")
    before = pipe.kept_rollout().latents.clone()
    with FailAt(pipe.transformer, at=2), pytest.raises(RuntimeError, match="stop here"):
        pipe.redo_last_chunk(generator=_seed(3))
    torch.testing.assert_close(pipe.kept_rollout().latents, before, rtol=0, atol=0)
    retried = pipe.redo_last_chunk(generator=_seed(3), output_type="latent").frames
    expected = pipe.redo_last_chunk(generator=_seed(3), output_type="latent", branch="reference").frames
    torch.testing.assert_close(retried, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ discarding kept rollouts
def test_a_new_video_warns_once_before_it_discards_kept_rollouts(pipe):
    pipe(prompt_embeds=_embeds(1), keep_cache=True, **CALL)
    pipe.fork_rollout("alt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe(prompt_embeds=_embeds(2), **CALL)
        pipe(prompt_embeds=_embeds(2), **CALL)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "discards the kept rollouts ['alt', 'main']" in messages[0]
    assert pipe.rollout_branches == []
    pipe(prompt_embeds=_embeds(1), keep_cache=True, **CALL)
    pipe.discard_rollout()  # freeing them on purpose is silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(prompt_embeds=_embeds(2), **CALL)


@pytest.mark.parametrize("kind", ["i2v", "vace"])
def test_a_failed_continuation_of_an_image_or_control_rollout_keeps_its_prefix(kind):
    if kind == "i2v":
        components = tiny_components()
        components["transformer"] = tiny_transformer(independent_first_frame=True)
        pipe = WanCausalImageToVideoPipeline(**components)
        inputs = {"image": PIL.Image.new("RGB", (16, 16), (200, 30, 30))}
    else:
        pipe = tiny_vace_pipeline()
        inputs = {"video": torch.rand(25, 3, 16, 16, generator=_seed(2))}
    pipe.set_progress_bar_config(disable=True)
    pipe(prompt="a red fox", generator=_seed(0), keep_cache=True, max_sequence_length=16, **CALL, **inputs)
    pipe.fork_rollout("reference")
    session = pipe.kept_rollout()
    with FailAt(pipe.transformer, at=4), pytest.raises(RuntimeError, match="stop here"):
        pipe.continue_rollout(24, generator=_seed(3))
    assert pipe.kept_rollout() is session and session.num_latent_frames == 7
    retried = pipe.continue_rollout(24, generator=_seed(3), output_type="latent").frames
    expected = pipe.continue_rollout(24, generator=_seed(3), output_type="latent", branch="reference").frames
    torch.testing.assert_close(retried, expected, rtol=0, atol=0)
