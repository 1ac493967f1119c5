"""Which KV cache policies each pipeline runs, and the policy / cache options every pipeline takes alike.

The recompute policy runs a chunk's forwards at the positions right after its context and the rolling policy
denoises several chunks per forward: conditioning read by frame (I2V's image, VACE's control video) would be
misplaced, so those pipelines refuse both (before any work) and leave a stored one out, with its settings.
"""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch

from fastgen_diffusers import (
    WanCausalImageToVideoPipeline,
    WanCausalPipeline,
    WanCausalVACEPipeline,
    WanCausalVideoToVideoPipeline,
)
from fastgen_diffusers.pipelines.rollout.options import RolloutOptions
from fastgen_diffusers.testing import tiny_components, tiny_transformer, tiny_vace_pipeline

I2V_CALL = {"prompt": "a cat", "num_frames": 21, "num_inference_steps": 1, "output_type": "latent"}
VACE_CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 21, "num_inference_steps": 1}
T2V_CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_inference_steps": 2, "output_type": "latent"}


def i2v_pipeline(**config) -> WanCausalImageToVideoPipeline:
    """A tiny T2V-student image-to-video pipeline (the image is given as the first, independent frame)."""
    components = tiny_components()
    components["transformer"] = tiny_transformer(chunk_size=2, independent_first_frame=True)
    pipe = WanCausalImageToVideoPipeline(**components, **config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def vace_pipeline(**config) -> WanCausalVACEPipeline:
    pipe = tiny_vace_pipeline()
    pipe.register_to_config(**config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, **kwargs) -> torch.Tensor:
    if isinstance(pipe, WanCausalImageToVideoPipeline):
        image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(2))
        kwargs = {**I2V_CALL, "image": image, **kwargs}
    else:
        kwargs = {**VACE_CALL, "output_type": "latent", **kwargs}
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames


class NoForward:
    """Fails the test if the transformer runs (a refusal must come before any work)."""

    def __init__(self, pipe):
        self.pipe = pipe

    def __enter__(self):
        def forbidden(*args, **kwargs):
            raise AssertionError("the transformer ran before the refusal")

        self.pipe.transformer.forward = forbidden

    def __exit__(self, *exc):
        del self.pipe.transformer.forward


@pytest.mark.parametrize("make", [i2v_pipeline, vace_pipeline], ids=["i2v", "vace"])
def test_conditioned_pipelines_refuse_recompute_and_rolling_before_work(make):
    pipe = make()
    for policy, extra in (("recompute", {}), ("recompute", {"context_frames": 2}), ("rolling", {})):
        with (
            NoForward(pipe),
            pytest.raises(
                ValueError, match=r"kv_cache_policy='.*'` cannot run on .*: it conditions its chunks by frame"
            ),
        ):
            run(pipe, kv_cache_policy=policy, **extra)
    assert pipe.supported_policies() == (None, "sequential")
    assert torch.equal(run(pipe, kv_cache_policy="sequential"), run(pipe))


@pytest.mark.parametrize("make", [i2v_pipeline, vace_pipeline], ids=["i2v", "vace"])
def test_conditioned_pipelines_leave_a_stored_recompute_out_with_its_settings(make):
    """Before: a stored "recompute" (a Krea checkpoint loaded as I2V / VACE) ran the recompute policy with the
    conditioning of the wrong frames, silently. Now the pipeline samples sequentially, without the stored bias."""
    stored = make(kv_cache_policy="recompute", context_frames=2, kv_cache_attention_bias=0.3, keep_first_frame=True)
    resolved = stored.resolve_options(RolloutOptions(prompt="a"))
    assert (resolved.kv_cache_policy, resolved.context_frames, resolved.kv_cache_attention_bias) == (None, None, None)
    assert not resolved.keep_first_frame
    plain = make()
    assert torch.equal(run(stored), run(plain))


@pytest.mark.parametrize("make", [i2v_pipeline, vace_pipeline], ids=["i2v", "vace"])
def test_conditioned_pipelines_take_prompt_transitions_and_the_bias_where_the_model_does(make):
    """Image-to-video and VACE take the attention bias (both VACE branches are biased) and a stored one applies
    (before: a stored bias failed inside VACE's first forward)."""
    pipe = make()
    base = run(pipe)
    biased = run(pipe, kv_cache_attention_bias=0.3)
    assert not torch.equal(biased, base)
    assert torch.equal(run(pipe, kv_cache_attention_bias=1.0), base)
    if isinstance(pipe, WanCausalVACEPipeline):
        assert torch.equal(run(vace_pipeline(kv_cache_attention_bias=0.3)), biased)
    schedule = {0: "a cat", 5: "a dog"}
    hard, blended = run(pipe, prompt=schedule), run(pipe, prompt=schedule, prompt_transition_chunks=2)
    assert not torch.equal(hard, blended)
    assert torch.equal(hard, run(pipe, prompt=schedule, prompt_transition_chunks=1))
    with pytest.raises(ValueError, match="keep_first_frame=True` needs `kv_cache_policy='recompute'"):
        run(pipe, keep_first_frame=True)


