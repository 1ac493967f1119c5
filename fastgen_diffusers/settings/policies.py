"""The KV-cache policies' settings: a registry, one class per policy.

Each policy class owns its name (the ``kv_cache_policy`` value), its own options (dataclass fields), its one
:meth:`~PolicySettings.check` of the whole call's settings, what it needs of the engines and of the pipeline, and
the words a model card says about it. A new policy is a new class decorated with :func:`register_policy`; nothing else
in the package compares a policy name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .base import ArgumentTypeError, SettingsValue, setting
from .cache import DEFAULT_SINK_DECAY

POLICIES: dict[str, type[PolicySettings]] = {}


def register_policy(cls: type[PolicySettings]) -> type[PolicySettings]:
    """Class decorator: make ``cls`` the policy named ``cls.name`` (``kv_cache_policy=cls.name``)."""
    if cls.name in POLICIES:
        raise ValueError(f"A KV-cache policy named {cls.name!r} is registered already: {POLICIES[cls.name].__name__}.")
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    """The accepted ``kv_cache_policy`` values (besides ``None``)."""
    return tuple(POLICIES)


def option_owner(option: str) -> type[PolicySettings] | None:
    """The policy class that owns the option ``option``, if any."""
    for cls in POLICIES.values():
        if option in cls.field_names():
            return cls
    return None


def policy_options() -> tuple[str, ...]:
    """Every policy's option names."""
    return tuple(name for cls in POLICIES.values() for name in cls.field_names())


