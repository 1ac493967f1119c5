"""Conditioners: what a rollout gives the transformer besides the noisy latents and the text, one class per kind.

A [`RolloutSession`] keeps its conditioner for as long as it lives, so a kept rollout of any kind can be continued.
Every hook takes the chunk's [`ChunkSpan`]; none reads pipeline or scheduler state.

| kind | class | what it does to a chunk |
|---|---|---|
| text only (T2V) | [`Conditioner`] | nothing |
| Wan2.1 image concat | [`ImageConcatConditioner`] | 20 condition channels concatenated, CLIP tokens |
| Wan2.2 TI2V first frame | [`FirstFrameConditioner`] | clean first frame at timestep 0 in chunk 0 |
| given frames (T2V students) | [`GivenFramesConditioner`] | given chunks are cached clean at timestep 0 |
| VACE control | [`VACEConditioner`] | control latents of the chunk, per-layer scale, hint cache |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...chunking import ChunkSpan


class Conditioner:
    """Text-only conditioning (text-to-video): every hook leaves the chunk as it is. The base of every conditioner."""

    def model_inputs(
        self, span: ChunkSpan, latents: torch.Tensor, *, cache_tag: str, store_kv: bool, step: int
    ) -> dict[str, Any]:
        """Extra (or replacing) transformer keyword arguments for one forward of ``span``.

        The session passes ``hidden_states=latents`` (``(B, C, F, H, W)`` float32) and the branch's text
        embeddings; a returned key replaces or adds an argument (``hidden_states`` is cast to the model's dtype).
        ``step`` is the denoising step within the chunk (0 for cache passes).
        """
        return {}

    def timestep(self, span: ChunkSpan, timestep: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep for a forward of ``span``: ``(B,)`` as it is, or per frame ``(B, F)``."""
        return timestep

    def after_step(self, span: ChunkSpan, latents: torch.Tensor) -> torch.Tensor:
        """``(B, C, F, H, W)`` latents of ``span`` after a scheduler step, before the callback."""
        return latents

    def given_latents(self, span: ChunkSpan) -> torch.Tensor | None:
        """Clean ``(B, C, F, H, W)`` latents of a chunk that is given rather than generated, or ``None``."""
        return None

    def extend(self, num_latent_frames: int) -> None:
        """Make chunks up to latent frame ``num_latent_frames`` servable (a continued rollout); the inputs of the
        frames already served must not change."""


class ImageConcatConditioner(Conditioner):
    """Wan2.1 image-to-video: the condition channels ``[mask(4) | VAE latent of [image, zeros...](z_dim)][:, :, s:e]``
    are concatenated to every forward's latents, and the CLIP image tokens (when the model takes them) are passed as
    ``encoder_hidden_states_image`` (one tensor for the whole rollout, so the cross K/V cache recognizes it).

    Args:
        condition: ``(B, 4 + z_dim, F, h, w)`` condition of the first ``F`` latent frames.
        image_embeds: ``(B, L_img, image_dim)`` CLIP tokens, or ``None``.
        encode: ``encode(num_latent_frames)`` builds the condition of a longer video (used by [`extend`]); the VAE is
            causal, so the frames already encoded come out the same.
    """

    def __init__(
        self,
        condition: torch.Tensor,
        image_embeds: torch.Tensor | None,
        encode: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.condition = condition
        self.image_embeds = image_embeds
        self._encode = encode

    def model_inputs(self, span, latents, *, cache_tag, store_kv, step):
        inputs = {"hidden_states": torch.cat([latents, self.condition[:, :, span.start : span.end]], dim=1)}
        if self.image_embeds is not None:
            inputs["encoder_hidden_states_image"] = self.image_embeds
        return inputs

    def extend(self, num_latent_frames: int) -> None:
        if num_latent_frames <= self.condition.shape[2]:
            return
        if self._encode is None:
            raise ValueError(f"This image condition covers {self.condition.shape[2]} latent frames and cannot grow.")
        condition = self._encode(num_latent_frames)
        self.condition = torch.cat([self.condition, condition[:, :, self.condition.shape[2] :]], dim=2)


class FirstFrameConditioner(Conditioner):
    """Wan2.2 TI2V: latent frame 0 of chunk 0 is the clean image latent at timestep 0 (per-frame timesteps) and is put
    back after every step.

    Args:
        image_latents: ``(B, C, 1, h, w)`` normalized latent of the image.
    """

    def __init__(self, image_latents: torch.Tensor) -> None:
        self.image_latents = image_latents

    def given_latents(self, span):  # a first chunk of the image frame alone is given, not denoised
        return self.image_latents if span.end <= 1 else None

    def model_inputs(self, span, latents, *, cache_tag, store_kv, step):
        if span.start != 0:
            return {}
        hidden_states = latents.clone()
        hidden_states[:, :, :1] = self.image_latents
        return {"hidden_states": hidden_states}

    def timestep(self, span, timestep):
        if span.end <= 1:
            return torch.zeros_like(timestep)
        if span.start != 0:
            return timestep
        frame_timesteps = timestep[:, None].repeat(1, span.num_frames)
        frame_timesteps[:, 0] = 0.0
        return frame_timesteps

    def after_step(self, span, latents):
        if span.start != 0:
            return latents
        latents[:, :, :1] = self.image_latents
        return latents


class GivenFramesConditioner(Conditioner):
    """Given frames (T2V students: an image or a clip to extend): the chunks they cover entirely are not denoised;
    they are written into the cache clean, at timestep 0, and yielded as they are.

    Args:
        latents: ``(B, C, F_given, h, w)`` normalized latents of the given frames, starting at latent frame 0.
    """

    def __init__(self, latents: torch.Tensor) -> None:
        self.latents = latents

    def given_latents(self, span):
        if span.end > self.latents.shape[2]:
            return None
        return self.latents[:, :, span.start : span.end]

    def model_inputs(self, span, latents, *, cache_tag, store_kv, step):
        given = self.given_latents(span)
        return {} if given is None else {"hidden_states": given}

    def timestep(self, span, timestep):
        return timestep if self.given_latents(span) is None else torch.zeros_like(timestep)


class VACEConditioner(Conditioner):
    """VACE control: each forward of ``[s, e)`` gets the control latents ``[:, :, s:e]``, the per-layer scale and,
    when enabled, the lossy hint cache (told the denoising step).

    Args:
        control: ``(B, 96, F, h, w)`` control latents (reference frames first) in the transformer's dtype.
        scale: ``conditioning_scale`` (a float or one value per VACE layer).
        hint_cache: a ``VACEHintCache`` or ``None``.
        encode: ``encode(num_latent_frames)`` builds the control of a longer video (the control video padded with
            black frames under a white mask: nothing to keep), used by [`extend`].
    """

    def __init__(
        self,
        control: torch.Tensor,
        scale: float | Sequence[float] | torch.Tensor,
        hint_cache: Any = None,
        encode: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.control = control
        self.scale = scale
        self.hint_cache = hint_cache
        self._encode = encode

    def model_inputs(self, span, latents, *, cache_tag, store_kv, step):
        if self.hint_cache is not None:
            self.hint_cache.set_step(step)
        return {
            "control_hidden_states": self.control[:, :, span.start : span.end],
            "control_hidden_states_scale": self.scale,
            "vace_hint_cache": self.hint_cache,
        }

    def extend(self, num_latent_frames: int) -> None:
        if num_latent_frames <= self.control.shape[2]:
            return
        if self._encode is None:
            raise ValueError(f"This VACE control covers {self.control.shape[2]} latent frames and cannot grow.")
        control = self._encode(num_latent_frames)
        self.control = torch.cat([self.control, control[:, :, self.control.shape[2] :]], dim=2)
