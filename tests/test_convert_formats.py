"""Every row of the format table: the container written as that project saves it, converted with ``--format NAME``
and ``--format auto``, every weight checked bit for bit; LoRA merging; the 40-layer (14B) key layout; the settings."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert import _student, fastgen_state_dict, original_state_dict, tiny_wan, wan_base  # noqa: F401

from fastgen_diffusers.convert import STUDENT_FORMATS, convert_checkpoint, detect_format, get_format, warp_timesteps
from fastgen_diffusers.convert.formats import CheckpointFacts
from fastgen_diffusers.settings import CONFIG_KEYS

SF = warp_timesteps([1000, 750, 500, 250], 5.0)


def fsdp_wrapped(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EMA keys as FSDP saves them: the model wrapped, every block wrapped again (with activation checkpointing)."""
    wrapped = {}
    for key, value in state_dict.items():
        key = key.replace("model.", "model._fsdp_wrapped_module.", 1)
        key = re.sub(r"(blocks\.\d+\.)", r"\1_fsdp_wrapped_module._checkpoint_wrapped_module.", key)
        wrapped[key] = value
    return wrapped


def unprefixed(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.removeprefix("model."): value for key, value in state_dict.items()}


REGULAR, EMA = _student(seed=31), _student(seed=32)


def _self_forcing_family(path: str, wrap_ema: bool = True):
    ema = original_state_dict(EMA)
    return path, {"generator": original_state_dict(REGULAR), "generator_ema": fsdp_wrapped(ema) if wrap_ema else ema}


# name -> (release path, container as the project saves it, copy the project's loader takes, format auto finds)
CONTAINERS = {
    "self-forcing": (*_self_forcing_family("checkpoints/self_forcing_dmd.pt", wrap_ema=False), EMA, "self-forcing"),
    "causvid": ("causvid/model.pt", {"generator": original_state_dict(REGULAR)}, REGULAR, "self-forcing"),
    "fastgen": (
        "checkpoints/0004000.pth",
        {"model": {"net": fastgen_state_dict(REGULAR), "ema": fastgen_state_dict(EMA)}, "iteration": 4000},
        EMA,
        "fastgen",
    ),
    "causal-forcing": (*_self_forcing_family("chunkwise/causal_forcing.pt"), EMA, "causal-forcing"),
    "causal-forcing-framewise": (
        *_self_forcing_family("framewise/causal_forcing.pt"),
        EMA,
        "causal-forcing-framewise",
    ),
    "causal-forcing-1step": (
        *_self_forcing_family("causal-forcing++/framewise-1step.pt"),
        EMA,
        "causal-forcing-1step",
    ),
    "causal-forcing-2step": (
        *_self_forcing_family("causal-forcing++/framewise-2step.pt"),
        EMA,
        "causal-forcing-2step",
    ),
    "rolling-forcing": (*_self_forcing_family("checkpoints/rolling_forcing_dmd.pt"), EMA, "rolling-forcing"),
    "reward-forcing": ("checkpoints/rewardforcing.pt", original_state_dict(EMA), EMA, "reward-forcing"),
    # LongLive's inference config has use_ema: false, so its loader takes `generator`.
    "longlive": (*_self_forcing_family("longlive_models/longlive_base.pt"), REGULAR, "longlive"),
    # LongLive 2.0 (main) saves its merged bf16 generator as {"model": ...}.
    "longlive-2": ("longlive2/model_bf16.pt", {"model": original_state_dict(REGULAR)}, REGULAR, "longlive-2"),
    "krea": ("checkpoints/krea-realtime-video-14b.safetensors", original_state_dict(EMA), EMA, "krea"),
    # StreamDiffusionV2 may drop the `model.` prefix; its loader takes `generator` first.
    "streamdiffusionv2": (
        "ckpts/model.pt",
        {"generator": unprefixed(original_state_dict(REGULAR)), "generator_ema": unprefixed(original_state_dict(EMA))},
        REGULAR,
        "streamdiffusionv2",
    ),
}

