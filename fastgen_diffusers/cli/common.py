"""What every ``fastgen-diffusers`` subcommand shares: the usage error, flag names, and readers of a model
directory's JSON files (its chunk layout and stored sampling settings), so that a command line is checked before any
model loads. Imports neither torch nor the pipelines.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..settings import (
    KEY_POSITIONS,
    KV_CACHE_DTYPE_NAMES,
    POLICIES,
    RECACHE_SINKS,
    SINK_UPDATES,
    CacheSettings,
    PromptSchedule,
    RolloutSettings,
    SamplingSettings,
    argument_names,
    policy_names,
)
from ..settings.prompts import TEMPORAL_FACTOR  # Wan VAEs: 4k+1 pixel frames encode to k+1 latent frames


def one_line(error: BaseException, limit: int | None = None) -> str:
    """The message of ``error`` on one line (whitespace runs, newlines included, become one space), cut to ``limit``
    characters; the error's type name when it has no message."""
    return " ".join(str(error).split())[:limit] or type(error).__name__


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[Any, Any]:
    """``(torch.device, torch dtype)`` of the ``--device`` and ``--dtype`` flags: CUDA when available, else the CPU;
    bfloat16 on CUDA, else float32 (imports torch)."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, getattr(torch, dtype or ("bfloat16" if device.type == "cuda" else "float32"))


def vae_in_float32(pipe: Any) -> Any:
    """``pipe`` with its VAE in float32 (it decodes so, as diffusers' Wan examples load it)."""
    import torch

    if pipe.vae.dtype != torch.float32:
        pipe.vae.to(torch.float32)
    return pipe


DTYPES = ("bfloat16", "float16", "float32")  # --dtype: the model's dtype
# The chunk layout of the built-in tiny random models (fastgen_diffusers.testing; tests/test_cli.py keeps them equal):
# the text- and video-to-video and VACE students chunk by 3 latent frames, the image-to-video one takes its first
# frame alone.
TINY_LAYOUT = {"chunk_size": 3, "independent_first_frame": False, "rope_max_seq_len": 1024, "t2v_student": True}
TINY_I2V_LAYOUT = {**TINY_LAYOUT, "independent_first_frame": True}
# A Wan transformer config's defaults for what a layout reads (diffusers' WanTransformer3DModel, the causal subclass).
LAYOUT_DEFAULTS = {"chunk_size": 3, "independent_first_frame": False, "rope_max_seq_len": 1024}


# The flags that set a settings value (fastgen_diffusers.settings): flag dest -> (the settings argument, the pipelines'
# keyword argument it sets; argparse options), one per flat settings argument, derived from the settings values: the
# argparse options from the field's type, the choices from the registries. Each flag's help is the value's own
# documentation and its default None (left out: the model's stored value, or the format's, stands); `generate` takes
# them all, `convert` those it stores. A new setting of a plain type needs no line here.
# Not flags: `sigmas` (`--timesteps` says the schedule), `kv_cache_engine` (the static engine), `keep_cache` (a
# command line runs once; nothing continues its rollout).
_NOT_FLAGS = ("sigmas", "kv_cache_engine", "keep_cache")
_DESTS = {"num_inference_steps": "steps"}
_CHOICES = {
    "kv_cache_policy": policy_names(),
    "rope_positions": tuple(KEY_POSITIONS),
    "sink_update": SINK_UPDATES,
    "kv_cache_dtype": KV_CACHE_DTYPE_NAMES,
    "recache_sink": RECACHE_SINKS,
}
_OPTIONS_OF_TYPE = {
    "int": {"type": int},
    "float": {"type": float},
    "tuple[float, ...]": {"type": float, "nargs": "+", "metavar": "T"},
    "bool": {"action": "store_true"},
    "bool | tuple[int, ...]": {"action": "rope_cut", "nargs": "*", "type": int, "metavar": "FRAME"},
}


def _flag_options(name: str) -> dict[str, Any]:
    """The argparse options of the flat settings argument ``name``: its choices, else by its field's type."""
    if name in _CHOICES:
        return {"choices": _CHOICES[name]}
    owners = (SamplingSettings, CacheSettings, PromptSchedule, *POLICIES.values())
    (field,) = (f for owner in owners for f in fields(owner) if f.name == name)
    return dict(_OPTIONS_OF_TYPE[field.type.removesuffix(" | None")])


def settings_flag_table() -> dict[str, tuple[str, dict[str, Any]]]:
    """The settings flags of the settings values as registered now (:data:`SETTINGS_ARGUMENTS`)."""
    names = (name for name in argument_names() if name not in _NOT_FLAGS)
    return {_DESTS.get(name, name): (name, _flag_options(name)) for name in names}


SETTINGS_ARGUMENTS = settings_flag_table()
SETTINGS_FLAGS = {dest: name for dest, (name, _) in SETTINGS_ARGUMENTS.items()}


class _RopeCutAction(argparse.Action):
    """``--rope-cut``: ``True`` (a cut at every prompt switch), or the switch frames given after it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(values) if values else True)


def add_settings_arguments(group: Any, dests: Iterable[str] | None = None) -> None:
    """Add the settings flags ``dests`` (default: all of :data:`SETTINGS_ARGUMENTS`) to an argparse parser or group,
    each with the documentation of the settings value it sets as its help ([`RolloutSettings.help_of`], so help and
    behaviour cannot disagree) and ``None`` as its default."""
    for dest in SETTINGS_ARGUMENTS if dests is None else dests:
        name, options = SETTINGS_ARGUMENTS[dest]
        options = dict(options)
        if options.get("action") == "rope_cut":
            options["action"] = _RopeCutAction
        help_text = RolloutSettings.help_of(name).replace("%", "%%")
        group.add_argument(flag(dest), dest=dest, default=None, help=help_text, **options)


class UsageError(ValueError):
    """A bad command line: ``cli.main`` prints it as one line (no traceback) and exits with status 2."""


def flag(name: str) -> str:
    """``"num_frames"`` -> ``"--num-frames"``."""
    return "--" + name.replace("_", "-")


def latent_frames(num_frames: int) -> int:
    """Latent frames of ``num_frames`` (4k+1) pixel frames."""
    return (num_frames - 1) // TEMPORAL_FACTOR + 1


def read_model_json(model: str | None, filename: str) -> dict | None:
    """``filename`` (e.g. ``"model_index.json"``) of ``--model`` as a dict, from its directory or the Hugging Face
    cache; ``None`` when it is not at hand or does not parse (the loader reports that)."""
    path = Path(model).expanduser() / filename
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, filename)
        except Exception:  # noqa: BLE001  (an id the Hub client refuses: the loader reports it)
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def stored_settings(model: str | None) -> dict | None:
    """The sampling settings ``--model`` stores (pipeline config fields of its ``model_index.json``); ``{}`` for the
    built-in tiny model (it stores none); ``None`` when the file is not at hand (the pipeline checks then)."""
    return {} if model is None else read_model_json(model, "model_index.json")


def transformer_layout(model: str | None, image_to_video: bool = False) -> dict[str, Any] | None:
    """``chunk_size``, ``independent_first_frame`` and ``rope_max_seq_len`` of ``--model``'s transformer, and whether
    it is a T2V student (``t2v_student``: it takes an image or clip as its first chunks), read from its
    ``transformer/config.json``; the built-in tiny model's without ``--model`` (``image_to_video``: the tiny
    image-to-video student's); ``None`` when the config is not at hand or holds something else (the pipeline checks
    then)."""
    if model is None:
        return dict(TINY_I2V_LAYOUT if image_to_video else TINY_LAYOUT)
    config = read_model_json(model, "transformer/config.json")
    if config is None:
        return None
    layout = {name: config.get(name, default) for name, default in LAYOUT_DEFAULTS.items()}
    chunk, table, first = layout["chunk_size"], layout["rope_max_seq_len"], layout["independent_first_frame"]
    for value in (chunk, table):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
    # a T2V student (as many input as output channels, no image tokens) takes an image or clip as its first chunks
    channels = config.get("in_channels", 16), config.get("out_channels", 16)
    layout["t2v_student"] = channels[0] == channels[1] and config.get("image_dim") is None
    return layout if isinstance(first, bool) else None
