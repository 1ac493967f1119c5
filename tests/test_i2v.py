"""Model-level proofs for the three ways a causal Wan model takes an image (tiny models built in code, CPU).

1. Wan2.1 I2V: 36 input channels (noisy latent | 4-channel first-frame mask | VAE latent of ``[image, zeros...]``) and
   CLIP image tokens whose K/V (``add_k_proj`` / ``add_v_proj``) are cached beside the text K/V.
2. Wan2.2 TI2V-5B: 48-channel latents; latent frame 0 is the clean image latent at timestep 0 inside chunk 0.
3. T2V students: the image (or a clip) latents are written into the cache at timestep 0 before the rollout.

For each: the cached chunk-by-chunk rollout equals the full-sequence block-causal forward (teacher forcing).
"""

from __future__ import annotations

import pytest
import torch

from fastgen_diffusers import WanCausalTransformer3DModel

TEXT_DIM = 32
IMAGE_DIM = 4
INNER_DIM = 16  # 2 heads x 8


def tiny_transformer(
    in_channels: int, out_channels: int, *, image: bool = False, **config
) -> WanCausalTransformer3DModel:
    torch.manual_seed(0)
    model = WanCausalTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        image_dim=IMAGE_DIM if image else None,
        added_kv_proj_dim=INNER_DIM if image else None,
        rope_max_seq_len=32,
        **config,
    )
    # Random (non-zero) output projections so that every path visibly reaches the output.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def count_calls(modules) -> tuple[list[int], list]:
    """Count forward calls of ``modules`` with hooks; returns ``(counter, handles)``."""
    counter = [0]

    def hook(*_):
        counter[0] += 1

    return counter, [m.register_forward_hook(hook) for m in modules]


def image_kv_modules(model: WanCausalTransformer3DModel) -> list:
    return [m for block in model.blocks for m in (block.attn2.add_k_proj, block.attn2.add_v_proj)]


def cached_rollout(model, latents, timesteps, text, image_tokens=None, start_frame=0):
    """Store ``latents`` ``(B, C, F, H, W)`` chunk by chunk; returns the per-chunk outputs, concatenated."""
    layout = model.chunk_layout_for(latents.shape[2], start_frame)
    outputs, s = [], 0
    for size in layout:
        out = model(
            latents[:, :, s : s + size],
            timesteps[:, s : s + size],
            text,
            image_tokens,
            start_frame=start_frame + s,
            store_kv=True,
            return_dict=False,
        )[0]
        outputs.append(out)
        s += size
    return torch.cat(outputs, dim=2)


# ---------------------------------------------------------------------------------------------------------- Wan2.1 I2V
def wan21_inputs(num_frames=6, generator_seed=1):
    g = torch.Generator().manual_seed(generator_seed)
    noisy = torch.randn(1, 16, num_frames, 4, 4, generator=g)
    mask = torch.zeros(1, 4, num_frames, 4, 4)
    mask[:, :, 0] = 1.0
    image_latent = torch.zeros(1, 16, num_frames, 4, 4)
    image_latent[:, :, 0] = torch.randn(1, 16, 4, 4, generator=g)
    latents = torch.cat([noisy, mask, image_latent], dim=1)  # (1, 36, F, 4, 4)
    text = torch.randn(1, 7, TEXT_DIM, generator=g)
    image_tokens = torch.randn(1, 5, IMAGE_DIM, generator=g)  # 5 CLIP tokens: the split is never a hard-coded 512
    return latents, text, image_tokens


@torch.no_grad()
def test_wan21_i2v_cached_rollout_equals_block_causal_forward():
    model = tiny_transformer(36, 16, image=True, chunk_size=2)
    latents, text, image_tokens = wan21_inputs()
    timesteps = torch.full((1, 6), 625.0)
    full = model(latents, timesteps, text, image_tokens, return_dict=False)[0]
    model.clear_caches()
    cached = cached_rollout(model, latents, timesteps, text, image_tokens)
    assert full.shape == (1, 16, 6, 4, 4)
    torch.testing.assert_close(cached, full, rtol=0, atol=2e-6)


