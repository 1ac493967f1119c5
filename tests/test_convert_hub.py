"""``diffusers.DiffusionPipeline.from_pretrained(dir)`` returns the causal pipeline, for converted directories and for
directories written by ``save_pretrained`` of all three pipelines (one mechanism: ``fastgen_diffusers.hub``)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from diffusers import DiffusionPipeline
from test_convert import _student, original_state_dict, wan_base  # noqa: F401

from fastgen_diffusers.convert import convert_checkpoint
from fastgen_diffusers.convert.card import REPO_PLACEHOLDER
from fastgen_diffusers.hub import HUB_PIPELINE_MODULE
from fastgen_diffusers.pipelines import WanCausalImageToVideoPipeline, WanCausalPipeline

CALL = {"height": 16, "width": 16, "num_frames": 9, "max_sequence_length": 8, "output_type": "latent"}


@pytest.fixture(scope="module")
def converted(wan_base, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("hub")
    checkpoint = root / "chunkwise" / "causal_forcing.pt"
    checkpoint.parent.mkdir()
    torch.save({"generator_ema": original_state_dict(_student(seed=51))}, checkpoint)
    return convert_checkpoint(checkpoint, base=wan_base, output=root / "out", base_model_id="org/wan-tiny").output


def _latents(pipe) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red fox runs", generator=torch.Generator().manual_seed(0), **CALL).frames


def test_diffusion_pipeline_loads_a_converted_directory_as_the_causal_pipeline(converted):
    index = json.loads((converted / "model_index.json").read_text())
    assert index["_class_name"] == [HUB_PIPELINE_MODULE, "WanCausalPipeline"]
    assert index["transformer"] == ["fastgen_diffusers", "WanCausalTransformer3DModel"]
    pipe = DiffusionPipeline.from_pretrained(converted, trust_remote_code=True)
    assert type(pipe) is WanCausalPipeline
    direct = WanCausalPipeline.from_pretrained(converted)  # no remote code needed through the class itself
    assert pipe.config.timesteps == direct.config.timesteps and pipe.config.timesteps is not None
    assert torch.equal(_latents(pipe), _latents(direct))


def test_without_trust_remote_code_diffusers_says_what_to_pass(converted):
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        DiffusionPipeline.from_pretrained(converted)


def test_the_model_card_snippets_run_as_written(converted):
    """Both loading snippets of the card run as printed (up to the GPU move): the pipeline in bfloat16, the VAE in
    float32 as the CLI keeps it, and the front matter names a license."""
    card = (converted / "README.md").read_text()
    assert re.search(r"^license: other$", card, flags=re.M) and re.search(r"^license_link: https://", card, flags=re.M)
    snippets = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert len(snippets) == 2
    for code in snippets:
        code = code.split('pipe.to("cuda")')[0].replace(REPO_PLACEHOLDER, str(converted))
        namespace = {}
        exec(code, namespace)  # each snippet imports what it uses
        pipe = namespace["pipe"]
        assert type(pipe) is WanCausalPipeline and pipe.transformer.dtype == torch.bfloat16
        assert pipe.vae.dtype == torch.float32


def _i2v():
    from fastgen_diffusers.testing import tiny_components

    components = tiny_components(seed=2, chunk_size=2, independent_first_frame=True)
    return WanCausalImageToVideoPipeline(**components)


def _vace():
    from fastgen_diffusers.testing import tiny_vace_pipeline

    return tiny_vace_pipeline(seed=3)


def _t2v():
    from fastgen_diffusers.testing import tiny_pipeline

    return tiny_pipeline(seed=4)


@pytest.mark.parametrize("make", [_t2v, _i2v, _vace], ids=["t2v", "i2v", "vace"])
def test_save_pretrained_of_every_pipeline_loads_back_through_diffusers(make, tmp_path):
    pipe = make()
    pipe.save_pretrained(tmp_path)
    assert (tmp_path / f"{HUB_PIPELINE_MODULE}.py").is_file()
    assert (tmp_path / "transformer" / "fastgen_diffusers.py").is_file()
    for loaded in (
        DiffusionPipeline.from_pretrained(tmp_path, trust_remote_code=True),
        type(pipe).from_pretrained(tmp_path),
    ):
        assert type(loaded) is type(pipe) and type(loaded.transformer) is type(pipe.transformer)
        for key, value in pipe.transformer.state_dict().items():
            assert torch.equal(loaded.transformer.state_dict()[key], value), key
    # A second save of a loaded pipeline writes the same hub form (idempotent).
    resaved = tmp_path / "again"
    DiffusionPipeline.from_pretrained(tmp_path, trust_remote_code=True).save_pretrained(resaved)
    assert json.loads((resaved / "model_index.json").read_text()) == json.loads(
        (tmp_path / "model_index.json").read_text()
    )


def test_hub_form_passes_diffusers_download_checks(converted):
    """What ``DiffusionPipeline.download`` checks for a Hub repo: custom components have their file, and the causal
    classes read the class name plainly (so ``WanCausalPipeline.from_pretrained(hub_id)`` downloads no code)."""
    from diffusers.pipelines.pipeline_loading_utils import _get_custom_components_and_folders

    filenames = [p.relative_to(converted).as_posix() for p in converted.rglob("*") if p.is_file()]
    config = DiffusionPipeline._dict_from_json_file(converted / "model_index.json")
    custom, folders = _get_custom_components_and_folders("org/student", config, filenames)
    assert custom == {"transformer": "fastgen_diffusers"} and "transformer" in folders
    assert f"{HUB_PIPELINE_MODULE}.py" in filenames
    assert WanCausalPipeline._dict_from_json_file(converted / "model_index.json")["_class_name"] == "WanCausalPipeline"
