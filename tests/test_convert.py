"""Converting Self-Forcing / CausVid / FastGen checkpoints into causal pipeline directories (tiny models, CPU).

The helpers here (original-layout state dicts, the tiny base directory) are shared by the other test_convert_* files.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_WAN_CONFIG
from diffusers import WanTransformer3DModel

from fastgen_diffusers.convert import (
    DEFAULT_SAMPLING,
    CheckpointConversionError,
    UnsafeCheckpointError,
    build_transformer,
    detect_format,
    load_checkpoint_safely,
    original_to_diffusers_state_dict,
    to_diffusers_state_dict,
    warp_timesteps,
)

TINY = {key: value for key, value in TINY_WAN_CONFIG.items() if key != "rope_max_seq_len"}
TINY_I2V = {**TINY, "in_channels": 36, "image_dim": 8, "added_kv_proj_dim": 64, "pos_embed_seq_len": 6}

# diffusers -> original Wan names, written out independently of the converter (the inverse of its mapping).
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
    ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
    ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
    ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".norm2.", ".norm3."),  # the cross-attention norm (original norm1/norm2 have no weights)
    ("proj_out.", "head.head."),
]


def to_original_key(key: str) -> str:
    """The original Wan name of a diffusers ``WanTransformer3DModel`` parameter."""
    if key == "scale_shift_table":
        return "head.modulation"
    key = re.sub(r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation", key)
    for diffusers_name, original_name in _TO_ORIGINAL:
        key = key.replace(diffusers_name, original_name)
    return key


def tiny_wan(seed: int = 0, **config) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**(config or TINY)).eval()


def original_state_dict(model: torch.nn.Module, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The model's weights in the original Wan layout, as Self-Forcing / CausVid save them."""
    return {prefix + to_original_key(k): v.clone() for k, v in model.state_dict().items()}


