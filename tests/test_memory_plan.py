"""The memory plan's formulas against what real models and engines hold: parameter counts of real transformers, text
encoders and decoders, self/cross K/V bytes of the engines after real tiny rollouts for every cache policy, CFG and
an 8-bit cache; bad input refused before any work."""

from __future__ import annotations

import pytest
import torch
from transformers import UMT5Config, UMT5EncoderModel

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.memory_plan import (
    GIB,
    UMT5_XXL,
    WAN_1_3B,
    WAN_14B,
    plan_rollout_memory,
    transformer_parameter_counts,
    umt5_encoder_parameters,
)
from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG, tiny_pipeline

TEXT_LEN = 12
HEIGHT = WIDTH = 32  # 2 x 2 tokens per latent frame


FLOAT32_MODULES = ("condition_embedder.time_embedder.", "scale_shift_table", "norm2.")


def _counts(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(quantizable linear weights, their rows, other parameters, float32-kept parameters) of a real model."""
    kept = {name for name, _ in model.named_parameters() if any(part in name for part in FLOAT32_MODULES)}
    linears = {
        name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and f"{name}.weight" not in kept
    }
    weights = sum(m.weight.numel() for m in linears.values())
    rows = sum(m.out_features for m in linears.values())
    float32 = sum(p.numel() for name, p in model.named_parameters() if name in kept)
    return weights, rows, sum(p.numel() for p in model.parameters()) - weights - float32, float32


@pytest.mark.parametrize(
    "config",
    [
        TINY_TRANSFORMER_CONFIG,
        {**TINY_TRANSFORMER_CONFIG, "num_attention_heads": 3, "ffn_dim": 40, "num_layers": 3, "text_dim": 24},
        {**TINY_TRANSFORMER_CONFIG, "cross_attn_norm": False, "patch_size": (1, 1, 1), "out_channels": 4},
        WAN_1_3B,
        WAN_14B,
    ],
    ids=["tiny", "odd", "no-norm2", "1.3b", "14b"],
)
def test_transformer_parameter_formula_equals_the_model(config):
    with torch.device("meta"):
        model = WanCausalTransformer3DModel(**config)
    assert tuple(transformer_parameter_counts(config)) == _counts(model)


def test_published_sizes():
    assert transformer_parameter_counts(WAN_14B).total == 14_288_491_584
    assert transformer_parameter_counts(WAN_1_3B).total == 1_418_996_800


@pytest.mark.parametrize("torch_dtype", [torch.bfloat16, torch.float16])
def test_weight_bytes_equal_a_model_loaded_by_diffusers(tmp_path, torch_dtype):
    """diffusers' loader keeps the `_keep_in_fp32_modules` in float32 whatever `torch_dtype`: the plan counts that."""
    tiny_pipeline().transformer.save_pretrained(tmp_path)
    model = WanCausalTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch_dtype)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    name = str(torch_dtype).removeprefix("torch.")
    plan = plan_rollout_memory(model.config, height=32, width=32, num_frames=9, weight_dtype=name, compute_dtype=name)
    assert held == plan.weights


@pytest.mark.parametrize("config", [UMT5_XXL, {**UMT5_XXL, "vocab_size": 99, "d_model": 16, "d_kv": 8, "d_ff": 40}])
def test_text_encoder_parameter_formula_equals_umt5(config):
    with torch.device("meta"):
        encoder = UMT5EncoderModel(UMT5Config(**config, num_decoder_layers=0))
    assert umt5_encoder_parameters(config) == sum(p.numel() for p in encoder.parameters())


def test_weight_bytes_by_dtype():
    linear, rows, other, float32 = transformer_parameter_counts(WAN_14B)
    plans = {
        dtype: plan_rollout_memory(WAN_14B, weight_dtype=dtype, decoder=None, text_encoder_offloaded=True)
        for dtype in ("bfloat16", "float8_e4m3fn", "int8", "float32")
    }
    assert plans["bfloat16"].weights == 2 * (linear + other) + 4 * float32
    assert plans["float32"].weights == 4 * linear + 2 * other + 4 * float32  # the rest in the compute dtype
    assert plans["float8_e4m3fn"].weights == linear + 4 * rows + 2 * other + 4 * float32  # float32 scale per row
    assert plans["int8"].weights == linear + 5 * rows + 2 * other + 4 * float32  # + int8 zero point per row
    assert plans["float8_e4m3fn"].text_encoder == 0 and plans["float8_e4m3fn"].decoder == 0


