"""Krea's KV-cache recompute: before each chunk the cache is rebuilt over a few clean context frames.

[`RecomputePolicy`], chunk after chunk (krea-ai/realtime-video ``recompute_kv_cache``, scope's
``RecomputeKVCacheBlock``):

```
for each chunk [start, end) of the plan:
    if it is not the first chunk:
        context = [anchor, last (context_frames - 1) latent frames]     # clean latents
        for each tag: clear the tag, then
            transformer(context, context_noise, text, start_frame=0, store_kv=True)      # positions 0 .. C-1
    x = source[start:end]
    for t in the chunk's timesteps:
        v = transformer(x, t, text, start_frame=C or 0, cache_tag)                     # positions C .. C+n-1
        x = scheduler.step(v, t, x)
    decode x with the streamed VAE decoder; keep the last 1 + (C - 1) * 4 decoded frames  # the anchor's source
    # (only while a later re-encode reads them or the frames are the output)
    yield ChunkRecord(chunk_index, start, end, x, pixels=decoded)                         # no cache pass after it
```

So the cache never holds more than ``context_frames`` frames plus the chunk being denoised, and RoPE positions stay
below ``context_frames + chunk`` however long the video.

The anchor (the first context frame) is the video's first latent frame while ``frames_done - chunk_frames <
context_frames`` (``frames_done``: latent frames finished before the chunk, ``chunk_frames``: the chunk's own size);
from then on it is Krea's re-encoded frame: the first of the last ``1 + (context_frames - 1) * 4`` decoded pixel
frames, encoded alone with a fresh VAE encoder cache and normalised with the VAE's latent mean/std (scope's
``get_context_frames``, Krea's ``get_clean_context_frames``; with 3-frame chunks and context 3: decoded frame 12
before chunk 2, 24 before chunk 3). Decoding happens chunk by chunk with [`StreamingWanDecoder`] (frames equal to
one decode of the whole video) and the decoded frames ride on the [`ChunkRecord`] (``pixels``), so a pipeline that
outputs frames does not decode again; with latents as output and no kept rollout, only the chunks a later re-encode
reads are decoded (not the last one; none while the anchor never leaves the context). ``keep_first_frame=True``
(Krea's option) keeps the first latent frame as the anchor for ever and decodes nothing. The cache pass runs at the
session's context timestep (``context_noise``; Krea's is 0) on the clean frames.

While fewer than ``context_frames`` frames are done, the context is all of them (scope pads its buffer with zero
frames and repeats the first frame there instead; with chunks of at least ``context_frames - 1`` frames, Krea's
setting, the two agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...chunking import ChunkSpan
from ...settings import CacheSettings, RecomputeSettings
from ..video_io.autoencoders import streaming_decoder, streaming_encoder
from ..video_io.streaming_decode import StreamingWanDecoder
from ..video_io.streaming_tiny import StreamingTinyWanDecoder
from .policy import SequentialPolicy
from .session import STORE_ONLY, RolloutSession


@dataclass(frozen=True)
class ContextFrames:
    """What a recompute rollout keeps of its finished chunks to build the next context (on the session).

    Immutable: [`add`] returns the state after a chunk, so a checkpoint of the session (a failed continuation, a
    ``redo_last_chunk``) restores it by reference; ``before_last`` is the state before the last chunk (one level).
    """

    first: torch.Tensor | None = None  # (B, C, 1, H, W): the video's first latent frame
    recent: torch.Tensor | None = None  # (B, C, <= context_frames, H, W): the last latent frames
    num_frames: int = 0  # latent frames done (reference frames included)
    decoder: StreamingWanDecoder | StreamingTinyWanDecoder | None = (
        None  # streamed decoder of the video so far (re-encoded anchors only)
    )
    decoded: torch.Tensor | None = None  # (B, 3, <= 1 + (context_frames - 1) * 4, H*8, W*8): the last decoded frames
    pixels: torch.Tensor | None = None  # (B, 3, f, H*8, W*8): the last chunk's decoded frames
    before_last: ContextFrames | None = None
    decode_before: int | None = None  # decode only chunks of a lower index (None: every chunk)

    def add(
        self,
        clean: torch.Tensor,
        context_frames: int,
        num_reference_frames: int = 0,
        start: int = 0,
        decode: bool = True,
    ) -> ContextFrames:
        """The state after the finished chunk ``clean`` ``(B, C, F_chunk, H, W)`` whose first latent frame is
        ``start``: its last frames kept, and, with a decoder, its video frames (those after the
        ``num_reference_frames`` leading latent frames) decoded into the buffer of the last ``1 + (context_frames -
        1) * 4`` frames. ``decode=False``: the rollout re-encodes no frame from this chunk on, so the decoder is
        dropped (the streamed decode cannot skip a chunk and go on)."""
        recent = clean if self.recent is None else torch.cat([self.recent, clean], dim=2)
        decoder, decoded, pixels = self.decoder, self.decoded, None
        if not decode:
            decoder, decoded = None, None
        video = clean[:, :, max(0, num_reference_frames - start) :]
        if decoder is not None and video.shape[2] > 0:
            decoder = decoder.fork()  # goes on from here, leaving the kept state as it is
            pixels = decoder.decode(video)
            decoded = pixels if decoded is None else torch.cat([decoded, pixels], dim=2)
            keep = 1 + (context_frames - 1) * decoder.vae.config.scale_factor_temporal
            decoded = decoded[:, :, max(decoded.shape[2] - keep, 0) :]
        return ContextFrames(
            first=clean[:, :, :1] if self.first is None else self.first,
            recent=recent[:, :, max(recent.shape[2] - context_frames, 0) :],
            num_frames=self.num_frames + clean.shape[2],
            decoder=decoder,
            decoded=decoded,
            pixels=pixels,
            before_last=replace(self, before_last=None, pixels=None),
        )

    def rewind(self, frame: int) -> ContextFrames:
        """The state with only the frames before ``frame``: this one, or the one before the last chunk when
        ``frame`` is that chunk's start (what ``redo_last_chunk`` needs); ``ValueError`` for anything else."""
        if frame >= self.num_frames:
            return self
        if self.before_last is not None and frame == self.before_last.num_frames:
            return self.before_last
        raise ValueError(
            f"A recompute rollout can only be rewound by its last chunk (to latent frame "
            f"{self.before_last.num_frames if self.before_last else 0}), got frame {frame}."
        )

    def fork(self) -> ContextFrames:
        """The same state for a forked branch (the decoder's cache list copied, the tensors shared)."""
        if self.decoder is None:
            return self
        return replace(self, decoder=self.decoder.fork())