@dataclass(frozen=True)
class PolicySettings(SettingsValue):
    """Base of the policies' settings (see the module docstring)."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    # Whether a pipeline that conditions its chunks by frame (image, control video) can run it.
    serves_conditioned_chunks: ClassVar[bool] = True
    # Whether it needs the pipeline's default chunk-by-chunk policy underneath (rolling replaces it outright).
    needs_sequential_default: ClassVar[bool] = False
    # The positions mode the engines must have (``None``: the call's own).
    engine_rope_positions: ClassVar[str | None] = None
    # Whether it keeps RoPE positions below a few chunks (a video may then outgrow the RoPE table).
    bounds_positions: ClassVar[bool] = False
    # Whether each chunk stays in the cache as its cache pass wrote it, so that a prompt switch can edit those entries
    # (a KV flush, a scene cut); a policy that rebuilds or rolls the cache cannot serve such an edit.
    keeps_written_chunks: ClassVar[bool] = True

    def check(self, values: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` for call settings this policy cannot serve (the policy's one combination check).

        ``values``: the call's flat settings, merged with the stored ones (``RolloutSettings.flat_values``), checked
        before the other values are built so that a message names the policy."""

    @classmethod
    def runs_on(cls, conditions_chunks: bool, sequential_default: bool = True) -> bool:
        """Whether a pipeline can run this policy: one that conditions its chunks by frame (``conditions_chunks``: an
        image, a clip, a control video) only a policy that reads that conditioning ([`serves_conditioned_chunks`]);
        one whose default rollout is not chunk by chunk (``sequential_default=False``: video-to-video) only a policy
        that does not replace that loop ([`needs_sequential_default`])."""
        if conditions_chunks and not cls.serves_conditioned_chunks:
            return False
        return sequential_default or not cls.needs_sequential_default

    @classmethod
    def check_runs_on(cls, pipeline: str, conditions_chunks: bool, sequential_default: bool = True) -> None:
        """Raise ``ValueError`` unless the pipeline named ``pipeline`` can run this policy ([`runs_on`]); the message
        names the policies it runs."""
        if cls.runs_on(conditions_chunks, sequential_default):
            return
        if conditions_chunks and not cls.serves_conditioned_chunks:
            reason = (
                "it conditions its chunks by frame (an image, a clip, a control video), which the policy cannot read"
            )
        else:
            reason = "the policy replaces the chunk-by-chunk rollout, which that pipeline does not run"
        accepted = (
            None,
            *(name for name, other in POLICIES.items() if other.runs_on(conditions_chunks, sequential_default)),
        )
        raise ValueError(
            f"`kv_cache_policy={cls.name!r}` cannot run on {pipeline}: {reason}. Accepted here: {accepted}."
        )

    def check_chunks(self, chunk_bounds: Sequence[tuple[int, int]], steps: int, rope_table: int | None = None) -> None:
        """Raise ``ValueError`` for a rollout of the chunks ``chunk_bounds`` (``[start, end)`` latent frames) sampled
        with ``steps`` denoising steps per chunk that this policy cannot serve (``rope_table``: the transformer's RoPE
        table, ``None`` when unknown). Checked before any work, once the chunks are known."""

    def cache_frames(self, max_chunk_frames: int) -> int | None:
        """The latent frames the cache must hold at most (``None``: the whole rollout)."""
        return None

    def held_frames(self, latent_frames: int, chunk_size: int, attention_window: int | None) -> int:
        """Latent frames the engines allocate per tag for a rollout of ``latent_frames`` (what they hold once full):
        the video or its window."""
        return latent_frames if attention_window is None else min(latent_frames, attention_window)

    def forward_frames(self, chunk_size: int, num_inference_steps: int, attention_window: int | None) -> int:
        """Latent frames one forward carries (its activations): a chunk."""
        return chunk_size

    def card_words(self, values: Mapping[str, Any]) -> str:
        """One sentence (model card) on how ``values`` (flat settings, as :meth:`check` takes them) sample under this
        policy, beyond the step schedule."""
        return self.title + "."

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@register_policy
@dataclass(frozen=True)
class SequentialSettings(PolicySettings):
    """Each chunk is denoised, then written into the cache (Self-Forcing's rollout)."""

    name: ClassVar[str] = "sequential"
    title: ClassVar[str] = "chunk by chunk, each finished chunk written into the KV cache"

    def card_words(self, values: Mapping[str, Any]) -> str:
        window = values.get("attention_window")
        if window is None:
            return "chunk by chunk, every finished chunk cached (the cache grows with the video)."
        sink = values.get("sink_frames") or 0
        text = f"chunk by chunk under a sliding window of {window} latent frames, the first {sink} kept as a sink"
        if values.get("rope_positions") == "window":
            text += "; cached keys are positioned by their slot in the window (no 1024-frame RoPE limit)"
        if values.get("sink_update") == "ema":
            decay = values.get("sink_decay") or DEFAULT_SINK_DECAY
            text += f", and frames leaving the window are averaged into the sink (decay {decay:.10g})"
        return text + "."


