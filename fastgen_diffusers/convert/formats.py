"""The table of checkpoint formats: one row per released student (name, title, project, sampling defaults, detector).

A new student is a new :class:`StudentFormat` row in :data:`STUDENT_FORMATS`: its container kinds, its sampling
settings (read from the project's own inference config) and a detector that recognises its released files. Nothing
else in the converter branches on a format name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..settings import CONFIG_KEYS, RolloutSettings

__all__ = [
    "DEFAULT_SAMPLING",
    "FORMATS",
    "STUDENT_FORMATS",
    "CheckpointFacts",
    "StudentSettings",
    "StudentFormat",
    "get_format",
    "warp_timesteps",
]


@dataclass(frozen=True)
class StudentSettings:
    """How a few-step causal student samples; written into the converted pipeline so ``pipe(prompt)`` uses it.

    The sampling and cache values are the pipelines' own settings
    (:class:`~fastgen_diffusers.settings.RolloutSettings`, :meth:`rollout_settings`): every rule a call of the
    converted model would apply is checked on construction, with the same message, so a setting the model would
    refuse cannot be stored; the chunk size is checked against the window and the EMA eviction rule for rollouts of
    any length.

    Args:
        timesteps: Model-scale denoising timesteps of every chunk, in ``[0, 1000]``, descending, without the final 0
            (Self-Forcing's warped ``denoising_step_list``, FastGen's ``t_list * 1000``).
        shift: Flow-matching shift of the scheduler (already folded into ``timesteps``).
        context_noise: Model-scale timestep of the pass that stores a finished chunk in the KV cache (0: clean).
        chunk_size: Latent frames per causal chunk (``num_frame_per_block``).
        independent_first_frame: Whether the first latent frame is a chunk of its own.
        first_chunk_timesteps: Timesteps of the first chunk when they differ from ``timesteps`` (Causal Forcing++
            1/2-step models denoise the first chunk with 4 steps: ``denoising_step_list_first_chunk``).
        attention_window: Sliding attention window in latent frames, the sink included (``local_attn_size``).
        sink_frames: First latent frames kept inside the window (``sink_size``).
        kv_cache_policy: A registered KV-cache policy (``"sequential"``, ``"recompute"``, ``"rolling"``).
        context_frames: Latent frames the recompute policy re-encodes (Krea's ``kv_cache_num_frames``).
        kv_cache_attention_bias: Attention weight on cached frames, as a factor (Krea: 0.3); 1.0 is no bias.
        rope_positions: Temporal RoPE positions of the cached keys: ``"absolute"`` or ``"window"``.
        sink_update: ``"fixed"`` or ``"ema"`` (Reward Forcing: frames leaving the window are averaged into the sink).
        sink_decay: The EMA's decay (Reward Forcing's ``compression_alpha``, 0.999); only with ``sink_update="ema"``.
        keep_first_frame: Keep the video's first latent frame as the recompute anchor for ever (Krea's
            ``keep_first_frame``); only with ``kv_cache_policy="recompute"``.
    """

    timesteps: tuple[float, ...]
    shift: float
    context_noise: float = 0.0
    chunk_size: int = 3
    independent_first_frame: bool = False
    first_chunk_timesteps: tuple[float, ...] | None = None
    attention_window: int | None = None
    sink_frames: int = 0
    kv_cache_policy: str = "sequential"
    context_frames: int | None = None
    kv_cache_attention_bias: float = 1.0
    # window-relative RoPE and EMA sink (Reward Forcing)
    rope_positions: str = "absolute"
    sink_update: str = "fixed"
    sink_decay: float | None = None
    keep_first_frame: bool | None = None

    def __post_init__(self):
        if self.timesteps is None:
            raise ValueError("`timesteps` must be a list of model-scale timesteps, got None.")
        shift = self.shift
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
            raise ValueError(f"`shift` must be a positive number, got {self.shift}.")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"`chunk_size` must be a positive number of latent frames, got {self.chunk_size}.")
        if not isinstance(self.independent_first_frame, bool):
            raise ValueError(f"`independent_first_frame` must be True or False, got {self.independent_first_frame!r}.")
        settings = self.rollout_settings()  # every rule of the pipelines' settings, checked once there
        object.__setattr__(self, "timesteps", settings.sampling.timesteps)
        object.__setattr__(self, "first_chunk_timesteps", settings.sampling.first_chunk_timesteps)
        settings.cache.check_chunk_size(self.chunk_size, self.independent_first_frame)

    def rollout_settings(self) -> RolloutSettings:
        """The pipelines' settings values of this student (what the converted pipeline config stores)."""
        return RolloutSettings.from_arguments(
            {name: getattr(self, name) for name in CONFIG_KEYS if hasattr(self, name)}
        )

    @property
    def num_inference_steps(self) -> int:
        """Denoising steps per chunk (after the first chunk when ``first_chunk_timesteps`` is set)."""
        return len(self.timesteps)

    def replace(self, **overrides: Any) -> StudentSettings:
        """A copy with the given fields replaced; ``None`` values keep the stored one."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({key: value for key, value in overrides.items() if value is not None})
        return StudentSettings(**values)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values (tuples as lists): the model settings (chunking, shift) and the pipeline config
        (:meth:`RolloutSettings.to_config`), in field order."""
        config = self.rollout_settings().to_config()
        values = {f.name: config.get(f.name, getattr(self, f.name)) for f in fields(self)}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


