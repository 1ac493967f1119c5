"""Prompt schedules: ``prompt={0: "a cat", 48: "a dog"}`` (pixel frame -> prompt) switches the conditional prompt
at the first chunk that starts at or after each frame; the prompts are encoded before any chunk runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...settings import switch_chunks


def check_transition_embeds(
    prompt_transition_chunks: int, prompt_embeds: torch.Tensor, switches: Mapping[int, torch.Tensor]
) -> None:
    """``ValueError`` when a blended prompt switch (``prompt_transition_chunks > 1``) cannot be blended: every
    switch must have the frame-0 prompt's shape ``(B, L, text_dim)``."""
    if not prompt_transition_chunks or prompt_transition_chunks <= 1:
        return
    for embeds in switches.values():
        if embeds.shape != prompt_embeds.shape:
            raise ValueError(
                f"`prompt_transition_chunks={prompt_transition_chunks}` blends prompt embeddings, which needs every "
                f"switch to have the first prompt's shape {tuple(prompt_embeds.shape)}, got {tuple(embeds.shape)}: "
                "encode the prompts with the same `max_sequence_length`, or use prompt_transition_chunks=0."
            )


class PromptScheduleMixin:
    """Prompt encoding and prompt schedules of the causal pipelines (the host provides ``encode_prompt``,
    ``transformer`` and ``vae_scale_factor_temporal``)."""

    @staticmethod
    def split_prompt_schedule(prompt: Any, prompt_embeds: Any) -> tuple[Any, Any, dict[int, Any]]:
        """Split a prompt schedule into the prompt of frame 0 and the later switches.

        ``prompt`` (or ``prompt_embeds``) may be a dict ``{pixel_frame: prompt}`` whose keys include 0; anything else
        is returned as it is with no switches.

        Returns:
            ``(prompt, prompt_embeds, switches)``: the frame-0 entry in place of the dict and ``{frame: prompt or
            (B, L, text_dim) embeddings}`` for the frames after 0.
        """
        name, schedule = ("prompt", prompt) if isinstance(prompt, Mapping) else ("prompt_embeds", prompt_embeds)
        if not isinstance(schedule, Mapping):
            return prompt, prompt_embeds, {}
        frames = list(schedule)
        if any(isinstance(f, bool) or not isinstance(f, int) or f < 0 for f in frames) or 0 not in schedule:
            raise ValueError(
                f"A `{name}` schedule must map pixel frames (ints >= 0, 0 included) to prompts, e.g. "
                f"{{0: 'a cat', 48: 'a dog'}}; got the keys {frames}."
            )
        switches = {frame: schedule[frame] for frame in sorted(frames) if frame > 0}
        if name == "prompt":
            return schedule[0], prompt_embeds, switches
        return prompt, schedule[0], switches

    def encode_rollout_prompts(
        self,
        prompt: str | list[str] | None,
        negative_prompt: str | list[str] | None,
        prompt_embeds: torch.Tensor | None,
        negative_prompt_embeds: torch.Tensor | None,
        prompt_schedule: Mapping[int, Any],
        guidance_scale: float,
        max_sequence_length: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
        """Prompt and negative prompt embeddings ``(B, L, text_dim)`` in the transformer's dtype (the negative one only
        with CFG), and the embeddings of the prompt schedule's later switches ``{pixel_frame: (B, L, text_dim)}``."""
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=guidance_scale > 1.0,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        dtype = self.transformer.dtype
        prompt_embeds = prompt_embeds.to(device, dtype)
        if negative_prompt_embeds is not None:
            negative_prompt_embeds = negative_prompt_embeds.to(device, dtype)
        switches = self.encode_prompt_switches(prompt_schedule, prompt_embeds, max_sequence_length, device)
        return prompt_embeds, negative_prompt_embeds, switches

    def encode_prompt_switches(
        self,
        switches: Mapping[int, Any],
        prompt_embeds: torch.Tensor,
        max_sequence_length: int,
        device: torch.device,
    ) -> dict[int, torch.Tensor]:
        """Encode the prompts of ``switches`` (``{pixel_frame: prompt or embeddings}``) like the frame-0 prompt.

        Args:
            prompt_embeds: ``(B, L, text_dim)`` embeddings of the frame-0 prompt: every switch must match its batch
                and width.

        Returns:
            ``{pixel_frame: (B, L', text_dim)}`` in the transformer's dtype.
        """
        encoded = {}
        for frame, value in switches.items():
            if isinstance(value, torch.Tensor):
                embeds = value
            else:
                embeds = self.encode_prompt(
                    prompt=value,
                    do_classifier_free_guidance=False,
                    max_sequence_length=max_sequence_length,
                    device=device,
                )[0]
            if (
                embeds.ndim != 3
                or embeds.shape[0] != prompt_embeds.shape[0]
                or embeds.shape[2] != prompt_embeds.shape[2]
            ):
                raise ValueError(
                    f"The prompt at frame {frame} encodes to {tuple(embeds.shape)}, but the frame-0 prompt to "
                    f"{tuple(prompt_embeds.shape)}: a switch must keep the batch and the text width."
                )
            encoded[frame] = embeds.to(device, self.transformer.dtype)
        return encoded

    def prompt_switch_chunks(
        self, switches: Mapping[int, torch.Tensor], bounds: Sequence[tuple[int, int]]
    ) -> dict[int, torch.Tensor]:
        """Map ``{pixel_frame: embeddings}`` to ``{chunk_index: embeddings}``: a switch takes effect at the first
        chunk whose first pixel frame is at or after its frame (latent frame ``s >= 1`` starts at pixel ``4s - 3``)."""
        chunks = switch_chunks(switches, bounds, self.vae_scale_factor_temporal)
        return {chunks[frame]: embeds for frame, embeds in switches.items()}