@register_policy
@dataclass(frozen=True)
class RecomputeSettings(PolicySettings):
    """Krea Realtime: before each chunk after the first the cache is cleared and rebuilt by one cache pass over
    ``context_frames`` clean frames (an anchor plus the last ``context_frames - 1``), at RoPE positions from 0."""

    name: ClassVar[str] = "recompute"
    title: ClassVar[str] = "Krea's recompute: the KV cache rebuilt from a few clean context frames before each chunk"
    serves_conditioned_chunks: ClassVar[bool] = False
    bounds_positions: ClassVar[bool] = True
    keeps_written_chunks: ClassVar[bool] = False

    context_frames: int | None = setting(
        None, "Latent frames of the recompute context (>= 1; Krea's kv_cache_num_frames, 3)."
    )
    keep_first_frame: bool | None = setting(
        None, "Keep the video's first latent frame as the context's anchor for ever (else Krea's re-encoded anchor)."
    )

    def __post_init__(self) -> None:
        frames = self.context_frames
        if frames is None or isinstance(frames, bool) or not isinstance(frames, int):
            raise ValueError(f"`context_frames` must be a positive integer under recompute, got {frames!r}.")
        if frames < 1:
            raise ValueError(f"`context_frames` must be >= 1, got {frames}.")
        if self.keep_first_frame is not None and not isinstance(self.keep_first_frame, bool):
            raise ValueError(f"`keep_first_frame` must be True or False, got {self.keep_first_frame!r}.")

    def check(self, values: Mapping[str, Any]) -> None:
        if values.get("attention_window") is not None or values.get("sink_frames"):
            raise ValueError(
                "`kv_cache_policy='recompute'` bounds the cache itself: it cannot be combined with `attention_window` "
                "/ `sink_frames`."
            )
        positions, update = values.get("rope_positions"), values.get("sink_update")
        if positions not in (None, "absolute") or update not in (None, "fixed"):
            raise ValueError(
                "`kv_cache_policy='recompute'` rebuilds the cache at RoPE positions from 0 before every chunk "
                "(positions stay below context + chunk) and keeps no sink: `rope_positions` must be 'absolute' and "
                f"`sink_update` 'fixed', got {positions or 'absolute'!r} / {update or 'fixed'!r}."
            )
        if values.get("recache"):
            raise ValueError(
                "`recache=True` has nothing to do under `kv_cache_policy='recompute'`: the cache is rebuilt under the "
                "current prompt before every chunk. Accepted: recache=False."
            )

    def cache_frames(self, max_chunk_frames: int) -> int | None:
        return self.context_frames + max_chunk_frames

    def held_frames(self, latent_frames: int, chunk_size: int, attention_window: int | None) -> int:
        return self.context_frames + chunk_size

    def forward_frames(self, chunk_size: int, num_inference_steps: int, attention_window: int | None) -> int:
        return max(chunk_size, self.context_frames)  # the context's cache pass

    def card_words(self, values: Mapping[str, Any]) -> str:
        text = (
            f"KV recompute (Krea): before each chunk the cache is rebuilt over {self.context_frames} clean context "
            "frames, so memory stays flat"
        )
        bias = values.get("kv_cache_attention_bias")
        if bias is not None and bias != 1:
            text += f", and cached frames other than the first get attention weight {float(bias):.10g}"
        return text + "."


@register_policy
@dataclass(frozen=True)
class RollingSettings(PolicySettings):
    """Rolling Forcing: one forward denoises a window of as many chunks as steps at staggered noise levels; the first
    chunk is the anchor; each forward attends to at most ``attention_window`` latent frames (21)."""

    name: ClassVar[str] = "rolling"
    title: ClassVar[str] = "Rolling Forcing's rolling window of chunks at staggered noise levels"
    serves_conditioned_chunks: ClassVar[bool] = False
    needs_sequential_default: ClassVar[bool] = True
    keeps_written_chunks: ClassVar[bool] = False
    engine_rope_positions: ClassVar[str | None] = "anchor"
    ATTENTION_FRAMES: ClassVar[int] = 21  # Rolling Forcing's `max_attention_size`

    def check(self, values: Mapping[str, Any]) -> None:
        name = f"`kv_cache_policy={self.name!r}`"
        if values.get("keep_cache") or values.get("recache"):
            raise ValueError(
                f"{name} finishes every chunk inside its last window and cannot be continued: it does not support "
                "`keep_cache` or `recache`."
            )
        if values.get("switch_frames"):
            raise ValueError(
                f"{name} denoises several chunks in one forward: a prompt schedule (a dict `prompt`) needs "
                "`kv_cache_policy='sequential'`."
            )
        if values.get("sink_frames"):
            raise ValueError(f"{name} keeps its first chunk as the sink (the anchor): pass no `sink_frames`.")
        positions, update = values.get("rope_positions"), values.get("sink_update")
        if positions not in (None, "absolute", self.engine_rope_positions) or update not in (None, "fixed"):
            raise ValueError(
                f"{name} positions its keys itself (absolute, the anchor rotated before the oldest frame attended: "
                f"rope_positions={self.engine_rope_positions!r}) and keeps a fixed anchor: pass no other "
                f"`rope_positions` / `sink_update`, got {positions or 'absolute'!r} / {update or 'fixed'!r}."
            )
        if values.get("context_noise"):
            raise ValueError(
                f"{name} commits each chunk clean at timestep 0 (Rolling Forcing's context_noise 0): `context_noise` "
                f"must be 0, got {values.get('context_noise')}."
            )
        if values.get("first_chunk_timesteps") is not None:
            raise ValueError(f"{name} runs every chunk on one schedule: `first_chunk_timesteps` is not supported.")

    def check_chunks(self, chunk_bounds: Sequence[tuple[int, int]], steps: int, rope_table: int | None = None) -> None:
        name = f"`kv_cache_policy={self.name!r}`"
        bounds = list(chunk_bounds)
        if len(bounds) < steps:
            raise ValueError(
                f"{name} needs at least as many chunks as denoising steps: {steps} steps, {len(bounds)} chunks of "
                f"latent frames {bounds}. Ask for more `num_frames` or fewer steps."
            )
        if rope_table is not None and bounds and bounds[-1][1] > rope_table:
            raise ValueError(
                f"{name} keeps absolute RoPE positions (only the anchor moves), so it serves at most {rope_table} "
                f"latent frames (`rope_max_seq_len`), got {bounds[-1][1]}; RoPE re-basing does not apply to its keys, "
                "which are stored before RoPE. Ask for fewer `num_frames`."
            )

    def card_words(self, values: Mapping[str, Any]) -> str:
        frames = self.attention_frames(values.get("attention_window"))
        return (
            f"a rolling window (Rolling Forcing): each forward denoises up to {len(values.get('timesteps') or ())} "
            f"chunks at staggered noise levels, attending to at most {frames} latent frames with the first chunk as "
            "anchor."
        )

    def held_frames(self, latent_frames: int, chunk_size: int, attention_window: int | None) -> int:
        return min(latent_frames, self.attention_frames(attention_window) + chunk_size)  # the anchor and the window

    def forward_frames(self, chunk_size: int, num_inference_steps: int, attention_window: int | None) -> int:
        return min(num_inference_steps * chunk_size, self.attention_frames(attention_window))  # one chunk per step

    def attention_frames(self, attention_window: int | None) -> int:
        """The frames one forward attends to: the call's ``attention_window``, else Rolling Forcing's 21."""
        return self.ATTENTION_FRAMES if attention_window is None else attention_window


def policy_settings(kv_cache_policy: Any = None, **options: Any) -> PolicySettings:
    """The policy named ``kv_cache_policy`` (``None``: sequential) with its ``options``. ``ValueError`` for an unknown
    name, or an option set (not ``None`` or ``False``) that belongs to another policy."""
    if kv_cache_policy is not None and (not isinstance(kv_cache_policy, str) or kv_cache_policy not in POLICIES):
        raise ValueError(f"`kv_cache_policy` must be one of {policy_names()} or None, got {kv_cache_policy!r}.")
    cls = POLICIES[kv_cache_policy or SequentialSettings.name]
    own = set(cls.field_names())
    for option, value in options.items():
        owner = option_owner(option)
        if owner is None:
            raise ArgumentTypeError(f"No KV-cache policy takes `{option}`; accepted options: {policy_options()}.")
        if option not in own and value is not None and value is not False:
            shown = f"`{option}={value!r}`" if isinstance(value, bool) else f"`{option}`"
            raise ValueError(f"{shown} needs `kv_cache_policy={owner.name!r}`.")
    return cls(**{name: value for name, value in options.items() if name in own})


def policy_from_dict(data: Mapping[str, Any]) -> PolicySettings:
    """The policy that ``policy.to_dict()`` (or [`PolicySettings.values`] with its ``"name"``) wrote."""
    data = dict(data)
    data.pop("version", None)
    return policy_settings(data.pop("name", None), **data)
