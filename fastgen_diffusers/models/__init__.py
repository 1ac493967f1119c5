"""Causal Wan models (subclasses of diffusers' Wan transformers; no new parameters)."""

from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (saved pipelines resolve classes through it)

from .blocks import WanCausalTransformerBlock, causal_block_forward
from .transformer_wan_causal import WanCausalTransformer3DModel

__all__ = ["WanCausalTransformer3DModel", "WanCausalTransformerBlock", "causal_block_forward"]
