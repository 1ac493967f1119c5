"""Per-call Python overhead removed from the forward: memoised dtype and timestep embedding, exactly as before."""

from __future__ import annotations

import torch
from conftest import make_causal_transformer
from diffusers.models.modeling_utils import get_parameter_dtype


def test_dtype_is_memoised_and_follows_casts_and_layerwise_casting():
    model = make_causal_transformer()
    assert model.dtype == get_parameter_dtype(model) == torch.float32
    model.to(torch.float64)
    assert model.dtype == get_parameter_dtype(model) == torch.float64
    model.to(torch.float32)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert model.dtype == get_parameter_dtype(model) == torch.bfloat16


@torch.no_grad()
def test_a_cfg_pair_embeds_its_timestep_once_with_the_same_numbers(latents, prompt_embeds):
    model = make_causal_transformer()
    calls = []
    model.condition_embedder.time_embedder.register_forward_hook(lambda *args: calls.append(1))
    timestep = torch.tensor([900.0, 900.0])
    pos = model(latents[:, :, :3], timestep, prompt_embeds, cache_tag="pos")[0]
    neg = model(latents[:, :, :3], timestep, -prompt_embeds, cache_tag="neg")[0]
    assert len(calls) == 1
    timestep.fill_(500.0)  # an in-place change is a new timestep
    changed = model(latents[:, :, :3], timestep, prompt_embeds, cache_tag="pos")[0]
    assert len(calls) == 2
    fresh = make_causal_transformer()
    assert torch.equal(neg, fresh(latents[:, :, :3], torch.tensor([900.0, 900.0]), -prompt_embeds)[0])
    assert torch.equal(changed, fresh(latents[:, :, :3], torch.tensor([500.0, 500.0]), prompt_embeds)[0])
    assert not torch.equal(pos, changed)
