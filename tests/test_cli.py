"""``fastgen-diffusers generate`` writes a readable mp4 with the expected frame count, offline."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import ClassVar  # a test policy's class variables (dataclasses read the module's names)

import imageio.v3 as iio
import numpy as np
import pytest

from fastgen_diffusers.cli import app as cli
from fastgen_diffusers.testing import tiny_pipeline


def read_frames(path) -> np.ndarray:
    """``(F, H, W, 3)`` uint8 frames decoded by imageio-ffmpeg."""
    return iio.imread(path, plugin="FFMPEG")


def test_console_script_points_at_main():
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "fastgen-diffusers"]
    assert script.load() is cli.main


def test_generate_without_model_uses_the_tiny_random_model(tmp_path, capsys):
    output = tmp_path / "videos" / "fox.mp4"
    args = ["generate", "--prompt", "a red fox runs", "--output", str(output), "--num-frames", "9"]
    assert cli.main([*args, "--height", "32", "--width", "48", "--seed", "1", "--fps", "8"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM weights" in printed
    assert f"Wrote {output} (9 frames, 48x32, 8 fps)" in printed
    frames = read_frames(output)
    assert len(frames) == 9
    assert frames[0].shape == (32, 48, 3)


def test_generate_with_a_local_model_directory_and_cfg(tmp_path, capsys):
    tiny_pipeline(seed=3).save_pretrained(tmp_path / "model")
    output = tmp_path / "out.mp4"
    args = ["generate", "--prompt", "a cat", "--model", str(tmp_path / "model"), "--output", str(output)]
    args += ["--num-frames", "5", "--height", "32", "--width", "32", "--steps", "2", "--guidance-scale", "3"]
    assert cli.main([*args, "--negative-prompt", "blurry", "--device", "cpu", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM" not in printed and "(5 frames, 32x32, 16 fps)" in printed
    assert len(read_frames(output)) == 5


def test_bad_arguments_exit_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as error:
        cli.main(["generate", "--output", "x.mp4"])
    assert error.value.code == 2
    assert "--prompt" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "a fox", "--num-frames", "8"]) == 2
    assert "--num-frames must be 4k+1" in capsys.readouterr().err


def test_generate_streams_with_an_attention_window(tmp_path, capsys):
    output = tmp_path / "stream.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "21", "--height", "32"]
    args += ["--width", "32", "--steps", "2", "--stream", "--attention-window", "4", "--sink-frames", "1"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "First 9 frames after" in printed and "Streamed 21 frames" in printed
    assert len(read_frames(output)) == 21


def test_generate_with_the_recompute_policy(tmp_path, capsys, monkeypatch):
    """``--kv-cache-policy recompute --context-frames --kv-cache-attention-bias`` reach the pipeline call."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    seen = []
    call = WanCausalPipeline.__call__

    def recording(self, *args, **kwargs):
        seen.append(
            {name: kwargs.get(name) for name in ("kv_cache_policy", "context_frames", "kv_cache_attention_bias")}
        )
        return call(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalPipeline, "__call__", recording)
    output = tmp_path / "recompute.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "21", "--height", "32"]
    args += ["--width", "32", "--steps", "2", "--kv-cache-policy", "recompute", "--context-frames", "2"]
    args += ["--kv-cache-attention-bias", "0.3"]
    assert cli.main(args) == 0
    assert seen == [{"kv_cache_policy": "recompute", "context_frames": 2, "kv_cache_attention_bias": 0.3}]
    assert len(read_frames(output)) == 21


