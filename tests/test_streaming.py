"""Streaming: exact streamed VAE decoding, chunks handed out as they finish, early close."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from fastgen_diffusers.pipelines.video_io.streaming_decode import StreamingWanDecoder
from fastgen_diffusers.testing import tiny_pipeline

CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 21, "num_inference_steps": 2}


def _full_decode(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        return vae.decode(latents / std + mean).sample


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(
    "config",
    [
        {},
        # Wan2.2-style: residual blocks and a 2x2 patchified output (unpatchify after the decoder).
        {"is_residual": True, "patch_size": 2, "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16},
    ],
)
def test_streamed_decode_ignores_chunking_and_matches_full_decode(config):
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        **config,
    ).eval()
    latents = torch.randn(1, 16, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    with StreamingWanDecoder(vae) as decoder:
        pieces = [decoder.decode(latents[:, :, s:e]) for s, e in [(0, 1), (1, 3)]]
        assert decoder.num_decoded_frames == 9
    assert [p.shape[2] for p in pieces] == [1, 8]
    with StreamingWanDecoder(vae) as decoder:
        assert torch.equal(torch.cat(pieces, dim=2), decoder.decode(latents))
    # vae.decode runs post_quant_conv on all frames at once, which rounds differently than frame by frame.
    torch.testing.assert_close(torch.cat(pieces, dim=2), _full_decode(vae, latents), atol=2e-6, rtol=0)
    assert all(entry is None for entry in vae._feat_map)  # the VAE's own cache is never touched


def test_decoding_chunks_independently_loses_frames():
    """Why the decoder carries its cache: a restarted cache decodes each chunk's first latent frame to 1 frame."""
    vae = tiny_pipeline().vae
    latents = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    independent = [StreamingWanDecoder(vae).decode(latents[:, :, s : s + 1]) for s in (0, 1)]
    assert sum(p.shape[2] for p in independent) == 2 < _full_decode(vae, latents).shape[2] == 5


def test_stream_frames_concatenate_to_call_frames(pipe):
    reference = pipe(**CALL, generator=torch.Generator().manual_seed(0))
    chunks = list(pipe.stream(**CALL, generator=torch.Generator().manual_seed(0)))
    assert [(c.start, c.end, c.frame_start) for c in chunks] == [(0, 3, 0), (3, 6, 9)]
    assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), reference.frames)
    latents = pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    assert torch.equal(torch.cat([c.latents for c in chunks], dim=2), latents)


def test_stream_yields_first_chunk_before_computing_the_second(pipe):
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["start_frame"]), with_kwargs=True
    )
    try:
        stream = pipe.stream(**CALL, generator=torch.Generator().manual_seed(0), output_type="latent")
        first = next(stream)
        assert first.end == 3 and set(calls) == {0}
        assert len(calls) == CALL["num_inference_steps"] + 1  # denoising steps + the cache pass, nothing of chunk 2
        list(stream)
        assert calls.count(3) == CALL["num_inference_steps"]  # the last chunk needs no cache pass
    finally:
        hook.remove()


def test_closing_a_stream_leaves_the_pipeline_fresh(pipe):
    stream = pipe.stream(**CALL, generator=torch.Generator().manual_seed(3))
    next(stream)
    stream.close()
    assert all(engine.num_stored_frames("pos") == 0 for engine in pipe.transformer.kv_cache_engines.values())
    after = pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    fresh = tiny_pipeline()
    fresh.set_progress_bar_config(disable=True)
    assert torch.equal(after, fresh(**CALL, generator=torch.Generator().manual_seed(0), output_type="latent").frames)


def test_stream_raises_the_rollout_error_and_stays_usable(pipe):
    def fail(pipeline, step, timestep, callback_kwargs):
        if step == 2:
            raise RuntimeError("boom")
        return callback_kwargs

    with pytest.raises(RuntimeError, match="boom"):
        list(pipe.stream(**CALL, callback_on_step_end=fail, output_type="latent"))
    assert list(pipe.stream(**CALL, output_type="latent"))[-1].end == 6


def test_stream_runs_in_the_callers_thread_without_leaking_grad_mode(pipe):
    threads = threading.active_count()
    with torch.enable_grad():
        for chunk in pipe.stream(**CALL, output_type="latent"):
            assert torch.is_grad_enabled() and threading.active_count() == threads
            assert not chunk.latents.requires_grad
    with torch.no_grad():
        next(pipe.stream(**CALL, output_type="latent"))
        assert not torch.is_grad_enabled()


def test_stream_checks_the_output_type_before_any_work(pipe):
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="output_type"):
            next(pipe.stream(**CALL, output_type="mp4"))
    finally:
        hook.remove()
    assert not calls


def test_a_kept_stream_that_stops_after_the_last_chunk_keeps_the_rollout(pipe):
    reference = pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    for chunk in pipe.stream(
        **CALL, generator=torch.Generator().manual_seed(0), output_type="latent", keep_cache=True
    ):
        if chunk.end == reference.shape[2]:
            break
    try:
        assert pipe.rollout_branches == ["main"]
        assert torch.equal(pipe.kept_rollout().latents, reference)
    finally:
        pipe.discard_rollout()
    stream = pipe.stream(**CALL, output_type="latent", keep_cache=True)
    next(stream)
    stream.close()  # an early close keeps nothing
    assert pipe.rollout_branches == []
