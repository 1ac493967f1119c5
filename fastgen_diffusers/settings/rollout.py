"""``RolloutSettings``: the settings of one call (sampling, cache, policy, prompt schedule), composed and checked as a
whole once; the flat keyword arguments of the pipelines, the pipeline config, the converter and the CLI all map onto
it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .base import SettingsValue, check_bool, setting
from .cache import DEFAULT_SINK_DECAY, CacheSettings, check_recache_keeps_sink, check_rope_table, merge_cache
from .policies import POLICIES, PolicySettings, SequentialSettings, option_owner, policy_from_dict, policy_settings
from .prompts import PromptSchedule
from .sampling import DEFAULT_STEPS, SamplingSettings, merge_schedule

# The pipeline config's stored settings (the pipelines' `__init__` arguments, written by the converter).
CONFIG_KEYS = (
    "timesteps",
    "context_noise",
    "first_chunk_timesteps",
    "attention_window",
    "sink_frames",
    "kv_cache_policy",
    "context_frames",
    "kv_cache_attention_bias",
    "rope_positions",
    "sink_update",
    "sink_decay",
    "keep_first_frame",
)
CALL_ONLY = ("keep_cache",)


def _part_names() -> dict[str, str]:
    names = {name: "sampling" for name in SamplingSettings.field_names() if name != "shift"}
    names.update({name: "cache" for name in CacheSettings.field_names()})
    names.update({name: "prompts" for name in PromptSchedule.field_names() if name != "switch_frames"})
    names["kv_cache_policy"] = "policy"
    names.update({name: "policy" for cls in POLICIES.values() for name in cls.field_names()})
    names.update(dict.fromkeys(CALL_ONLY, "rollout"))
    return names


def argument_names() -> tuple[str, ...]:
    """The flat keyword arguments that map onto settings (a new policy's options included)."""
    return tuple(_part_names())


@dataclass(frozen=True)
class RolloutSettings(SettingsValue):
    """Every setting of a call. Built from the pipelines' flat keyword arguments ([`from_arguments`]), from a
    pipeline config ([`from_config`]) or from JSON ([`from_dict`]); checked as a whole on construction.

    Args:
        sampling: the schedule, guidance and context noise.
        cache: the engines, window, key positions, sink rule, storage dtype and attention bias.
        policy: the KV-cache policy and its options (``None``: none named; chunk by chunk).
        prompts: the prompt switches, transitions and recache.
        keep_cache: keep the rollout to continue it.
    """

    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    policy: PolicySettings | None = None
    prompts: PromptSchedule = field(default_factory=PromptSchedule)
    keep_cache: bool = setting(False, "Keep the KV caches after the call to continue, redo or fork it.", stored=False)

    def __post_init__(self) -> None:
        for name, cls in (("sampling", SamplingSettings), ("cache", CacheSettings), ("prompts", PromptSchedule)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"`{name}` must be a {cls.__name__}, got {type(getattr(self, name)).__name__}.")
        if self.policy is not None and not isinstance(self.policy, PolicySettings):
            raise ValueError(f"`policy` must be a registered PolicySettings, got {type(self.policy).__name__}.")
        check_bool("keep_cache", self.keep_cache)
        self.active_policy.check(self.flat_values())
        check_recache_keeps_sink(self.cache.update, self.prompts.recache and self.prompts.switches)
        self.check_prompt_switches()

    def check_prompt_switches(self) -> None:
        """The rules that combine what a prompt switch does to the caches ([`PromptSchedule`]) with the cache
        settings and the policy, each stated here once:

        * a KV flush or a scene cut edits the entries of a cache that keeps every chunk as written: a policy that
          rebuilds or rolls the cache refuses them;
        * ``recache_sink="keep"`` keeps the sink of a sliding window: it needs ``attention_window`` and sink frames;
        * ``kv_flush`` keeps the sink and the last frames of a sliding window: it needs ``attention_window``, and a
          fixed sink (an EMA sink folds in the frames a flush drops);
        * ``rope_cut`` moves a chunk's frames at read time: it needs keys stored before RoPE and positioned within the
          window (``rope_positions="window"``).

        The rule that needs the chunks as well is [`check_chunks`]'s."""
        prompts, cache, policy = self.prompts, self.cache, self.active_policy
        edit = prompts.switch_edit
        if edit is not None and not policy.keeps_written_chunks:
            accepted = " or ".join(["None", *(repr(n) for n, c in POLICIES.items() if c.keeps_written_chunks)])
            raise ValueError(
                f"`{edit}` edits the cache of a chunk-by-chunk rollout at a prompt switch; "
                f"`kv_cache_policy={policy.name!r}` rebuilds or rolls it. Accepted: kv_cache_policy={accepted}."
            )
        if prompts.recache_sink == "keep" and not (cache.window.bounded and cache.sink):
            raise ValueError(
                "`recache_sink='keep'` keeps the sink's K/V at a recache of the frames the window holds: set "
                "`attention_window` and `sink_frames` > 0 (LongLive: 12 and 3), or use recache_sink='rerun'."
            )
        if prompts.kv_flush:
            if not cache.window.bounded:
                raise ValueError(
                    "`kv_flush=True` keeps the sink and the last frames of a sliding window: set `attention_window` "
                    "(Infinity-RoPE: 6, with sink_frames=1), or use kv_flush=False."
                )
            if cache.update == "ema":
                raise ValueError(
                    "`kv_flush=True` drops frames an EMA sink (`sink_update='ema'`) folds in: use sink_update='fixed' "
                    "(or kv_flush=False)."
                )
        if prompts.cut_frames and cache.positions != "window":
            raise ValueError(
                "`rope_cut` moves a chunk's frames to other temporal positions at read time, which needs keys stored "
                "before RoPE and positions within the window: use rope_positions='window' (got "
                f"{cache.positions!r})."
            )

    def without_policy(self) -> RolloutSettings:
        """These (stored) settings for a pipeline that cannot run their policy ([`PolicySettings.runs_on`]): no policy
        (chunk by chunk), without its options and without the attention bias stored with it."""
        return replace(self, policy=None, cache=self.cache.replace(kv_cache_attention_bias=None))

    def flat_values(self) -> dict[str, Any]:
        """Every value by its flat name (the prompt switches as ``switch_frames``): what a policy checks."""
        values = {"keep_cache": self.keep_cache}
        for part in (self.sampling, self.cache, self.prompts):
            values.update({name: getattr(part, name) for name in part.field_names()})
        return values

    @property
    def active_policy(self) -> PolicySettings:
        """The policy that runs (sequential when none is named)."""
        return SequentialSettings() if self.policy is None else self.policy

    # ------------------------------------------------------------------ flat arguments
    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any] | None = None, **more: Any) -> RolloutSettings:
        """The settings of a call's flat keyword arguments (``None``: not given)."""
        return cls(policy=None).with_arguments({**(arguments or {}), **more})

    def arguments(self) -> dict[str, Any]:
        """The flat keyword arguments of these settings (``None`` where unset)."""
        values: dict[str, Any] = {"kv_cache_policy": None if self.policy is None else self.policy.name}
        for part in (self.sampling, self.cache, self.prompts):
            values.update({name: getattr(part, name) for name in part.field_names()})
        values.pop("switch_frames")
        values.pop("shift")
        for cls in POLICIES.values():
            values.update(dict.fromkeys(cls.field_names()))
        if self.policy is not None:
            values.update(self.policy.options())
        values["keep_cache"] = self.keep_cache
        return values

    def resolved_arguments(self) -> dict[str, Any]:
        """[`arguments`] with the defaults filled in where the rollout needs a value (steps, context noise, guidance,
        sink frames, key positions, sink rule)."""
        values = self.arguments()
        steps = self.sampling.num_inference_steps
        values.update(
            num_inference_steps=DEFAULT_STEPS if steps is None else steps,
            context_noise=0.0 if self.sampling.context_noise is None else self.sampling.context_noise,
            guidance_scale=1.0 if self.sampling.guidance_scale is None else self.sampling.guidance_scale,
            sink_frames=self.cache.sink,
            rope_positions=self.cache.positions,
            sink_update=self.cache.update,
            sink_decay=self.cache.decay,
        )
        return values

    def with_arguments(self, arguments: Mapping[str, Any], switch_frames: Any = None) -> RolloutSettings:
        """These settings (the stored ones) with a call's flat ``arguments`` over them, field by field (``None``: not
        given, the stored value stands), by these rules:

        * a call naming a schedule (steps, timesteps or sigmas) takes neither stored timesteps nor stored first-chunk
          timesteps ([`SamplingSettings.merge`]);
        * the stored cache settings apply to a call that configures engines (``kv_cache_engine`` not ``None``), the
          stored ``sink_decay`` only to a call naming no ``sink_update`` ([`merge_cache`]);
        * the stored policy, its options and the stored attention bias apply to a call that names no policy or the
          same one.
        """
        parts = _part_names()
        unknown = sorted(set(arguments) - set(parts))
        if unknown:
            raise ValueError(f"Unknown setting {unknown}; accepted: {tuple(parts)}.")
        given = {part: {} for part in ("sampling", "cache", "prompts", "policy", "rollout")}
        for name, value in arguments.items():
            given[parts[name]][name] = value
        name = given["policy"].pop("kv_cache_policy", None)
        stored_name = None if self.policy is None else self.policy.name
        same = name is None or name == stored_name
        options = {key: value for key, value in given["policy"].items() if value is not None}
        if same and self.policy is not None:
            options = {**{k: v for k, v in self.policy.options().items() if v is not None}, **options}
        chosen = name or stored_name
        policy = None if chosen is None and not options else policy_settings(chosen, **options)
        if chosen is None and isinstance(policy, SequentialSettings):
            policy = None
        stored_cache = self.cache.values()
        if not same:
            stored_cache["kv_cache_attention_bias"] = None
        cache = merge_cache(stored_cache, given["cache"])
        sampling = merge_schedule(self.sampling.values(), given["sampling"])
        prompts = {k: v for k, v in given["prompts"].items() if v is not None}
        if switch_frames is not None:
            prompts["switch_frames"] = tuple(switch_frames)
        keep_cache = given["rollout"].get("keep_cache")
        keep_cache = False if keep_cache is None else keep_cache
        if policy is not None:  # the policy's check first, so that its message names the policy
            policy.check({**sampling, **cache, **prompts, "keep_cache": keep_cache})
        return RolloutSettings(
            sampling=SamplingSettings(**sampling),
            cache=CacheSettings(**cache),
            policy=policy,
            prompts=PromptSchedule(**prompts),
            keep_cache=keep_cache,
        )

    def merge(self, other: RolloutSettings | None = None, **overrides: Any) -> RolloutSettings:
        """``other``'s values (a call's settings object), then the flat ``overrides``, over these, field by field
        (see [`with_arguments`])."""
        arguments = {} if other is None else other.arguments()
        arguments.update(overrides)
        switches = None if other is None else other.prompts.switch_frames
        return self.with_arguments(arguments, switch_frames=switches)

    @classmethod
    def help_of(cls, name: str) -> str:
        """The help text of the flat argument ``name``."""
        part = _part_names()[name]
        if name == "kv_cache_policy":
            return (
                f"KV-cache policy: one of {tuple(POLICIES)}: "
                + "; ".join(f"{n!r}: {c.title}" for n, c in POLICIES.items())
                + "."
            )
        if part == "policy":
            owner = option_owner(name)
            return f"{owner.help(name)} (kv_cache_policy={owner.name!r} only)"
        if part == "rollout":
            return cls.help(name)
        return {"sampling": SamplingSettings, "cache": CacheSettings, "prompts": PromptSchedule}[part].help(name)

    # ------------------------------------------------------------------ rules that need the chunks
    def check_chunks(
        self,
        chunk_bounds: Sequence[tuple[int, int]],
        chunk_size: int | None = None,
        *,
        rope_table: int | None = None,
        rope_rebasing: bool = False,
        leading_frames: int = 0,
        complete: bool = True,
    ) -> None:
        """Raise ``ValueError`` for what these settings cannot serve about a rollout of the chunks ``chunk_bounds``
        (``[start, end)`` latent frames; ``leading_frames`` of them before the video's frame 0) of ``chunk_size``
        latent frames (``None``: the largest chunk's), before any work: the transformer's RoPE table (``rope_table``,
        ``None`` when unknown; :func:`check_rope_table`), the cache's rules ([`CacheSettings.check_chunks`]), a recache
        keeping the sink (``recache_sink="keep"``, which re-runs the window's non-sink frames from a chunk boundary, so
        the sink and the rest of the window must be whole chunks), the prompt switches
        ([`PromptSchedule.check_chunks`]) and the policy's own rule ([`PolicySettings.check_chunks`]).
        ``complete=False``: ``chunk_bounds`` are the first chunks of an open-ended stream (a video iterator's), checked
        for the cache's rules only."""
        bounds = list(chunk_bounds)
        if rope_table is not None:
            check_rope_table(
                bounds[-1][1],
                rope_table,
                self.cache.positions,
                positions_bounded=self.active_policy.bounds_positions,
                rope_rebasing=rope_rebasing,
            )
        self.cache.check_chunks(bounds)
        if self.prompts.recache_sink == "keep":
            chunk_size = chunk_size or max(end - start for start, end in bounds)
            sink, room = self.cache.sink, self.cache.window.room
            if sink % chunk_size or room % chunk_size:
                raise ValueError(
                    f"`recache_sink='keep'` re-runs the window's non-sink frames from a chunk boundary: `sink_frames` "
                    f"({sink}) and `attention_window - sink_frames` ({room}) must be multiples of the chunk size "
                    f"({chunk_size})."
                )
        if not complete:
            return
        self.prompts.check_chunks(bounds, leading_frames)
        self.active_policy.check_chunks(bounds, self.sampling.steps, rope_table)

    # ------------------------------------------------------------------ pipeline config
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RolloutSettings:
        """The stored settings of a pipeline config (the keys of :data:`CONFIG_KEYS`; others are ignored). The default
        ``sink_decay`` of 0.999 under a fixed sink (which every config held before the settings values) is not a
        setting and is dropped."""
        stored = {key: config.get(key) for key in CONFIG_KEYS}
        if stored.get("sink_update") in (None, "fixed") and stored.get("sink_decay") == DEFAULT_SINK_DECAY:
            stored["sink_decay"] = None
        if stored.get("keep_first_frame") is False:
            stored["keep_first_frame"] = None
        if stored.get("sink_frames") == 0:
            stored["sink_frames"] = None
        return cls(policy=None).with_arguments(stored)

    def to_config(self) -> dict[str, Any]:
        """The pipeline config of these settings (what [`from_config`] reads)."""
        values = self.arguments()
        config = {key: values[key] for key in CONFIG_KEYS}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()}

    # ------------------------------------------------------------------ JSON
    def values(self) -> dict[str, Any]:
        return {
            "sampling": self.sampling.values(),
            "cache": self.cache.values(),
            "policy": None if self.policy is None else {"name": self.policy.name, **self.policy.values()},
            "prompts": self.prompts.values(),
            "keep_cache": self.keep_cache,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutSettings:
        data = cls._checked_dict(data)
        policy = data.get("policy")
        return cls(
            sampling=SamplingSettings.from_dict(data.get("sampling", {})),
            cache=CacheSettings.from_dict(data.get("cache", {})),
            policy=None if policy is None else policy_from_dict(policy),
            prompts=PromptSchedule.from_dict(data.get("prompts", {})),
            keep_cache=data.get("keep_cache", False),
        )

    # ------------------------------------------------------------------ model card
    def card_words(self) -> str:
        """How these settings sample, in one sentence beyond the step schedule (the converter's model card): the
        policy's words ([`PolicySettings.card_words`])."""
        return self.active_policy.card_words(self.flat_values())
