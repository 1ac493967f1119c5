"""Every rule of the settings gives the same verdict and the same message at every door a setting enters by: a
pipeline call, a stored pipeline config (the pipeline built with it, and a saved pipeline whose model_index.json holds
it, loaded with `from_pretrained`) and `convert`'s stored settings. The rules and their cases are
`test_settings.RULES`; a door is a function in `DOORS`, the CLI's pre-load checks among them.

A door is called as ``door(components, arguments, saved)`` and returns ``None`` when it accepts the settings, the
``ValueError``'s message when it refuses them, or ``NOT_A_DOOR`` when the settings cannot enter by it (a call-only
setting at the stored config, say)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_settings import RULES

from fastgen_diffusers import WanCausalPipeline
from fastgen_diffusers.convert.formats import StudentSettings, get_format
from fastgen_diffusers.settings import CONFIG_KEYS
from fastgen_diffusers.testing import tiny_components

NOT_A_DOOR = object()
CALL = {"height": 16, "width": 16, "num_frames": 45, "num_inference_steps": 1, "output_type": "latent"}


class _Accepted(Exception):
    """Raised by the first transformer forward: the call got past every check."""


def _refusal(run) -> str | None:
    try:
        run()
    except _Accepted:
        return None
    except ValueError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def components():
    return tiny_components()


@pytest.fixture(scope="module")
def saved(components, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved")
    WanCausalPipeline(**components).save_pretrained(path)
    return path


def call_door(components, arguments, saved):
    """``pipe(prompt_embeds=..., **arguments)`` stopped at its first forward (12 latent frames: 4 chunks of 3 starting
    at pixel frames 0, 9, 21, 33); ``switch_frames`` become the keys of a prompt schedule ``prompt_embeds``."""
    pipe = WanCausalPipeline(**components)
    pipe.set_progress_bar_config(disable=True)

    def forward(*args, **kwargs):
        raise _Accepted

    handle = pipe.transformer.register_forward_pre_hook(forward)
    try:
        arguments = dict(arguments)
        embeds = torch.zeros(1, 4, pipe.transformer.config.text_dim)
        switches = arguments.pop("switch_frames", ())
        if switches:
            embeds = {frame: embeds for frame in (0, *switches)}
        return _refusal(lambda: pipe(prompt_embeds=embeds, **CALL, **arguments))
    finally:
        handle.remove()
        pipe.transformer.clear_caches()


def stored_config_door(components, arguments, saved):
    """A pipeline built with ``arguments`` as its stored config (``from_pretrained`` passes the config this way)."""
    if not set(arguments) <= set(CONFIG_KEYS):
        return NOT_A_DOOR
    return _refusal(lambda: WanCausalPipeline(**components, **arguments))


def from_pretrained_door(components, arguments, saved):
    """A saved pipeline whose ``model_index.json`` holds ``arguments`` (what `convert` writes), loaded."""
    if not set(arguments) <= set(CONFIG_KEYS):
        return NOT_A_DOOR
    index = json.loads((saved / "model_index.json").read_text())
    (saved / "model_index.json").write_text(json.dumps({**index, **arguments}))
    try:
        return _refusal(lambda: WanCausalPipeline.from_pretrained(saved))
    finally:
        (saved / "model_index.json").write_text(json.dumps(index))


def convert_door(components, arguments, saved):
    """``convert --format self-forcing`` with ``arguments`` as its setting flags (the stored settings it writes)."""
    if not set(arguments) <= set(StudentSettings.__dataclass_fields__):
        return NOT_A_DOOR
    return _refusal(lambda: get_format("self-forcing").sampling.replace(**arguments))


def cli_door(components, arguments, saved):
    """``fastgen-diffusers generate --num-frames 45`` (the call's 4 chunks of 3 on the tiny model) with ``arguments``
    as its settings flags (``switch_frames`` as ``--prompt-switch`` flags), checked before any model loads (the
    settings built from the flags, then asked about the rollout's chunks); not through argparse, whose ``choices``
    refuse a bad name first."""
    from fastgen_diffusers.cli import app
    from fastgen_diffusers.cli.checks import generate_settings
    from fastgen_diffusers.cli.common import SETTINGS_FLAGS
    from fastgen_diffusers.cli.layout import check_rollout_layout

    dests = {name: dest for dest, name in SETTINGS_FLAGS.items()}
    arguments = dict(arguments)
    switches = [f"{frame}:a dog" for frame in arguments.pop("switch_frames", ())]  # --prompt-switch FRAME:PROMPT
    if not set(arguments) <= set(dests):
        return NOT_A_DOOR
    args = app.build_parser().parse_args(["generate", "--prompt", "a fox", "--num-frames", "45"])
    args.prompt_switch = switches
    for name, value in arguments.items():
        setattr(args, dests[name], value)
    return _refusal(lambda: (generate_settings(args), check_rollout_layout(args)))


DOORS = [call_door, stored_config_door, from_pretrained_door, convert_door, cli_door]


@pytest.mark.parametrize(("rule", "arguments", "message"), RULES, ids=[f"{r[0]}-{i}" for i, r in enumerate(RULES)])
def test_every_door_gives_the_same_verdict_and_message(components, saved, rule, arguments, message):
    verdicts = {door.__name__: door(components, arguments, saved) for door in DOORS}
    verdicts = {name: verdict for name, verdict in verdicts.items() if verdict is not NOT_A_DOOR}
    assert "call_door" in verdicts and "cli_door" in verdicts  # every rule enters by a call and by the command line
    if message is None:
        assert verdicts == dict.fromkeys(verdicts), verdicts
        return
    assert all(verdict is not None and re.search(message, verdict) for verdict in verdicts.values()), verdicts
    assert len(set(verdicts.values())) == 1, verdicts


def test_unsampleable_student_settings_are_refused_before_conversion():
    """What `convert` accepted before and every default call of the converted model then refused."""
    refusals = [
        ("self-forcing", {"attention_window": 2}, "does not fit the attention window"),
        ("rolling-forcing", {"attention_window": 2}, "does not fit the attention window"),
        ("krea", {"context_frames": None, "kv_cache_policy": "recompute"}, None),
        ("self-forcing", {"kv_cache_policy": "recompute"}, "`context_frames` must be a positive integer"),
        ("reward-forcing", {"attention_window": 8}, "every eviction must remove exactly sink_frames=3"),
        ("reward-forcing", {"chunk_size": 1}, "every eviction must remove exactly sink_frames=3"),
        ("reward-forcing", {"chunk_size": 2}, "every eviction must remove exactly sink_frames=3"),
    ]
    for name, overrides, message in refusals:
        if message is None:
            get_format(name).sampling.replace(**overrides)
            continue
        with pytest.raises(ValueError, match=message):
            get_format(name).sampling.replace(**overrides)


@torch.no_grad()
def test_a_settings_value_samples_as_its_flat_arguments(components):
    """``pipe(settings=...)`` is the call of its flat arguments; a flat argument that differs from its default
    overrides the value field by field."""
    from fastgen_diffusers.settings import RolloutSettings

    pipe = WanCausalPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.randn(1, 4, pipe.transformer.config.text_dim, generator=torch.Generator().manual_seed(1))
    call = {**CALL, "num_frames": 21, "prompt_embeds": embeds}
    flat = {"attention_window": 6, "sink_frames": 3, "kv_cache_attention_bias": 0.5, "timesteps": [1000.0, 750.0]}

    def latents(**kwargs):
        return pipe(generator=torch.Generator().manual_seed(0), **call, **kwargs).frames

    settings = RolloutSettings.from_arguments(flat)
    assert torch.equal(latents(settings=settings), latents(**flat))
    # the override must change the output at this size (21 frames fit in window 6: a sink override would not)
    settings_only = latents(settings=settings)
    overriding = latents(settings=settings, kv_cache_attention_bias=1.0)
    assert (overriding - settings_only).abs().max() > 1e-4
    assert torch.equal(overriding, latents(**{**flat, "kv_cache_attention_bias": 1.0}))
    with pytest.raises(ValueError, match="`settings` must be a RolloutSettings or None, got dict"):
        latents(settings=settings.to_dict())