def fastgen_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {"transformer." + k: v.clone() for k, v in model.state_dict().items()}


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A directory with the tiny transformer config (what `build_transformer` reads from --base)."""
    path = tmp_path_factory.mktemp("base")
    tiny_wan(seed=123).save_pretrained(path / "transformer")
    return path


def test_inverse_mapping_is_the_original_layout():
    keys = {to_original_key(k) for k in tiny_wan(**TINY_I2V).state_dict()}
    assert {"head.modulation", "head.head.weight", "blocks.0.modulation", "blocks.0.norm3.weight"} <= keys
    assert {
        "blocks.0.self_attn.q.weight",
        "blocks.1.cross_attn.k_img.weight",
        "blocks.0.cross_attn.norm_k_img.weight",
    } <= keys
    assert {"img_emb.proj.0.weight", "img_emb.proj.4.bias", "img_emb.emb_pos", "time_projection.1.weight"} <= keys
    assert not any("norm2" in k or "attn1" in k or "to_" in k for k in keys)


@pytest.mark.parametrize("config", [TINY, TINY_I2V], ids=["t2v", "i2v-flf2v"])
def test_original_keys_map_back_bit_identically(config):
    model = tiny_wan(**config)
    converted = original_to_diffusers_state_dict(original_state_dict(model))
    assert_bit_identical(converted, model.state_dict())


def test_build_transformer_takes_the_checkpoint_tensors(base_dir):
    model = tiny_wan(seed=1)
    transformer = build_transformer(to_diffusers_state_dict(original_state_dict(model)), base_dir, chunk_size=2)
    assert transformer.config.chunk_size == 2 and transformer.config.independent_first_frame is False
    assert_bit_identical(transformer.state_dict(), model.state_dict())
    bf16 = build_transformer(to_diffusers_state_dict(fastgen_state_dict(model)), base_dir, dtype=torch.bfloat16)
    assert {v.dtype for v in bf16.state_dict().values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("checkpoint", "format", "copies", "ema"),
    [
        ({"generator_ema": 1, "generator": 0}, "self-forcing", ["generator_ema", "generator"], "generator_ema"),
        ({"generator": 0}, "self-forcing", ["generator"], "generator"),
        ({"model": {"net": 0, "ema": 1, "fake_score": 2}, "iteration": 7}, "fastgen", ["net", "ema"], "ema"),
    ],
)
def test_detect_format_and_default_ema(checkpoint, format, copies, ema):
    model = tiny_wan()
    weights = [original_state_dict(model), original_state_dict(model)]
    if format == "fastgen":
        weights = [fastgen_state_dict(model), fastgen_state_dict(model), {"x": torch.zeros(1)}]
        checkpoint = {"model": {k: weights[v] for k, v in checkpoint["model"].items()}, "iteration": 7}
    else:
        checkpoint = {k: weights[v] for k, v in checkpoint.items()}
    detected = detect_format(checkpoint)
    assert detected.format == format and list(detected.copies) == copies
    assert detected.select() == ema
    assert "Self-Forcing" in detected.description or "FastGen" in detected.description


ORIGINAL = {"model.head.head.weight": torch.zeros(1)}  # enough keys to tell the layout
DIFFUSERS = {"transformer.proj_out.weight": torch.zeros(1)}


def test_ema_selection_errors_name_the_copies():
    both = detect_format({"generator_ema": ORIGINAL, "generator": ORIGINAL}, "causvid")
    assert both.format == "causvid"
    assert both.select(True) == "generator_ema" and both.select(False) == "generator"
    only_regular = detect_format({"generator": ORIGINAL})
    with pytest.raises(CheckpointConversionError, match=r"has none; it has \['generator'\]"):
        only_regular.select(True)
    only_ema = detect_format({"model": {"ema": DIFFUSERS}})
    with pytest.raises(CheckpointConversionError, match=r"only has \['ema'\]"):
        only_ema.select(False)
    several = detect_format({"model": {"net": DIFFUSERS, "ema_0.99": DIFFUSERS, "ema_0.9": {}}})
    assert several.select() == "ema_0.99"  # the empty copy is not a weight copy
    two = detect_format({"model": {"ema_a": DIFFUSERS, "ema_b": DIFFUSERS}})
    with pytest.raises(CheckpointConversionError, match=r"several EMA copies \['ema_a', 'ema_b'\]"):
        two.select()
    assert two.select("ema_b") == "ema_b"
    bare = detect_format(DIFFUSERS, "fastgen")
    assert (bare.format, bare.select(), bare.description) == (
        "fastgen",
        "state_dict",
        "FastGen: a flat state dict (diffusers Wan keys, no EMA copy)",
    )


def test_detect_format_rejects_unknown_and_contradicting_layouts():
    with pytest.raises(CheckpointConversionError, match=r"Unrecognised checkpoint.*\['weights'\]"):
        detect_format({"weights": ORIGINAL})
    with pytest.raises(CheckpointConversionError, match=r"Cannot tell the key layout.*\['model.norm.weight'\]"):
        detect_format({"generator": {"model.norm.weight": torch.zeros(1)}})
    with pytest.raises(CheckpointConversionError, match="--format fastgen expects"):
        detect_format({"generator": ORIGINAL}, "fastgen")
    with pytest.raises(CheckpointConversionError, match="--format causvid expects"):
        detect_format({"model": {"net": DIFFUSERS}}, "causvid")
    with pytest.raises(ValueError, match="`format` must be one of"):
        detect_format({}, "wan")


@pytest.mark.parametrize("layout", ["original", "fastgen"])
def test_unknown_missing_and_misshaped_keys_are_listed(base_dir, layout):
    weights = original_state_dict(tiny_wan()) if layout == "original" else fastgen_state_dict(tiny_wan())
    prefix = "model." if layout == "original" else "transformer."
    norm = "blocks.1.norm3.bias" if layout == "original" else "blocks.1.norm2.bias"
    del weights[prefix + norm]
    weights[prefix + "blocks.0.extra_gate.weight"] = torch.zeros(3)
    ffn = "blocks.0.ffn.0.weight" if layout == "original" else "blocks.0.ffn.net.0.proj.weight"
    weights[prefix + ffn] = torch.zeros(32, 64)
    with pytest.raises(CheckpointConversionError) as error:
        build_transformer(to_diffusers_state_dict(weights), base_dir)
    message = str(error.value)
    assert "1 key(s) that map to no parameter" in message and "blocks.0.extra_gate.weight" in message
    assert "1 parameter(s) of the base transformer missing" in message and "blocks.1.norm2.bias" in message
    assert "blocks.0.ffn.net.0.proj.weight: checkpoint (32, 64), base config expects (64, 64)" in message
    assert "\n" not in message  # the CLI prints it as one line


def test_fastgen_training_heads_are_dropped_but_other_extras_fail(base_dir):
    model = tiny_wan()
    weights = {**fastgen_state_dict(model), "transformer.logvar_linear.weight": torch.zeros(1, 8)}
    assert_bit_identical(
        build_transformer(to_diffusers_state_dict(weights), base_dir).state_dict(), model.state_dict()
    )
    weights["transformer.r_embedder.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointConversionError, match="r_embedder.weight"):
        build_transformer(to_diffusers_state_dict(weights), base_dir)


def test_warped_self_forcing_timesteps():
    assert warp_timesteps([1000, 750, 500, 250], 5.0) == pytest.approx((1000.0, 937.5, 833.3333333, 625.0))
    assert DEFAULT_SAMPLING["self-forcing"].timesteps == warp_timesteps([1000, 750, 500, 250], 5.0)
    assert DEFAULT_SAMPLING["causvid"].timesteps == (1000.0, 757.0, 522.0)


class _Payload:
    """Pickles to a call that creates a file: what a malicious checkpoint would run on ``torch.load``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_with_a_callable_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"generator": {"model.patch_embedding.weight": torch.zeros(1)}, "extra": _Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"Refused to load .*evil\.pt.*Nothing in it was executed"):
        load_checkpoint_safely(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is real: an unsafe load runs it
    assert marker.exists()


def test_plain_pickles_and_safetensors_load(tmp_path):
    from safetensors.torch import save_file

    weights = {"model.head.head.weight": torch.arange(4.0)}
    torch.save({"generator": weights, "step": 3, "names": ["a"]}, tmp_path / "sf.pt")
    assert torch.equal(
        load_checkpoint_safely(tmp_path / "sf.pt")["generator"]["model.head.head.weight"], torch.arange(4.0)
    )
    save_file(weights, tmp_path / "w.safetensors")
    assert torch.equal(load_checkpoint_safely(tmp_path / "w.safetensors")["model.head.head.weight"], torch.arange(4.0))
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint_safely(tmp_path / "missing.pt")


@pytest.fixture(scope="module")
def wan_base(tmp_path_factory) -> Path:
    """A diffusers Wan directory as `WanPipeline.save_pretrained` writes it (plain transformer, UniPC-free)."""
    from diffusers import WanPipeline

    from fastgen_diffusers.pipelines import wan_transformer_from_causal
    from fastgen_diffusers.testing import tiny_components

    components = tiny_components(seed=5)
    components["transformer"] = wan_transformer_from_causal(components["transformer"])
    path = tmp_path_factory.mktemp("wan-base")
    WanPipeline(**components, transformer_2=None).save_pretrained(path)
    return path


def _student(seed: int = 11) -> WanTransformer3DModel:
    from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG

    config = {k: v for k, v in TINY_TRANSFORMER_CONFIG.items() if k != "chunk_size"}
    return tiny_wan(seed, **config)


def _front_matter(card: str) -> dict:
    import yaml

    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n", 2)[1])


GENERATE = {"height": 16, "width": 16, "num_frames": 9, "max_sequence_length": 8, "output_type": "latent"}


def test_converted_self_forcing_directory_loads_and_generates(wan_base, tmp_path):
    from fastgen_diffusers.convert import convert_checkpoint
    from fastgen_diffusers.pipelines import WanCausalPipeline

    ema, regular = _student(seed=11), _student(seed=12)
    checkpoint = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator": original_state_dict(regular), "generator_ema": original_state_dict(ema)}, checkpoint)
    result = convert_checkpoint(checkpoint, base=wan_base, output=tmp_path / "out", base_model_id="org/wan-tiny")
    assert not [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]  # the staging directory was renamed
    assert (result.format, result.copy) == ("self-forcing", "generator_ema")

    files = {p.relative_to(result.output).as_posix() for p in result.output.rglob("*") if p.is_file()}
    assert "transformer/diffusion_pytorch_model.safetensors" in files and "README.md" in files
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in files)

    pipe = WanCausalPipeline.from_pretrained(result.output)
    assert_bit_identical(pipe.transformer.state_dict(), ema.state_dict())
    assert pipe.transformer.config.chunk_size == 3 and pipe.transformer.config.independent_first_frame is False
    assert pipe.scheduler.config.shift == 5.0 and pipe.scheduler.config.stochastic_sampling
    model_index = json.loads((result.output / "model_index.json").read_text())
    assert model_index["timesteps"] == pytest.approx([1000.0, 937.5, 833.3333333, 625.0])
    assert model_index["context_noise"] == 0.0
    video = pipe("a red fox runs", generator=torch.Generator().manual_seed(0), **GENERATE).frames
    assert video.shape == (1, 16, 3, 2, 2) and torch.isfinite(video).all()

    card = (result.output / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["library_name"] == "diffusers" and meta["pipeline_tag"] == "text-to-video"
    assert meta["base_model"] == "org/wan-tiny" and "self-forcing" in meta["tags"]
    assert meta["license"] == "other" and meta["license_link"] == "https://github.com/guandeh17/Self-Forcing"
    assert "self_forcing_dmd.pt" in card and "`generator_ema`" in card and "937.5" in card
    assert "pip install fastgen-diffusers" in card and "WanCausalPipeline.from_pretrained" in card
    assert "(https://huggingface.co/org/wan-tiny)" in card
    assert "`pipe(prompt, timesteps=[1000, 937.5, 833.3333333, 625], context_noise=0" in card


def test_converted_fastgen_regular_weights_with_overrides(wan_base, tmp_path):
    from fastgen_diffusers.convert import convert_checkpoint
    from fastgen_diffusers.pipelines import WanCausalPipeline

    net, ema = _student(seed=21), _student(seed=22)
    checkpoint = tmp_path / "0004000.pth"
    model = {"net": fastgen_state_dict(net), "ema": fastgen_state_dict(ema), "fake_score": fastgen_state_dict(net)}
    torch.save(
        {"model": model, "iteration": 4000, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-5}]}}, checkpoint
    )
    result = convert_checkpoint(
        checkpoint,
        base=wan_base,
        output=tmp_path / "out",
        ema=False,
        dtype="bfloat16",
        chunk_size=2,
        independent_first_frame=True,
        timesteps=[1000, 500],
        context_noise=100,
        base_model_id="org/wan-tiny",
    )
    assert (result.format, result.copy) == ("fastgen", "net")
    pipe = WanCausalPipeline.from_pretrained(result.output)
    expected = {k: v.to(torch.bfloat16) for k, v in net.state_dict().items()}
    assert_bit_identical({k: v.to(torch.bfloat16) for k, v in pipe.transformer.state_dict().items()}, expected)
    assert pipe.transformer.config.chunk_size == 2 and pipe.transformer.config.independent_first_frame is True
    model_index = json.loads((result.output / "model_index.json").read_text())
    assert model_index["timesteps"] == [1000.0, 500.0] and model_index["context_noise"] == 100.0
    assert _front_matter((result.output / "README.md").read_text())["tags"][-1] == "fastgen"