def warp_timesteps(indices: Sequence[float], shift: float) -> tuple[float, ...]:
    """Self-Forcing's ``warp_denoising_step``: map ``denoising_step_list`` indices to shifted model timesteps.

    ``t = 1000 * shift * s / (1 + (shift - 1) * s)`` with ``s = index / 1000``; ``[1000, 750, 500, 250]`` with shift 5
    gives ``[1000, 937.5, 833.33, 625]``.
    """
    warped = []
    for index in indices:
        sigma = float(index) / 1000.0
        warped.append(1000.0 * shift * sigma / (1.0 + (shift - 1.0) * sigma))
    return tuple(warped)


@dataclass(frozen=True)
class CheckpointFacts:
    """What a detector may look at: the file's path, its container kind and its (unwrapped) key layout.

    Attributes:
        path: The checkpoint path as given (lower-cased), or ``""`` when unknown.
        container: ``"generator"`` (``{"generator", "generator_ema"}``), ``"state_dict"`` (``{"state_dict": ...}``),
            ``"model"`` (``{"model": sd}``), ``"fastgen"`` (``{"model": {"net", "ema"}}``) or ``"flat"``.
        layout: ``"original"`` or ``"diffusers"`` key names.
        fsdp_wrapped: Whether any key carries a training-wrapper segment (``_fsdp_wrapped_module.``, ...).
        model_prefix: Whether original keys carry the ``model.`` prefix.
        num_layers: Number of transformer blocks.
        dim: Hidden width.
        safetensors: Whether the file is a safetensors file.
    """

    path: str = ""
    container: str = "flat"
    layout: str = "original"
    fsdp_wrapped: bool = False
    model_prefix: bool = True
    num_layers: int = 0
    dim: int = 0
    safetensors: bool = False

    def name_has(self, *parts: str) -> bool:
        return any(part in self.path for part in parts)


Detector = Callable[[CheckpointFacts], "str | None"]


