"""Live video-to-video: frames from a list or an iterator restyled chunk by chunk (`WanCausalVideoToVideoPipeline`)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import AutoencoderKLWan

from fastgen_diffusers import MotionAwareStrength, WanCausalPipeline, WanCausalVideoToVideoPipeline
from fastgen_diffusers.pipelines import VideoToVideoOptions
from fastgen_diffusers.pipelines.video_io import video_source
from fastgen_diffusers.pipelines.video_io.streaming_encode import normalize_latents
from fastgen_diffusers.testing import tiny_components, tiny_transformer

SIZE = 32
CALL = {"prompt": "a cat", "num_inference_steps": 4}


@pytest.fixture(scope="module")
def components():
    return tiny_components()


@pytest.fixture(scope="module")
def pipe(components):
    pipe = WanCausalVideoToVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(num_frames: int = 21) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for _ in range(num_frames)]


def _encoded(pipe, frames) -> torch.Tensor:
    pixels = torch.stack([torch.from_numpy(f).permute(2, 0, 1).float() / 127.5 - 1 for f in frames], dim=1)[None]
    with torch.no_grad():
        return normalize_latents(pipe.vae, pipe.vae.encode(pixels).latent_dist.mode().float())


def _latents(pipe, video, seed: int = 0, **kwargs) -> torch.Tensor:
    kwargs = {**CALL, "strength": 0.5, **kwargs}
    return pipe(video=video, generator=torch.Generator().manual_seed(seed), output_type="latent", **kwargs).frames


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"attention_window": 3, "kv_cache_engine": "vanilla"},
        {"prompt": {0: "a cat", 9: "a dog"}, "strength": {0: 0.75, 1: 0.5}},
        {"strength": MotionAwareStrength(), "context_noise": 100.0},
    ],
    ids=["plain", "window", "prompt-and-strength-schedules", "motion-aware"],
)
def test_frames_from_an_iterator_give_the_list_output(pipe, kwargs):
    frames = _frames()
    listed = _latents(pipe, frames, **kwargs)
    streamed = _latents(pipe, iter(frames), **kwargs)
    assert listed.shape == (1, 16, 6, SIZE // 8, SIZE // 8)
    assert torch.equal(streamed, listed)


def test_strength_zero_returns_the_input_latents(pipe):
    frames = _frames()
    assert torch.equal(_latents(pipe, frames, strength=0.0), _encoded(pipe, frames))
    assert torch.equal(_latents(pipe, frames, strength=0.2), _encoded(pipe, frames))  # int(4 * 0.2) = 0 steps


@pytest.mark.parametrize("kwargs", [{}, {"context_noise": 100.0, "timesteps": [1000.0, 750.0, 500.0, 250.0]}])
def test_strength_one_is_text_to_video_with_that_noise(pipe, components, kwargs):
    t2v = WanCausalPipeline(**components)
    t2v.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 16, 6, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(1))
    call = {**CALL, "output_type": "latent", **kwargs}
    if "timesteps" in kwargs:
        call.pop("num_inference_steps")
    reference = t2v(
        num_frames=21, height=SIZE, width=SIZE, latents=noise, generator=torch.Generator().manual_seed(2), **call
    ).frames
    restyled = pipe(video=_frames(), strength=1.0, latents=noise, generator=torch.Generator().manual_seed(2), **call)
    assert torch.equal(restyled.frames, reference)


def test_wan22_patchified_vae_strength_zero_and_one():
    """A Wan2.2-style VAE (z_dim 48, patch 2, 16x spatial): strength 0 gives its encoding, strength 1 text-to-video."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
    ).eval()  # fmt: skip
    components = {**tiny_components(), "vae": vae, "transformer": tiny_transformer(in_channels=48, out_channels=48)}
    pipe = WanCausalVideoToVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(21)]
    assert torch.equal(_latents(pipe, iter(frames), strength=0.0), _encoded(pipe, frames))
    t2v = WanCausalPipeline(**components)
    t2v.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 48, 6, 4, 4, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(0)  # the seed of `_latents`: the same re-noising draws
    reference = t2v(
        **CALL, num_frames=21, height=64, width=64, latents=noise, generator=generator, output_type="latent"
    )
    reference = reference.frames
    assert torch.equal(_latents(pipe, iter(frames), strength=1.0, latents=noise), reference)


def test_strength_schedule_per_chunk(pipe):
    frames = _frames()
    latents = _latents(pipe, frames, strength={0: 1.0, 1: 0.0})
    assert torch.equal(latents[:, :, 3:], _encoded(pipe, frames)[:, :, 3:])  # chunk 1 at strength 0: its input
    assert not torch.allclose(latents[:, :, :3], _encoded(pipe, frames)[:, :, :3], atol=1e-2)


