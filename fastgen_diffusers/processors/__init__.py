"""Causal attention processors for Wan (self, cross with optional I2V image tokens); VACE blocks reuse them."""

from .attention import (
    WanCausalAttnProcessor,
    WanCausalCrossAttnProcessor,
    apply_rotary_emb,
    masked_attention,
    rms_norm_fp32,
)

__all__ = [
    "WanCausalAttnProcessor",
    "WanCausalCrossAttnProcessor",
    "apply_rotary_emb",
    "masked_attention",
    "rms_norm_fp32",
]
