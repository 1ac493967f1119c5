"""Hostile and broken inputs of ``convert``: files named for what they are, refused weights, an output that is either
complete or absent, shards streamed one at a time, and the CLI's one-line errors."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import pytest
import torch
from bench_loader import load_benchmark
from safetensors.torch import save_file
from test_convert import _student, original_state_dict, wan_base  # noqa: F401

from fastgen_diffusers.convert import CheckpointConversionError, convert_checkpoint, load_checkpoint_safely
from fastgen_diffusers.convert.writer import parse_size, write_sharded_safetensors


def _weights() -> dict[str, torch.Tensor]:
    return original_state_dict(_student(seed=41))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"is empty \(0 bytes\)"),
        (b"<!DOCTYPE html><html>Rate limited</html>", r"not a PyTorch checkpoint .* an HTML/XML document"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc", r"a Git LFS pointer"),
        (b"hello, these are not weights", r"not a PyTorch checkpoint .* a text file"),
    ],
    ids=["empty", "html", "lfs-pointer", "text"],
)
def test_non_checkpoint_files_are_named_for_what_they_are(tmp_path, content, match):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointConversionError, match=match):
        load_checkpoint_safely(path)


@pytest.mark.parametrize("container", ["zip", "legacy", "safetensors"])
def test_truncated_files_say_truncated(tmp_path, container):
    weights = {"generator": _weights()}
    path = tmp_path / ("model.safetensors" if container == "safetensors" else "model.pt")
    if container == "safetensors":
        save_file(weights["generator"], str(path))
    else:
        torch.save(weights, path, _use_new_zipfile_serialization=container == "zip")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointConversionError, match="truncated or corrupt") as error:
        load_checkpoint_safely(path)
    assert "\n" not in str(error.value)


def _convert(tmp_path: Path, base: Path, weights: dict, **kwargs):
    checkpoint = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator": weights}, checkpoint)
    return convert_checkpoint(checkpoint, base=base, output=tmp_path / "out", base_model_id="org/w", **kwargs)


def _leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out")))


def test_non_finite_weights_are_refused_and_leave_nothing(wan_base, tmp_path):  # noqa: F811
    weights = _weights()
    last_block = max(k for k in weights if k.startswith("model.blocks."))
    weights[last_block] = weights[last_block].clone()
    weights[last_block].view(-1)[0] = float("nan")
    # Small shards: some are written before the broken tensor is reached.
    with pytest.raises(CheckpointConversionError, match=r"holds 1 NaN/Inf value\(s\).*--allow-non-finite"):
        _convert(tmp_path, wan_base, weights, max_shard_size="4KB")
    assert _leftovers(tmp_path) == []  # no output, no staging directory: a rerun works
    result = _convert(tmp_path, wan_base, weights, max_shard_size="4KB", allow_non_finite=True)
    assert result.output.is_dir() and _leftovers(tmp_path) == ["out"]


def test_a_cast_that_overflows_is_refused(wan_base, tmp_path):  # noqa: F811
    weights = _weights()
    key = "model.head.head.weight"
    weights[key] = weights[key].clone()
    weights[key].view(-1)[0] = 1e6  # finite in float32, inf in float16
    with pytest.raises(CheckpointConversionError, match=r"after the cast to torch.float16"):
        _convert(tmp_path, wan_base, weights, dtype="float16")


def test_non_float_weights_are_refused_before_any_work(wan_base, tmp_path):  # noqa: F811
    weights = _weights()
    weights["model.head.head.weight"] = weights["model.head.head.weight"].to(torch.int8)
    with pytest.raises(CheckpointConversionError, match=r"non-float weights .*head.*torch.int8"):
        _convert(tmp_path, wan_base, weights)
    assert _leftovers(tmp_path) == []


def test_an_interrupted_conversion_leaves_nothing_that_looks_valid(wan_base, tmp_path, monkeypatch):  # noqa: F811
    from fastgen_diffusers.convert import writer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "copy_base_components", interrupted)
    monkeypatch.setattr("fastgen_diffusers.convert.core.copy_base_components", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _convert(tmp_path, wan_base, _weights())
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    (tmp_path / "out").mkdir()  # an empty directory is a valid target
    assert _convert(tmp_path, wan_base, _weights()).output.is_dir()
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
        _convert(tmp_path, wan_base, _weights())


def test_shards_are_written_one_tensor_at_a_time(tmp_path):
    """The writer makes each output tensor only when it writes it, straight into its shard file, and drops it before
    the next one: one output tensor is alive at a time, so peak memory is the (mapped/lazy) source plus one tensor."""
    from safetensors.torch import load_file

    shapes = {f"w{i}": (torch.Size([64, 64]), torch.float32) for i in range(12)}  # 16 KiB each
    shapes["h"] = (torch.Size([3, 5]), torch.bfloat16)
    alive: set[str] = set()
    peak = [0]

    def make_tensor(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(dtype) + len(name)
        alive.add(name)
        weakref.finalize(tensor, alive.discard, name)
        peak[0] = max(peak[0], len(alive))
        return tensor

    shards = write_sharded_safetensors(tmp_path, shapes, make_tensor, max_shard_size=40_000)
    gc.collect()
    assert len(shards) == 6 and (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert peak[0] == 1 and not alive
    written = {}
    for shard in shards:
        written.update(load_file(str(tmp_path / shard)))
    assert sorted(written) == sorted(shapes)
    for name, (shape, dtype) in shapes.items():
        expected = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(dtype) + len(name)
        assert written[name].dtype == dtype and torch.equal(written[name], expected), name


def test_cli_errors_are_one_line_without_a_traceback(tmp_path, capsys):
    """The console entry's convert error is a ``SystemExit`` whose message (what the interpreter prints on stderr, with
    no traceback) is one line, and nothing else is printed."""
    from fastgen_diffusers import cli

    empty = tmp_path / "model.pt"
    empty.touch()
    argv = ["convert", "--checkpoint", str(empty), "--base", str(tmp_path), "--base-model-id", "org/w"]
    with pytest.raises(SystemExit) as exit:
        cli.main([*argv, "--output", str(tmp_path / "out")])
    message = exit.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith("error: --base"), message
    assert capsys.readouterr().err == ""


def test_cli_dtypes_are_what_the_converter_writes():
    from fastgen_diffusers.cli.convert import DTYPES
    from fastgen_diffusers.convert.core import DTYPE_NAMES

    assert sorted(DTYPES) == sorted(DTYPE_NAMES)


def test_cli_names_empty_and_foreign_files(wan_base, tmp_path):  # noqa: F811
    import argparse

    from fastgen_diffusers.cli.convert import add_convert_subparser

    parser = argparse.ArgumentParser(prog="fastgen-diffusers")
    add_convert_subparser(parser.add_subparsers(dest="command", required=True))
    for name, content, match in (
        ("empty.pt", b"", "is empty"),
        ("page.pt", b"<html>", "HTML"),
        ("w.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{", "not a readable safetensors file"),
    ):
        path = tmp_path / name
        path.write_bytes(content)
        argv = ["convert", "--checkpoint", str(path), "--base", str(wan_base), "--base-model-id", "org/w"]
        args = parser.parse_args([*argv, "--output", str(tmp_path / "out")])
        with pytest.raises(SystemExit, match=f"^error: .*{match}") as error:
            args.func(args)
        assert "\n" not in str(error.value.code)
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--output", str(tmp_path / "o"), "--chunk-size", "0"])
    assert not (tmp_path / "out").exists()


def test_a_local_base_without_a_hub_id_converts_with_a_valid_card_without_base_model(wan_base, tmp_path, caplog):  # noqa: F811
    """No Hub id is needed to convert: the card leaves out ``base_model``, a warning says how to add it, and the front
    matter is valid Hub metadata (``huggingface_hub.ModelCard`` parses it); with an id the card names it."""
    from huggingface_hub import ModelCard

    checkpoint = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator": _weights()}, checkpoint)
    result = convert_checkpoint(checkpoint, base=wan_base, output=tmp_path / "out")
    assert "no --base-model-id was given" in caplog.text and "Add `base_model: <hub id>`" in caplog.text
    data = ModelCard((result.output / "README.md").read_text()).data.to_dict()
    assert "base_model" not in data and data["library_name"] == "diffusers" and "self-forcing" in data["tags"]
    assert data["pipeline_tag"] == "text-to-video"
    named = convert_checkpoint(checkpoint, base=wan_base, output=tmp_path / "named", base_model_id="org/wan-tiny")
    assert ModelCard((named.output / "README.md").read_text()).data.base_model == "org/wan-tiny"


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_weights_are_written_and_read_back_bit_for_bit(wan_base, tmp_path, dtype):  # noqa: F811
    """``dtype="float8_e4m3fn" | "float8_e5m2"`` writes safetensors ``F8_E4M3`` / ``F8_E5M2`` shards holding exactly
    the cast weights; a float8 checkpoint converts as it is (its dtype kept)."""
    import json

    from safetensors.torch import load_file

    from fastgen_diffusers.convert import original_to_diffusers_state_dict

    weights = _weights()
    expected = {
        name: value.to(getattr(torch, dtype)) for name, value in original_to_diffusers_state_dict(weights).items()
    }
    (tmp_path / "cast").mkdir()
    (tmp_path / "stored").mkdir()
    cast = _convert(tmp_path / "cast", wan_base, weights, dtype=dtype)
    stored = _convert(tmp_path / "stored", wan_base, {k: v.to(getattr(torch, dtype)) for k, v in weights.items()})
    code = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}[dtype]
    for result in (cast, stored):
        (shard,) = result.shards
        path = result.output / "transformer" / shard
        header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
        assert {entry["dtype"] for key, entry in header.items() if key != "__metadata__"} == {code}
        written = load_file(str(path))
        assert sorted(written) == sorted(expected)
        for name, value in expected.items():
            assert written[name].dtype == value.dtype and torch.equal(
                written[name].view(torch.uint8), value.view(torch.uint8)
            )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "`dtype` must be one of"),
        ({"dtype": "float8_e4m3fnuz"}, "`dtype` must be one of"),
        ({"max_shard_size": "5XB"}, "`max_shard_size` must be"),
        ({"lora_alpha": float("nan"), "lora": "lora.pt"}, "`lora_alpha` must be a positive finite number"),
        ({"attention_window": 2, "sink_frames": 3}, "sink_frames"),
        ({"attention_window": 2}, r"The chunk of latent frames \[0, 3\) does not fit the attention window"),
        ({"sink_decay": 0.9}, "`sink_decay=0.9` is the decay of the EMA sink: it needs `sink_update='ema'`"),
        ({"kv_cache_policy": "recompute"}, "`context_frames` must be a positive integer under recompute"),
        ({"base": "no_vae"}, "has no VAE in its model_index.json"),
        ({"base": "no_tokenizer_folder"}, "lists `tokenizer` but has no tokenizer/ folder"),
    ],
)
def test_every_argument_check_runs_before_the_first_shard(wan_base, tmp_path, monkeypatch, kwargs, match):  # noqa: F811
    """A bad argument or base is refused before any shard is written (the shard writer is never called)."""
    import json
    import shutil

    import fastgen_diffusers.convert.core as core

    def no_shards(*args, **kwargs):
        raise AssertionError("a shard was written before the argument check")

    monkeypatch.setattr(core, "write_sharded_safetensors", no_shards)
    base = kwargs.pop("base", None)
    if base is not None:  # a copy of the tiny base with a component missing
        shutil.copytree(wan_base, tmp_path / base)
        index = json.loads((tmp_path / base / "model_index.json").read_text())
        if base == "no_vae":
            index["vae"] = [None, None]
        else:
            shutil.rmtree(tmp_path / base / "tokenizer")
        (tmp_path / base / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=match) as error:
        _convert(tmp_path, tmp_path / base if base else wan_base, _weights(), **kwargs)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_convert_benchmark_runs_on_a_small_forty_layer_checkpoint(tmp_path, capsys):
    import json

    module = load_benchmark("bench_convert")
    checkpoint, base, nbytes = module.build(tmp_path, layers=40, dim=16, source="safetensors")
    module.main(["--child", "--checkpoint", str(checkpoint), "--base", str(base), "--output", str(tmp_path / "o")]
                + ["--max-shard-size", str(nbytes // 3)])  # fmt: skip
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["shards"] >= 3 and figures["peak_mb"] >= figures["baseline_mb"]


def test_a_safetensors_file_with_a_pt_name_is_read_as_safetensors(tmp_path):
    weights = _weights()
    path = tmp_path / "model.pt"
    save_file(weights, str(path))
    loaded = load_checkpoint_safely(path)
    assert sorted(loaded) == sorted(weights) and torch.equal(
        loaded["model.head.head.weight"], weights["model.head.head.weight"]
    )


def test_a_missing_base_says_so_and_an_unfetchable_hub_id_says_how_to_fetch(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from fastgen_diffusers.convert.writer import resolve_base

    with pytest.raises(CheckpointConversionError, match="no such directory"):
        resolve_base(str(tmp_path / "nope" / "wan"))

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointConversionError, match="huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        resolve_base("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


@pytest.mark.parametrize("size", ["abc", "5XB", "", "GB", "nanGB", "infGB", "0", "-1GB"])
def test_a_bad_max_shard_size_is_a_value_error_naming_it(size):
    """``--max-shard-size`` that is no size (not a number, unknown unit, nan, inf, not positive) is a one-line
    ``ValueError`` (the convert CLI prints it), never float()'s message or an OverflowError."""
    with pytest.raises(ValueError, match="`max_shard_size` must be"):
        parse_size(size)


def test_max_shard_sizes():
    assert [parse_size(size) for size in ("5GB", "512MiB", " 2kb ", 7, "1.5KB")] == [5 * 10**9, 2**29, 2000, 7, 1500]