def test_generate_streams_with_window_rope_and_an_ema_sink(tmp_path, capsys, monkeypatch):
    """``--rope-positions window --sink-update ema --sink-decay`` reach ``stream()`` and its engines."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    engines = []
    stream = WanCausalPipeline.stream

    def recording(self, *args, **kwargs):
        for record in stream(self, *args, **kwargs):
            engines.append(self.transformer.kv_cache_engines["main"])
            yield record

    monkeypatch.setattr(WanCausalPipeline, "stream", recording)
    output = tmp_path / "reward.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "45", "--height", "32"]
    args += ["--width", "32", "--steps", "1", "--stream", "--attention-window", "9", "--sink-frames", "3"]
    args += ["--rope-positions", "window", "--sink-update", "ema", "--sink-decay", "0.9"]
    assert cli.main(args) == 0
    assert len(engines) == 4  # 12 latent frames: the window slides and the sink is updated at the fourth chunk
    assert {(e.rope_positions, e.sink_update, e.sink_decay, e.window_frames) for e in engines} == {
        ("window", "ema", 0.9, 9)
    }
    assert len(read_frames(output)) == 45


def test_generate_with_prompt_switches_transitions_and_keep_first_frame(tmp_path, monkeypatch):
    """``--prompt-switch``, ``--prompt-transition-chunks`` and ``--keep-first-frame`` reach the pipeline call."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    seen = []
    call = WanCausalPipeline.__call__

    def recording(self, *args, **kwargs):
        seen.append({name: kwargs.get(name) for name in ("prompt", "prompt_transition_chunks", "keep_first_frame")})
        return call(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalPipeline, "__call__", recording)
    output = tmp_path / "switch.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "33", "--height", "32"]
    args += ["--width", "32", "--steps", "1", "--kv-cache-policy", "recompute", "--context-frames", "3"]
    args += ["--keep-first-frame", "--prompt-switch", "9:a dog: running", "--prompt-transition-chunks", "2"]
    assert cli.main(args) == 0
    expected = {"prompt": {0: "a fox", 9: "a dog: running"}, "prompt_transition_chunks": 2, "keep_first_frame": True}
    assert seen == [expected]
    assert len(read_frames(output)) == 33


