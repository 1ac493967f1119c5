"""The spec's engine structure, readable under its own names (``seeds/000``, "Engine-Level Structure"):
``_module_to_block[id(attn)]``, ``_self_kv[block_idx][cache_tag]``, ``_cross_kv[block_idx][cache_tag]`` and the masks
memoised by chunk layout (``_block_masks``), as read-only views over the engine's own structures."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine

CHUNK = 2


@pytest.fixture(params=["vanilla", "static"])
def model(request):
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=3)
    engine = VanillaKVCacheEngine() if request.param == "vanilla" else StaticKVCacheEngine(8)
    model.set_kv_cache_engines({"main": engine})
    return model


@torch.no_grad()
def test_spec_views_read_the_engine_structures(model):
    gen = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 16, 4, 4, 6, generator=gen), torch.randn(1, 8, 32, generator=gen)
    model(x, torch.tensor([0.0]), text, store_kv=True)  # two chunks of two frames: a multi-chunk (masked) call
    engine = model.kv_cache_engines["main"]

    expected = {id(attn): i for i, block in enumerate(model.blocks) for attn in (block.attn1, block.attn2)}
    assert dict(engine._module_to_block) == expected
    with pytest.raises(TypeError):
        engine._module_to_block[id(model.blocks[0].attn1)] = 2  # a view: the registration is not edited through it

    assert len(engine._self_kv) == len(engine._cross_kv) == 3
    assert all(set(entries) == {"pos"} for entries in (*engine._self_kv, *engine._cross_kv))
    assert engine._cross_kv[2]["pos"].key.shape == (1, 8, 2, 32)  # (B, L_text, H, D)

    assert len(engine._block_masks) == 1
    (key,) = engine._block_masks
    assert (2, 2) in key  # keyed by the chunk layout
    model(x, torch.tensor([0.0]), text)  # the same layout again: the memoised mask serves it
    assert len(engine._block_masks) == 1
    model.clear_caches()
    assert len(engine._block_masks) == 0