@dataclass(frozen=True)
class StudentFormat:
    """One row of the format table.

    Attributes:
        name: The ``--format`` value.
        title: Human name of the project or model.
        project: Source repository (``org/name``), shown in the model card.
        files: The released file names this row reads.
        containers: Container kinds (see :class:`CheckpointFacts`) the project saves; an explicit ``--format``
            refuses any other.
        sampling: The project's inference settings.
        detector: ``facts -> evidence`` (a short reason) when ``facts`` look like this project's release, else None.
        lora_alpha: LoRA alpha of the project's released adapter (None: alpha = rank).
        prefer_ema: Whether the project's loader takes the EMA copy by default (LongLive and StreamDiffusionV2 load
            ``generator``).
        license_note: What the model card says about the source license.
    """

    name: str
    title: str
    project: str
    files: tuple[str, ...]
    containers: tuple[str, ...]
    sampling: StudentSettings
    detector: Detector = field(default=lambda facts: None, repr=False, compare=False)
    lora_alpha: float | None = None
    prefer_ema: bool = True
    license_note: str = "Check the license of the source checkpoint and of the base model."


_SF_STEPS = warp_timesteps([1000, 750, 500, 250], 5.0)
_ORIGINAL_CONTAINERS = ("generator", "flat")


def _name(*parts: str) -> Detector:
    return lambda facts: f"file name matches {parts[0]!r}" if facts.name_has(*parts) else None


def _framewise(steps: str) -> Detector:
    def detect(facts: CheckpointFacts) -> str | None:
        if steps == "chunkwise":
            hit = facts.name_has("causal_forcing", "causal-forcing") and not facts.name_has("framewise")
        elif steps == "framewise":
            hit = facts.name_has("framewise/causal_forcing", "framewise\\causal_forcing")
        else:
            hit = facts.name_has(f"framewise-{steps}")
        if not hit:
            return None
        evidence = f"file name matches Causal Forcing's {steps} release"
        if steps == "chunkwise" and not facts.name_has("chunkwise"):
            evidence += (
                " (the frame-wise release, framewise/causal_forcing.pt, has the same file name: pass --format "
                "causal-forcing-framewise for it)"
            )
        return evidence

    return detect


def _krea(facts: CheckpointFacts) -> str | None:
    if facts.name_has("krea"):
        return "file name matches 'krea'"
    if facts.safetensors and facts.container == "flat" and facts.num_layers == 40 and facts.dim == 5120:
        return "a flat safetensors file with the Wan2.1-14B layout (40 blocks of width 5120)"
    return None


def _streamdiffusionv2(facts: CheckpointFacts) -> str | None:
    if facts.name_has("streamdiffusionv2", "streamv2v"):
        return "file name matches 'streamdiffusionv2'"
    if facts.container == "state_dict":
        return "weights under 'state_dict' (StreamDiffusionV2's container)"
    if facts.layout == "original" and not facts.model_prefix:
        return "original Wan keys without the 'model.' prefix (StreamDiffusionV2 saves them so)"
    return None


def _reward_forcing(facts: CheckpointFacts) -> str | None:
    if facts.name_has("rewardforcing", "reward_forcing", "reward-forcing"):
        return "file name matches 'rewardforcing'"
    return None


def _longlive_2(facts: CheckpointFacts) -> str | None:
    if facts.name_has("longlive2", "longlive-2", "longlive_2", "model_bf16"):
        return "file name matches LongLive 2.0's release"
    if facts.container == "model" and facts.dim == 3072:
        return "weights under 'model' with the Wan2.2-TI2V-5B width (3072)"
    return None


def _fastgen(facts: CheckpointFacts) -> str | None:
    return "weights under {'model': {'net', 'ema'}}" if facts.container == "fastgen" else None


