"""The chunk source of live video-to-video: input frames, encoded and noised chunk by chunk, as starting latents.

For text-to-video a chunk starts from pre-sampled noise. For video-to-video it starts from its input frames:
[`VideoToVideoSource`] reads the next pixel chunk from a [`VideoChunker`] (a list of frames or a live iterator),
encodes it with a [`StreamingWanEncoder`] (the causal encoder cache carried across chunks, so the latents equal one
``vae.encode`` of the whole clip), picks the chunk's strength from a [`StrengthSchedule`] and, given the chunk's
denoising schedule, noises the latents to its first kept step ([`noise_to_strength`]). A rollout policy then runs the
chunk's timesteps from that step on (``scheduler.set_begin_index``); a chunk of strength 0 has nothing to denoise and
is written to the cache as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

from ..video_io.streaming_encode import StreamingWanEncoder
from ..video_io.video_source import VideoChunker
from .strength import StrengthSchedule, first_kept_step, noise_to_strength


@dataclass
class VideoChunk:
    """One input chunk of a video-to-video rollout.

    Args:
        index: the chunk's position (0 for the first chunk).
        start: absolute index of its first latent frame.
        end: one past its last latent frame.
        pixels: ``(1, 3, f, H, W)`` its input frames in [-1, 1] (``f = 4(end - start) - 3`` for chunk 0, else
            ``4(end - start)``).
        encoded: ``(B, C, end - start, H / 8, W / 8)`` normalized float32 latents of the frames, one copy per video of
            the batch.
        strength: its strength, in [0, 1].
    """

    index: int
    start: int
    end: int
    pixels: torch.Tensor
    encoded: torch.Tensor
    strength: float


class VideoToVideoSource:
    r"""Starting latents of the chunks of a video-to-video rollout, read, encoded and noised one chunk at a time.

    Iterating the source reads the next pixel chunk (waiting for a live iterator's frames), encodes it and sets its
    strength; [`start`] then gives the chunk's starting latents and first step for its schedule. Nothing is read
    ahead: chunk ``k + 1``'s frames are asked for only after chunk ``k`` was handed out.

    Args:
        chunker: the [`VideoChunker`] of the input video (its chunk sizes are the rollout's).
        encoder: a [`StreamingWanEncoder`] on the pipeline's VAE (the source resets it and closes it at the end).
        strength: the [`StrengthSchedule`] of the chunks.
        batch_size: videos generated from the one input video (prompts times videos per prompt).
        device: where the latents go (the transformer's execution device).
        generator: RNG(s) of the noise, one chunk at a time (``randn_tensor`` of the chunk's shape).
        noise: ``(B, C, F, h, w)`` float32 noise to use instead (chunk ``[s, e)`` takes ``noise[:, :, s:e]``), e.g.
            a text-to-video call's ``latents``; the video must not outgrow it.
    """

    def __init__(
        self,
        chunker: VideoChunker,
        encoder: StreamingWanEncoder,
        strength: StrengthSchedule,
        *,
        batch_size: int = 1,
        device: torch.device | str = "cpu",
        generator: torch.Generator | list[torch.Generator] | None = None,
        noise: torch.Tensor | None = None,
    ):
        if noise is not None and noise.ndim != 5:
            raise ValueError(f"`latents` must be (B, C, F, h, w) noise, got shape {tuple(noise.shape)}.")
        if noise is not None and noise.shape[0] != batch_size:
            raise ValueError(f"`latents` must hold {batch_size} videos (the batch), got {noise.shape[0]}.")
        num_latent_frames = None if chunker.latent_layout() is None else sum(chunker.latent_layout())
        if noise is not None and num_latent_frames is not None and noise.shape[2] < num_latent_frames:
            raise ValueError(f"`latents` holds {noise.shape[2]} latent frames; the video needs {num_latent_frames}.")
        self.chunker = chunker
        self.encoder = encoder
        self.strength = strength
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.generator = generator
        self.noise = noise

    def __iter__(self) -> Iterator[VideoChunk]:
        """Read, encode and set the strength of each chunk in turn (see [`VideoChunk`])."""
        self.encoder.reset()
        self.strength.reset()
        start = 0
        try:
            for index, pixels in enumerate(self.chunker):
                num_latents = (
                    self.chunker.first_chunk_latent_frames if index == 0 else self.chunker.chunk_latent_frames
                )
                if self.noise is not None and self.noise.shape[2] < start + num_latents:
                    raise ValueError(
                        f"`video` outgrew `latents`: chunk {index} needs latent frames "
                        f"[{start}, {start + num_latents}), `latents` holds {self.noise.shape[2]}."
                    )
                strength = self.strength.at(index, pixels)  # checked before the chunk is encoded
                encoded = self.encoder.encode(pixels).to(self.device)
                encoded = encoded.expand(self.batch_size, -1, -1, -1, -1).contiguous()
                yield VideoChunk(index, start, start + num_latents, pixels, encoded, strength)
                start += num_latents
        finally:
            self.encoder.close()

    def chunk_noise(self, chunk: VideoChunk) -> torch.Tensor:
        """``(B, C, end - start, h, w)`` float32 noise of ``chunk``: the given noise's frames, else fresh draws."""
        if self.noise is not None:
            return self.noise[:, :, chunk.start : chunk.end].to(self.device, torch.float32)
        return randn_tensor(chunk.encoded.shape, generator=self.generator, device=self.device, dtype=torch.float32)

    def start(self, chunk: VideoChunk, sigmas: torch.Tensor, order: int = 1) -> tuple[torch.Tensor, int]:
        """``(latents, begin_index)`` of ``chunk`` on a schedule with the scheduler's ``sigmas`` (see
        [`noise_to_strength`]): run the timesteps from ``begin_index`` on; ``begin_index`` equal to the number of
        steps: ``latents`` are the encoded ones, nothing to denoise (no noise is drawn)."""
        num_steps = (len(sigmas) - 1 if float(sigmas[-1]) == 0.0 else len(sigmas)) // order
        begin_index = first_kept_step(num_steps, chunk.strength, order)
        if begin_index >= num_steps * order:
            return chunk.encoded, begin_index
        return noise_to_strength(chunk.encoded, self.chunk_noise(chunk), sigmas, chunk.strength, order)
