"""Streamed VAE encoding: chunk by chunk with the causal encoder cache carried across, equal to one `vae.encode`."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan

from fastgen_diffusers.pipelines.video_io.streaming_encode import StreamingWanEncoder, normalize_latents

WAN21 = {}
# Wan2.2-style: residual blocks and a 2x2 patchified input (patchify before the encoder).
WAN22 = {"is_residual": True, "patch_size": 2, "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16}


def _vae(config: dict) -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        **config,
    ).eval()


def _video(num_frames: int, size: int, batch_size: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.rand(batch_size, 3, num_frames, size, size, generator=generator) * 2 - 1


def _full_encode(vae: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return normalize_latents(vae, vae.encode(video).latent_dist.mode().float())


def _streamed(vae: AutoencoderKLWan, video: torch.Tensor, cuts: list[tuple[int, int]]) -> list[torch.Tensor]:
    with StreamingWanEncoder(vae) as encoder:
        pieces = [encoder.encode(video[:, :, s:e]) for s, e in cuts]
        assert encoder.num_frames == cuts[-1][1]
        assert encoder.num_latent_frames == sum(p.shape[2] for p in pieces)
    return pieces


@pytest.mark.parametrize("config", [WAN21, WAN22], ids=["wan2.1", "wan2.2"])
def test_streamed_encode_is_bit_equal_to_full_encode(config):
    """At 64x64 the per-latent-frame `quant_conv` rounds like `vae.encode`'s whole-clip one: bit-equal latents."""
    vae = _vae(config)
    video = _video(17, 64)
    pieces = _streamed(vae, video, [(0, 9), (9, 17)])
    assert [p.shape[2] for p in pieces] == [3, 2]
    assert torch.equal(torch.cat(pieces, dim=2), _full_encode(vae, video))


@pytest.mark.parametrize("config", [WAN21, WAN22], ids=["wan2.1", "wan2.2"])
def test_streamed_encode_ignores_chunking(config):
    """Any cut of the clip gives the same latents bit for bit; at 16x16 (4 or 1 latent positions) `vae.encode`'s
    whole-clip `quant_conv` rounds differently from the per-frame one, by at most a few float32 ulps."""
    vae = _vae(config)
    video = _video(25, 16, batch_size=2)
    one_piece = torch.cat(_streamed(vae, video, [(0, 25)]), dim=2)
    for cuts in ([(0, 1), (1, 5), (5, 25)], [(0, 9), (9, 17), (17, 25)], [(0, 5), (5, 9), (9, 13), (13, 25)]):
        assert torch.equal(torch.cat(_streamed(vae, video, cuts), dim=2), one_piece)
    torch.testing.assert_close(one_piece, _full_encode(vae, video), atol=3e-7, rtol=0)


def test_encoding_chunks_independently_differs():
    """Why the encoder carries its cache: restarting it at a chunk encodes that chunk as the opening of a video."""
    vae = _vae(WAN21)
    video = _video(9, 64)
    streamed = torch.cat(_streamed(vae, video, [(0, 5), (5, 9)]), dim=2)
    restarted = _full_encode(vae, video[:, :, 5:9])  # a fresh cache: only the chunk's first frame is encoded
    assert torch.equal(streamed[:, :, :2], _full_encode(vae, video[:, :, :5]))
    assert restarted.shape == streamed[:, :, 2:].shape
    assert not torch.allclose(streamed[:, :, 2:], restarted, atol=1e-3)


def test_encoder_leaves_the_vae_cache_alone_and_vae_encode_usable_between_chunks():
    vae = _vae(WAN21)
    video = _video(9, 64)
    reference = _full_encode(vae, video)
    with StreamingWanEncoder(vae) as encoder:
        first = encoder.encode(video[:, :, :5])
        assert all(entry is None for entry in vae._enc_feat_map)
        assert torch.equal(_full_encode(vae, video), reference)  # a one-shot encode in the middle of a stream
        second = encoder.encode(video[:, :, 5:])
    assert torch.equal(torch.cat([first, second], dim=2), reference)
    assert encoder.num_frames == 0  # closed: the next encode starts a new video
    assert torch.equal(encoder.encode(video[:, :, :5]), first)


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([(1, 3, 4, 16, 16)], "1 \\+ 4k frames"),
        ([(1, 3, 5, 16, 16), (1, 3, 3, 16, 16)], "4k frames"),
        ([(1, 3, 5, 16, 16), (1, 3, 4, 32, 16)], "batch size and frame size"),
        ([(1, 3, 5, 16, 16), (2, 3, 4, 16, 16)], "batch size and frame size"),
        ([(1, 3, 5, 12, 16)], "multiples of 8"),
        ([(1, 4, 5, 16, 16)], "\\(B, 3, F, H, W\\)"),
    ],
)
def test_bad_chunks_are_refused_before_encoding(pieces, message):
    vae = _vae(WAN21)
    encoder = StreamingWanEncoder(vae)
    for shape in pieces[:-1]:
        encoder.encode(torch.zeros(shape))
    frames_before = encoder.num_frames
    cache_before = [None if entry is None else entry.clone() for entry in encoder._feat_cache or []]
    with pytest.raises(ValueError, match=f"`pixels`.*{message}"):
        encoder.encode(torch.zeros(pieces[-1]))
    assert encoder.num_frames == frames_before
    after = encoder._feat_cache or []
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(cache_before, after))
