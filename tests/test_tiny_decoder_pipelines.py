"""The tiny autoencoder (AutoencoderTinyWan) in the pipelines: as `vae` (decode and encode: text-to-video, Krea's
re-encoded anchor, video-to-video) and as the decode-only `decoder` component of `stream()`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgen_diffusers import (
    AutoencoderTinyWan,
    WanCausalImageToVideoPipeline,
    WanCausalPipeline,
    WanCausalVACEPipeline,
    WanCausalVideoToVideoPipeline,
)
from fastgen_diffusers.models import TinyWanStreamState
from fastgen_diffusers.pipelines.video_io.autoencoders import streaming_decoder, streaming_encoder
from fastgen_diffusers.pipelines.video_io.streaming_tiny import StreamingTinyWanDecoder, StreamingTinyWanEncoder
from fastgen_diffusers.testing import tiny_components, tiny_taehv, tiny_vace_pipeline

CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 21, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def taehv() -> AutoencoderTinyWan:
    return tiny_taehv()


@pytest.fixture(scope="module")
def components():
    return tiny_components()


def _pipe(cls, components, **changes):
    pipe = cls(**{**components, **changes})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, method="__call__", **kwargs):
    kwargs = {**CALL, "generator": torch.Generator().manual_seed(0), "output_type": "pt", **kwargs}
    if method == "stream":
        return torch.cat([chunk.frames for chunk in pipe.stream(**kwargs)], dim=1)
    return pipe(**kwargs).frames


@torch.no_grad()
def test_tiny_vae_decodes_the_latents_as_they_are_and_streams_like_the_call(components, taehv):
    pipe = _pipe(WanCausalPipeline, components, vae=taehv)
    latents = _run(pipe, output_type="latent")
    frames = _run(pipe)
    assert frames.shape == (1, 21, 3, 16, 16)
    expected = (taehv.decode(latents).sample.permute(0, 2, 1, 3, 4) + 1) / 2  # no latent de-normalization
    torch.testing.assert_close(frames, expected, rtol=0, atol=1e-5)  # one decode vs chunk by chunk: batch rounding
    # the call decodes chunk by chunk with the tiny autoencoder as the stream does: the same frames, bit for bit
    assert torch.equal(_run(pipe, "stream"), frames)


@torch.no_grad()
def test_decode_only_decoder_leaves_the_output_unchanged_and_decodes_the_stream(components, taehv):
    plain = _pipe(WanCausalPipeline, components)
    previewing = _pipe(WanCausalPipeline, components, decoder=taehv)
    assert previewing.stream_decoder is taehv and plain.stream_decoder is plain.vae
    assert torch.equal(_run(previewing), _run(plain))
    latents = _run(plain, output_type="latent")
    preview = _run(previewing, "stream")
    expected = (taehv.decode(latents).sample.permute(0, 2, 1, 3, 4) + 1) / 2
    torch.testing.assert_close(preview, expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_decode_only_decoder_decodes_every_chunk_of_a_recompute_stream(components, taehv):
    previewing = _pipe(WanCausalPipeline, components, decoder=taehv)
    options = {"kv_cache_policy": "recompute", "context_frames": 3}
    latents = _run(previewing, output_type="latent", **options)
    expected = (taehv.decode(latents).sample.permute(0, 2, 1, 3, 4) + 1) / 2
    torch.testing.assert_close(_run(previewing, "stream", **options), expected, rtol=0, atol=1e-5)
    plain = _pipe(WanCausalPipeline, components)
    assert torch.equal(_run(previewing, **options), _run(plain, **options))


@torch.no_grad()
def test_tiny_vae_serves_krea_reencoded_anchor(components, taehv, monkeypatch):
    """Krea's recompute re-encodes its anchor (one decoded frame, alone) with the pipeline's VAE: here the tiny
    encoder, spied on; the call and the stream give the same frames."""
    pipe = _pipe(WanCausalPipeline, components, vae=taehv)
    encoded, encode = [], StreamingTinyWanEncoder.encode

    def spying(self, pixels):
        latents = encode(self, pixels)
        encoded.append((tuple(pixels.shape), tuple(latents.shape)))
        return latents

    monkeypatch.setattr(StreamingTinyWanEncoder, "encode", spying)
    options = {"kv_cache_policy": "recompute", "context_frames": 2, "num_frames": 29}  # the anchor is re-encoded
    frames = _run(pipe, **options)
    assert frames.shape == (1, 29, 3, 16, 16) and torch.isfinite(frames).all()
    assert encoded and set(encoded) == {((1, 3, 1, 16, 16), (1, 16, 1, 2, 2))}  # one frame -> one latent frame
    calls = len(encoded)
    assert torch.equal(_run(pipe, "stream", **options), frames)
    assert len(encoded) == 2 * calls  # the stream re-encodes as the call did


@torch.no_grad()
def test_tiny_vae_encodes_video_to_video(components, taehv):
    pipe = _pipe(WanCausalVideoToVideoPipeline, components, vae=taehv)
    rng = np.random.default_rng(0)
    video = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(21)]
    pixels = torch.stack([torch.from_numpy(f).permute(2, 0, 1).float() / 127.5 - 1 for f in video], dim=1)[None]
    with streaming_encoder(taehv) as encoder:
        encoded = encoder.encode(pixels)
    kwargs = {key: value for key, value in CALL.items() if key not in ("height", "width", "num_frames")}
    generator = torch.Generator().manual_seed(0)
    latents = pipe(video=video, strength=0.0, generator=generator, output_type="latent", **kwargs).frames
    torch.testing.assert_close(latents, encoded, rtol=0, atol=1e-5)  # strength 0: the encoded video as it is


@torch.no_grad()
@pytest.mark.parametrize("options", [{}, {"kv_cache_policy": "recompute", "context_frames": 3}])
def test_tiny_vae_video_to_video_call_decodes_chunk_by_chunk_like_the_stream(components, taehv, options):
    """Video-to-video's call decodes each chunk as it comes with the streamed decoder, as ``stream()`` does: the same
    frames bit for bit (one decode of the whole video rounds differently with the tiny decoder)."""
    pipe = _pipe(WanCausalVideoToVideoPipeline, components, vae=taehv)
    rng = np.random.default_rng(1)
    video = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(21)]
    kwargs = {key: value for key, value in CALL.items() if key not in ("height", "width", "num_frames")}
    kwargs = {**kwargs, "video": video, "strength": 0.7, "output_type": "pt", **options}
    frames = pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames
    streamed = torch.cat([c.frames for c in pipe.stream(generator=torch.Generator().manual_seed(0), **kwargs)], 1)
    assert frames.shape == (1, 21, 3, 16, 16)
    assert torch.equal(frames, streamed)


@torch.no_grad()
def test_streamed_tiny_encoder_follows_wan_frame_groups(taehv):
    pixels = torch.rand(1, 3, 13, 16, 16) * 2 - 1
    with StreamingTinyWanEncoder(taehv) as encoder:
        pieces = [encoder.encode(pixels[:, :, :5]), encoder.encode(pixels[:, :, 5:])]
        assert encoder.num_latent_frames == 4
    assert [p.shape[2] for p in pieces] == [2, 2]
    state = TinyWanStreamState()  # 3 copies of frame 0 in front: the frames the decoder drops
    front = torch.cat([pixels[:, :, :1].expand(-1, -1, 3, -1, -1), pixels], dim=2)
    torch.testing.assert_close(torch.cat(pieces, 2), taehv.encode_chunk(front, state), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="pixels"):
        StreamingTinyWanEncoder(taehv).encode(pixels[:, :, :4])


@torch.no_grad()
def test_streamed_tiny_decoder_forks_and_counts_frames(taehv):
    latents = torch.randn(1, 16, 3, 2, 2)
    with streaming_decoder(taehv) as decoder:
        assert isinstance(decoder, StreamingTinyWanDecoder)
        first = decoder.decode(latents[:, :, :1])
        fork = decoder.fork()
        rest = decoder.decode(latents[:, :, 1:])
        assert torch.equal(fork.decode(latents[:, :, 1:]), rest)
        assert decoder.num_decoded_frames == 9 and first.shape[2] == 1 and rest.shape[2] == 8


def test_decoder_component_must_be_the_tiny_autoencoder(components):
    with pytest.raises(ValueError, match="`decoder` must be an AutoencoderTinyWan"):
        WanCausalPipeline(**components, decoder=components["vae"])


@pytest.mark.parametrize("cls", [WanCausalImageToVideoPipeline, WanCausalVACEPipeline])
def test_pipelines_that_encode_with_the_wan_vae_refuse_the_tiny_one_as_vae(components, taehv, cls):
    """Image-to-video and VACE encode their conditioning with the Wan VAE's latent distribution and statistics: the
    tiny autoencoder as `vae` is refused at construction (it failed after prompt encoding), pointing to `decoder=`."""
    if cls is WanCausalVACEPipeline:
        components = tiny_vace_pipeline().components
    with pytest.raises(ValueError, match=r"`vae` must be the Wan VAE .*`decoder=`"):
        cls(**{**components, "vae": taehv})
    pipe = cls(**{**components, "decoder": taehv})  # the decode-only tiny decoder is accepted
    assert pipe.stream_decoder is taehv


def test_pipeline_with_decoder_saves_and_loads(components, taehv, tmp_path):
    pipe = _pipe(WanCausalPipeline, components, decoder=taehv)
    pipe.save_pretrained(tmp_path)
    loaded = WanCausalPipeline.from_pretrained(tmp_path)
    assert isinstance(loaded.decoder, AutoencoderTinyWan)
    latents = torch.randn(1, 16, 2, 2, 2)
    with torch.no_grad():
        assert torch.equal(loaded.decoder.decode(latents).sample, taehv.decode(latents).sample)
    _pipe(WanCausalPipeline, components).save_pretrained(tmp_path / "plain")
    assert WanCausalPipeline.from_pretrained(tmp_path / "plain").decoder is None


def test_cli_generate_decodes_with_taehv(tmp_path, capsys, monkeypatch):
    import imageio.v3 as iio

    from fastgen_diffusers.cli import app as cli
    from fastgen_diffusers.testing import taehv_released_state_dict

    decoded, decode = [], StreamingTinyWanDecoder.decode

    def spy(self, latents):
        frames = decode(self, latents)
        decoded.append(frames.shape[2])
        return frames

    monkeypatch.setattr(StreamingTinyWanDecoder, "decode", spy)
    weights = tmp_path / "renamed_decoder.pth"
    torch.save(taehv_released_state_dict(), weights)
    output = tmp_path / "fox.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "9", "--height", "32"]
    assert cli.main([*args, "--width", "32", "--decoder", "taehv", str(weights)]) == 0
    assert "(9 frames, 32x32" in capsys.readouterr().out
    assert decoded and sum(decoded) == 9  # the tiny decoder decoded every frame written (not the Wan VAE)
    assert len(iio.imread(output, plugin="FFMPEG")) == 9
    assert cli.main([*args, "--decoder", "taesd", str(weights)]) == 2
    assert "--decoder KIND must be one of taehv" in capsys.readouterr().err
    assert cli.main([*args, "--decoder", "taehv", str(tmp_path / "missing.pth")]) == 2
    assert "no such file" in capsys.readouterr().err
    torch.save(taehv_released_state_dict(latent_channels=48, patch_size=2), weights)
    assert cli.main([*args, "--decoder", "taehv", str(weights)]) == 2
    assert "decodes 48 latent channels, the model makes 16" in capsys.readouterr().err


def test_tiny_decoder_benchmark_runs_small(capsys):
    from bench_loader import load_benchmark

    load_benchmark("bench_tiny_decoder").main(
        ["--height", "16", "--width", "16", "--chunk", "1", "--repeats", "1", "--small-wan", "--device", "cpu"]
    )
    printed = capsys.readouterr().out
    assert "TAEHV streamed decode of one chunk (16x16, 4 frames, cpu, float32)" in printed
    assert "tiny / Wan VAE time: " in printed