def test_callbacks_see_the_kept_steps_and_can_interrupt(pipe):
    seen = []

    def callback(pipe, step, timestep, callback_kwargs):
        seen.append((step, float(timestep), tuple(callback_kwargs["latents"].shape)))
        pipe._interrupt = step == 2
        return {}

    latents = _latents(pipe, _frames(), strength=0.5, callback_on_step_end=callback)
    # strength 0.5 keeps the last 2 of 4 steps (833.3, 625) of each chunk; the interrupt ends after chunk 0
    assert [(s, round(t, 1)) for s, t, _ in seen] == [(0, 833.3), (1, 625.0), (2, 833.3)]
    assert seen[0][2] == (1, 16, 3, 4, 4) and latents.shape[2] == 3


def test_stream_yields_each_chunk_before_reading_the_next_frames(pipe):
    frames = _frames()
    pulled = []

    def webcam():
        for index, frame in enumerate(frames):
            pulled.append(index)
            yield PIL.Image.fromarray(frame)

    stream = pipe.stream(**CALL, video=webcam(), strength=0.5, generator=torch.Generator().manual_seed(0))
    first = next(stream)
    assert (first.start, first.end, first.frame_start, first.frames.shape) == (0, 3, 0, (1, 9, SIZE, SIZE, 3))
    assert len(pulled) == 9  # the first chunk is out before frame 9 was asked for
    chunks = [first, *stream]
    assert [(c.start, c.end, c.frame_start) for c in chunks] == [(0, 3, 0), (3, 6, 9)]
    called = pipe(**CALL, video=frames, strength=0.5, generator=torch.Generator().manual_seed(0)).frames
    assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), called)


def test_video_ending_inside_a_chunk_gives_the_chunks_it_completes(pipe, monkeypatch):
    warnings = []
    monkeypatch.setattr(video_source.logger, "warning", warnings.append)
    frames = _frames(21 + 7)
    streamed = _latents(pipe, iter(frames))
    assert torch.equal(streamed, _latents(pipe, frames[:21]))
    assert len(warnings) == 1 and "dropped the last 7 frames" in warnings[0]


def test_bad_frame_mid_stream_stops_before_its_chunk_and_frees_the_caches(pipe):
    frames = _frames()
    bad = frames[:15] + [PIL.Image.fromarray(frames[15]).convert("RGBA")] + frames[16:]
    stream = pipe.stream(**CALL, video=iter(bad), strength=0.5, generator=torch.Generator().manual_seed(0))
    first = next(stream)
    with pytest.raises(ValueError, match="frame 15 of `video` is a 'RGBA' PIL image"):
        next(stream)
    assert all(engine.tag_state("pos") is None for engine in pipe.transformer.kv_cache_engines.values())
    called = pipe(**CALL, video=frames, strength=0.5, generator=torch.Generator().manual_seed(0)).frames
    assert np.array_equal(first.frames, called[:, :9])


def _rgba(frames):
    frames[0] = PIL.Image.fromarray(frames[0]).convert("RGBA")
    return frames


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strength": 1.5}, "`strength` must be a number in \\[0, 1\\], got 1.5"),
        ({"strength": {2: 0.5}}, "`strength` schedule must set chunk 0"),
        ({"video": iter(_frames(8))}, "`video` ended after 8 frames; its first chunk .* needs 9"),
        ({"video": _frames(8)}, "`video` ended after 8 frames"),
        ({"video": _rgba(_frames())}, "frame 0 of `video` is a 'RGBA' PIL image"),
        ({"video": iter(_frames(3) + [np.zeros((16, 32, 3), np.uint8)])}, "frame 3 of `video` is 16x32"),
        ({"video": _frames(), "height": 64, "width": 64}, "frame 0 of `video` is 32x32 \\(HxW\\); the video is 64x64"),
        ({"video": None}, "Pass `video`"),
        ({"keep_cache": True}, "`keep_cache` is not supported"),
        ({"latents": torch.zeros(1, 16, 5, 4, 4)}, "`latents` must be noise of shape \\(1, 16, 6, 4, 4\\)"),
        ({"output_type": "gif"}, "`output_type` must be one of"),
        ({"attention_window": 2}, "does not fit the attention window"),
        (  # an iterator's chunk layout is known before its frames: the 4th chunk's eviction (3 frames != sink 1)
            {
                "video": iter(_frames(45)),
                "attention_window": 8,
                "sink_frames": 1,
                "sink_update": "ema",
                "rope_positions": "window",
            },
            "the chunk at latent frame 9 evicts 3",
        ),
    ],
)
def test_bad_inputs_are_refused_before_any_model_work(pipe, change, message):
    calls = []
    hooks = [
        module.register_forward_pre_hook(lambda *args: calls.append(args))
        for module in (pipe.transformer, pipe.vae.encoder, pipe.text_encoder)
    ]
    kwargs = {**CALL, "video": _frames(), **change}
    try:
        with pytest.raises(ValueError, match=message):
            if "keep_cache" in change:  # not an argument of `__call__`: options built directly
                pipe.generate(VideoToVideoOptions(**kwargs))
            else:
                pipe(**kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == []
