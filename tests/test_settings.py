"""The settings values (fastgen_diffusers/settings): each rule accepts and refuses by itself, torch-free, with the
message naming the argument and the accepted values; JSON with a version, merging and help text."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest

from fastgen_diffusers.settings import (
    POLICIES,
    AttentionWindow,
    CacheSettings,
    PolicySettings,
    PromptSchedule,
    RecomputeSettings,
    RollingSettings,
    RolloutSettings,
    SamplingSettings,
    SequentialSettings,
    argument_names,
    register_policy,
)

# (rule, arguments, message fragment or None when accepted); the same table runs through every door in
# tests/test_settings_doors.py
RULES = [
    ("bias range", {"kv_cache_attention_bias": 0.3}, None),
    ("bias range", {"kv_cache_attention_bias": 0.005}, r"`kv_cache_attention_bias` must be a number in \[0.01, 1\]"),
    ("bias range", {"kv_cache_attention_bias": 1.5}, r"`kv_cache_attention_bias` must be a number in \[0.01, 1\]"),
    ("recompute bounds the cache", {"kv_cache_policy": "recompute", "context_frames": 3}, None),
    (
        "recompute bounds the cache",
        {"kv_cache_policy": "recompute", "context_frames": 3, "attention_window": 6},
        "`kv_cache_policy='recompute'` bounds the cache itself",
    ),
    (
        "recompute bounds the cache",
        {"kv_cache_policy": "recompute", "context_frames": 3, "rope_positions": "window"},
        "`kv_cache_policy='recompute'` rebuilds the cache at RoPE positions from 0",
    ),
    ("recompute needs context", {"kv_cache_policy": "recompute"}, "`context_frames` must be a positive integer"),
    ("context needs recompute", {"context_frames": 3}, "`context_frames` needs `kv_cache_policy='recompute'`"),
    ("anchor needs recompute", {"keep_first_frame": True}, "`keep_first_frame=True` needs `kv_cache_policy='recomp"),
    ("ema sink", {"attention_window": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"}, None),
    (
        "ema sink",
        {"attention_window": 9, "rope_positions": "window", "sink_update": "ema"},
        r"`sink_update='ema'` averages evicted frames into the sink: set `sink_frames` > 0",
    ),
    (
        "ema sink",
        {"attention_window": 9, "sink_frames": 3, "sink_update": "ema"},
        "`sink_update='ema'` averages the keys of frames at different positions, which needs keys stored before RoPE",
    ),
    ("sink decay needs ema", {"sink_decay": 0.9}, "`sink_decay=0.9` is the decay of the EMA sink"),
    (
        "8-bit ema",
        {
            "attention_window": 9,
            "sink_frames": 3,
            "rope_positions": "window",
            "sink_update": "ema",
            "kv_cache_dtype": "int8",
        },
        "`sink_update='ema'` cannot be combined with an 8-bit `kv_cache_dtype`",
    ),
    ("sink below window", {"attention_window": 6, "sink_frames": 3}, None),
    ("sink below window", {"attention_window": 3, "sink_frames": 3}, "expected sink_frames < attention_window"),
    ("sink needs window", {"sink_frames": 1}, "`sink_frames=1` needs a sliding window: set `attention_window`"),
    (
        "window fits a chunk",
        {"attention_window": 2},
        r"The chunk of latent frames \[0, 3\) does not fit the attention",
    ),
    (
        "ema eviction",
        {"attention_window": 8, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"},
        r"every eviction must remove exactly sink_frames=3 frames; the chunk at latent frame 6 evicts 1",
    ),
    ("rolling", {"kv_cache_policy": "rolling", "attention_window": 9}, None),
    (
        "rolling",
        {"kv_cache_policy": "rolling", "attention_window": 9, "sink_frames": 3},
        r"`kv_cache_policy='rolling'` keeps its first chunk as the sink \(the anchor\): pass no `sink_frames`",
    ),
    (
        "rolling",
        {"kv_cache_policy": "rolling", "context_noise": 100.0},
        "`kv_cache_policy='rolling'` commits each chunk clean at timestep 0",
    ),
    (
        "rolling",
        {"kv_cache_policy": "rolling", "first_chunk_timesteps": [1000.0, 750.0]},
        "`kv_cache_policy='rolling'` runs every chunk on one schedule",
    ),
    ("policy names", {"kv_cache_policy": "bogus"}, r"`kv_cache_policy` must be one of \('sequential', 'recompute'"),
    ("timesteps", {"timesteps": [1000.0, 1000.0]}, "`timesteps` must be strictly decreasing"),
    # what a prompt switch does to the caches (`switch_frames`: the call's prompt schedule, not a flat argument)
    ("recache sink", {"recache_sink": "keep", "recache": True, "attention_window": 6, "sink_frames": 3}, None),
    ("recache sink", {"recache_sink": "maybe"}, r"`recache_sink` must be one of \('rerun', 'keep'\), got 'maybe'"),
    ("recache sink", {"recache_sink": "keep"}, r"`recache_sink='keep'` says what a recache does .*set `recache=True`"),
    (
        "recache sink",
        {"recache_sink": "keep", "recache": True},
        "`recache_sink='keep'` keeps the sink's K/V .*: set `attention_window` and `sink_frames` > 0",
    ),
    (
        "recache sink chunks",
        {"recache_sink": "keep", "recache": True, "attention_window": 6, "sink_frames": 1},
        r"`sink_frames` \(1\) and `attention_window - sink_frames` \(5\) must be multiples of the chunk size \(3\)",
    ),
    ("kv flush", {"kv_flush": True, "attention_window": 6, "sink_frames": 1, "switch_frames": (21,)}, None),
    ("kv flush", {"kv_flush": 1}, "`kv_flush` must be True or False, got 1"),
    ("kv flush", {"kv_flush": True}, "`kv_flush=True` keeps the sink and the last frames .*: set `attention_window`"),
    (
        "kv flush",
        {"kv_flush": True, "recache": True, "attention_window": 6, "switch_frames": (21,)},
        r"`kv_flush=True` replaces the recache \(no forward at a switch\): use recache=False",
    ),
    (
        "kv flush",
        {"kv_flush": True, "kv_cache_policy": "recompute", "context_frames": 3},
        "`kv_flush` edits the cache of a chunk-by-chunk rollout .*Accepted: kv_cache_policy=None or 'sequential'",
    ),
    (
        "kv flush",
        {"kv_flush": True, "kv_cache_policy": "rolling", "attention_window": 9},
        "`kv_cache_policy='rolling'` rebuilds or rolls it",
    ),
    (
        "kv flush",
        {"kv_flush": True, "attention_window": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"},
        r"`kv_flush=True` drops frames an EMA sink \(`sink_update='ema'`\) folds in: use sink_update='fixed'",
    ),
    (
        "kv flush",
        {"kv_flush": True, "prompt_transition_chunks": 2, "attention_window": 6},
        "`kv_flush` acts at the chunk a prompt takes effect; .*use prompt_transition_chunks=0 with kv_flush",
    ),
    (
        "rope cut",
        {"rope_cut": [33], "attention_window": 6, "rope_positions": "window", "switch_frames": (21, 33)},
        None,
    ),
    ("rope cut", {"rope_cut": True, "attention_window": 6, "rope_positions": "window", "switch_frames": (21,)}, None),
    ("rope cut", {"rope_cut": "yes"}, "`rope_cut` must be a bool or a sequence of prompt-switch frames"),
    ("rope cut", {"rope_cut": True}, r"`rope_cut=True` cuts at every prompt switch: give a prompt schedule"),
    (
        "rope cut",
        {"rope_cut": [9], "attention_window": 6, "rope_positions": "window", "switch_frames": (21,)},
        r"`rope_cut` frames \[9\] are not prompt switches; the schedule switches at \[21\]",
    ),
    (
        "rope cut",
        {"rope_cut": True, "attention_window": 6, "switch_frames": (21,)},
        r"`rope_cut` moves a chunk's frames .*: use rope_positions='window' \(got 'absolute'\)",
    ),
    (
        "rope cut",
        {"rope_cut": True, "kv_cache_policy": "recompute", "context_frames": 3, "switch_frames": (21,)},
        "`rope_cut` edits the cache of a chunk-by-chunk rollout at a prompt switch; `kv_cache_policy='recompute'`",
    ),
]


# rules of the chunking: checked by `RolloutSettings.check_chunks` (`CacheSettings.check_chunks` /
# `check_chunk_size` for the cache's) once the chunks are known
CHUNK_RULES = ("window fits a chunk", "ema eviction", "recache sink chunks")
CHUNKS_OF_3 = [(start, start + 3) for start in range(0, 30, 3)]


def settings_of(arguments: dict) -> RolloutSettings:
    """The settings of a rule's ``arguments`` (``switch_frames``: the frames of the call's prompt schedule)."""
    arguments = dict(arguments)
    return RolloutSettings(policy=None).with_arguments(arguments, switch_frames=arguments.pop("switch_frames", None))


@pytest.mark.parametrize(("rule", "arguments", "message"), RULES, ids=[f"{r[0]}-{i}" for i, r in enumerate(RULES)])
def test_each_rule_accepts_and_refuses_by_itself(rule, arguments, message):
    if rule in CHUNK_RULES:
        settings = settings_of(arguments)
        with pytest.raises(ValueError, match=message):
            settings.check_chunks(CHUNKS_OF_3, 3)
    elif message is None:
        settings = settings_of(arguments)
        settings.check_chunks(CHUNKS_OF_3, 3)
        assert RolloutSettings.from_dict(settings.to_dict()) == settings
    else:
        with pytest.raises(ValueError, match=message):
            settings_of(arguments)


def test_the_settings_import_no_torch_and_no_numpy():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\nsys.modules['numpy'] = None\n"
        "import fastgen_diffusers.settings as s\n"
        "s.RolloutSettings.from_arguments(kv_cache_policy='recompute', context_frames=3)\n"
        "assert not any(name.startswith(('torch', 'diffusers')) for name in sys.modules if sys.modules[name])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_window_moved_and_the_old_import_is_the_same_class():
    from fastgen_diffusers.kv_cache import AttentionWindow as FromEngines
    from fastgen_diffusers.kv_cache.window import AttentionWindow as FromWindow

    assert FromEngines is AttentionWindow is FromWindow


def test_json_round_trip_with_a_version():
    settings = RolloutSettings.from_arguments(
        timesteps=[1000, 757, 522], attention_window=9, sink_frames=3, rope_positions="window", sink_update="ema",
        sink_decay=0.99, kv_cache_dtype=None, prompt_transition_chunks=2, keep_cache=True,
    )  # fmt: skip
    data = settings.to_dict()
    assert data["version"] == 1 and data["sampling"]["timesteps"] == [1000.0, 757.0, 522.0]
    assert RolloutSettings.from_dict(data) == settings
    for part in (settings.sampling, settings.cache, settings.prompts):
        assert type(part).from_dict(part.to_dict()) == part
    with pytest.raises(ValueError, match="`version` must be 1"):
        RolloutSettings.from_dict({**data, "version": 2})
    with pytest.raises(ValueError, match="has no setting"):
        CacheSettings.from_dict({"window": 3})


def test_a_call_overrides_stored_values_field_by_field():
    stored = RolloutSettings.from_config(
        {"timesteps": [1000, 757, 522], "attention_window": 12, "sink_frames": 3, "sink_decay": 0.999}
    )
    assert stored.cache.sink_decay is None  # the old default under a fixed sink is not a setting
    call = stored.with_arguments({"sink_frames": 1})
    assert (call.cache.attention_window, call.cache.sink_frames) == (12, 1)
    assert call.sampling.timesteps == (1000.0, 757.0, 522.0)
    # a call naming its own schedule takes neither the stored timesteps nor the stored first-chunk ones
    assert stored.with_arguments({"num_inference_steps": 2}).sampling.timesteps is None
    # a call that keeps its own engines takes none of the stored cache settings
    assert stored.with_arguments({"kv_cache_engine": None}).cache.attention_window is None
    # the stored policy's options and bias stand for a call naming no policy or the same one, not another
    krea = RolloutSettings.from_config(
        {"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": 0.3}
    )
    assert krea.with_arguments({}).policy == RecomputeSettings(context_frames=3)
    assert krea.with_arguments({"context_frames": 2}).policy.context_frames == 2
    sequential = krea.with_arguments({"kv_cache_policy": "sequential"})
    assert isinstance(sequential.policy, SequentialSettings) and sequential.cache.kv_cache_attention_bias is None
    # a settings value over stored ones, the same rules
    assert stored.merge(RolloutSettings.from_arguments(attention_window=6, sink_frames=2)).cache.sink_frames == 2
    assert CacheSettings(attention_window=6).merge(sink_frames=2) == CacheSettings(attention_window=6, sink_frames=2)


def test_config_round_trip():
    stored = RolloutSettings.from_arguments(kv_cache_policy="recompute", context_frames=3, kv_cache_attention_bias=0.3)
    assert RolloutSettings.from_config(stored.to_config()) == stored


def test_every_flat_argument_has_help_text():
    for name in argument_names():
        assert RolloutSettings.help_of(name), name
    assert "recompute" in RolloutSettings.help_of("kv_cache_policy")
    assert "(kv_cache_policy='recompute' only)" in RolloutSettings.help_of("context_frames")


def test_the_ema_eviction_rule_is_checked_for_a_chunk_size():
    ema = CacheSettings(attention_window=9, sink_frames=3, rope_positions="window", sink_update="ema")
    ema.check_chunk_size(3)
    for chunk_size in (1, 2):
        with pytest.raises(ValueError, match="every eviction must remove exactly sink_frames=3 frames"):
            ema.check_chunk_size(chunk_size)
    with pytest.raises(ValueError, match="does not fit the attention window"):
        CacheSettings(attention_window=2).check_chunk_size(3)


def test_value_checks_name_the_argument():
    with pytest.raises(ValueError, match="`guidance_scale` must be a finite number >= 1 or 0"):
        SamplingSettings(guidance_scale=0.5)
    with pytest.raises(ValueError, match="Pass at most one of `timesteps` and `sigmas`"):
        SamplingSettings(timesteps=[1000.0], sigmas=[1.0])
    with pytest.raises(ValueError, match=r"`kv_cache_engine` must be one of \('static', 'vanilla'\) or None"):
        CacheSettings(kv_cache_engine="paged")
    with pytest.raises(ValueError, match=r"`kv_cache_dtype` must be None or one of \('float8_e4m3fn', 'int8'\)"):
        CacheSettings(kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="`prompt_transition_chunks` must be at least 0"):
        PromptSchedule(prompt_transition_chunks=-1)
    with pytest.raises(ValueError, match="prompt schedule"):
        RolloutSettings().with_arguments({"kv_cache_policy": "rolling"}, switch_frames=[9])


def test_a_new_policy_registers_its_name_options_and_check():
    @register_policy
    @dataclass(frozen=True)
    class EveryOtherSettings(PolicySettings):
        name: ClassVar[str] = "every-other-test"
        title: ClassVar[str] = "a test policy"
        stride: int | None = None

        def check(self, values):
            if values.get("attention_window") is not None:
                raise ValueError("`kv_cache_policy='every-other-test'` takes no `attention_window`.")

    try:
        settings = RolloutSettings.from_arguments(kv_cache_policy="every-other-test")
        assert settings.policy == EveryOtherSettings() and "every-other-test" in RolloutSettings.help_of(
            "kv_cache_policy"
        )
        with pytest.raises(ValueError, match="takes no `attention_window`"):
            RolloutSettings.from_arguments(kv_cache_policy="every-other-test", attention_window=6)
        with pytest.raises(ValueError, match="`stride` needs `kv_cache_policy='every-other-test'`"):
            RolloutSettings.from_arguments(stride=2)
        with pytest.raises(ValueError, match="registered already"):
            register_policy(EveryOtherSettings)
    finally:
        del POLICIES["every-other-test"]
    assert set(POLICIES) == {"sequential", "recompute", "rolling"}
    assert RollingSettings().attention_frames(None) == 21
    assert AttentionWindow(9, 3).room == 6


def test_a_settings_value_merges_by_the_rule_rollout_settings_use():
    """``CacheSettings.merge`` takes the sink rule of ``merge_cache`` (a call's own ``sink_update`` drops the stored
    decay), as ``RolloutSettings.merge`` does, and ``SamplingSettings.merge`` the schedule rule."""
    sink = {"sink_frames": 3, "attention_window": 6, "rope_positions": "window"}
    stored = CacheSettings(sink_update="ema", sink_decay=0.9, **sink)
    merged = stored.merge(sink_update="fixed")
    rollout = RolloutSettings.from_arguments(sink_update="ema", sink_decay=0.9, **sink).merge(sink_update="fixed")
    assert merged == rollout.cache and merged.sink_update == "fixed" and merged.sink_decay is None
    assert stored.merge(CacheSettings(sink_update="fixed", **sink)) == merged
    schedule = SamplingSettings(timesteps=(999, 500)).merge(num_inference_steps=4)
    assert schedule.num_inference_steps == 4 and schedule.timesteps is None
    with pytest.raises(ValueError, match="no setting"):
        SamplingSettings().merge(bogus=1)