def _rollout_cache(pipe, **call):
    """Most self K/V bytes allocated and held, and cross K/V bytes, seen at any step end of a rollout and after it
    (kept: the last chunk's cache pass follows its last step; a rolling rollout cannot be kept)."""
    prompt = torch.randn(1, TEXT_LEN, TINY_TRANSFORMER_CONFIG["text_dim"])
    if call.get("guidance_scale", 1.0) > 1:
        call["negative_prompt_embeds"] = torch.randn_like(prompt)
    seen = {"allocated": 0, "held": 0, "cross": 0}

    def record(pipe, *args):
        engines = pipe.transformer.kv_cache_engines.values()
        seen["allocated"] = max(seen["allocated"], sum(engine.allocated_self_cache_bytes() for engine in engines))
        seen["held"] = max(seen["held"], pipe.transformer.kv_cache_bytes())
        seen["cross"] = max(seen["cross"], sum(engine.cross_cache_bytes() for engine in engines))
        return {}

    pipe(
        prompt_embeds=prompt, height=HEIGHT, width=WIDTH, num_inference_steps=2, output_type="latent",
        generator=torch.Generator().manual_seed(0), callback_on_step_end=record,
        keep_cache=call.get("kv_cache_policy") != "rolling", **call,
    )  # fmt: skip
    record(pipe)
    return seen["allocated"], seen["held"], seen["cross"]


CALLS = {
    "sequential": ({"num_frames": 21}, {}),
    "window": ({"num_frames": 33, "attention_window": 6}, {"attention_window": 6}),
    "cfg": ({"num_frames": 13, "guidance_scale": 3.0}, {"guidance_scale": 3.0}),
    "int8 cache": ({"num_frames": 13, "kv_cache_dtype": torch.int8}, {"kv_cache_dtype": "int8"}),
    "recompute": (
        {"num_frames": 33, "kv_cache_policy": "recompute", "context_frames": 3},
        {"kv_cache_policy": "recompute", "context_frames": 3},
    ),
    "rolling": ({"num_frames": 33, "kv_cache_policy": "rolling"}, {"kv_cache_policy": "rolling"}),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_cache_formula_equals_the_engines_after_a_rollout(name):
    call, plan_options = CALLS[name]
    pipe = tiny_pipeline()
    allocated, held, cross = _rollout_cache(pipe, **call)
    plan = plan_rollout_memory(
        pipe.transformer.config, height=HEIGHT, width=WIDTH, num_frames=call["num_frames"], compute_dtype="float32",
        num_inference_steps=2, text_len=TEXT_LEN, decoder=None, **plan_options,
    )  # fmt: skip
    assert allocated == plan.self_kv_cache
    assert held <= plan.self_kv_cache
    if name == "recompute":  # the chunk's own K/V are never stored: the context alone is held
        assert held == plan.self_kv_cache * 3 // plan.cached_frames
    elif name != "rolling":  # these fill their cache (the rolling anchor + 21 frames: 33 frames are too few)
        assert held == plan.self_kv_cache
    assert cross == plan.cross_kv_cache


def test_krea_14b_fp8_recompute_fits_24_gib():
    plan = plan_rollout_memory(
        WAN_14B, weight_dtype="float8_e4m3fn", kv_cache_policy="recompute", context_frames=3,
        text_encoder_offloaded=True, decoder="tiny",
    )  # fmt: skip
    assert plan.cached_frames == 6
    assert plan.total < 24 * GIB
    assert plan.weights < 14 * GIB
    summary = plan.summary()
    assert "self kv cache: 7.14 GiB (6 latent frames)" in summary and "total:" in summary


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"weight_dtype": "fp8"}, "`weight_dtype` must be one of"),
        ({"compute_dtype": "int8"}, "`compute_dtype` must be one of"),
        ({"kv_cache_policy": "window"}, "`kv_cache_policy` must be one of"),
        ({"kv_cache_policy": "recompute"}, "`context_frames` must be a positive integer under recompute"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "attention_window": 6}, "bounds the cache itself"),
        ({"decoder": "taehv"}, "`decoder` must be one of"),
        ({"num_frames": 80}, r"`num_frames` must be of the form 4k\+1"),
        ({"height": 100}, "multiples of 16"),
        ({"chunk_size": 0}, "`chunk_size` must be a positive integer"),
        ({"kv_cache_dtype": torch.int8}, "`kv_cache_dtype` must be one of"),
    ],
)
def test_bad_input_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        plan_rollout_memory(WAN_1_3B, **options)


def test_image_conditioned_config_is_refused():
    with pytest.raises(ValueError, match="text-to-video"):
        plan_rollout_memory({**WAN_14B, "image_dim": 1280})


def test_decoder_parameters_are_the_decoding_halves():
    from diffusers import AutoencoderKLWan

    from fastgen_diffusers.memory_plan import decoder_parameters
    from fastgen_diffusers.models.autoencoder_tiny_wan import AutoencoderTinyWan

    with torch.device("meta"):
        vae, tiny = AutoencoderKLWan(), AutoencoderTinyWan()
    assert decoder_parameters("wan") == sum(p.numel() for p in vae.decoder.parameters()) + sum(
        p.numel() for p in vae.post_quant_conv.parameters()
    )
    assert decoder_parameters("tiny") == sum(p.numel() for p in tiny.decoder.parameters())
