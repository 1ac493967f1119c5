"""Causal Wan models (subclasses of diffusers' Wan transformers; no new parameters) and the tiny streaming
autoencoder (TAEHV family)."""

from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (saved pipelines resolve classes through it)

from .autoencoder_tiny_wan import AutoencoderTinyWan, TinyWanStreamState
from .blocks import WanCausalTransformerBlock, WanCausalVACETransformerBlock, causal_block_forward
from .transformer_wan_causal import WanCausalTransformer3DModel
from .transformer_wan_vace_causal import VACEHintCache, WanCausalVACETransformer3DModel

__all__ = [
    "AutoencoderTinyWan",
    "TinyWanStreamState",
    "VACEHintCache",
    "WanCausalTransformer3DModel",
    "WanCausalTransformerBlock",
    "WanCausalVACETransformer3DModel",
    "WanCausalVACETransformerBlock",
    "causal_block_forward",
]
