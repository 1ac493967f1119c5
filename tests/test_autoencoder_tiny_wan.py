"""AutoencoderTinyWan (TAEHV) against a reference recorded from upstream madebyollin/taehv (tests/data/taehv_tiny)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastgen_diffusers import AutoencoderTinyWan
from fastgen_diffusers.models import TinyWanStreamState
from fastgen_diffusers.testing import taehv_released_state_dict, tiny_taehv

DATA = Path(__file__).parent / "data" / "taehv_tiny"
META = json.loads((DATA / "meta.json").read_text())
VARIANTS = ("taew2_1", "taew2_2")
TOLERANCE = 1e-5


def released_weights(name: str) -> dict[str, torch.Tensor]:
    meta = META[name]
    return taehv_released_state_dict(
        meta["latent_channels"], meta["patch_size"], meta["seed"], meta["first_tgrow_oversized"]
    )


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    """(name, model, reference tensors in diffusers layout: (B, C, T, H, W), pixels in [-1, 1])."""
    name = request.param
    model = AutoencoderTinyWan.from_released_state_dict(released_weights(name))
    recorded = load_file(DATA / f"{name}.safetensors")  # upstream layout: (N, T, C, H, W), pixels in [0, 1]
    reference = {key: value.transpose(1, 2) for key, value in recorded.items()}
    for key in ("decoded", "decoded_streamed", "video"):
        reference[key] = reference[key] * 2 - 1
    return name, model, reference


def test_generated_weights_have_the_released_layout():
    for name in VARIANTS:
        shapes = {key: list(value.shape) for key, value in released_weights(name).items()}
        assert shapes == META[name]["shapes"]


@torch.no_grad()
def test_decode_matches_upstream(variant):
    _, model, reference = variant
    frames = model.decode(reference["latents"]).sample
    assert (frames - reference["decoded"]).abs().max().item() <= TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize("cuts", [(1,), (2,), (1, 2)])
def test_streamed_decode_matches_upstream_streaming_and_one_decode(variant, cuts):
    _, model, reference = variant
    latents = reference["latents"]
    state = TinyWanStreamState()
    bounds = [0, *cuts, latents.shape[2]]
    pieces = [model.decode_chunk(latents[:, :, s:e], state) for s, e in zip(bounds, bounds[1:])]
    assert [p.shape[2] for p in pieces] == [4 * (e - s) - (3 if s == 0 else 0) for s, e in zip(bounds, bounds[1:])]
    streamed = torch.cat(pieces, dim=2)
    assert (streamed - reference["decoded_streamed"]).abs().max().item() <= TOLERANCE
    assert (streamed - model.decode(latents).sample).abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_forked_stream_goes_on_like_the_original(variant):
    _, model, reference = variant
    latents = reference["latents"]
    state = TinyWanStreamState()
    model.decode_chunk(latents[:, :, :1], state)
    fork = state.copy()
    rest = model.decode_chunk(latents[:, :, 1:], state)
    assert torch.equal(model.decode_chunk(latents[:, :, 1:], fork), rest)


@torch.no_grad()
def test_encode_matches_upstream(variant):
    _, model, reference = variant
    latents = model.encode(reference["video"]).latents
    assert latents.shape == reference["encoded"].shape
    assert (latents - reference["encoded"]).abs().max().item() <= TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize("cuts", [(1,), (4,), (3, 6)])
def test_streamed_encode_matches_one_encode(variant, cuts):
    _, model, reference = variant
    video = reference["video"]
    state = TinyWanStreamState()
    bounds = [0, *cuts, video.shape[2]]
    pieces = [
        model.encode_chunk(video[:, :, s:e], state, last=e == video.shape[2]) for s, e in zip(bounds, bounds[1:])
    ]
    streamed = torch.cat(pieces, dim=2)
    assert (streamed - reference["encoded_streamed"]).abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_shapes_and_range():
    model = AutoencoderTinyWan.from_released_state_dict(released_weights("taew2_1"))
    latents = torch.randn(1, 16, 3, 2, 3) * 3
    frames = model.decode(latents).sample
    assert frames.shape == (1, 3, 9, 16, 24)
    assert frames.min() >= -1 and frames.max() <= 1
    assert model.encode(frames).latents.shape == (1, 16, 3, 2, 3)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_single_file_reads_the_configuration_from_shapes_not_the_name(tmp_path, suffix):
    weights = released_weights("taew2_2")  # 48 channels, patch 2, an oversized first frame unfold
    path = tmp_path / f"taew2_1_renamed{suffix}"  # a misleading name
    if suffix == ".pth":
        torch.save(weights, path)
    else:
        save_file(weights, path)
    model = AutoencoderTinyWan.from_single_file(path)
    assert (model.config.latent_channels, model.config.patch_size, model.config.scale_factor_spatial) == (48, 2, 16)
    assert model.config.decoder_time_upscale == (False, True, True)
    reference = load_file(DATA / "taew2_2.safetensors")
    with torch.no_grad():
        frames = model.decode(reference["latents"].transpose(1, 2)).sample
    assert (frames - (reference["decoded"].transpose(1, 2) * 2 - 1)).abs().max().item() <= TOLERANCE


def test_save_and_load_pretrained(tmp_path):
    model = AutoencoderTinyWan.from_released_state_dict(released_weights("taew2_1"))
    model.save_pretrained(tmp_path)
    loaded = AutoencoderTinyWan.from_pretrained(tmp_path)

    def plain(config):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if not k.startswith("_")}

    assert plain(loaded.config) == plain(model.config)
    latents = torch.randn(1, 16, 2, 2, 2)
    with torch.no_grad():
        assert torch.equal(loaded.decode(latents).sample, model.decode(latents).sample)


def test_bad_inputs_are_clear_errors(tmp_path):
    model = AutoencoderTinyWan()
    with pytest.raises(ValueError, match="latents"):
        model.decode(torch.randn(1, 48, 2, 2, 2))
    with pytest.raises(ValueError, match="video"):
        model.encode(torch.randn(1, 3, 5, 12, 16))
    with pytest.raises(ValueError, match="scale_factor_temporal"):
        AutoencoderTinyWan(decoder_time_upscale=(True, True, True))
    with pytest.raises(ValueError, match="not a TAEHV"):
        AutoencoderTinyWan.from_released_state_dict({"conv_in.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="super"):
        AutoencoderTinyWan.from_released_state_dict({"decoder.1.conv.0.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="pretrained_model_link_or_path"):
        AutoencoderTinyWan.from_single_file(tmp_path / "missing.pth")


@torch.no_grad()
def test_model_cpu_offload_hook_runs_before_every_chunk_and_inputs_follow_the_weights():
    """As diffusers' autoencoders do (``apply_forward_hook``): with model CPU offload (accelerate's hook on the
    module) the streamed decode and encode call the hook's ``pre_forward`` first, which moves the weights in; the
    inputs then go wherever the weights are (here a float64 model: float32 latents are taken to float64)."""
    model = tiny_taehv().double()
    calls = []

    class OffloadHook:  # what `cpu_offload_with_hook` attaches (`pre_forward` moves the module to the GPU)
        def pre_forward(self, module, *args, **kwargs):
            calls.append(type(module).__name__)
            return args, kwargs

    model._hf_hook = OffloadHook()
    latents = torch.randn(1, 16, 2, 2, 2)
    frames = model.decode_chunk(latents, TinyWanStreamState())
    assert frames.dtype == torch.float64 and calls == ["AutoencoderTinyWan"]
    model.encode(frames.float())
    assert len(calls) == 2
