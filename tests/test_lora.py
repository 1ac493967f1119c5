"""Diffusers-format Wan LoRAs load on the causal pipeline (`pipe.load_lora_weights`), scale and unload."""

from __future__ import annotations

import peft  # noqa: F401  (a test dependency: diffusers' LoRA loading needs it; missing, the tests fail)
import torch
from safetensors.torch import save_file

from fastgen_diffusers import WanCausalAttnProcessor, WanCausalCrossAttnProcessor
from fastgen_diffusers.testing import tiny_pipeline

RANK = 4
TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "ffn.net.0.proj")
GENERATE = {"height": 16, "width": 16, "num_frames": 9, "max_sequence_length": 8, "output_type": "latent"}


def wan_lora_state_dict(pipe, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rank-4 LoRA in diffusers' Wan naming (``transformer.blocks.N.attn1.to_q.lora_A.weight``, ...)."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for index, block in enumerate(pipe.transformer.blocks):
        for target in TARGETS:
            linear = block.get_submodule(target)
            prefix = f"transformer.blocks.{index}.{target}"
            state_dict[f"{prefix}.lora_A.weight"] = torch.randn(RANK, linear.in_features, generator=generator)
            state_dict[f"{prefix}.lora_B.weight"] = torch.randn(linear.out_features, RANK, generator=generator)
    return state_dict


def generate(pipe) -> torch.Tensor:
    return pipe("a red fox runs", generator=torch.Generator().manual_seed(0), **GENERATE).frames


def test_wan_lora_loads_scales_and_unloads(tmp_path):
    pipe = tiny_pipeline(seed=3)
    pipe.set_progress_bar_config(disable=True)
    base = generate(pipe)
    save_file(wan_lora_state_dict(pipe), tmp_path / "pytorch_lora_weights.safetensors")

    pipe.load_lora_weights(tmp_path, weight_name="pytorch_lora_weights.safetensors", adapter_name="style")
    assert pipe.get_active_adapters() == ["style"]
    assert hasattr(pipe.transformer.blocks[1].attn1.to_q, "lora_A")
    styled = generate(pipe)
    assert not torch.allclose(styled, base, atol=1e-4)

    pipe.set_adapters(["style"], adapter_weights=[0.0])
    torch.testing.assert_close(generate(pipe), base, rtol=0, atol=1e-6)
    pipe.set_adapters(["style"], adapter_weights=[1.0])
    torch.testing.assert_close(generate(pipe), styled, rtol=0, atol=0)

    pipe.unload_lora_weights()
    assert not hasattr(pipe.transformer.blocks[1].attn1.to_q, "lora_A")
    torch.testing.assert_close(generate(pipe), base, rtol=0, atol=0)
    # The causal attention processors survive loading and unloading.
    assert isinstance(pipe.transformer.blocks[0].attn1.processor, WanCausalAttnProcessor)
    assert isinstance(pipe.transformer.blocks[0].attn2.processor, WanCausalCrossAttnProcessor)
