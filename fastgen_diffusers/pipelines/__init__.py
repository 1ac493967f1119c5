"""Causal Wan pipelines and the rollout they share (options, session, conditioners, policies)."""

from .pipeline_wan_causal import (
    WanCausalPipeline,
    causal_scheduler_from_config,
    causal_transformer_from_wan,
    wan_transformer_from_causal,
)
from .pipeline_wan_i2v_causal import I2V_LAYOUTS, WanCausalImageToVideoPipeline, detect_i2v_layout
from .pipeline_wan_v2v_causal import VideoToVideoOptions, WanCausalVideoToVideoPipeline
from .pipeline_wan_vace_causal import WanCausalVACEPipeline, causal_transformer_from_wan_vace
from .rollout.conditioning import (
    Conditioner,
    FirstFrameConditioner,
    GivenFramesConditioner,
    ImageConcatConditioner,
    VACEConditioner,
)
from .rollout.core import CausalRolloutMixin, RolloutRun
from .rollout.live import LiveRolloutMixin
from .rollout.options import ImageToVideoOptions, RolloutOptions, VACEOptions
from .rollout.policy import RolloutPolicy, SequentialPolicy
from .rollout.policy_recompute import RecomputePolicy
from .rollout.policy_rolling import RollingPolicy
from .rollout.policy_v2v import VideoChunkPlan, VideoToVideoPolicy
from .rollout.records import ChunkOutput, ChunkRecord
from .rollout.session import RolloutSession
from .rollout.sources import NoiseSource
from .rollout.strength import MotionAwareStrength, StrengthSchedule
from .rollout.video_latents import VideoToVideoSource
from .video_io.streaming_encode import StreamingWanEncoder
from .video_io.video_source import VideoChunker

__all__ = [
    "CausalRolloutMixin",
    "ChunkOutput",
    "ChunkRecord",
    "Conditioner",
    "FirstFrameConditioner",
    "GivenFramesConditioner",
    "I2V_LAYOUTS",
    "ImageConcatConditioner",
    "ImageToVideoOptions",
    "LiveRolloutMixin",
    "MotionAwareStrength",
    "NoiseSource",
    "RecomputePolicy",
    "RollingPolicy",
    "RolloutOptions",
    "RolloutPolicy",
    "RolloutRun",
    "RolloutSession",
    "SequentialPolicy",
    "StreamingWanEncoder",
    "StrengthSchedule",
    "VACEConditioner",
    "VACEOptions",
    "VideoChunkPlan",
    "VideoChunker",
    "VideoToVideoOptions",
    "VideoToVideoPolicy",
    "VideoToVideoSource",
    "WanCausalImageToVideoPipeline",
    "WanCausalPipeline",
    "WanCausalVACEPipeline",
    "WanCausalVideoToVideoPipeline",
    "causal_scheduler_from_config",
    "causal_transformer_from_wan",
    "causal_transformer_from_wan_vace",
    "detect_i2v_layout",
    "wan_transformer_from_causal",
]
