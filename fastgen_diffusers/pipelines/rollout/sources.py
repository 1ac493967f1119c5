"""Chunk sources: where each generated chunk's starting latents come from."""

from __future__ import annotations

import torch

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
