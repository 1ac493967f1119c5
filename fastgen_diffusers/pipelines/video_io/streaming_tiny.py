"""Streamed decoding and encoding with the tiny autoencoder ([`AutoencoderTinyWan`], TAEHV family).

Same interface as [`StreamingWanDecoder`] / [`StreamingWanEncoder`], so the rollout serves either autoencoder, with
no latent (de-)normalization: TAEHV reads and writes the latents exactly as the transformer uses them. The carried
state is a [`TinyWanStreamState`] (the last frame of every memory block), so chunk after chunk gives the frames of one
``vae.decode`` of all the latents (equal up to float rounding of the convolutions' batch sizes: <= 1e-5 in float32).

Encoding follows Wan's frame groups: the first chunk of ``1 + 4k`` frames gives ``1 + k`` latents (its first frame is
repeated 3 times in front, the frames the decoder drops at the start), later chunks of ``4k`` frames give ``k``; so
latent ``t`` stands for pixel frames ``4t - 3 .. 4t`` as with the Wan VAE. (Upstream's ``encode_video``, which
``AutoencoderTinyWan.encode`` reproduces, pads the last group at the end instead.)
"""

from __future__ import annotations

import torch

from ...models.autoencoder_tiny_wan import AutoencoderTinyWan, TinyWanStreamState
from .streaming_encode import StreamingWanEncoder


class StreamingTinyWanDecoder:
    r"""Decode the latent chunks of one video with an [`AutoencoderTinyWan`], carrying its stream state.

    Args:
        vae ([`AutoencoderTinyWan`]): the tiny autoencoder (the pipeline's `vae` or its decode-only `decoder`).
    """

    def __init__(self, vae: AutoencoderTinyWan):
        self.vae = vae
        self._state: TinyWanStreamState | None = None
        self.num_latent_frames = 0

    def reset(self) -> None:
        """Start a new video."""
        self._state = TinyWanStreamState()
        self.num_latent_frames = 0

    def close(self) -> None:
        """Free the stream state."""
        self._state = None
        self.num_latent_frames = 0

    def fork(self) -> StreamingTinyWanDecoder:
        """A decoder that goes on from where this one is, leaving this one as it is (tensors shared)."""
        forked = StreamingTinyWanDecoder(self.vae)
        forked._state = None if self._state is None else self._state.copy()
        forked.num_latent_frames = self.num_latent_frames
        return forked

    def __enter__(self) -> StreamingTinyWanDecoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def num_decoded_frames(self) -> int:
        """Pixel frames decoded so far: 1 for the first latent frame, 4 for every later one."""
        factor = self.vae.config.scale_factor_temporal
        return 0 if self.num_latent_frames == 0 else 1 + (self.num_latent_frames - 1) * factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next latent frames ``(B, C, F, h, w)`` of the video (as the transformer produces them) to
        ``(B, 3, F_out, H, W)`` frames in [-1, 1] in the decoder's dtype: ``F_out = 4F - 3`` for the chunk holding
        frame 0, ``4F`` after it."""
        if self._state is None:
            self.reset()
        vae = self.vae
        frames = vae.decode_chunk(latents, self._state)  # moves them to its weights (offloaded: after moving those)
        self.num_latent_frames += latents.shape[2]
        return frames


class StreamingTinyWanEncoder(StreamingWanEncoder):
    r"""Encode the pixel chunks of one video with an [`AutoencoderTinyWan`] in Wan's frame groups (see the module
    docstring); the chunk rules and checks are [`StreamingWanEncoder`]'s, the latents are float32 and not normalized.

    Args:
        vae ([`AutoencoderTinyWan`]): the pipeline's tiny autoencoder.
    """

    def __init__(self, vae: AutoencoderTinyWan):  # the Wan encoder's feature cache is replaced by a stream state
        self.vae = vae
        self._state: TinyWanStreamState | None = None
        self._frame_shape: tuple[int, int, int] | None = None
        self.num_frames = 0

    def reset(self) -> None:
        self._state = TinyWanStreamState()
        self._frame_shape = None
        self.num_frames = 0

    def close(self) -> None:
        self._state = None
        self._frame_shape = None
        self.num_frames = 0

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode the next frames ``(B, 3, F, H, W)`` in [-1, 1] of the video: ``(B, C, F_lat, H / s, W / s)`` float32
        latents, ``F_lat = (F - 1) / 4 + 1`` for the first chunk and ``F / 4`` after it."""
        self.check_chunk(pixels)
        if self._state is None:
            self.reset()
        self._frame_shape = (pixels.shape[0], pixels.shape[3], pixels.shape[4])
        vae = self.vae
        video = pixels  # `encode_chunk` moves them to its weights (offloaded: after moving those)
        if self.num_frames == 0:  # the decoder's dropped lead-in frames: the first frame, 3 more times
            video = torch.cat([video[:, :, :1].expand(-1, -1, self.temporal_factor - 1, -1, -1), video], dim=2)
        latents = vae.encode_chunk(video, self._state)
        self.num_frames += pixels.shape[2]
        return latents.float()
