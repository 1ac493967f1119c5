"""Causal Wan transformer blocks: per-frame AdaLN modulation, and the block's view of the forward for its processors.

A block's forward is tensor code only (the model decides the per-call state beforehand), so
``transformer.compile_repeated_blocks(fullgraph=True)`` compiles it in both the read and the store path.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformerBlock

from ..context import CausalBlockView


def _modulation(block: WanTransformerBlock | WanVACETransformerBlock, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(shift, scale, gate, c_shift, c_scale, c_gate)``, ``(B, F, 1, D)`` each, from the ``(B, F, 6, D)``
    per-frame timestep projection ``temb``."""
    return (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)


def _self_attention_input(
    block: WanTransformerBlock | WanVACETransformerBlock,
    hidden_states: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """``(B, F*S, D)``: ``norm1`` of the tokens modulated per frame, the input of the self-attention."""
    norm_hidden_states = block.norm1(hidden_states.float()).unflatten(1, (shift.shape[1], -1)) * (1 + scale) + shift
    return norm_hidden_states.flatten(1, 2).type_as(hidden_states)


def causal_block_forward(
    block: WanTransformerBlock | WanVACETransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    causal_context: CausalBlockView,
) -> torch.Tensor:
    """The Wan block body with one modulation per latent frame (the math of diffusers' block, per frame).

    Args:
        hidden_states: ``(B, F*S, D)`` tokens of this call, frame-major.
        encoder_hidden_states: ``(B, L_ctx, D)`` embedded ``[image | text]`` context.
        temb: ``(B, F, 6, D)`` per-frame timestep projection.
        rotary_emb: ``(1, F*S, 1, head_dim/2, 2)`` rotations of this call's tokens (see ``apply_rotary_emb``).
        causal_context: the block's :class:`CausalBlockView` of this forward, handed to both attention processors
            (each resolves its engine and reads what the model prepared for it).

    Returns:
        ``(B, F*S, D)``.
    """
    num_frames = temb.shape[1]

    def per_frame(x: torch.Tensor) -> torch.Tensor:  # (B, F*S, D) -> (B, F, S, D)
        return x.unflatten(1, (num_frames, -1))

    shift, scale, gate, c_shift, c_scale, c_gate = _modulation(block, temb)

    # 1. Self-attention
    norm_hidden_states = _self_attention_input(block, hidden_states, shift, scale)
    attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb, causal_context=causal_context)
    hidden_states = (per_frame(hidden_states.float()) + per_frame(attn_output) * gate).flatten(1, 2)
    hidden_states = hidden_states.type_as(attn_output)

    # 2. Cross-attention
    norm_hidden_states = block.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None, causal_context=causal_context)
    hidden_states = hidden_states + attn_output

    # 3. Feed-forward
    norm_hidden_states = per_frame(block.norm3(hidden_states.float())) * (1 + c_scale) + c_shift
    ff_output = block.ffn(norm_hidden_states.flatten(1, 2).type_as(hidden_states))
    hidden_states = (per_frame(hidden_states.float()) + per_frame(ff_output.float()) * c_gate).flatten(1, 2)
    return hidden_states.type_as(ff_output)


def is_compiled_block(block: torch.nn.Module) -> bool:
    """Whether calling ``block`` runs compiled code: ``block.compile()`` (what ``compile_repeated_blocks`` calls) or
    ``torch.compile(block)`` in its place."""
    return getattr(block, "_compiled_call_impl", None) is not None or isinstance(
        block, torch._dynamo.eval_frame.OptimizedModule
    )


def causal_block_store_only(
    block: WanTransformerBlock | WanVACETransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    causal_context: CausalBlockView,
) -> None:
    """What the last block of a store-only forward leaves in the caches, and nothing else: its self-attention K/V
    (from the same modulated input as :func:`causal_block_forward`) and the cross K/V it fills. The attention
    outputs, the feed-forward and the block's output are not computed (nothing reads them)."""
    shift, scale = _modulation(block, temb)[:2]
    norm_hidden_states = _self_attention_input(block, hidden_states, shift, scale)
    block.attn1.processor.store_only(block.attn1, norm_hidden_states, rotary_emb, causal_context=causal_context)
    block.attn2.processor.store_only(block.attn2, encoder_hidden_states, causal_context=causal_context)


class WanCausalTransformerBlock(WanTransformerBlock):
    """A ``WanTransformerBlock`` (same parameters) whose forward modulates per frame and passes the causal context."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: torch.Tensor,
        causal_context: CausalBlockView,
    ) -> torch.Tensor:
        return causal_block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, causal_context)


class WanCausalVACETransformerBlock(WanVACETransformerBlock):
    """A ``WanVACETransformerBlock`` (same parameters) running the causal Wan block body on the control stream."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        control_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: torch.Tensor,
        causal_context: CausalBlockView,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One VACE layer: ``control = proj_in(control) + hidden_states`` (first layer only), then the block body.

        Args:
            hidden_states: ``(B, F*S, D)`` patch-embedded main tokens (read by the first layer only).
            encoder_hidden_states: ``(B, L_ctx, D)`` embedded context.
            control_hidden_states: ``(B, F*S, D)`` control stream.
            temb: ``(B, F, 6, D)`` per-frame timestep projection.
            rotary_emb: ``(1, F*S, 1, head_dim/2, 2)`` rotations (see ``apply_rotary_emb``).
            causal_context: the block's :class:`CausalBlockView`.

        Returns:
            ``(hint, control)``: ``proj_out(control)`` and the control stream for the next layer, both ``(B, F*S, D)``.
        """
        if self.proj_in is not None:
            control_hidden_states = self.proj_in(control_hidden_states) + hidden_states
        control_hidden_states = causal_block_forward(
            self, control_hidden_states, encoder_hidden_states, temb, rotary_emb, causal_context
        )
        return self.proj_out(control_hidden_states), control_hidden_states