# The settings each project samples with, read from its inference config (see formats.py for the files).
EXPECTED = {
    "self-forcing": {"timesteps": SF, "shift": 5.0, "chunk_size": 3},
    "causvid": {"timesteps": (1000.0, 757.0, 522.0), "shift": 8.0, "chunk_size": 3},
    "fastgen": {"timesteps": (999.0, 937.0, 833.0, 624.0), "shift": 5.0},
    "causal-forcing": {"timesteps": SF, "chunk_size": 3, "first_chunk_timesteps": None},
    "causal-forcing-framewise": {"timesteps": SF, "chunk_size": 1},
    "causal-forcing-1step": {"timesteps": (1000.0,), "chunk_size": 1, "first_chunk_timesteps": SF},
    "causal-forcing-2step": {"timesteps": (1000.0, 2500 / 3), "chunk_size": 1, "first_chunk_timesteps": SF},
    "rolling-forcing": {
        "timesteps": warp_timesteps([1000, 800, 600, 400, 200], 5.0),
        "chunk_size": 3,
        "kv_cache_policy": "rolling",
    },
    "reward-forcing": {
        "timesteps": SF,
        "attention_window": 9,
        "sink_frames": 3,
        "rope_positions": "window",
        "sink_update": "ema",
        "sink_decay": 0.999,
    },
    "longlive": {"timesteps": SF, "attention_window": 12, "sink_frames": 3, "chunk_size": 3},
    "longlive-2": {
        "timesteps": (1000.0, 937.0, 833.0, 625.0),
        "chunk_size": 8,
        "attention_window": 32,
        "sink_frames": 8,
    },
    "krea": {
        "timesteps": (1000.0, 937.0, 833.0, 625.0),
        "kv_cache_policy": "recompute",
        "context_frames": 3,
        "kv_cache_attention_bias": 0.3,
    },
    "streamdiffusionv2": {
        "timesteps": (700.0, 500.0, 400.0, 200.0),
        "shift": 8.0,
        "chunk_size": 1,
        "attention_window": 6,
        "sink_frames": 3,
    },
}


def write_release(root: Path, name: str) -> Path:
    path, container, _, _ = CONTAINERS[name]
    path = root / "release" / path
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file({key: value.contiguous() for key, value in container.items()}, str(path))
    else:
        torch.save(container, path)
    return path


