"""Causal Wan pipelines and the chunk rollout they share."""

from .pipeline_wan_causal import (
    WanCausalPipeline,
    causal_scheduler_from_config,
    causal_transformer_from_wan,
    wan_transformer_from_causal,
)
from .pipeline_wan_i2v_causal import I2V_LAYOUTS, WanCausalImageToVideoPipeline, detect_i2v_layout
from .pipeline_wan_vace_causal import WanCausalVACEPipeline, causal_transformer_from_wan_vace
from .rollout import CausalRolloutMixin, ChunkOutput, RolloutRun

__all__ = [
    "CausalRolloutMixin",
    "ChunkOutput",
    "I2V_LAYOUTS",
    "RolloutRun",
    "WanCausalImageToVideoPipeline",
    "WanCausalPipeline",
    "WanCausalVACEPipeline",
    "causal_scheduler_from_config",
    "causal_transformer_from_wan",
    "causal_transformer_from_wan_vace",
    "detect_i2v_layout",
    "wan_transformer_from_causal",
]
