"""The video-to-video chunk source: frames read, encoded and noised one chunk at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgen_diffusers.pipelines.rollout.strength import MotionAwareStrength, StrengthSchedule
from fastgen_diffusers.pipelines.rollout.video_latents import VideoToVideoSource
from fastgen_diffusers.pipelines.video_io.streaming_encode import StreamingWanEncoder, normalize_latents
from fastgen_diffusers.pipelines.video_io.video_source import VideoChunker
from fastgen_diffusers.testing import tiny_scheduler, tiny_vae

SIZE = 64


@pytest.fixture(scope="module")
def vae():
    return tiny_vae()


def _frames(num_frames: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for _ in range(num_frames)]


def _source(vae, video, strength=0.5, **kwargs) -> VideoToVideoSource:
    chunker = VideoChunker(video, chunk_latent_frames=2, first_chunk_latent_frames=3)
    return VideoToVideoSource(chunker, StreamingWanEncoder(vae), StrengthSchedule(strength), **kwargs)


def _sigmas(num_steps: int = 4) -> torch.Tensor:
    scheduler = tiny_scheduler()
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1].tolist())
    return scheduler.sigmas


def test_chunks_are_the_encoding_of_the_whole_clip(vae):
    frames = _frames(17)
    chunks = list(_source(vae, frames, batch_size=2))
    assert [(c.index, c.start, c.end, c.pixels.shape[2]) for c in chunks] == [(0, 0, 3, 9), (1, 3, 5, 8)]
    pixels = torch.cat([c.pixels for c in chunks], dim=2)
    with torch.no_grad():
        full = normalize_latents(vae, vae.encode(pixels).latent_dist.mode().float())
    encoded = torch.cat([c.encoded for c in chunks], dim=2)
    assert encoded.shape == (2, 16, 5, SIZE // 8, SIZE // 8)
    assert torch.equal(encoded, full.expand(2, -1, -1, -1, -1))


def test_iterator_and_list_give_the_same_chunks_and_reading_is_lazy(vae):
    frames = _frames(17)
    pulled = []

    def webcam():
        for index, frame in enumerate(frames):
            pulled.append(index)
            yield frame

    source = _source(vae, webcam(), strength=lambda i: 0.25 * (i + 1))
    streamed = iter(source)
    first = next(streamed)
    assert len(pulled) == 9 and first.strength == 0.25
    chunks = [first, *streamed]
    listed = list(_source(vae, frames, strength=lambda i: 0.25 * (i + 1)))
    assert [c.strength for c in chunks] == [c.strength for c in listed] == [0.25, 0.5]
    assert all(torch.equal(a.encoded, b.encoded) for a, b in zip(chunks, listed))
    assert source.encoder._feat_cache is None  # closed at the end


def test_stopping_early_closes_the_encoder(vae):
    source = _source(vae, _frames(17))
    stream = iter(source)
    next(stream)
    assert source.encoder._feat_cache is not None
    stream.close()
    assert source.encoder._feat_cache is None


def test_strength_zero_starts_from_the_encoded_latents_without_drawing_noise(vae):
    generator = torch.Generator().manual_seed(0)
    source = _source(vae, _frames(9), strength=0.0, generator=generator)
    chunk = next(iter(source))
    state = generator.get_state()
    latents, begin = source.start(chunk, _sigmas())
    assert latents is chunk.encoded and begin == 4
    assert torch.equal(generator.get_state(), state)


def test_strength_one_starts_from_the_given_noise(vae):
    noise = torch.randn(1, 16, 5, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(3))
    source = _source(vae, _frames(17), strength=1.0, noise=noise)
    starts = [source.start(chunk, _sigmas()) for chunk in source]
    assert [begin for _, begin in starts] == [0, 0]
    assert torch.equal(torch.cat([latents for latents, _ in starts], dim=2), noise)


def test_intermediate_strength_blends_encoded_and_noise(vae):
    generator = torch.Generator().manual_seed(5)
    source = _source(vae, _frames(9), strength=0.5, generator=generator)
    chunk = next(iter(source))
    latents, begin = source.start(chunk, _sigmas())
    noise = torch.randn(chunk.encoded.shape, generator=torch.Generator().manual_seed(5))
    sigma = _sigmas()[2]
    assert begin == 2 and torch.equal(latents, (1.0 - sigma) * chunk.encoded + sigma * noise)


def test_motion_aware_strength_reads_each_chunk(vae):
    controller = MotionAwareStrength(smoothing=0.0)
    chunks = list(_source(vae, _frames(17), strength=controller))
    assert all(0.6 <= c.strength <= 0.8 for c in chunks)
    assert chunks[-1].strength == pytest.approx(0.8 - 0.2 * controller.motion)


def test_noise_must_cover_the_video(vae):
    noise = torch.zeros(1, 16, 4, SIZE // 8, SIZE // 8)
    with pytest.raises(ValueError, match="`latents` holds 4 latent frames; the video needs 5"):
        _source(vae, _frames(17), noise=noise)
    stream = iter(_source(vae, iter(_frames(17)), noise=noise))  # an iterator: found at the chunk that outgrows it
    next(stream)
    with pytest.raises(ValueError, match="`video` outgrew `latents`: chunk 1 needs latent frames \\[3, 5\\)"):
        next(stream)
    with pytest.raises(ValueError, match="`latents` must hold 2 videos"):
        _source(vae, _frames(17), noise=torch.zeros(1, 16, 5, 8, 8), batch_size=2)
