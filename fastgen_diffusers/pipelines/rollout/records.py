"""The one record of a finished chunk, yielded by every rollout policy, kept in a session's history and streamed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ChunkRecord:
    """One finished chunk of a causal rollout.

    Args:
        chunk_index: position of the chunk in the rollout (0 for the first chunk).
        start: absolute index of the chunk's first latent frame.
        end: one past its last latent frame.
        latents: ``(B, C, end - start, H, W)`` clean latents of the chunk (float32, the x0 of the last step).
        is_last: whether it is the last chunk of the rollout.
        context: ``(B, C, end - start, H, W)`` input of its cache pass (``latents``, re-noised when the rollout's
            ``context_noise > 0``); ``None`` when no cache pass ran. A recache runs it again under a new prompt.
        frames: the chunk's new pixel frames when streamed (``"np"``: ``(B, f, H*8, W*8, 3)``, ``"pt"``:
            ``(B, f, 3, H*8, W*8)``, ``"pil"``: lists of images), ``None`` for ``"latent"`` or not decoded; ``f`` is
            ``4 * (end - start) - 3`` for the first chunk and ``4 * (end - start)`` after it.
        frame_start: index in the whole video of the first of these pixel frames.
        pixels: ``(B, 3, f, H*8, W*8)`` the chunk's new frames in [-1, 1] as the streamed VAE decoder gives them, when
            the policy decoded the chunk itself (recompute's re-encoded anchors need them): the pipeline then
            post-processes these instead of decoding again; ``None`` otherwise.
    """

    chunk_index: int
    start: int
    end: int
    latents: torch.Tensor
    is_last: bool = False
    context: torch.Tensor | None = None
    frames: Any = None
    frame_start: int = 0
    pixels: torch.Tensor | None = None

    @property
    def index(self) -> int:
        return self.chunk_index


# The three records this one replaced, kept importable.
ChunkOutput = ChunkRecord
RolloutChunk = ChunkRecord
StreamChunk = ChunkRecord
