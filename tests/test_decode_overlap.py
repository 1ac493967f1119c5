"""Decode overlapped with denoising: each chunk's decode is queued as soon as the chunk is done (on its own CUDA stream
on a GPU, at once on a CPU), before the next chunk denoises, and the frames equal the serial decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgen_diffusers import WanCausalPipeline, WanCausalVideoToVideoPipeline
from fastgen_diffusers.pipelines.video_io.autoencoders import streaming_decoder
from fastgen_diffusers.pipelines.video_io.decode_overlap import DecodedChunk, OverlappedDecoder
from fastgen_diffusers.testing import tiny_components, tiny_taehv

CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 21, "num_inference_steps": 2, "output_type": "pt"}


@pytest.fixture(scope="module")
def components():
    return tiny_components()


def _pipe(components, **changes):
    pipe = WanCausalPipeline(**{**components, **changes})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(pipe, **kwargs):
    return pipe(generator=torch.Generator().manual_seed(0), **{**CALL, **kwargs}).frames


@pytest.mark.parametrize("vae", ["wan", "taehv"])
@pytest.mark.parametrize("options", [{}, {"kv_cache_policy": "recompute", "context_frames": 3}])
def test_overlapped_call_gives_the_serial_frames(components, vae, options):
    pipe = _pipe(components, **({"vae": tiny_taehv()} if vae == "taehv" else {}))
    serial = _frames(pipe, **options)
    assert not pipe.decode_overlap
    pipe.enable_decode_overlap()
    assert pipe.decode_overlap
    # the Wan VAE decodes frame by frame, the tiny one chunk by chunk, overlapped or not: bit-equal
    assert torch.equal(_frames(pipe, **options), serial)
    pipe.disable_decode_overlap()
    assert not pipe.decode_overlap


@pytest.mark.parametrize("vae", ["wan", "taehv"])
def test_overlapped_video_to_video_call_gives_the_serial_frames_chunk_by_chunk(components, vae, monkeypatch):
    """Video-to-video's call decodes through the same per-chunk decoder as text-to-video's."""
    pipe = WanCausalVideoToVideoPipeline(**{**components, **({"vae": tiny_taehv()} if vae == "taehv" else {})})
    pipe.set_progress_bar_config(disable=True)
    video = [np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(21)]
    call = {"prompt": "a cat", "video": video, "strength": 0.6, "num_inference_steps": 2, "output_type": "pt"}
    submitted = []
    submit = OverlappedDecoder.submit
    monkeypatch.setattr(
        OverlappedDecoder, "submit", lambda self, latents: submitted.append(latents.shape[2]) or submit(self, latents)
    )
    serial = pipe(generator=torch.Generator().manual_seed(0), **call).frames
    assert submitted == [3, 3]  # 6 latent frames: each chunk decoded as it comes
    pipe.enable_decode_overlap()
    try:
        assert torch.equal(pipe(generator=torch.Generator().manual_seed(0), **call).frames, serial)
    finally:
        pipe.disable_decode_overlap()
    assert submitted == [3, 3, 3, 3]


def test_each_chunk_is_decoded_before_the_next_chunk_denoises(components):
    pipe = _pipe(components)
    pipe.enable_decode_overlap()
    events = []
    forward, submit = pipe.transformer.forward, OverlappedDecoder.submit

    def recording_forward(hidden_states, *args, **kwargs):
        events.append(("forward", kwargs["start_frame"]))
        return forward(hidden_states, *args, **kwargs)

    def recording_submit(self, latents):
        events.append(("decode", latents.shape[2]))
        return submit(self, latents)

    pipe.transformer.forward = recording_forward
    OverlappedDecoder.submit = recording_submit
    try:
        _frames(pipe)
    finally:
        del pipe.transformer.forward
        OverlappedDecoder.submit = submit
    decodes = [i for i, event in enumerate(events) if event[0] == "decode"]
    assert len(decodes) == 2  # 6 latent frames: chunks of 3
    first_forward_of_chunk_1 = events.index(("forward", 3))
    assert decodes[0] < first_forward_of_chunk_1 < decodes[1] == len(events) - 1


@torch.no_grad()
def test_cpu_decoder_runs_serially_in_order():
    taehv = tiny_taehv()
    latents = torch.randn(1, 16, 4, 2, 2)
    with streaming_decoder(taehv) as decoder:
        overlapped = OverlappedDecoder(decoder, torch.device("cpu"))
        assert not overlapped.overlaps
        pending = [overlapped.submit(latents[:, :, s:e]) for s, e in [(0, 1), (1, 3), (3, 4)]]
    assert all(isinstance(p, DecodedChunk) and p.event is None for p in pending)
    with streaming_decoder(taehv) as decoder:
        serial = [decoder.decode(latents[:, :, s:e]) for s, e in [(0, 1), (1, 3), (3, 4)]]
    assert all(torch.equal(p.frames(), frames) for p, frames in zip(pending, serial))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs CUDA")
@torch.no_grad()
def test_cuda_overlapped_decode_equals_serial():
    taehv = tiny_taehv().cuda()
    latents = torch.randn(1, 16, 7, 8, 8, device="cuda")
    bounds = [(0, 1), (1, 4), (4, 7)]
    with streaming_decoder(taehv) as decoder:
        overlapped = OverlappedDecoder(decoder, latents.device)
        assert overlapped.overlaps
        pending = []
        for s, e in bounds:
            pending.append(overlapped.submit(latents[:, :, s:e].clone()))
            torch.cuda._sleep(1_000_000)  # the main stream keeps working meanwhile
        overlapped_frames = torch.cat([p.frames() for p in pending], dim=2)
    with streaming_decoder(taehv) as decoder:
        serial = torch.cat([decoder.decode(latents[:, :, s:e]) for s, e in bounds], dim=2)
    assert torch.equal(overlapped_frames, serial)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs CUDA")
@pytest.mark.parametrize("vae", ["wan", "taehv"])
def test_cuda_overlapped_call_gives_the_serial_frames(vae):
    """The pipeline's own overlapped path on a GPU (decodes on the side stream while the next chunk denoises); fresh
    components, moved to the GPU (the module's fixture stays on the CPU)."""
    pipe = _pipe(tiny_components(), **({"vae": tiny_taehv()} if vae == "taehv" else {})).to("cuda")
    serial = _frames(pipe)
    pipe.enable_decode_overlap()
    try:
        assert torch.equal(_frames(pipe), serial)
    finally:
        pipe.disable_decode_overlap()


def test_an_offloaded_vae_decodes_once_at_the_end(components, monkeypatch):
    """Model CPU offload (accelerate's hook on the VAE) would move the transformer out and back for every chunk's
    decode: the call then decodes the latents once at the end instead, to the same frames."""
    pipe = _pipe(components)
    serial = _frames(pipe)
    submitted = []
    submit = OverlappedDecoder.submit
    monkeypatch.setattr(
        OverlappedDecoder, "submit", lambda self, latents: submitted.append(1) or submit(self, latents)
    )
    assert torch.equal(_frames(pipe), serial) and len(submitted) == 2  # chunk by chunk by default

    class OffloadHook:  # what `enable_model_cpu_offload` attaches (here moving nothing)
        def pre_forward(self, module, *args, **kwargs):
            return args, kwargs

    pipe.vae._hf_hook = OffloadHook()
    try:
        assert torch.equal(_frames(pipe), serial) and len(submitted) == 2  # no chunk decoded on the way
    finally:
        del pipe.vae._hf_hook