# Order matters for --format auto: the first row whose detector answers wins; self-forcing is the fallback.
STUDENT_FORMATS: tuple[StudentFormat, ...] = (
    StudentFormat(
        "fastgen",
        "FastGen",
        "NVlabs/FastGen",
        ("{iteration:07d}.pth",),
        ("fastgen", "flat"),
        StudentSettings(timesteps=(999.0, 937.0, 833.0, 624.0), shift=5.0),
        _fastgen,
    ),
    StudentFormat(
        "krea",
        "Krea Realtime Video 14B",
        "krea-ai/realtime-video",
        ("krea-realtime-video-14b.safetensors",),
        ("flat",),
        # configs/self_forcing_server_14b.yaml: denoising_step_list [1000, 937, 833, 625] (no warp), 3-frame chunks,
        # KV recompute over kv_cache_num_frames=3; scope's port adds the 0.3 attention bias on cached frames.
        StudentSettings(
            timesteps=(1000.0, 937.0, 833.0, 625.0),
            shift=5.0,
            kv_cache_policy="recompute",
            context_frames=3,
            kv_cache_attention_bias=0.3,
        ),
        _krea,
        license_note="Krea Realtime Video is released under its own license (see the krea-ai/realtime-video "
        "repository); Wan2.1-T2V-14B is Apache-2.0.",
    ),
    StudentFormat(
        "streamdiffusionv2",
        "StreamDiffusionV2",
        "chenfengxu714/StreamDiffusionV2",
        ("model.pt",),
        ("generator", "state_dict", "flat"),
        # configs/wan_causal_dmd_v2v.yaml: [700, 500, 400, 200] unwarped, shift 8, one frame per block, 3 sink
        # frames; scope's port keeps a 6-frame ring cache.
        StudentSettings(
            timesteps=(700.0, 500.0, 400.0, 200.0), shift=8.0, chunk_size=1, attention_window=6, sink_frames=3
        ),
        _streamdiffusionv2,
        prefer_ema=False,
        license_note="StreamDiffusionV2 is Apache-2.0; check the base model's license.",
    ),
    StudentFormat(
        "reward-forcing",
        "Reward Forcing",
        "JaydenLyh/Reward-Forcing",
        ("rewardforcing.pt",),
        _ORIGINAL_CONTAINERS,
        # configs/reward_forcing.yaml: warped [1000, 750, 500, 250], local_attn_size 9, sink_size 3; its
        # CausalWanSelfAttention caches keys before RoPE, ropes them by slot in the window and averages evicted
        # frames into the sink (compression_alpha 0.999): tests/data/reward_forcing_tiny.
        StudentSettings(
            timesteps=_SF_STEPS,
            shift=5.0,
            attention_window=9,
            sink_frames=3,
            rope_positions="window",
            sink_update="ema",
            sink_decay=0.999,
        ),
        _reward_forcing,
    ),
    StudentFormat(
        "longlive-2",
        "LongLive 2.0",
        "NVlabs/LongLive",
        ("model_bf16.pt",),
        ("model", "generator"),
        # configs/inference.yaml (main): Wan2.2-TI2V-5B, sampling_steps 4 (sigmas 1, .75, .5, .25 shifted by 5 and
        # truncated: 1000, 937, 833, 625), 8-frame blocks, local_attn_size 32, sink_size 8; its multi-shot sinks and
        # NVFP4 files are not converted (packed NVFP4 weights are refused as non-float).
        StudentSettings(
            timesteps=(1000.0, 937.0, 833.0, 625.0), shift=5.0, chunk_size=8, attention_window=32, sink_frames=8
        ),
        _longlive_2,
        prefer_ema=False,
        license_note="LongLive is released under the NVIDIA license of the NVlabs/LongLive repository; check it "
        "and the Wan2.2-TI2V-5B license.",
    ),
    StudentFormat(
        "longlive",
        "LongLive",
        "NVlabs/LongLive",
        ("longlive_base.pt", "lora.pt"),
        ("generator", "model", "flat"),
        # configs/longlive_inference.yaml (v1.0): warped [1000, 750, 500, 250], local_attn_size 12, sink_size 3;
        # the LoRA adapter is rank 256, alpha 256.
        StudentSettings(timesteps=_SF_STEPS, shift=5.0, attention_window=12, sink_frames=3),
        _name("longlive", "memflow"),
        lora_alpha=256.0,
        prefer_ema=False,
        license_note="LongLive is released under the NVIDIA license of the NVlabs/LongLive repository; check it "
        "and the base model's license.",
    ),
    StudentFormat(
        "rolling-forcing",
        "Rolling Forcing",
        "TencentARC/RollingForcing",
        ("rolling_forcing_dmd.pt",),
        _ORIGINAL_CONTAINERS,
        # configs/rolling_forcing_dmd.yaml: warped [1000, 800, 600, 400, 200], 3-frame blocks;
        # inference_rolling_forcing denoises a rolling window of 5 blocks at staggered levels (21-frame attention,
        # the first block as anchor).
        StudentSettings(
            timesteps=warp_timesteps([1000, 800, 600, 400, 200], 5.0), shift=5.0, kv_cache_policy="rolling"
        ),
        _name("rolling_forcing", "rolling-forcing", "rollingforcing"),
    ),
    StudentFormat(
        "causal-forcing-1step",
        "Causal Forcing++ (frame-wise, 1 step)",
        "thu-ml/Causal-Forcing",
        ("causal-forcing++/framewise-1step.pt",),
        _ORIGINAL_CONTAINERS,
        # configs/causal_forcing_dmd_framewise_1step.yaml: [1000]; first chunk [1000, 750, 500, 250]; both warped.
        StudentSettings(
            timesteps=warp_timesteps([1000], 5.0), shift=5.0, chunk_size=1, first_chunk_timesteps=_SF_STEPS
        ),
        _framewise("1step"),
    ),
    StudentFormat(
        "causal-forcing-2step",
        "Causal Forcing++ (frame-wise, 2 steps)",
        "thu-ml/Causal-Forcing",
        ("causal-forcing++/framewise-2step.pt",),
        _ORIGINAL_CONTAINERS,
        StudentSettings(
            timesteps=warp_timesteps([1000, 500], 5.0), shift=5.0, chunk_size=1, first_chunk_timesteps=_SF_STEPS
        ),
        _framewise("2step"),
    ),
    StudentFormat(
        "causal-forcing-framewise",
        "Causal Forcing (frame-wise)",
        "thu-ml/Causal-Forcing",
        ("framewise/causal_forcing.pt",),
        _ORIGINAL_CONTAINERS,
        StudentSettings(timesteps=_SF_STEPS, shift=5.0, chunk_size=1),
        _framewise("framewise"),
    ),
    StudentFormat(
        "causal-forcing",
        "Causal Forcing (chunk-wise)",
        "thu-ml/Causal-Forcing",
        ("chunkwise/causal_forcing.pt",),
        _ORIGINAL_CONTAINERS,
        # configs/causal_forcing_dmd_chunkwise.yaml: warped [1000, 750, 500, 250], 3-frame blocks.
        StudentSettings(timesteps=_SF_STEPS, shift=5.0),
        _framewise("chunkwise"),
    ),
    StudentFormat(
        "causvid",
        "CausVid",
        "tianweiy/CausVid",
        ("model.pt",),
        _ORIGINAL_CONTAINERS,
        StudentSettings(timesteps=(1000.0, 757.0, 522.0), shift=8.0),
    ),
    StudentFormat(
        "self-forcing",
        "Self-Forcing",
        "guandeh17/Self-Forcing",
        ("self_forcing_dmd.pt",),
        _ORIGINAL_CONTAINERS,
        StudentSettings(timesteps=_SF_STEPS, shift=5.0),
        _name("self_forcing", "self-forcing"),
    ),
)

_BY_NAME: Mapping[str, StudentFormat] = {row.name: row for row in STUDENT_FORMATS}
FORMATS: tuple[str, ...] = ("auto", *sorted(_BY_NAME))
DEFAULT_SAMPLING: Mapping[str, StudentSettings] = {row.name: row.sampling for row in STUDENT_FORMATS}


def get_format(name: str) -> StudentFormat:
    """The row called ``name``; ``ValueError`` naming the accepted values otherwise."""
    if name not in _BY_NAME:
        raise ValueError(f"`format` must be one of {FORMATS}, got {name!r}.")
    return _BY_NAME[name]
