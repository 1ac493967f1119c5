"""Exact streamed encoding of Wan video frames: chunk by chunk, latents equal to one ``vae.encode`` of the whole clip.

``AutoencoderKLWan`` encodes the first pixel frame alone, then groups of 4 frames, through causal 3D convolutions
that carry a feature cache (the last input frames of every causal conv, and the last frame of every temporal
downsampler) from one group to the next. ``vae.encode`` builds that cache from scratch on every call, so encoding
the chunks of a live video independently restarts it: every chunk would then be encoded as if it opened a video.
[`StreamingWanEncoder`] keeps its own feature cache alive across chunks instead, and runs the encoder on the same
frame groups as ``vae.encode``, so its latents do not depend on how the clip is cut into chunks: bit for bit the same
whether the frames come in one piece or chunk by chunk. Against ``vae.encode`` of the whole clip the only difference
is the 1x1x1 ``quant_conv``, which the streamed encoder runs one latent frame at a time (as [`StreamingWanDecoder`]
runs ``post_quant_conv``) and ``vae.encode`` on all frames at once: CPU convolution kernels round differently for
different shapes when a latent frame has few positions. Measured in float32 on CPU: bit-equal from 64x64 pixels
(both the Wan2.1 and the patchified Wan2.2 VAE), up to ~2e-7 at 16x16.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify

from .streaming_decode import latent_statistics


def normalize_latents(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """``(z - latents_mean) / latents_std``: the VAE's latents in the transformer's space, as the causal pipelines
    normalize encoded conditions (the inverse of [`denormalize_latents`])."""
    mean, std = latent_statistics(vae, latents)
    return (latents - mean) / std


class StreamingWanEncoder:
    r"""Encode the pixel chunks of one video as they come, carrying the Wan VAE's causal encoder cache across them.

    The encoder owns its feature cache (one entry per causal conv of ``vae.encoder``): the VAE's own
    ``_enc_feat_map`` is never touched, so ``vae.encode`` / ``vae.decode`` stay usable between chunks and several
    streams can coexist. [`close`] (or leaving the ``with`` block) frees the cache; a closed encoder can be [`reset`]
    for a new video.

    The first chunk of a video holds ``1 + 4k`` pixel frames (``k >= 0``) and gives ``1 + k`` latent frames; every
    later chunk holds ``4k`` frames (``k >= 1``) and gives ``k`` latent frames, 4 being the VAE's temporal factor.
    Frames are patchified for the Wan2.2 VAE (``patch_size``), encoded, and the posterior's mode (its mean, as
    diffusers' video-to-video pipeline takes with ``sample_mode="argmax"``) is normalized like the pipelines do
    (``(z - latents_mean) / latents_std``) in float32. VAE tiling is not streamed: with ``vae.use_tiling`` on,
    ``vae.encode`` of a large video tiles and the two differ.

    Args:
        vae ([`AutoencoderKLWan`]): the pipeline's VAE.

    Examples:
        ```python
        >>> encoder = StreamingWanEncoder(pipe.vae)
        >>> with encoder:  # video: (1, 3, 33, H, W) pixels in [-1, 1]
        ...     pieces = [encoder.encode(video[:, :, s:e]) for s, e in [(0, 9), (9, 21), (21, 33)]]
        >>> latents = torch.cat(pieces, dim=2)  # (1, 16, 9, H / 8, W / 8) == normalized vae.encode(video) mode
        ```
    """

    def __init__(self, vae: AutoencoderKLWan):
        self.vae = vae
        self._num_convs = sum(isinstance(module, WanCausalConv3d) for module in vae.encoder.modules())
        self._feat_cache: list | None = None
        self._frame_shape: tuple[int, int, int] | None = None  # (B, H, W) of the video being encoded
        self.num_frames = 0

    @property
    def temporal_factor(self) -> int:
        """Pixel frames per latent frame after the first (4 for Wan)."""
        return self.vae.config.scale_factor_temporal

    def reset(self) -> None:
        """Start a new video: empty feature cache, next pixel frame is frame 0."""
        self._feat_cache = [None] * self._num_convs
        self._frame_shape = None
        self.num_frames = 0

    def close(self) -> None:
        """Free the feature cache (tensors of the last input frames of every causal conv)."""
        self._feat_cache = None
        self._frame_shape = None
        self.num_frames = 0

    def __enter__(self) -> StreamingWanEncoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def num_latent_frames(self) -> int:
        """Latent frames encoded so far: 1 for the first pixel frame, 1 for every later group of 4."""
        return 0 if self.num_frames == 0 else 1 + (self.num_frames - 1) // self.temporal_factor

    def expected_frames(self, num_latent_frames: int) -> int:
        """Pixel frames the next chunk needs to give ``num_latent_frames`` latent frames (``4n - 3`` for the first
        chunk of the video, ``4n`` after it)."""
        frames = self.temporal_factor * num_latent_frames
        return frames - (self.temporal_factor - 1) if self.num_frames == 0 else frames

    def check_chunk(self, pixels: torch.Tensor) -> None:
        """Raise a ``ValueError`` naming ``pixels`` unless it is a ``(B, 3, F, H, W)`` chunk that can follow the frames
        encoded so far: ``F = 1 + 4k`` for the first chunk, ``F = 4k > 0`` after it, ``H`` and ``W`` multiples of the
        VAE's spatial factor, and the batch size and frame size of the video's first chunk. Nothing is encoded."""
        factor = self.temporal_factor
        spatial = self.vae.config.scale_factor_spatial
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise ValueError(f"`pixels` must be (B, 3, F, H, W) video frames, got shape {tuple(pixels.shape)}.")
        batch_size, _, num_frames, height, width = pixels.shape
        if height % spatial or width % spatial:
            raise ValueError(f"`pixels` height and width must be multiples of {spatial}, got {height}x{width}.")
        if self.num_frames == 0 and num_frames % factor != 1:
            raise ValueError(
                f"`pixels` of the first chunk must hold 1 + {factor}k frames (1, {1 + factor}, {1 + 2 * factor}, "
                f"...), got {num_frames}."
            )
        if self.num_frames > 0 and (num_frames == 0 or num_frames % factor != 0):
            raise ValueError(
                f"`pixels` of a chunk after the first must hold {factor}k frames ({factor}, {2 * factor}, ...), "
                f"got {num_frames}."
            )
        if self._frame_shape is not None and (batch_size, height, width) != self._frame_shape:
            raise ValueError(
                f"`pixels` must keep the video's batch size and frame size {self._frame_shape} (B, H, W), got "
                f"{(batch_size, height, width)}."
            )

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode the next frames of the video.

        Args:
            pixels: ``(B, 3, F, H, W)`` frames in [-1, 1] that follow the frames encoded so far; the first call starts
                the video. ``H`` and ``W`` divisible by the VAE's spatial factor (8, or 16 for Wan2.2).

        Returns:
            ``(B, z_dim, F_lat, H / s, W / s)`` normalized float32 latents; ``F_lat = (F - 1) / 4 + 1`` for the first
            chunk and ``F / 4`` for later chunks.
        """
        self.check_chunk(pixels)
        vae = self.vae
        if self._feat_cache is None:
            self.reset()
        self._frame_shape = (pixels.shape[0], pixels.shape[3], pixels.shape[4])
        hook = getattr(vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(vae)  # CPU offload: the same call `vae.encode` makes through `apply_forward_hook`
        device = next(vae.encoder.parameters()).device
        pixels = pixels.to(device, dtype=vae.dtype)
        if vae.config.patch_size is not None:
            pixels = patchify(pixels, patch_size=vae.config.patch_size)

        # The groups `vae.encode` runs: frame 0 alone, then 4 frames at a time.
        factor = self.temporal_factor
        bounds = [(0, 1)] if self.num_frames == 0 else []
        first = bounds[-1][1] if bounds else 0
        bounds += [(s, s + factor) for s in range(first, pixels.shape[2], factor)]
        latents = []
        for start, end in bounds:
            moments = vae.encoder(pixels[:, :, start:end], feat_cache=self._feat_cache, feat_idx=[0])
            # quant_conv is 1x1x1 (no state across frames): run per latent frame so rounding ignores chunking.
            for i in range(moments.shape[2]):
                mean = vae.quant_conv(moments[:, :, i : i + 1])[:, : vae.config.z_dim]  # the posterior's mode
                latents.append(mean)
            self.num_frames += end - start
        latents = torch.cat(latents, dim=2).float()
        return normalize_latents(vae, latents)
