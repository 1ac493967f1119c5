"""``RolloutRun.endless()``: a stream without an end (the server's ``num_frames: null``)."""

import itertools

import numpy as np
import pytest
import torch

from fastgen_diffusers import testing

CALL = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "np"}


@pytest.fixture(scope="module")
def pipe():
    return testing.tiny_pipeline(rope_max_seq_len=12)


def options(pipe, num_frames=33, **settings):
    generator = torch.Generator("cpu").manual_seed(1)
    return pipe.stream_options("a fox", num_frames=num_frames, generator=generator, **CALL, **settings)


@pytest.mark.parametrize(
    "settings",
    [{"attention_window": 6, "rope_positions": "window"}, {"kv_cache_policy": "recompute", "context_frames": 3}],
    ids=["window", "recompute"],
)
def test_an_endless_run_is_its_planned_run_then_goes_on_past_the_rope_table(pipe, settings):
    planned = np.concatenate([c.frames[0] for c in pipe.stream_run(pipe.prepare_rollout(options(pipe, **settings)))])
    stream = pipe.stream_run(pipe.prepare_rollout(options(pipe, **settings)).endless())
    chunks = list(itertools.islice(stream, 12))  # 36 latent frames: three times the RoPE table
    stream.close()
    frames = np.concatenate([c.frames[0] for c in chunks])
    np.testing.assert_array_equal(frames[: len(planned)], planned)
    assert [c.end for c in chunks] == list(range(3, 37, 3)) and not any(c.is_last for c in chunks)
    assert np.isfinite(frames).all() and frames[len(planned) :].std() > 0
    assert all(engine.cache_bytes() == 0 for engine in pipe.transformer.kv_cache_engines.values())  # closed: freed


def test_a_run_that_needs_its_chunks_up_front_or_keeps_its_cache_is_not_made_endless(pipe):
    rolling = pipe.prepare_rollout(options(pipe, kv_cache_policy="rolling"))
    with pytest.raises(ValueError, match="plans its chunks up front"):
        rolling.endless()
    kept = pipe.prepare_rollout(options(pipe, keep_cache=True))
    with pytest.raises(ValueError, match="keep_cache=False"):
        kept.endless()
    pipe.discard_rollout()