@torch.no_grad()
def reencode_frame(vae, frame: torch.Tensor) -> torch.Tensor:
    """Krea's re-encoded anchor: ``frame`` ``(B, 3, 1, H, W)`` pixels in [-1, 1] encoded alone with a fresh encoder
    cache, the posterior's mode normalised with the VAE's latent mean/std (the tiny autoencoder's latents as they are):
    ``(B, z_dim, 1, H / 8, W / 8)`` float32."""
    with streaming_encoder(vae) as encoder:
        return encoder.encode(frame)


class RecomputePolicy(SequentialPolicy):
    """Krea's recompute rollout (see the module docstring).

    Args:
        context_frames: latent frames the cache is rebuilt over before each chunk (the anchor included).
        keep_first_frame: keep the video's first latent frame as the anchor for ever (Krea's ``keep_first_frame``)
            instead of re-encoding a decoded frame once the first frame has left the context; nothing is decoded
            then.
        kv_cache_attention_bias: in ``[0.01, 1]``: during denoising forwards the logits of cached keys other than
            the anchor frame get ``log(bias)`` added (1: off, no mask at all).
        anchor: ``(chunk_index, state: ContextFrames) -> (B, C, 1, h, w)``: a custom anchor in place of the
            re-encoded frame, from the same chunk on (nothing is decoded then; tests feed recorded anchors);
            ignored with ``keep_first_frame``.
        output_frames: the chunks' decoded frames are the output (``output_type`` other than ``"latent"``): decode
            every chunk. ``False``: decode only the chunks a later re-encode reads (of a rollout that is not kept:
            not the last chunk, nothing at all in a video too short for the anchor to leave the context).
    """

    def __init__(
        self,
        context_frames: int = 3,
        *,
        keep_first_frame: bool = False,
        kv_cache_attention_bias: float = 1.0,
        anchor: Callable[[int, ContextFrames], torch.Tensor] | None = None,
        output_frames: bool = True,
    ) -> None:
        # the settings' rules (the policy's options, the bias range), stated once there
        RecomputeSettings(context_frames=context_frames, keep_first_frame=keep_first_frame)
        CacheSettings(kv_cache_attention_bias=kv_cache_attention_bias)
        self.context_frames = context_frames
        self.keep_first_frame = keep_first_frame
        self.kv_cache_attention_bias = float(kv_cache_attention_bias)
        self.anchor = anchor
        self.output_frames = output_frames

    def uses_reencoded_anchor(self, done: ContextFrames, span: ChunkSpan) -> bool:
        """Krea's rule (scope ``get_context_frames``): the anchor is re-encoded once ``frames_done - chunk_frames >=
        context_frames``."""
        return self.reencodes_after(done.num_frames, span)

    def reencodes_after(self, frames_done: int, span: ChunkSpan) -> bool:
        """Whether the context of ``span``, after ``frames_done`` latent frames, starts with a re-encoded anchor
        (Krea's rule; [`context_of`] uses the frames done as they are while they are at most ``context_frames``)."""
        c = self.context_frames
        return not self.keep_first_frame and frames_done > c and frames_done - (span.end - span.start) >= c

    def decode_before(self, plan: Any, frames_done: int) -> int | None:
        """The chunk index from which a rollout of ``plan`` after ``frames_done`` latent frames decodes nothing: one
        past the last chunk whose frames a later re-encode reads (the re-encode before chunk ``k`` reads the
        decoded frames of chunks ``< k``); ``None`` (decode every chunk) for a plan whose chunks are not known up
        front (a live video)."""
        spans = getattr(plan, "spans", None)
        if spans is None:
            return None
        last_reader = spans[0].index
        for span in spans:
            if self.reencodes_after(frames_done, span):
                last_reader = span.index
            frames_done += span.end - span.start
        return last_reader

    def context_of(self, done: ContextFrames, span: ChunkSpan) -> torch.Tensor:
        """The clean context before ``span``: all the frames done while they are at most ``context_frames``, else
        the anchor + the last ``context_frames - 1`` frames (see the module docstring for the anchor)."""
        c = self.context_frames
        if done.num_frames <= c:
            return done.recent
        anchor = done.first
        if self.uses_reencoded_anchor(done, span):
            if self.anchor is not None:
                anchor = self.anchor(span.index, done)
            else:
                anchor = reencode_frame(done.decoder.vae, done.decoded[:, :, :1])
            anchor = anchor.to(done.first)
        return torch.cat([anchor, done.recent[:, :, done.recent.shape[2] - (c - 1) :]], dim=2)

    def rebuild(self, session: RolloutSession, span: ChunkSpan, context: torch.Tensor) -> None:
        """Drop the self-attention K/V of every tag of ``session`` and write ``context`` at positions ``0 .. C-1`` (one
        cache pass a tag). The cross-attention K/V stay: they depend on the conditioning only, so the rebuild and the
        chunk's denoising forwards read them (the engines recompute them when the prompt changed)."""
        for engine in session.transformer.kv_cache_engines.values():
            for tag in session.cache_tags:
                engine.truncate(tag, 0)
        window = ChunkSpan(span.index, 0, context.shape[2])
        timestep = session.context_timestep(context.shape[0], context.device)
        for cache_tag in session.cache_tags:  # the prediction is not read: a store-only forward
            session.forward(window, context, timestep, cache_tag=cache_tag, store_kv=True, call_options=STORE_ONLY)

    def run(self, pipe, session, plan, source, **options):
        """[`SequentialPolicy.run`] with the cache rebuilt before each chunk and no cache pass after it; a prompt
        switch needs no recache (the next rebuild runs under the new prompt). The frames the next context needs live
        on the session (``session.policy_state``, kept with a kept rollout, so a continuation goes on exactly), so
        one policy object can serve several rollouts at once. Each record carries the chunk's decoded frames
        (``pixels``) when the policy decoded them."""
        session.attention_bias = self.kv_cache_attention_bias
        if not isinstance(session.policy_state, ContextFrames):  # a new rollout (a continuation keeps its state)
            decoder = None if self.keep_first_frame or self.anchor is not None else streaming_decoder(pipe.vae)
            session.policy_state = ContextFrames(decoder=decoder)
        state = session.policy_state
        decode_before = None  # frames as output, or a kept rollout (a continuation re-encodes): every chunk
        if not self.output_frames and not options.get("store_last", False) and state.decoder is not None:
            decode_before = self.decode_before(plan, state.num_frames)
        session.policy_state = replace(state, decode_before=decode_before)
        for record in super().run(pipe, session, plan, source, **{**options, "recache": False}):
            yield replace(record, pixels=session.policy_state.pixels)

    def chunk_position(self, session: RolloutSession, span: ChunkSpan) -> ChunkSpan:
        """Rebuild the cache over the clean context (not before the first chunk), then sit the chunk right after it."""
        done: ContextFrames = session.policy_state
        if done.first is None:
            return span
        context = self.context_of(done, span)
        self.rebuild(session, span, context)
        start = context.shape[2]
        return ChunkSpan(span.index, start, start + span.end - span.start)

    def finish_chunk(
        self, session: RolloutSession, span: ChunkSpan, clean: torch.Tensor, *, store: bool, generator
    ) -> None:
        """No cache pass (the next rebuild replaces this chunk's noisy K/V); remember the frames the next context
        needs (and decode the chunk when anchors are re-encoded)."""
        state = session.policy_state
        decode = store or self.output_frames  # the last chunk of a rollout that is not kept: no later re-encode
        decode = decode and (state.decode_before is None or span.index < state.decode_before)
        session.policy_state = state.add(clean, self.context_frames, session.num_reference_frames, span.start, decode)
        session.record(span, clean, None)
        return None