def test_generate_streams_prompt_switches_with_a_transition(tmp_path, monkeypatch):
    """``--prompt-switch`` and ``--prompt-transition-chunks`` reach ``stream()`` under ``--stream`` too."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    seen = []
    stream = WanCausalPipeline.stream

    def recording(self, *args, **kwargs):
        seen.append({name: kwargs.get(name) for name in ("prompt", "prompt_transition_chunks")})
        yield from stream(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalPipeline, "stream", recording)
    output = tmp_path / "switch.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "33", "--height", "32"]
    args += ["--width", "32", "--steps", "1", "--stream", "--prompt-switch", "9:a dog", "--prompt-transition-chunks"]
    assert cli.main([*args, "2"]) == 0
    assert seen == [{"prompt": {0: "a fox", 9: "a dog"}, "prompt_transition_chunks": 2}]
    assert len(read_frames(output)) == 33


def test_generate_with_vace_control_and_image_flags(tmp_path, capsys):
    import imageio

    control = tmp_path / "control.mp4"
    with imageio.get_writer(control, fps=8) as writer:
        for value in range(0, 255, 28):
            writer.append_data(np.full((32, 32, 3), value, dtype=np.uint8))
    output = tmp_path / "vace.mp4"
    args = ["generate", "--prompt", "a fox", "--output", str(output), "--num-frames", "9", "--height", "32"]
    assert cli.main([*args, "--width", "32", "--steps", "1", "--control-video", str(control)]) == 0
    assert "(9 frames, 32x32" in capsys.readouterr().out
    assert cli.main([*args, "--control-video", str(tmp_path / "missing.mp4")]) == 2
    assert "--control-video" in capsys.readouterr().err
    assert cli.main([*args, "--control-video", str(control), "--video", str(control)]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_generate_video_to_video_from_an_input_video(tmp_path, capsys, caplog):
    """``--input-video`` end to end on the tiny model: ``--stream`` writes the restyled video (the input's size, its
    two whole chunks: 9 + 12 of 23 frames, the dropped frames named in a warning) into an mp4; ``--height``/``--width``
    resize the frames and ``--num-frames`` keeps the first ones, with the motion-aware strength."""
    import imageio

    source = tmp_path / "input.mp4"
    with imageio.get_writer(source, fps=8) as writer:
        for value in np.linspace(0, 255, 23).astype(np.uint8):
            writer.append_data(np.full((48, 48, 3), value, dtype=np.uint8))
    output = tmp_path / "restyled.mp4"
    args = ["generate", "--prompt", "a fox", "--input-video", str(source), "--strength", "0.6", "--steps", "2"]
    assert cli.main([*args, "--stream", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "First 9 frames after" in printed and f"Wrote {output} (21 frames, 48x48" in printed
    assert "dropped the last 2 frames" in caplog.text
    frames = read_frames(output)
    assert frames.shape[:3] == (21, 48, 48)

    resized = tmp_path / "resized.mp4"
    args += ["--height", "32", "--width", "32", "--num-frames", "9", "--motion-aware", "--output", str(resized)]
    assert cli.main(args) == 0
    assert f"Wrote {resized} (9 frames, 32x32" in capsys.readouterr().out
    assert read_frames(resized).shape[:3] == (9, 32, 32)


def test_convert_is_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    assert "--checkpoint" in capsys.readouterr().out


# A valid value of each settings flag `generate` passes to the pipeline call (valid for text-to-video).
SETTINGS_FLAG_VALUES = {
    "steps": ["--steps", "2"],
    "timesteps": ["--timesteps", "1000", "500"],
    "first_chunk_timesteps": ["--first-chunk-timesteps", "1000", "750", "500"],
    "context_noise": ["--context-noise", "100"],
    "guidance_scale": ["--guidance-scale", "3"],
    "attention_window": ["--attention-window", "6"],
    "sink_frames": ["--attention-window", "6", "--sink-frames", "3"],
    "kv_cache_policy": ["--kv-cache-policy", "recompute", "--context-frames", "3"],
    "context_frames": ["--kv-cache-policy", "recompute", "--context-frames", "3"],
    "kv_cache_attention_bias": ["--kv-cache-attention-bias", "0.5"],
    "keep_first_frame": ["--kv-cache-policy", "recompute", "--context-frames", "3", "--keep-first-frame"],
    "prompt_transition_chunks": ["--prompt-switch", "13:a dog", "--prompt-transition-chunks", "2"],
    "recache": ["--prompt-switch", "13:a dog", "--recache"],
    "rope_positions": ["--rope-positions", "window", "--attention-window", "6"],
    "sink_update": [
        "--sink-update", "ema", "--rope-positions", "window", "--attention-window", "9", "--sink-frames", "3",
    ],
    "sink_decay": [
        "--sink-update", "ema", "--rope-positions", "window", "--attention-window", "9", "--sink-frames", "3",
        "--sink-decay", "0.9",
    ],
    "kv_cache_dtype": ["--kv-cache-dtype", "int8"],
    "recache_sink": [
        "--prompt-switch", "13:a dog", "--recache", "--recache-sink", "keep", "--attention-window", "6",
        "--sink-frames", "3",
    ],
    "kv_flush": ["--prompt-switch", "13:a dog", "--kv-flush", "--attention-window", "6", "--sink-frames", "1"],
    "rope_cut": ["--prompt-switch", "13:a dog", "--rope-cut", "--rope-positions", "window", "--attention-window", "6"],
}  # fmt: skip


@pytest.mark.parametrize("kind", ["t2v", "i2v", "vace", "v2v"])
def test_every_settings_flag_is_taken_by_its_pipeline_or_refused_before_loading(kind, tmp_path):
    """Each settings flag ``generate`` passes on (under the settings' name) is a parameter of the ``__call__`` of the
    pipeline its inputs pick (``stream`` takes the same), or the pre-load checks refuse the combination: never a
    ``TypeError`` after a load."""
    import inspect

    import imageio

    from fastgen_diffusers import pipelines
    from fastgen_diffusers.cli.checks import UsageError, check_generate_arguments, settings_arguments
    from fastgen_diffusers.cli.common import SETTINGS_FLAGS

    imageio.imwrite(tmp_path / "frame.png", np.zeros((32, 32, 3), dtype=np.uint8))
    imageio.mimwrite(tmp_path / "clip.gif", [np.zeros((32, 32, 3), dtype=np.uint8)] * 21)
    inputs, pipeline = {
        "t2v": ([], pipelines.WanCausalPipeline),
        "i2v": (["--image", str(tmp_path / "frame.png")], pipelines.WanCausalImageToVideoPipeline),
        "vace": (["--control-video", str(tmp_path / "clip.gif")], pipelines.WanCausalVACEPipeline),
        "v2v": (["--input-video", str(tmp_path / "clip.gif")], pipelines.WanCausalVideoToVideoPipeline),
    }[kind]
    parameters = inspect.signature(pipeline.__call__).parameters
    assert set(SETTINGS_FLAG_VALUES) == set(SETTINGS_FLAGS)
    taken = []
    for name, flags in SETTINGS_FLAG_VALUES.items():
        argv = ["generate", "--prompt", "a fox", "--output", str(tmp_path / "o.mp4"), *inputs, *flags]
        args = cli.build_parser().parse_args(argv)
        try:
            check_generate_arguments(args)
        except UsageError as error:
            # the conditioned pipelines refuse Krea's recompute (and what needs it) before loading
            assert kind in ("i2v", "vace") and "recompute" in flags, f"{name}: {error}"
            continue
        given = settings_arguments(args)
        assert SETTINGS_FLAGS[name] in given
        assert set(given) <= set(parameters), (name, given)
        taken.append(name)
    if kind in ("t2v", "v2v"):
        assert taken == list(SETTINGS_FLAG_VALUES)
    else:
        assert set(taken) == set(SETTINGS_FLAG_VALUES) - {"kv_cache_policy", "context_frames", "keep_first_frame"}


def test_generate_passes_the_prompt_switch_cache_options(tmp_path, monkeypatch):
    """``--recache-sink``, ``--kv-flush`` and ``--rope-cut`` (all switches, or the frames given) reach the pipeline
    call as the settings' ``recache_sink`` / ``kv_flush`` / ``rope_cut``; a flag left out is not passed."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    names = ("prompt", "recache", "recache_sink", "kv_flush", "rope_cut")
    seen = []
    call = WanCausalPipeline.__call__

    def recording(self, *args, **kwargs):
        seen.append({name: kwargs[name] for name in names if name in kwargs})
        return call(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalPipeline, "__call__", recording)
    base = ["generate", "--prompt", "a fox", "--output", str(tmp_path / "o.mp4"), "--num-frames", "21"]
    base += ["--height", "32", "--width", "32", "--steps", "1", "--prompt-switch", "9:a dog"]
    window = ["--attention-window", "6", "--sink-frames", "3"]
    assert cli.main([*base, *window, "--recache", "--recache-sink", "keep"]) == 0
    assert cli.main([*base, *window, "--kv-flush"]) == 0
    assert cli.main([*base, *window, "--rope-positions", "window", "--rope-cut"]) == 0
    assert cli.main([*base, *window, "--rope-positions", "window", "--rope-cut", "9"]) == 0
    prompt = {0: "a fox", 9: "a dog"}
    assert seen == [
        {"prompt": prompt, "recache": True, "recache_sink": "keep"},
        {"prompt": prompt, "kv_flush": True},
        {"prompt": prompt, "rope_cut": True},
        {"prompt": prompt, "rope_cut": (9,)},
    ]


def _subcommand(name: str):
    parser = cli.build_parser()
    (subparsers,) = parser._subparsers._group_actions
    return subparsers.choices[name]


def test_settings_flags_help_is_the_settings_documentation():
    """Each settings flag's ``--help`` (``generate`` and ``convert``) is the documentation of the settings value it
    sets, word for word, so help and behaviour cannot disagree; a flag left out is ``None`` (the model's stored value,
    or the format's, stands); the policy choices are the registry's."""
    from fastgen_diffusers.cli.common import SETTINGS_FLAGS
    from fastgen_diffusers.settings import RolloutSettings, argument_names, policy_names

    generate = {action.dest: action for action in _subcommand("generate")._actions}
    for dest, name in SETTINGS_FLAGS.items():
        assert generate[dest].help.replace("%%", "%") == RolloutSettings.help_of(name), dest
        assert generate[dest].default is None, dest
    convert = {action.dest: action for action in _subcommand("convert")._actions}
    settings_flags = [dest for dest in convert if dest in argument_names()]
    assert len(settings_flags) >= 10, settings_flags
    for dest in settings_flags:
        assert convert[dest].help.replace("%%", "%") == RolloutSettings.help_of(dest), dest
        assert convert[dest].default is None, dest
    for actions in (generate, convert):
        assert tuple(actions["kv_cache_policy"].choices) == policy_names()


def test_the_attention_bias_reaches_image_to_video_and_changes_its_frames(tmp_path, monkeypatch):
    """``--kv-cache-attention-bias`` with ``--image``: the image-to-video pipeline applies the bias (as the T2V, VACE
    and V2V pipelines do), so the CLI passes it on rather than refusing it; the frames differ from an unbiased run."""
    import imageio

    from fastgen_diffusers.pipelines import WanCausalImageToVideoPipeline

    imageio.imwrite(tmp_path / "frame.png", np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    seen = []
    call = WanCausalImageToVideoPipeline.__call__

    def recording(self, *args, **kwargs):
        output = call(self, *args, **kwargs)
        seen.append((kwargs.get("kv_cache_attention_bias"), output.frames))
        return output

    monkeypatch.setattr(WanCausalImageToVideoPipeline, "__call__", recording)
    # 29 frames: the tiny I2V student's chunks (1, 4, 3); the last sees cached frames other than the first
    argv = ["generate", "--prompt", "a fox", "--image", str(tmp_path / "frame.png"), "--num-frames", "29"]
    argv += ["--height", "32", "--width", "32", "--steps", "1", "--output", str(tmp_path / "o.mp4")]
    assert cli.main([*argv, "--kv-cache-attention-bias", "0.5"]) == 0
    assert cli.main(argv) == 0
    (bias, biased), (none, plain) = seen
    assert (bias, none) == (0.5, None)
    # latent frames 0-4 (pixel frames 0-16) see no biased frame; the last chunk's do (the tiny VAE shrinks the change)
    assert np.array_equal(biased[:, :17], plain[:, :17])
    assert np.abs(biased[:, 17:] - plain[:, 17:]).max() > 1e-6


def test_the_cli_knows_the_tiny_models_chunk_layouts():
    """The pre-load layout checks read the tiny models' chunking from ``cli.common`` (the model modules stay
    unimported there): it must be what ``fastgen_diffusers.testing`` builds."""
    from fastgen_diffusers.cli.common import TINY_I2V_LAYOUT, TINY_LAYOUT
    from fastgen_diffusers.cli.i2v import load_i2v_pipeline
    from fastgen_diffusers.testing import tiny_vace_pipeline

    args = cli.build_parser().parse_args(["generate", "--prompt", "a fox", "--image", "x.png"])
    for layout, transformer in (
        (TINY_LAYOUT, tiny_pipeline().transformer),
        (TINY_LAYOUT, tiny_vace_pipeline().transformer),
        (TINY_I2V_LAYOUT, load_i2v_pipeline(args, None).transformer),
    ):
        config = transformer.config
        assert {name: config[name] for name in layout if name != "t2v_student"} == {
            name: value for name, value in layout.items() if name != "t2v_student"
        }
        assert layout["t2v_student"] == (config.in_channels == config.out_channels and config.image_dim is None)


def test_the_settings_flags_are_derived_from_the_settings_values():
    """Every flat settings argument is a settings flag (but ``sigmas``, ``kv_cache_engine`` and ``keep_cache``), with
    argparse options from its field's type, so a new option of a plain type, a registered policy's included, gets its
    flag with no line in the CLI; every setting a pipeline config stores is one of them."""
    from fastgen_diffusers.cli.common import SETTINGS_ARGUMENTS, settings_flag_table
    from fastgen_diffusers.settings import CONFIG_KEYS, POLICIES, PolicySettings, argument_names, register_policy
    from fastgen_diffusers.settings.base import setting

    names = [name for name, _ in SETTINGS_ARGUMENTS.values()]
    assert names == [name for name in argument_names() if name not in ("sigmas", "kv_cache_engine", "keep_cache")]
    assert set(CONFIG_KEYS) <= set(names)
    assert SETTINGS_ARGUMENTS["steps"] == ("num_inference_steps", {"type": int})
    assert SETTINGS_ARGUMENTS["sink_decay"] == ("sink_decay", {"type": float})
    assert SETTINGS_ARGUMENTS["keep_first_frame"] == ("keep_first_frame", {"action": "store_true"})

    @register_policy
    @dataclass(frozen=True)
    class StrideSettings(PolicySettings):
        name: ClassVar[str] = "stride-test"
        title: ClassVar[str] = "a test policy"
        stride: int | None = setting(None, "Chunks to skip.")
        damping: float | None = setting(None, "A factor.")

    try:
        table = settings_flag_table()
    finally:
        del POLICIES["stride-test"]
    assert table["stride"] == ("stride", {"type": int}) and table["damping"] == ("damping", {"type": float})
    assert {dest: entry for dest, entry in table.items() if dest not in ("stride", "damping")} == SETTINGS_ARGUMENTS