def test_call_without_arguments_uses_the_stored_settings(wan_base, tmp_path):
    from fastgen_diffusers.convert import convert_checkpoint
    from fastgen_diffusers.pipelines import WanCausalPipeline

    checkpoint = tmp_path / "model.pt"
    torch.save({"generator": original_state_dict(_student())}, checkpoint)
    result = convert_checkpoint(
        checkpoint, base=wan_base, output=tmp_path / "out", format="causvid", base_model_id="org/wan-tiny"
    )
    assert result.sampling.timesteps == (1000.0, 757.0, 522.0)
    pipe = WanCausalPipeline.from_pretrained(result.output)
    default = pipe("a cat", generator=torch.Generator().manual_seed(0), **GENERATE).frames
    spelled = pipe("a cat", timesteps=[1000, 757, 522], generator=torch.Generator().manual_seed(0), **GENERATE).frames
    assert torch.equal(default, spelled)


def test_cli_convert(wan_base, tmp_path, capsys):
    import argparse

    from fastgen_diffusers.convert import add_convert_subparser

    checkpoint = tmp_path / "model.pt"
    torch.save({"generator": original_state_dict(_student())}, checkpoint)
    parser = argparse.ArgumentParser(prog="fastgen-diffusers")
    add_convert_subparser(parser.add_subparsers(dest="command", required=True))
    argv = ["convert", "--checkpoint", str(checkpoint), "--base", str(wan_base), "--base-model-id", "org/w"]
    argv += ["--output", str(tmp_path / "o")]
    args = parser.parse_args([*argv, "--format", "causvid", "--timesteps", "1000", "750", "--warp-shift", "8"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    found = "CausVid: a {'generator', 'generator_ema'} checkpoint (original Wan keys, weight copies ['generator'])"
    assert found in printed
    assert "'timesteps': [1000.0, 960.0]" in printed
    assert "'shift': 8.0" in printed
    with pytest.raises(SystemExit, match="^error: --output .* exists and is not an empty directory"):
        args.func(args)
    args = parser.parse_args([*argv[:-1], str(tmp_path / "o2"), "--ema"])
    with pytest.raises(SystemExit, match="An EMA copy was requested but the checkpoint has none"):
        args.func(args)
    # the cache settings of the policies override the format's too (stored as pipeline config fields)
    overrides = {"attention_window": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"}
    overrides |= {"sink_decay": 0.99, "kv_cache_attention_bias": 0.5}
    flags = [str(part) for key, value in overrides.items() for part in ("--" + key.replace("_", "-"), value)]
    args = parser.parse_args([*argv[:-1], str(tmp_path / "o3"), "--format", "causvid", *flags])
    assert args.func(args) == 0
    model_index = json.loads((tmp_path / "o3" / "model_index.json").read_text())
    assert {key: model_index[key] for key in overrides} == overrides
    args = parser.parse_args(
        [*argv[:-1], str(tmp_path / "o4"), "--kv-cache-policy", "recompute", "--context-frames", "2"]
    )
    assert args.func(args) == 0
    model_index = json.loads((tmp_path / "o4" / "model_index.json").read_text())
    assert (model_index["kv_cache_policy"], model_index["context_frames"]) == ("recompute", 2)
    args = parser.parse_args([*argv[:-1], str(tmp_path / "o5"), "--sink-update", "ema"])  # no window, no sink
    with pytest.raises(SystemExit, match="^error: `sink_update='ema'` averages evicted frames into the sink"):
        args.func(args)
    assert not (tmp_path / "o5").exists()


def test_names_of_the_single_module_converter_still_import():
    import fastgen_diffusers.convert as convert

    names = [
        "FORMATS", "DEFAULT_SAMPLING", "StudentSettings", "warp_timesteps", "load_checkpoint_safely",
        "DetectedCheckpoint", "detect_format", "original_to_diffusers_state_dict", "to_diffusers_state_dict",
        "check_state_dict", "ConversionResult", "build_transformer", "convert_checkpoint", "model_card",
        "add_convert_subparser", "run_convert", "CheckpointConversionError", "UnsafeCheckpointError",
    ]  # fmt: skip
    assert all(callable(getattr(convert, name)) or name.isupper() for name in names)
    assert {"auto", "self-forcing", "causvid", "fastgen"} <= set(convert.FORMATS)


@pytest.mark.parametrize("pending", [(), ("kv_cache_policy",)], ids=["every setting applied", "one pending"])
def test_the_card_notes_sampling_json_only_when_a_setting_is_left_there(tmp_path, pending):
    from fastgen_diffusers.convert.card import model_card
    from fastgen_diffusers.convert.formats import get_format
    from fastgen_diffusers.convert.result import ConversionResult

    row = get_format("self-forcing")
    recompute = {"kv_cache_policy": "recompute", "context_frames": 3}
    settings = row.sampling if not pending else dataclasses.replace(row.sampling, **recompute)
    applied = tuple(key for key in settings.as_dict() if key not in pending)
    result = ConversionResult(tmp_path, row.name, "generator_ema", "found", settings, applied, pending)
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"x")
    card = model_card(result, row=row, checkpoint=checkpoint, lora_file=None, base_model="org/wan", dtype=None)
    assert ("Settings marked `sampling.json`" in card) == bool(pending)
    assert ("`sampling.json` (policy pending)" in card) == bool(pending)
    assert "\n\n\n" not in card.split("## Sampling settings")[1].split("## License")[0]  # no gap left by the note


def test_generate_on_a_converted_causvid_directory_samples_its_stored_schedule(wan_base, tmp_path, monkeypatch):
    """``fastgen-diffusers generate`` without ``--steps`` samples the schedule the converter stored (CausVid's 1000,
    757, 522), as ``pipe(prompt)`` does: three denoising forwards per chunk at those timesteps."""
    from fastgen_diffusers.cli import main
    from fastgen_diffusers.convert import convert_checkpoint
    from fastgen_diffusers.models import WanCausalTransformer3DModel

    checkpoint = tmp_path / "causvid.pt"
    torch.save({"generator": original_state_dict(_student())}, checkpoint)
    output = tmp_path / "causvid"
    convert_checkpoint(checkpoint, base=wan_base, output=output, format="causvid", base_model_id="org/wan-tiny")
    calls = []
    forward = WanCausalTransformer3DModel.forward

    def recording(self, hidden_states, timestep, *args, **kwargs):
        calls.append((kwargs.get("start_frame", 0), kwargs.get("store_kv", False), timestep.flatten()[0].item()))
        return forward(self, hidden_states, timestep, *args, **kwargs)

    monkeypatch.setattr(WanCausalTransformer3DModel, "forward", recording)
    argv = ["generate", "--prompt", "a cat", "--model", str(output), "--output", str(tmp_path / "cat.mp4")]
    assert main([*argv, "--num-frames", "21", "--height", "16", "--width", "16", "--device", "cpu"]) == 0
    denoising = {}
    for start, store, timestep in calls:
        if not store:
            denoising.setdefault(start, []).append(round(timestep, 3))
    assert denoising == {0: [1000.0, 757.0, 522.0], 3: [1000.0, 757.0, 522.0]}
    assert [start for start, store, _ in calls if store] == [0]  # the last chunk is not cached: nothing follows it
