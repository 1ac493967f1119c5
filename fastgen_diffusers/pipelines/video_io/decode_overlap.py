"""Decode chunk ``k`` while chunk ``k + 1`` denoises: the streamed decoder's work on its own CUDA stream.

The rollout queues chunk ``k``'s last forward on the current CUDA stream and hands the chunk over;
[`OverlappedDecoder.submit`] then queues its decode on a side stream (after waiting for the chunk's latents) and
returns at once, so the host goes on queueing chunk ``k + 1``'s denoising and the GPU runs both. Decodes stay in
submission order on the one side stream, so the decoder's carried state (the Wan VAE's feature cache, the tiny
decoder's memory) sees the chunks in order and the frames equal the serial ones. The side stream has the higher
priority, so a chunk's decode is not slowed by the next chunk's denoising (its frames come no later than in the
serial order). [`DecodedChunk.frames`] makes the current stream wait for that chunk's decode only. On a CPU (or any
non-CUDA device), or with ``overlap=False``, ``submit`` decodes at once: the serial path, through the same bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .streaming_decode import StreamingWanDecoder
from .streaming_tiny import StreamingTinyWanDecoder


@dataclass
class DecodedChunk:
    """The frames of one submitted chunk, ready once its decode event has completed."""

    pixels: torch.Tensor  # (B, 3, F_out, H, W) in [-1, 1]
    event: torch.cuda.Event | None = None  # recorded on the decode stream after the decode (None: decoded already)

    def frames(self) -> torch.Tensor:
        """The chunk's frames, usable on the current stream (which waits for this chunk's decode, nothing else)."""
        if self.event is not None:
            current = torch.cuda.current_stream(self.pixels.device)
            current.wait_event(self.event)
            self.pixels.record_stream(current)  # allocated on the decode stream, now read here
            self.event = None
        return self.pixels


class OverlappedDecoder:
    r"""Run a streamed decoder ([`StreamingWanDecoder`] or [`StreamingTinyWanDecoder`]) on its own CUDA stream.

    Args:
        decoder: the streamed decoder of the video (owned by the caller, who closes it).
        device (`torch.device`): where the latents live; only ``"cuda"`` overlaps.
        overlap (`bool`, defaults to `True`): ``False`` decodes each chunk at once, on any device.

    Examples:
        ```python
        >>> overlapped = OverlappedDecoder(streaming_decoder(pipe.vae), torch.device("cuda"))
        >>> pending = [overlapped.submit(chunk.latents) for chunk in chunks]  # each returns before its decode ends
        >>> video = torch.cat([p.frames() for p in pending], dim=2)  # == the serial streamed decode
        ```
    """

    def __init__(
        self, decoder: StreamingWanDecoder | StreamingTinyWanDecoder, device: torch.device, overlap: bool = True
    ):
        self.decoder = decoder
        device = torch.device(device)
        # priority -1: the higher of CUDA's two stream priorities (the default stream has 0)
        self.stream = torch.cuda.Stream(device, priority=-1) if overlap and device.type == "cuda" else None

    @property
    def overlaps(self) -> bool:
        """Whether decodes run on a side stream (CUDA) rather than at once."""
        return self.stream is not None

    def submit(self, latents: torch.Tensor) -> DecodedChunk:
        """Queue the decode of the next latent chunk ``(B, C, F, h, w)`` (after the current stream's work on them)."""
        if self.stream is None:
            return DecodedChunk(self.decoder.decode(latents))
        self.stream.wait_stream(torch.cuda.current_stream(latents.device))
        with torch.cuda.stream(self.stream):
            latents.record_stream(self.stream)  # the allocator keeps them until the decode has read them
            pixels = self.decoder.decode(latents)
            event = torch.cuda.Event()
            event.record(self.stream)
        return DecodedChunk(pixels, event)
