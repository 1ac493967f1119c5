"""Exact streamed decoding of Wan latents: chunk by chunk, frames equal to one ``vae.decode`` of the whole video.

``AutoencoderKLWan`` decodes one latent frame at a time through causal 3D convolutions that carry a feature cache
(the last input frames of every causal conv) from one latent frame to the next. ``vae.decode`` builds that cache
from scratch on every call, so decoding chunks independently restarts it: every chunk's first latent frame then
decodes to 1 pixel frame instead of 4 (15 frames instead of 21 for 3 chunks of 2) and the seams differ.
[`StreamingWanDecoder`] keeps its own feature cache alive across chunks instead, and runs every op on one latent
frame at a time, so the frames it returns do not depend on how the video is cut into chunks: bit for bit the same
whether the latents come in one piece or chunk by chunk. The causal pipelines decode through it, so streamed and
non-streamed frames are identical. Against ``vae.decode`` of the whole video the only difference is the 1x1x1
``post_quant_conv``, which ``vae.decode`` runs on all frames at once: CPU/GPU convolution kernels round differently
for different tensor shapes (up to ~5e-7 measured in float32, often 0.0).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify


def latent_statistics(vae: AutoencoderKLWan, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and std, each ``(1, z_dim, 1, 1, 1)`` on ``like``'s device and dtype."""
    config = vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like)
    std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like)
    return mean, std


def denormalize_latents(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """``z * latents_std + latents_mean``, with `WanPipeline`'s arithmetic (``z / (1 / std) + mean``) for bit-equal
    frames."""
    mean, std = latent_statistics(vae, latents)
    return latents / (1.0 / std) + mean


class StreamingWanDecoder:
    r"""Decode the latent chunks of one video as they come, carrying the Wan VAE's causal feature cache across them.

    The decoder owns its feature cache (one entry per causal conv of ``vae.decoder``): the VAE's own ``_feat_map`` is
    never touched, so ``vae.encode`` / ``vae.decode`` stay usable between chunks and several streams can coexist.
    [`close`] (or leaving the ``with`` block) frees the cache; a closed decoder can be [`reset`] for a new video.

    Latents are un-normalized like `WanPipeline` does (``z * latents_std + latents_mean``), decoded latent frame by
    latent frame (the first frame of the video with ``first_chunk=True``), un-patchified for the Wan2.2 VAE
    (``patch_size``) and clamped to [-1, 1]. VAE tiling is not streamed: with ``vae.use_tiling`` on, ``vae.decode``
    of a large video tiles and the two differ.

    Args:
        vae ([`AutoencoderKLWan`]): the pipeline's VAE.

    Examples:
        ```python
        >>> decoder = StreamingWanDecoder(pipe.vae)
        >>> with decoder:
        ...     pieces = [decoder.decode(latents[:, :, s:e]) for s, e in [(0, 3), (3, 6), (6, 9)]]
        >>> video = torch.cat(pieces, dim=2)  # == vae.decode(latents * std + mean).sample, 33 frames
        ```
    """

    def __init__(self, vae: AutoencoderKLWan):
        self.vae = vae
        self._num_convs = sum(isinstance(module, WanCausalConv3d) for module in vae.decoder.modules())
        self._feat_cache: list | None = None
        self.num_latent_frames = 0

    def reset(self) -> None:
        """Start a new video: empty feature cache, next latent frame is frame 0."""
        self._feat_cache = [None] * self._num_convs
        self.num_latent_frames = 0

    def close(self) -> None:
        """Free the feature cache (tensors of the last input frames of every causal conv)."""
        self._feat_cache = None
        self.num_latent_frames = 0

    def fork(self) -> StreamingWanDecoder:
        """A decoder that goes on from where this one is, leaving this one as it is: the feature cache list is copied
        (the VAE replaces the entries of that list, never a cached tensor in place), so the copy costs no tensor memory
        until the two diverge."""
        forked = StreamingWanDecoder(self.vae)
        forked._feat_cache = None if self._feat_cache is None else list(self._feat_cache)
        forked.num_latent_frames = self.num_latent_frames
        return forked

    def __enter__(self) -> StreamingWanDecoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def num_decoded_frames(self) -> int:
        """Pixel frames decoded so far: 1 for the first latent frame, 4 for every later one."""
        return (
            0
            if self.num_latent_frames == 0
            else 1 + (self.num_latent_frames - 1) * self.vae.config.scale_factor_temporal
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next latent frames of the video.

        Args:
            latents: ``(B, z_dim, F, h, w)`` normalized latents (as the transformer produces them) that follow the
                frames decoded so far; the first call starts the video.

        Returns:
            ``(B, 3, F_out, h * s, w * s)`` frames in [-1, 1] in the VAE's dtype, ``s`` the spatial factor;
            ``F_out = 4F - 3`` for the chunk holding frame 0 and ``4F`` for later chunks.
        """
        vae = self.vae
        if self._feat_cache is None:
            self.reset()
        hook = getattr(vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(vae)  # CPU offload: the same call `vae.decode` makes through `apply_forward_hook`
        device = next(vae.decoder.parameters()).device
        latents = denormalize_latents(vae, latents.to(device, dtype=vae.dtype))

        frames = []
        for i in range(latents.shape[2]):
            # post_quant_conv is 1x1x1 (no state across frames), run per frame so that rounding ignores chunking
            frames.append(
                vae.decoder(
                    vae.post_quant_conv(latents[:, :, i : i + 1]),
                    feat_cache=self._feat_cache,
                    feat_idx=[0],
                    first_chunk=self.num_latent_frames == 0,
                )
            )
            self.num_latent_frames += 1
        video = torch.cat(frames, dim=2)
        if vae.config.patch_size is not None:
            video = unpatchify(video, patch_size=vae.config.patch_size)
        return torch.clamp(video, min=-1.0, max=1.0)