def test_every_pipeline_takes_every_call_option():
    """Every option of ``RolloutOptions`` is an argument of each pipeline's ``__call__`` (and so of its ``stream``),
    except what video-to-video decides from its input (``num_frames``, ``num_videos_per_prompt``, ``keep_cache``)."""
    names = {field.name for field in fields(RolloutOptions)}
    for cls in (WanCausalPipeline, WanCausalImageToVideoPipeline, WanCausalVACEPipeline):
        assert names <= set(inspect.signature(cls.__call__).parameters), cls.__name__
    v2v = set(inspect.signature(WanCausalVideoToVideoPipeline.__call__).parameters)
    assert names - v2v == {"num_frames", "num_videos_per_prompt", "keep_cache"}


def test_recompute_refuses_window_positions_and_ema_by_name():
    """Before: rope_positions='window' under recompute asked for an `attention_window`, which recompute refuses."""
    pipe = WanCausalPipeline(**tiny_components())
    recompute = {"kv_cache_policy": "recompute", "context_frames": 3}
    for extra in ({"rope_positions": "window"}, {"rope_positions": "anchor"}):
        with NoForward(pipe), pytest.raises(ValueError, match="kv_cache_policy='recompute'` rebuilds the cache"):
            pipe(num_frames=21, **T2V_CALL, **recompute, **extra)


def test_video_to_video_checks_its_arguments_and_refuses_rolling():
    """Before: video-to-video ran guidance_scale=0.5 without guidance, took recache="yes", and sampled a
    ``kv_cache_policy="rolling"`` call chunk by chunk, silently."""
    pipe = WanCausalVideoToVideoPipeline(**tiny_components())
    call = {"prompt": "a cat", "video": torch.rand(9, 3, 16, 16), "num_inference_steps": 1, "output_type": "latent"}
    for bad, match in (
        ({"guidance_scale": 0.5}, "`guidance_scale` must be"),
        ({"recache": "yes"}, "`recache` must be True or False"),
        ({"return_dict": 1}, "`return_dict` must be True or False"),
        (
            {"kv_cache_policy": "rolling"},
            r"'rolling'` cannot run on WanCausalVideoToVideoPipeline: the policy replaces the chunk-by-chunk "
            r"rollout.*Accepted here: \(None, 'sequential', ",
        ),
    ):
        with NoForward(pipe), pytest.raises(ValueError, match=match):
            pipe(**call, **bad)
    live = iter(list(call["video"]))
    with pytest.raises(ValueError, match="'rolling'` cannot run on"):
        pipe(**{**call, "video": live}, kv_cache_policy="rolling")
    assert len(list(live)) == 9  # a refused call takes no frame of a live video


def test_stored_keep_first_frame_fills_a_recompute_call():
    components = tiny_components()
    stored = WanCausalPipeline(**components, kv_cache_policy="recompute", context_frames=3, keep_first_frame=True)
    plain = WanCausalPipeline(**components)
    for pipe in (stored, plain):
        pipe.set_progress_bar_config(disable=True)
    assert stored.resolve_options(RolloutOptions(prompt="a")).keep_first_frame is True
    assert stored.resolve_options(RolloutOptions(prompt="a", keep_first_frame=False)).keep_first_frame is False
    assert stored.resolve_options(RolloutOptions(prompt="a", kv_cache_policy="sequential")).keep_first_frame is None

    def latents(pipe, **kwargs):
        z = torch.randn(1, 16, 12, 2, 2, generator=torch.Generator().manual_seed(1))
        return pipe(num_frames=45, latents=z, generator=torch.Generator().manual_seed(0), **T2V_CALL, **kwargs).frames

    kept_first = latents(plain, kv_cache_policy="recompute", context_frames=3, keep_first_frame=True)
    assert torch.equal(latents(stored), kept_first)
    assert not torch.equal(latents(stored, keep_first_frame=False), kept_first)  # the re-encoded anchor


@pytest.mark.parametrize(
    "options",
    [
        {"attention_window": 6, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"},
        {"attention_window": 6, "sink_frames": 3, "kv_cache_dtype": torch.int8},
        {"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_dtype": torch.float8_e4m3fn},
    ],
    ids=["window-ema", "window-int8", "recompute-fp8"],
)
def test_video_to_video_takes_the_engine_options_alike_in_call_stream_and_iterator(options):
    """Window-relative RoPE with the EMA sink and the 8-bit cache reach video-to-video's engines; a list, an
    iterator and ``stream()`` give the same latents; the options change the output."""
    pipe = WanCausalVideoToVideoPipeline(**tiny_components())
    pipe.set_progress_bar_config(disable=True)
    frames = list(torch.rand(33, 3, 16, 16, generator=torch.Generator().manual_seed(3)))  # 9 latent frames
    call = {"prompt": "a cat", "strength": 0.7, "num_inference_steps": 2, "output_type": "latent"}

    def latents(video, **kwargs):
        return pipe(video=video, generator=torch.Generator().manual_seed(0), **call, **kwargs).frames

    listed = latents(frames, **options)
    engine = next(iter(pipe.transformer.kv_cache_engines.values()))
    expected = {name: options.get(name, default) for name, default in (("rope_positions", "absolute"),
                ("sink_update", "fixed"), ("kv_cache_dtype", None))}  # fmt: skip
    assert {name: getattr(engine, name) for name in expected} == expected
    assert torch.equal(latents(iter(frames), **options), listed)
    streamed = pipe.stream(video=iter(frames), generator=torch.Generator().manual_seed(0), **call, **options)
    assert torch.equal(torch.cat([chunk.latents for chunk in streamed], dim=2), listed)
    assert not torch.equal(latents(frames), listed)
