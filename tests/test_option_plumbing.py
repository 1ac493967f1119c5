"""A call's settings reach the engines without being restated on the way: the call options take their settings
fields (and the defaults that tell a given value from a left-out one) from the settings values, and the engine factory
and the static engine hand the engines' options to ``BaseKVCacheEngine`` as they come."""

from __future__ import annotations

import inspect
from dataclasses import fields

from fastgen_diffusers import WanCausalPipeline
from fastgen_diffusers.kv_cache import BaseKVCacheEngine, StaticKVCacheEngine, make_engines
from fastgen_diffusers.pipelines.rollout.options import RolloutOptions
from fastgen_diffusers.settings import argument_names
from fastgen_diffusers.testing import tiny_transformer


def test_call_options_hold_every_settings_argument_at_the_call_default():
    defaults = {f.name: f.default for f in fields(RolloutOptions)}
    call = inspect.signature(WanCausalPipeline.__call__).parameters
    for name in argument_names():
        assert defaults[name] == call[name].default, name


def test_the_engine_factory_and_the_static_engine_pass_the_engine_options_through():
    options = set(inspect.signature(BaseKVCacheEngine.__init__).parameters) - {"self"}
    for function in (make_engines, StaticKVCacheEngine.__init__):
        assert not options & set(inspect.signature(function).parameters), function.__qualname__
    chosen = {
        "window_frames": 6,
        "sink_frames": 3,
        "rope_positions": "window",
        "sink_update": "ema",
        "sink_decay": 0.5,
    }
    for kind in ("static", "vanilla"):
        (engine,) = make_engines(tiny_transformer(), kind, max_frames=9, **chosen).values()
        assert (engine.window.frames, engine.window.sink, engine.rope_positions) == (6, 3, "window"), kind
        assert (engine.sink_update, engine.sink_decay) == ("ema", 0.5), kind