def converted_weights(output: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for shard in sorted((output / "transformer").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return weights


def assert_weights_equal(actual: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key


def test_the_table_covers_every_released_student():
    assert {row.name for row in STUDENT_FORMATS} == set(CONTAINERS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_release_converts_bit_exactly_with_its_format_and_with_auto(name, wan_base, tmp_path):  # noqa: F811
    checkpoint = write_release(tmp_path, name)
    _, _, model, auto_format = CONTAINERS[name]
    for format in (name, "auto"):
        output = tmp_path / f"out-{format}"
        result = convert_checkpoint(
            checkpoint, base=wan_base, output=output, format=format, base_model_id="org/wan-tiny"
        )
        assert result.format == (name if format == name else auto_format), result.description
        assert_weights_equal(converted_weights(output), model)

        settings = json.loads((output / "sampling.json").read_text())["settings"]
        for key, value in EXPECTED[result.format].items():
            stored = tuple(settings[key]) if isinstance(settings[key], list) else settings[key]
            assert stored == (pytest.approx(value) if isinstance(value, tuple) else value), (key, stored)
        transformer_config = json.loads((output / "transformer" / "config.json").read_text())
        assert transformer_config["chunk_size"] == settings["chunk_size"]
        scheduler_config = json.loads((output / "scheduler" / "scheduler_config.json").read_text())
        assert scheduler_config["shift"] == settings["shift"] and scheduler_config["stochastic_sampling"]
        model_index = json.loads((output / "model_index.json").read_text())
        for key in result.pipeline_settings:  # what `pipe(...)` reads as its defaults
            if key not in ("chunk_size", "independent_first_frame", "shift"):
                assert model_index[key] == settings[key], key
        assert not result.pending_settings  # the pipeline reads every setting of the table
        card = (output / "README.md").read_text()
        assert get_format(result.format).project in card and f"- {result.format}" in card
        assert "Settings marked `sampling.json`" not in card
        assert CARD_SUMMARY.get(result.format, "`pipe(prompt)` samples with the settings below: ") in card
        # the card's spelled-out call is Python whose arguments are the stored defaults
        call = re.search(r"\(`pipe\(prompt, (.*?)\)` spells out the stored defaults\)", card, flags=re.S).group(1)
        keywords = ast.parse(f"pipe({call})", mode="eval").body.keywords
        spelled = {keyword.arg: ast.literal_eval(keyword.value) for keyword in keywords}
        assert spelled and all(value is not None for value in spelled.values())
        # every stored setting the pipeline config holds, in the settings' order (CONFIG_KEYS), none left out
        assert list(spelled) == [key for key in CONFIG_KEYS if model_index.get(key) is not None]
        for key, value in spelled.items():
            assert value == (
                pytest.approx(model_index[key], rel=1e-9) if isinstance(value, list) else model_index[key]
            )


# How the model card words the sampling of the rows with a policy, window or RoPE mode of their own.
CARD_SUMMARY = {
    "krea": "KV recompute (Krea): before each chunk the cache is rebuilt over 3 clean context frames, so memory stays "
    "flat, and cached frames other than the first get attention weight 0.3.",
    "reward-forcing": "a sliding window of 9 latent frames, the first 3 kept as a sink; cached keys are positioned "
    "by their slot in the window (no 1024-frame RoPE limit), and frames leaving the window are averaged into the "
    "sink (decay 0.999).",
    "rolling-forcing": "a rolling window (Rolling Forcing): each forward denoises up to 5 chunks at staggered noise "
    "levels, attending to at most 21 latent frames with the first chunk as anchor.",
    "longlive": "a sliding window of 12 latent frames, the first 3 kept as a sink.",
    "self-forcing": "chunk by chunk, every finished chunk cached (the cache grows with the video).",
}


def test_auto_says_what_it_found_and_why(tmp_path):
    detected = detect_format(CONTAINERS["rolling-forcing"][1], path="checkpoints/rolling_forcing_dmd.pt")
    assert detected.description.startswith("Rolling Forcing: a {'generator', 'generator_ema'} checkpoint")
    assert "FSDP/compile wrapper segments" in detected.description and "file name matches" in detected.description
    unnamed = detect_format(CONTAINERS["rolling-forcing"][1], path="downloads/student.pt")
    assert unnamed.format == "self-forcing" and "pass --format to pick another of" in unnamed.description
    # a bare causal_forcing.pt is taken as the chunk-wise release, and the description says the frame-wise one has the
    # same file name; under its release folder it is not ambiguous
    bare = detect_format(CONTAINERS["causal-forcing"][1], path="downloads/causal_forcing.pt")
    assert bare.format == "causal-forcing"
    assert "framewise/causal_forcing.pt, has the same file name: pass --format causal-forcing-framewise" in (
        bare.description
    )
    chunkwise = detect_format(CONTAINERS["causal-forcing"][1], path="chunkwise/causal_forcing.pt")
    assert chunkwise.format == "causal-forcing" and "same file name" not in chunkwise.description
    sdv2 = detect_format({"state_dict": unprefixed(original_state_dict(EMA))}, path="x/model.pt")
    assert sdv2.format == "streamdiffusionv2" and sdv2.select() == "state_dict"
    longlive2 = detect_format({"model": original_state_dict(EMA)}, "longlive")
    assert longlive2.select() == "model"
    # Krea is also recognised by its layout: a flat safetensors file with 40 blocks of width 5120.
    facts = CheckpointFacts(container="flat", num_layers=40, dim=5120, safetensors=True)
    assert get_format("krea").detector(facts) is not None
    assert get_format("krea").detector(CheckpointFacts(container="flat", num_layers=30, dim=1536)) is None


def test_forty_layer_checkpoint_has_the_14b_key_layout(tmp_path):
    """Wan2.1-14B's layout (40 blocks; Krea's file) at tiny width: every original key maps, bit for bit."""
    from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG

    config = {k: v for k, v in TINY_TRANSFORMER_CONFIG.items() if k != "chunk_size"}
    config.update(num_layers=40, num_attention_heads=1, attention_head_dim=8, ffn_dim=16, freq_dim=16)
    model = tiny_wan(7, **config)
    base = tmp_path / "base14b"
    tiny_wan(8, **config).save_pretrained(base / "transformer")
    components = {"tokenizer": None, "text_encoder": None, "vae": None}
    _write_minimal_base(base, components)
    checkpoint = tmp_path / "checkpoints" / "krea-realtime-video-14b.safetensors"
    checkpoint.parent.mkdir()
    weights = original_state_dict(model)
    assert {f"model.blocks.{i}.self_attn.q.weight" for i in range(40)} <= set(weights)
    assert {"model.blocks.39.norm3.weight", "model.head.modulation", "model.head.head.weight"} <= set(weights)
    save_file(weights, str(checkpoint))
    result = convert_checkpoint(
        checkpoint, base=base, output=tmp_path / "out", base_model_id="org/w", max_shard_size="40KB"
    )
    assert result.format == "krea" and len(result.shards) > 1
    assert_weights_equal(converted_weights(result.output), model)


def _write_minimal_base(base: Path, components: dict) -> None:
    """A base directory with a VAE and a scheduler but no text encoder (enough to convert and read the weights)."""
    from fastgen_diffusers.testing import tiny_scheduler, tiny_vae

    tiny_vae().save_pretrained(base / "vae")
    tiny_scheduler().save_pretrained(base / "scheduler")
    index = {
        "_class_name": "WanPipeline",
        "vae": ["diffusers", "AutoencoderKLWan"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        **{name: [None, None] for name in components if name != "vae"},
    }
    (base / "model_index.json").write_text(json.dumps(index))


# ---------------------------------------------------------------------------------------------------- LoRA (LongLive)
LORA_RANK, LORA_ALPHA = 4, 8.0  # alpha != rank, so the scale alpha / r is exercised
LORA_TARGETS = ("self_attn.q", "self_attn.o", "cross_attn.k", "ffn.0", "ffn.2")
# The same modules in diffusers' names, written out by hand.
DIFFUSERS_TARGETS = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_k": "cross_attn.k",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}


def peft_lora(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """A PEFT state dict as LongLive saves it (``generator.model`` wrapped by ``get_peft_model``), original names."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    weights = original_state_dict(model, prefix="")
    for index in range(len(model.blocks)):
        for target in LORA_TARGETS:
            out_features, in_features = weights[f"blocks.{index}.{target}.weight"].shape
            prefix = f"base_model.model.blocks.{index}.{target}"
            lora[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, in_features, generator=generator)
            lora[f"{prefix}.lora_B.weight"] = torch.randn(out_features, LORA_RANK, generator=generator) * 0.1
    return lora


@pytest.fixture(scope="module")
def longlive_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("longlive")
    base = write_release(root, "longlive")
    lora = root / "release" / "longlive_models" / "lora.pt"
    torch.save({"generator_lora": peft_lora(REGULAR)}, lora)
    return base, lora


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lora_merge_is_w_plus_scaled_ba_in_float32(wan_base, longlive_release, tmp_path, dtype):  # noqa: F811
    base, lora_file = longlive_release
    result = convert_checkpoint(
        base, base=wan_base, output=tmp_path / "m", base_model_id="org/w", lora=lora_file, lora_alpha=LORA_ALPHA,
        dtype=dtype,
    )  # fmt: skip
    assert result.lora == "merged"
    merged = converted_weights(result.output)
    lora = peft_lora(REGULAR)
    out = dtype or torch.float32
    for key, weight in REGULAR.state_dict().items():
        module = key.split(".", 2)[-1].removesuffix(".weight")
        if key.startswith("blocks.") and key.endswith(".weight") and module in DIFFUSERS_TARGETS:
            block, target = key.split(".")[1], DIFFUSERS_TARGETS[module]
            a = lora[f"base_model.model.blocks.{block}.{target}.lora_A.weight"]
            b = lora[f"base_model.model.blocks.{block}.{target}.lora_B.weight"]
            expected = (weight.float() + LORA_ALPHA / LORA_RANK * (b.float() @ a.float())).to(out)
            assert torch.equal(merged[key], expected), key  # float32 arithmetic, then the output dtype
            if dtype is None:
                exact = weight.double() + LORA_ALPHA / LORA_RANK * (b.double() @ a.double())
                assert (merged[key].double() - exact).abs().max() <= 1e-5, key
        else:
            assert torch.equal(merged[key], weight.to(out)), key


def test_merged_lora_equals_load_lora_weights(wan_base, longlive_release, tmp_path):  # noqa: F811
    from fastgen_diffusers.pipelines import WanCausalPipeline

    base, lora_file = longlive_release
    common = {"base": wan_base, "base_model_id": "org/w", "lora": lora_file, "lora_alpha": LORA_ALPHA}
    merged = convert_checkpoint(base, output=tmp_path / "merged", **common)
    kept = convert_checkpoint(base, output=tmp_path / "kept", keep_lora=True, **common)
    assert kept.lora == "kept" and (kept.output / "pytorch_lora_weights.safetensors").is_file()
    assert_weights_equal(converted_weights(kept.output), REGULAR)  # the base weights stay unmerged
    card = (kept.output / "README.md").read_text()
    assert "pipe.load_lora_weights(" in card

    latents = {}
    for name, result in (("merged", merged), ("kept", kept)):
        pipe = WanCausalPipeline.from_pretrained(result.output)
        pipe.set_progress_bar_config(disable=True)
        if name == "kept":
            pipe.load_lora_weights(result.output)
        call = {"height": 16, "width": 16, "num_frames": 9, "max_sequence_length": 8, "output_type": "latent"}
        latents[name] = pipe("a red fox runs", generator=torch.Generator().manual_seed(0), **call).frames
    torch.testing.assert_close(latents["kept"], latents["merged"], rtol=1e-4, atol=1e-5)


def test_default_lora_alpha_is_the_projects():
    assert get_format("longlive").lora_alpha == 256.0 and get_format("self-forcing").lora_alpha is None


# ------------------------------------------------------------------------- the per-chunk schedule (Causal Forcing++)
def test_causal_forcing_plus_plus_denoises_the_first_chunk_with_four_steps(wan_base, tmp_path):  # noqa: F811
    from fastgen_diffusers.pipelines import WanCausalPipeline

    checkpoint = write_release(tmp_path, "causal-forcing-1step")
    result = convert_checkpoint(checkpoint, base=wan_base, output=tmp_path / "out", base_model_id="org/w")
    assert "first_chunk_timesteps" in result.pipeline_settings
    pipe = WanCausalPipeline.from_pretrained(result.output)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((bool(kwargs.get("store_kv")), kwargs["timestep"])), with_kwargs=True
    )
    try:
        pipe("a red fox runs", height=16, width=16, num_frames=9, max_sequence_length=8, output_type="latent")
    finally:
        handle.remove()
    steps_per_chunk, steps = [], []
    for store, timestep in calls:
        if store:
            steps_per_chunk.append(steps)
            steps = []
        else:
            steps.append(float(timestep.flatten()[0]))
    if steps:
        steps_per_chunk.append(steps)
    # 9 frames = 3 latent frames = 3 frame-wise chunks: 4 steps, then 1 step each.
    assert [len(s) for s in steps_per_chunk] == [4, 1, 1]
    assert steps_per_chunk[0] == pytest.approx(list(SF), abs=1e-3) and steps_per_chunk[1] == [1000.0]


def test_a_lora_that_does_not_fit_is_refused_before_any_work(wan_base, longlive_release, tmp_path):  # noqa: F811
    from fastgen_diffusers.convert import CheckpointConversionError

    base, _ = longlive_release
    lora = peft_lora(REGULAR)
    key = next(k for k in lora if k.endswith("lora_B.weight"))
    lora[key] = torch.zeros(lora[key].shape[0] + 1, LORA_RANK)
    torch.save(lora, tmp_path / "lora.pt")
    with pytest.raises(CheckpointConversionError, match="LoRA shapes do not fit"):
        convert_checkpoint(
            base, base=wan_base, output=tmp_path / "o", base_model_id="org/w", lora=tmp_path / "lora.pt"
        )
    assert not (tmp_path / "o").exists()


def test_converted_krea_samples_with_recompute_by_default(wan_base, tmp_path):  # noqa: F811
    """`convert --format krea` stores the recompute policy in model_index.json: `pipe(prompt)` re-encodes the context
    before each chunk (RoPE positions stay below context + chunk), a call may switch back to the sequential cache,
    and `save_pretrained`/`from_pretrained` keep the settings."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    output = tmp_path / "krea"
    result = convert_checkpoint(
        write_release(tmp_path, "krea"), base=wan_base, output=output, format="krea", base_model_id="org/w"
    )
    stored = {"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": 0.3}
    assert set(stored) <= set(result.pipeline_settings) and not result.pending_settings
    model_index = json.loads((output / "model_index.json").read_text())
    assert {key: model_index[key] for key in stored} == stored
    pipe = WanCausalPipeline.from_pretrained(output)
    pipe.set_progress_bar_config(disable=True)
    assert {key: pipe.config[key] for key in stored} == stored
    pipe.save_pretrained(tmp_path / "saved")
    assert {key: WanCausalPipeline.from_pretrained(tmp_path / "saved").config[key] for key in stored} == stored

    positions = []  # the RoPE end position of every transformer forward
    forward = pipe.transformer.forward

    def recording(hidden_states, *args, **kwargs):
        positions.append(kwargs["start_frame"] + hidden_states.shape[2])
        return forward(hidden_states, *args, **kwargs)

    pipe.transformer.forward = recording
    call = {"height": 16, "width": 16, "num_frames": 45, "num_inference_steps": 2, "output_type": "latent"}
    try:
        default = pipe("a cat", generator=torch.Generator().manual_seed(0), **call).frames
        recompute_positions, positions[:] = max(positions), []
        explicit = pipe("a cat", generator=torch.Generator().manual_seed(0), kv_cache_policy="recompute",
                        context_frames=3, kv_cache_attention_bias=0.3, **call).frames  # fmt: skip
        positions.clear()
        sequential = pipe("a cat", generator=torch.Generator().manual_seed(0), kv_cache_policy="sequential", **call)
    finally:
        del pipe.transformer.forward
    chunk = pipe.transformer.config.chunk_size
    assert recompute_positions <= 3 + chunk < max(positions) == default.shape[2]
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    assert not torch.equal(default, sequential.frames)


def test_converted_reward_forcing_samples_with_window_rope_and_ema_sink_by_default(wan_base, tmp_path):  # noqa: F811
    """`convert --format reward-forcing` stores window-relative RoPE and the EMA sink (decay 0.999) in
    model_index.json: `pipe(prompt)` builds engines with them, equal to naming them in the call, and a call may go back
    to absolute positions and a fixed sink."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    output = tmp_path / "reward"
    result = convert_checkpoint(
        write_release(tmp_path, "reward-forcing"), base=wan_base, output=output, format="reward-forcing",
        base_model_id="org/w",
    )  # fmt: skip
    stored = {"rope_positions": "window", "sink_update": "ema", "sink_decay": 0.999}
    assert set(stored) <= set(result.pipeline_settings) and not result.pending_settings
    model_index = json.loads((output / "model_index.json").read_text())
    assert {key: model_index[key] for key in stored} == stored
    pipe = WanCausalPipeline.from_pretrained(output)
    pipe.set_progress_bar_config(disable=True)
    call = {"height": 16, "width": 16, "num_frames": 69, "num_inference_steps": 1, "output_type": "latent"}
    default = pipe("a cat", generator=torch.Generator().manual_seed(0), **call).frames  # 6 chunks of 3 latent frames
    engine = pipe.transformer.kv_cache_engines["main"]
    assert (engine.rope_positions, engine.sink_update, engine.sink_decay) == ("window", "ema", 0.999)
    explicit = pipe("a cat", generator=torch.Generator().manual_seed(0), **stored, **call).frames
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    absolute = pipe(
        "a cat", generator=torch.Generator().manual_seed(0), rope_positions="absolute", sink_update="fixed", **call
    ).frames
    assert pipe.transformer.kv_cache_engines["main"].rope_positions == "absolute"
    assert not torch.equal(default, absolute)


def test_converted_rolling_forcing_samples_with_the_rolling_window_by_default(wan_base, tmp_path):  # noqa: F811
    """`convert --format rolling-forcing` stores `kv_cache_policy="rolling"`: `pipe(prompt)` denoises windows of 5
    chunks at staggered levels (one forward per window plus its commit); a call may still ask for the sequential
    rollout."""
    from fastgen_diffusers.pipelines import WanCausalPipeline

    output = tmp_path / "rolling"
    result = convert_checkpoint(
        write_release(tmp_path, "rolling-forcing"),
        base=wan_base,
        output=output,
        format="rolling-forcing",
        base_model_id="org/w",
    )
    assert "kv_cache_policy" in result.pipeline_settings and not result.pending_settings
    assert json.loads((output / "model_index.json").read_text())["kv_cache_policy"] == "rolling"
    pipe = WanCausalPipeline.from_pretrained(output)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config["kv_cache_policy"] == "rolling"
    frames = []  # the frame count of every transformer forward
    forward = pipe.transformer.forward

    def recording(hidden_states, *args, **kwargs):
        frames.append(hidden_states.shape[2])
        return forward(hidden_states, *args, **kwargs)

    pipe.transformer.forward = recording
    call = {"height": 16, "width": 16, "num_frames": 57, "output_type": "latent"}  # 5 chunks, the 5 stored steps
    try:
        default = pipe("a cat", generator=torch.Generator().manual_seed(0), **call).frames
        rolling_frames, frames[:] = list(frames), []
        sequential = pipe("a cat", generator=torch.Generator().manual_seed(0), kv_cache_policy="sequential", **call)
    finally:
        del pipe.transformer.forward
    assert len(rolling_frames) == 2 * (5 + 5 - 1) - 1 and max(rolling_frames) == 15  # a full window: 5 chunks
    assert len(frames) == 5 * 5 + 4 and max(frames) == 3
    assert not torch.equal(default, sequential.frames)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        # what every pipeline call would refuse
        ({"kv_cache_attention_bias": 0.005}, "must be a number in \\[0.01, 1\\]"),
        ({"kv_cache_attention_bias": float("nan")}, "must be a number in \\[0.01, 1\\]"),
        ({"sink_decay": 1.0}, "`sink_decay` must be a number in \\(0, 1\\)"),
        ({"sink_update": "ema"}, "averages evicted frames into the sink: set `sink_frames` > 0"),
        ({"rope_positions": "window"}, "set `attention_window` as well"),
        (
            {"kv_cache_policy": "rolling", "attention_window": 12, "sink_frames": 3},
            "keeps its first chunk as the sink",
        ),
        # every default call would refuse these (the stored policy settings fill what a call leaves out)
        ({"context_frames": 3}, "needs `kv_cache_policy='recompute'`"),
        ({"kv_cache_policy": "recompute", "context_frames": 0}, "`context_frames` must be >= 1"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "attention_window": 9}, "bounds the cache itself"),
        (
            {"kv_cache_policy": "rolling", "attention_window": 12, "rope_positions": "window"},
            "positions its keys itself",
        ),
    ],
)
def test_stored_settings_the_pipelines_would_refuse_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        get_format("self-forcing").sampling.replace(**overrides)


def test_every_stored_setting_is_taken_by_convert_and_by_the_cli(wan_base, tmp_path, capsys):  # noqa: F811
    """Each setting a pipeline config stores (the settings' ``CONFIG_KEYS``) is a ``generate`` flag, a ``convert`` flag
    and a ``convert_checkpoint`` keyword (a [`StudentSettings`] field), and what ``convert`` is given reaches
    ``model_index.json`` and the card's spelled-out call: ``keep_first_frame`` of a Krea student, through the CLI.
    Anything else is refused by name before any work."""
    from dataclasses import fields

    from fastgen_diffusers import cli
    from fastgen_diffusers.cli.common import SETTINGS_FLAGS
    from fastgen_diffusers.cli.convert import stored_settings_flags
    from fastgen_diffusers.convert import StudentSettings

    student = {f.name for f in fields(StudentSettings)}
    assert set(CONFIG_KEYS) <= student
    assert set(CONFIG_KEYS) <= set(SETTINGS_FLAGS.values())
    convert_flags = {SETTINGS_FLAGS[dest] for dest in stored_settings_flags()}
    assert set(CONFIG_KEYS) <= convert_flags <= student
    with pytest.raises(ValueError, match=r"`shiftt` is not a stored setting of `convert_checkpoint`") as error:
        convert_checkpoint(tmp_path / "missing.pt", base=wan_base, output=tmp_path / "never", shiftt=5.0)
    assert all(repr(name) in str(error.value) for name in CONFIG_KEYS)
    assert not (tmp_path / "never").exists()

    output = tmp_path / "krea"
    argv = ["convert", "--checkpoint", str(write_release(tmp_path, "krea")), "--base", str(wan_base)]
    argv += ["--output", str(output), "--format", "krea", "--base-model-id", "org/w", "--keep-first-frame"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert json.loads((output / "model_index.json").read_text())["keep_first_frame"] is True
    card = (output / "README.md").read_text()
    assert "keep_first_frame=True" in re.search(r"`pipe\(prompt, (.*?)\)` spells out", card, flags=re.S).group(1)
