"""Chunk sources: where each generated chunk's starting latents come from."""

from __future__ import annotations

import torch
from diffusers.utils.torch_utils import randn_tensor

from ...chunking import ChunkSpan


class NoiseSource:
    """Pre-sampled noise: chunk ``[s, e)`` starts from ``noise[:, :, s - start_frame : e - start_frame]``.

    Args:
        noise: ``(B, C, F, H, W)`` float32 noise of the frames the rollout generates.
        start_frame: the absolute latent frame of ``noise[:, :, 0]`` (a continuation starts after the kept frames).
    """

    def __init__(self, noise: torch.Tensor, start_frame: int = 0) -> None:
        self.noise = noise
        self.start_frame = start_frame

    def latents(self, span: ChunkSpan) -> torch.Tensor:
        """``(B, C, span.num_frames, H, W)`` starting latents of ``span``."""
        return self.noise[:, :, span.start - self.start_frame : span.end - self.start_frame]


class EndlessNoiseSource(NoiseSource):
    """``noise`` for the chunks it covers, then fresh noise from ``generator`` for each later chunk, drawn when the
    chunk starts (an endless stream's chunks, in order).

    Args:
        noise: ``(B, C, F, H, W)`` float32 noise of the planned chunks.
        generator: the RNG(s) of the later chunks' noise.
    """

    def __init__(self, noise: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None) -> None:
        super().__init__(noise)
        self.generator = generator

    def latents(self, span: ChunkSpan) -> torch.Tensor:
        if span.end <= self.noise.shape[2]:
            return super().latents(span)
        batch, channels, _, height, width = self.noise.shape
        shape = (batch, channels, span.num_frames, height, width)
        return randn_tensor(shape, generator=self.generator, device=self.noise.device, dtype=self.noise.dtype)
