"""Torch-free settings values: the one place each sampling and cache rule is stated and checked.

The pipelines (flat keyword arguments, a ``settings=`` value, the stored pipeline config), the converter, the CLI and
the server all build these values and ask them; each rule lives on exactly one value:

* [`SamplingSettings`]: schedule, first-chunk schedule, guidance, context noise;
* [`CacheSettings`]: engine kind, [`AttentionWindow`] (window and sink), key positions, sink rule and decay, storage
  dtype, attention bias; the EMA eviction rule ([`check_ema_eviction`]); the RoPE table ([`check_rope_table`]);
* the policy registry ([`register_policy`]): [`SequentialSettings`], [`RecomputeSettings`], [`RollingSettings`];
* [`PromptSchedule`]: prompt switches, transitions, recache and what a switch does to the caches (``recache_sink``,
  ``kv_flush``, ``rope_cut``); which chunk a switch takes effect at ([`switch_chunks`]);
* [`RolloutSettings`]: all of them, composed; ``to_dict`` / ``from_dict`` (with a version), ``from_config`` /
  ``to_config`` (the pipeline config), ``with_arguments`` (a call's values over stored ones, field by field),
  ``check_chunks`` (every rule that needs the rollout's chunks, before any work).
"""

from .base import SETTINGS_VERSION, ArgumentTypeError, SettingsValue
from .cache import ENGINE_KINDS, KEY_POSITIONS, KV_CACHE_DTYPE_NAMES, SINK_UPDATES, CacheSettings, check_rope_table
from .policies import (
    POLICIES,
    PolicySettings,
    RecomputeSettings,
    RollingSettings,
    SequentialSettings,
    policy_names,
    policy_settings,
    register_policy,
)
from .prompts import RECACHE_SINKS, PromptSchedule, switch_chunks
from .rollout import CONFIG_KEYS, RolloutSettings, argument_names
from .sampling import SamplingSettings
from .window import AttentionWindow, check_ema_chunks, check_ema_eviction

__all__ = [
    "CONFIG_KEYS",
    "ENGINE_KINDS",
    "KEY_POSITIONS",
    "KV_CACHE_DTYPE_NAMES",
    "POLICIES",
    "RECACHE_SINKS",
    "SETTINGS_VERSION",
    "SINK_UPDATES",
    "ArgumentTypeError",
    "AttentionWindow",
    "CacheSettings",
    "PolicySettings",
    "PromptSchedule",
    "RecomputeSettings",
    "RollingSettings",
    "RolloutSettings",
    "SamplingSettings",
    "SequentialSettings",
    "SettingsValue",
    "argument_names",
    "check_ema_chunks",
    "check_ema_eviction",
    "check_rope_table",
    "policy_names",
    "policy_settings",
    "register_policy",
    "switch_chunks",
]