def test_wan21_i2v_image_kv_reuse_is_bit_exact_and_projects_nothing():
    model = tiny_transformer(36, 16, image=True, chunk_size=2)
    latents, text, image_tokens = wan21_inputs()
    timesteps = torch.full((1, 2), 500.0)
    counter, handles = count_calls(image_kv_modules(model))
    try:
        with torch.no_grad():
            model(latents[:, :, :2], timesteps, text, image_tokens, start_frame=0, store_kv=True)  # fills the entry
            assert counter[0] == 2 * len(model.blocks)
            counter[0] = 0
            read = model(latents[:, :, 2:4], timesteps, text, image_tokens, start_frame=2, return_dict=False)[0]
            assert counter[0] == 0, "no-grad reads must not run the image K/V projections"
        with torch.enable_grad():  # gradients on: the K/V are recomputed, never read
            recomputed = model(latents[:, :, 2:4], timesteps, text, image_tokens, start_frame=2, return_dict=False)[0]
        assert counter[0] == 2 * len(model.blocks)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(read, recomputed.detach())


@torch.no_grad()
def test_wan21_i2v_image_tokens_and_condition_channels_both_condition_the_output():
    model = tiny_transformer(36, 16, image=True, chunk_size=2)
    latents, text, image_tokens = wan21_inputs()
    timesteps = torch.full((1, 6), 625.0)
    base = model(latents, timesteps, text, image_tokens, return_dict=False)[0]
    other_tokens = model(latents, timesteps, text, torch.randn_like(image_tokens), return_dict=False)[0]
    other_latent = latents.clone()
    other_latent[:, 20:, 0] += 1.0
    other_frame = model(other_latent, timesteps, text, image_tokens, return_dict=False)[0]
    assert (base - other_tokens).abs().max() > 1e-3
    assert (base - other_frame).abs().max() > 1e-3


@torch.no_grad()
def test_image_tokens_for_a_model_without_image_embedder_raise():
    model = tiny_transformer(16, 16, chunk_size=2)
    with pytest.raises(ValueError, match="image embedder"):
        model(torch.randn(1, 16, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 7, TEXT_DIM), torch.randn(1, 5, 4))


# ---------------------------------------------------------------------------------------------------- Wan2.2 TI2V-5B
@torch.no_grad()
def test_ti2v_first_frame_at_t0_cached_rollout_equals_block_causal_forward():
    model = tiny_transformer(48, 48, chunk_size=3)
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 48, 6, 4, 4, generator=g)
    text = torch.randn(1, 7, TEXT_DIM, generator=g)
    timesteps = torch.full((1, 6), 750.0)
    timesteps[:, 0] = 0.0  # the clean image latent of chunk 0
    full = model(latents, timesteps, text, return_dict=False)[0]
    model.clear_caches()
    cached = cached_rollout(model, latents, timesteps, text)
    torch.testing.assert_close(cached, full, rtol=0, atol=2e-6)
    # The per-frame timestep reaches the model: frame 0 at t=750 predicts something else.
    noisy_first = model(latents[:, :, :3], torch.full((1, 3), 750.0), text, return_dict=False)[0]
    assert (noisy_first[:, :, 0] - full[:, :, 0]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------------ T2V students
@pytest.mark.parametrize(("independent_first_frame", "num_context"), [(True, 1), (False, 3)])
@torch.no_grad()
def test_t2v_student_context_prefill_equals_block_causal_forward(independent_first_frame, num_context):
    """Context latents written at t=0, then the generated chunks: same numbers as one teacher-forced forward."""
    model = tiny_transformer(16, 16, chunk_size=3, independent_first_frame=independent_first_frame)
    g = torch.Generator().manual_seed(3)
    num_frames = num_context + 6
    latents = torch.randn(1, 16, num_frames, 4, 4, generator=g)
    text = torch.randn(1, 7, TEXT_DIM, generator=g)
    timesteps = torch.zeros(1, num_frames)  # every stored frame is clean context (the cache-refresh pass)
    assert model.chunk_layout_for(num_frames)[0] == num_context
    full = model(latents, timesteps, text, return_dict=False)[0]

    model.clear_caches()
    context = latents[:, :, :num_context]
    model(context, timesteps[:, :num_context], text, start_frame=0, store_kv=True)  # the prefill
    generated = cached_rollout(model, latents[:, :, num_context:], timesteps[:, num_context:], text, None, num_context)
    torch.testing.assert_close(generated, full[:, :, num_context:], rtol=0, atol=2e-6)
    assert model.kv_cache_engines["main"].num_stored_frames("pos") == num_frames

    # The context conditions what follows.
    model.clear_caches()
    model(context + 1.0, timesteps[:, :num_context], text, start_frame=0, store_kv=True)
    other = cached_rollout(model, latents[:, :, num_context:], timesteps[:, num_context:], text, None, num_context)
    assert (other - generated).abs().max() > 1e-3
