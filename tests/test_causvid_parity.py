"""Parity with CausVid's own causal inference: replay every recorded transformer call through our cache protocol.

``tests/data/causvid_tiny`` (a copy of the team's ``shared/reference/causvid_tiny``; see its README) holds a tiny
random Wan model and every call CausVid's ``InferencePipeline.inference()`` made with it: per-chunk denoising calls,
the cache-refresh ("context") call at t=0 after each chunk, and, for the video-extension variant, a prefill call
with clean start latents.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel

REFERENCE = Path(__file__).resolve().parent / "data" / "causvid_tiny"
VARIANTS = ("main", "warp4", "startlat3")


@pytest.fixture(scope="module")
def reference():
    meta = json.loads((REFERENCE / "meta.json").read_text())
    inputs = load_file(REFERENCE / "inputs.safetensors")
    outputs = load_file(REFERENCE / "outputs.safetensors")
    model = WanCausalTransformer3DModel.from_pretrained(REFERENCE / "transformer", chunk_size=3).eval()
    return meta, inputs, outputs, model


def to_model_layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` (the reference pipeline's layout) to ``[B, C, F, H, W]``."""
    return x.permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_replaying_causvid_calls_matches_every_output(reference, variant):
    meta, inputs, outputs, model = reference
    prompt = inputs["prompt_embeds"]
    model.clear_caches()
    worst = 0.0
    num_calls = 0

    def call(x, timestep, start_frame, store_kv, expected_key):
        nonlocal worst, num_calls
        out = model(
            to_model_layout(x), timestep, prompt, start_frame=start_frame, store_kv=store_kv, return_dict=False
        )[0]
        expected = to_model_layout(outputs[expected_key])
        worst = max(worst, (out - expected).abs().max().item())
        num_calls += 1

    calls = meta["variants"][variant]["calls"]
    blocks = sorted({c["block"] for c in calls})
    for block in blocks:
        start = 3 * block
        prefill = f"{variant}.block{block}.prefill"
        if f"{prefill}.flow_pred" in outputs:
            call(
                inputs[f"{variant}.start_latents"], outputs[f"{prefill}.timestep"], start, True, f"{prefill}.flow_pred"
            )
            continue
        step = 0
        while f"{variant}.block{block}.step{step}.noisy_input" in outputs:
            prefix = f"{variant}.block{block}.step{step}"
            call(outputs[f"{prefix}.noisy_input"], outputs[f"{prefix}.timestep"], start, False, f"{prefix}.flow_pred")
            step += 1
        clean = outputs[f"{variant}.block{block}.step{step - 1}.x0_pred"]
        context = f"{variant}.block{block}.context"
        call(clean, outputs[f"{context}.timestep"], start, True, f"{context}.flow_pred")

    assert num_calls == len(calls)
    assert worst <= 1e-4, f"{variant}: max abs diff {worst:.3e} over {num_calls} calls"
    # With the float64 timestep sinusoid the remaining error is float32 rounding.
    assert worst <= 1e-5, f"{variant}: max abs diff {worst:.3e}; the float64 sinusoid should reach ~2e-6"


@torch.no_grad()
def test_bidirectional_reference_outputs_match_one_full_chunk(reference):
    """CausVid's bidirectional WanModel outputs equal our causal model run with all 9 frames as one chunk."""
    _, inputs, outputs, model = reference
    big_chunk = WanCausalTransformer3DModel.from_pretrained(REFERENCE / "transformer", chunk_size=9).eval()
    x = inputs["bidir.hidden_states"]
    worst = 0.0
    for t in (1000, 757, 0):
        timestep = torch.full((1,), float(t))
        out = big_chunk(x, timestep, inputs["prompt_embeds"], return_dict=False)[0]
        worst = max(worst, (out - outputs[f"bidir.t{t}.output"]).abs().max().item())
    assert worst <= 1e-5, worst
