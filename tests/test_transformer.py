"""The causal transformer's numerical contract: cached == full block-causal, one chunk == stock diffusers."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_WAN_CONFIG, make_causal_transformer
from diffusers import WanTransformer3DModel

from fastgen_diffusers import WanCausalTransformer3DModel, expected_self_cache_bytes


def frame_timesteps(batch: int, frames: int, seed: int = 3) -> torch.Tensor:
    return torch.rand(batch, frames, generator=torch.Generator().manual_seed(seed)) * 1000


def rollout(model, latents, timesteps, prompt_embeds, layout, cache_tag="pos"):
    """Run ``latents`` chunk by chunk with ``store_kv=True``; returns the concatenated outputs."""
    outputs, start = [], 0
    for size in layout:
        end = start + size
        out = model(
            latents[:, :, start:end],
            timesteps[:, start:end],
            prompt_embeds,
            start_frame=start,
            cache_tag=cache_tag,
            store_kv=True,
            return_dict=False,
        )[0]
        outputs.append(out)
        start = end
    return torch.cat(outputs, dim=2)


@pytest.mark.parametrize("independent_first_frame", [False, True])
@torch.no_grad()
def test_chunked_cached_rollout_equals_full_block_causal_forward(latents, prompt_embeds, independent_first_frame):
    model = make_causal_transformer(independent_first_frame=independent_first_frame)
    timesteps = frame_timesteps(2, 8)
    layout = model.chunk_layout_for(8)
    assert layout == ((1, 4, 3) if independent_first_frame else (5, 3))  # remainder absorbed by the first chunk
    full = model(latents, timesteps, prompt_embeds, return_dict=False)[0]
    model.clear_caches()
    cached = rollout(model, latents, timesteps, prompt_embeds, layout)
    assert (cached - full).abs().max().item() <= 1e-5


@torch.no_grad()
def test_denoising_calls_read_the_prefix_without_storing(tiny_model, latents, prompt_embeds):
    """A store_kv=False call of the last chunk sees the stored prefix and leaves the cache unchanged."""
    timesteps = frame_timesteps(2, 8)
    full = tiny_model(latents, timesteps, prompt_embeds, return_dict=False)[0]
    tiny_model.clear_caches()
    rollout(tiny_model, latents[:, :, :5], timesteps[:, :5], prompt_embeds, (5,))
    bytes_before = tiny_model.kv_cache_bytes()
    last = tiny_model(latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, return_dict=False)[0]
    assert (last - full[:, :, 5:]).abs().max().item() <= 1e-5
    assert tiny_model.kv_cache_bytes() == bytes_before
    assert tiny_model.kv_cache_engines["main"].num_stored_frames("pos") == 5


@torch.no_grad()
def test_one_chunk_equals_stock_diffusers(latents, prompt_embeds):
    stock = WanTransformer3DModel(**TINY_WAN_CONFIG).eval()
    model = make_causal_transformer(chunk_size=8)
    model.load_state_dict(stock.state_dict())
    for t in (999.0, 500.0, 0.0):
        timestep = torch.full((2,), t)
        expected = stock(latents, timestep, prompt_embeds, return_dict=False)[0]
        got = model(latents, timestep, prompt_embeds, return_dict=False)[0]
        # The only difference is diffusers' float32 timestep sinusoid (ours is float64, as Wan was trained).
        assert (got - expected).abs().max().item() <= 1e-4


@torch.no_grad()
def test_restoring_a_stored_chunk_replaces_it(tiny_model, latents, prompt_embeds):
    timesteps = frame_timesteps(2, 8)
    rollout(tiny_model, latents, timesteps, prompt_embeds, (5, 3))
    engine = tiny_model.kv_cache_engines["main"]
    bytes_after_rollout = tiny_model.kv_cache_bytes()
    again = tiny_model(
        latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, store_kv=True, return_dict=False
    )[0]
    assert engine.num_stored_frames("pos") == 8
    assert tiny_model.kv_cache_bytes() == bytes_after_rollout
    tiny_model.clear_caches()
    fresh = rollout(tiny_model, latents, timesteps, prompt_embeds, (5, 3))
    assert torch.equal(again, fresh[:, :, 5:])
    # Re-running the first chunk drops everything stored after it.
    tiny_model(latents[:, :, :5], timesteps[:, :5], prompt_embeds, start_frame=0, store_kv=True)
    assert engine.num_stored_frames("pos") == 5


@torch.no_grad()
def test_cache_bytes_follow_the_formula(tiny_model, latents, prompt_embeds):
    rollout(tiny_model, latents, frame_timesteps(2, 8), prompt_embeds, (5, 3))
    expected = expected_self_cache_bytes(
        num_layers=2, batch_size=2, num_heads=2, num_tokens=8 * 15, head_dim=32, dtype=torch.float32
    )
    assert tiny_model.kv_cache_bytes() == expected == tiny_model.kv_cache_bytes("pos")
    assert tiny_model.kv_cache_bytes("neg") == 0


@torch.no_grad()
def test_flex_attention_block_mask_equals_sdpa_mask(tiny_model, latents, prompt_embeds):
    timesteps = frame_timesteps(2, 8)
    sdpa = tiny_model(latents, timesteps, prompt_embeds, return_dict=False)[0]
    tiny_model.clear_caches()
    tiny_model.set_block_mask_backend("flex")  # eager FlexAttention on CPU; compiled on CUDA
    flex = tiny_model(latents, timesteps, prompt_embeds, return_dict=False)[0]
    assert (flex - sdpa).abs().max().item() <= 1e-5
    masks = tiny_model.block_masks
    assert len(masks) == 1
    (backend, device, window, layout, frame_seqlen, prefix_pinned, prefix_recent, (pattern, pinned)) = masks.keys()[0]
    assert (backend, layout, frame_seqlen, prefix_recent) == ("flex", (5, 3), 15, 0)
    assert pattern == tuple(range(8)) and len(pinned) == 8


@torch.no_grad()
def test_block_masks_are_keyed_by_the_chunk_layout(latents, prompt_embeds):
    model = make_causal_transformer(independent_first_frame=True)
    model(latents[:, :, :7], torch.zeros(2), prompt_embeds)  # chunks (1, 3, 3)
    model(latents[:, :, :1], torch.zeros(2), prompt_embeds, store_kv=True)
    model(latents[:, :, 1:8], torch.zeros(2), prompt_embeds, start_frame=1)  # 7 frames again, chunks (4, 3)
    keys = {(key[3], key[4], key[0], key[6]) for key in model.block_masks.keys()}
    assert keys == {((1, 3, 3), 15, "sdpa", 0), ((4, 3), 15, "sdpa", 1)}
    model.clear_caches()
    assert len(model.block_masks) == 0


def test_bf16_keeps_rope_tables_and_qk_norm_in_high_precision(latents, prompt_embeds):
    model = make_causal_transformer().to(torch.bfloat16)
    assert all(table.dtype == torch.float64 for table in model.rotary_tables._cos)
    with torch.no_grad():
        out = model(latents.bfloat16(), torch.full((2,), 500.0), prompt_embeds.bfloat16(), return_dict=False)[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_from_pretrained_loads_plain_wan_weights_bit_identically(tmp_path):
    stock = WanTransformer3DModel(**TINY_WAN_CONFIG)
    stock.save_pretrained(tmp_path / "transformer")
    model = WanCausalTransformer3DModel.from_pretrained(
        tmp_path / "transformer", chunk_size=2, independent_first_frame=True
    )
    assert model.config.chunk_size == 2 and model.config.independent_first_frame
    stock_state = stock.state_dict()
    model_state = model.state_dict()
    assert stock_state.keys() == model_state.keys()
    assert all(torch.equal(stock_state[k], model_state[k]) for k in stock_state)
    assert type(model.blocks[0]).__name__ == "WanCausalTransformerBlock"
    model.save_pretrained(tmp_path / "causal")
    again = WanCausalTransformer3DModel.from_pretrained(tmp_path / "causal")
    assert again.config.chunk_size == 2 and again.config.independent_first_frame


def test_gradient_checkpointing_gives_the_same_output_and_gradients(latents, prompt_embeds):
    timesteps = frame_timesteps(2, 8)
    results = []
    for checkpointing in (False, True):
        model = make_causal_transformer()
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        with torch.no_grad():
            model(latents[:, :, :5], timesteps[:, :5], prompt_embeds, store_kv=True)
        out = model(latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, store_kv=True).sample
        out.square().mean().backward()
        results.append((out.detach(), model.blocks[0].attn1.to_q.weight.grad.clone()))
        assert model.kv_cache_engines["main"].num_stored_frames("pos") == 8
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_deepcopy_resolves_its_own_modules_to_its_own_engines(tiny_model, latents, prompt_embeds):
    timesteps = frame_timesteps(2, 8)
    with torch.no_grad():
        rollout(tiny_model, latents[:, :, :5], timesteps[:, :5], prompt_embeds, (5,))
    ema = copy.deepcopy(tiny_model)
    engine, ema_engine = tiny_model.kv_cache_engines["main"], ema.kv_cache_engines["main"]
    assert ema_engine is not engine
    assert ema_engine.owns(ema.blocks[1].attn2) and not ema_engine.owns(tiny_model.blocks[1].attn2)
    assert ema_engine.block_index(ema.blocks[1].attn1) == 1
    with torch.no_grad():
        ema(latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, store_kv=True)
        out = tiny_model(latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, return_dict=False)[0]
    assert ema_engine.num_stored_frames("pos") == 8 and engine.num_stored_frames("pos") == 5
    assert torch.isfinite(out).all()
