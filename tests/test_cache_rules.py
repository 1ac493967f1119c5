"""Cache rules: cross K/V reuse, tag isolation, clearing, and errors raised before any cache is modified."""

from __future__ import annotations

import pytest
import torch
from conftest import make_causal_transformer

from fastgen_diffusers import CausalContext, KVCacheEngine
from fastgen_diffusers.kv_cache import CrossKVMode


def count_calls(modules):
    counter = {"calls": 0}

    def hook(*_):
        counter["calls"] += 1

    handles = [m.register_forward_hook(hook) for m in modules]
    return counter, handles


def cross_kv_projections(model):
    return [p for block in model.blocks for p in (block.attn2.to_k, block.attn2.to_v)]


def cache_snapshot(model):
    engine = model.kv_cache_engines["main"]
    return {tag: (state.num_frames, list(state.chunk_starts)) for tag, state in engine._tags.items()}, (
        model.kv_cache_bytes()
    )


@torch.no_grad()
def test_no_grad_reads_run_zero_cross_projections_and_are_bit_exact(tiny_model, latents, prompt_embeds):
    t = torch.full((2,), 500.0)
    counter, handles = count_calls(cross_kv_projections(tiny_model))
    tiny_model(latents[:, :, :5], t, prompt_embeds)  # store_kv=False: computes, leaves the entry empty
    assert counter["calls"] == 4 and not tiny_model.kv_cache_engines["main"]._cross_kv[0]["pos"].is_init
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)  # fills
    assert counter["calls"] == 8
    cached = tiny_model(latents[:, :, 5:], t, prompt_embeds, start_frame=5, return_dict=False)[0]
    assert counter["calls"] == 8  # read: no K/V projection ran
    tiny_model.kv_cache_engines["main"].invalidate_cross("pos")
    recomputed = tiny_model(latents[:, :, 5:], t, prompt_embeds, start_frame=5, return_dict=False)[0]
    assert counter["calls"] == 12
    assert torch.equal(cached, recomputed)
    for handle in handles:
        handle.remove()


def test_grad_enabled_forward_recomputes_cross_kv_and_trains_them(tiny_model, latents, prompt_embeds):
    with torch.no_grad():
        tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    counter, handles = count_calls(cross_kv_projections(tiny_model))
    out = tiny_model(latents[:, :, 5:], torch.full((2,), 500.0), prompt_embeds, start_frame=5).sample
    assert counter["calls"] == 4
    out.square().mean().backward()
    for block in tiny_model.blocks:
        assert block.attn2.to_k.weight.grad is not None and block.attn2.to_k.weight.grad.abs().sum() > 0
        assert block.attn2.to_v.weight.grad is not None and block.attn2.to_v.weight.grad.abs().sum() > 0
    for handle in handles:
        handle.remove()


@torch.no_grad()
def test_other_conditioning_is_recomputed_never_read_from_a_stale_cache(tiny_model, latents, prompt_embeds):
    t = torch.full((2,), 500.0)
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    other_prompt = prompt_embeds + 1.0
    stale_read = tiny_model(latents[:, :, 5:], t, other_prompt, start_frame=5, return_dict=False)[0]
    engine = tiny_model.kv_cache_engines["main"]
    engine.invalidate_cross("pos")
    recomputed = tiny_model(latents[:, :, 5:], t, other_prompt, start_frame=5, return_dict=False)[0]
    assert torch.equal(stale_read, recomputed)
    # An equal tensor (another object with the same values) still reads the cache.
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    ctx_mode = engine.cross_mode("pos", (prompt_embeds.clone(), None), store_kv=False, grad_enabled=False)
    assert ctx_mode is CrossKVMode.READ
    prompt_embeds.add_(1.0)  # modified in place: no longer the conditioning that filled the cache
    assert engine.cross_mode("pos", (prompt_embeds, None), store_kv=False, grad_enabled=False) is CrossKVMode.COMPUTE


@torch.no_grad()
def test_tags_never_see_each_other(latents, prompt_embeds):
    t = torch.full((2,), 500.0)
    negative = torch.zeros_like(prompt_embeds)
    alone = make_causal_transformer()
    alone(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    pos_alone = alone(latents[:, :, 5:], t, prompt_embeds, start_frame=5, return_dict=False)[0]

    both = make_causal_transformer()
    both(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True, cache_tag="pos")
    both(latents[:, :, :5] * 2, torch.zeros(2), negative, store_kv=True, cache_tag="neg")
    pos_both = both(latents[:, :, 5:], t, prompt_embeds, start_frame=5, return_dict=False)[0]
    neg_both = both(latents[:, :, 5:], t, negative, start_frame=5, cache_tag="neg", return_dict=False)[0]
    assert torch.equal(pos_alone, pos_both)

    neg_alone = make_causal_transformer()
    neg_alone(latents[:, :, :5] * 2, torch.zeros(2), negative, store_kv=True, cache_tag="neg")
    assert torch.equal(neg_both, neg_alone(latents[:, :, 5:], t, negative, start_frame=5, cache_tag="neg").sample)
    assert both.kv_cache_bytes("pos") == both.kv_cache_bytes("neg") == alone.kv_cache_bytes("pos")

    both.kv_cache_engines["main"].clear("neg")
    assert both.kv_cache_bytes("neg") == 0 and both.kv_cache_bytes("pos") == alone.kv_cache_bytes()


@torch.no_grad()
def test_clear_caches_restores_the_state_of_a_new_model(tiny_model, latents, prompt_embeds):
    new_engine = make_causal_transformer().kv_cache_engines["main"]
    first = tiny_model(latents, torch.zeros(2), prompt_embeds, return_dict=False)[0]
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True, cache_tag="neg")
    tiny_model.clear_caches()
    engine = tiny_model.kv_cache_engines["main"]
    for name in ("_self_kv", "_cross_kv", "_tags"):
        assert getattr(engine, name) == getattr(new_engine, name), name
    assert len(tiny_model.block_masks) == 0
    assert tiny_model.kv_cache_bytes() == 0 and engine.cross_cache_bytes() == 0
    assert torch.equal(first, tiny_model(latents, torch.zeros(2), prompt_embeds, return_dict=False)[0])


@torch.no_grad()
def test_a_forward_that_fails_midway_undoes_its_store(tiny_model, latents, prompt_embeds):
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    before = cache_snapshot(tiny_model)

    def explode(*_):
        raise KeyboardInterrupt

    handle = tiny_model.blocks[1].register_forward_hook(explode)
    with pytest.raises(KeyboardInterrupt):
        tiny_model(latents[:, :, 5:], torch.zeros(2), prompt_embeds, start_frame=5, store_kv=True)
    handle.remove()
    assert cache_snapshot(tiny_model) == before  # block 0's half-written chunk was dropped
    fresh = make_causal_transformer()
    fresh(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    expected = fresh(latents[:, :, 5:], torch.zeros(2), prompt_embeds, start_frame=5, store_kv=True).sample
    got = tiny_model(latents[:, :, 5:], torch.zeros(2), prompt_embeds, start_frame=5, store_kv=True).sample
    assert torch.equal(expected, got)


def error_cases(latents, prompt_embeds):
    """(description, kwargs for the forward, expected message fragment); the "pos" tag holds frames [0, 5)."""
    t, rest = torch.zeros(2), latents[:, :, 5:]
    return [
        ("hole", dict(hidden_states=rest, timestep=t, start_frame=6), "leaves a hole"),
        ("inside a chunk", dict(hidden_states=latents[:, :, 2:5], timestep=t, start_frame=2), "chunk boundary"),
        ("batch", dict(hidden_states=rest[:1], timestep=t[:1], enc=prompt_embeds[:1], start_frame=5), "batch_size=2"),
        ("resolution", dict(hidden_states=rest[..., :4], timestep=t, start_frame=5), "frame_seqlen=15"),
        ("timestep shape", dict(hidden_states=rest, timestep=torch.zeros(2, 2), start_frame=5), "must have shape"),
        ("timestep batch", dict(hidden_states=rest, timestep=torch.zeros(3), start_frame=5), "must have shape"),
        ("context batch", dict(hidden_states=rest, timestep=t, enc=prompt_embeds[:1], start_frame=5), "batch"),
        ("past the RoPE table", dict(hidden_states=rest, timestep=t, start_frame=1023), "RoPE table"),
    ]


@pytest.mark.parametrize("case", range(8))
@torch.no_grad()
def test_bad_calls_raise_before_any_cache_is_modified(tiny_model, latents, prompt_embeds, case):
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    before = cache_snapshot(tiny_model)
    name, kwargs, message = error_cases(latents, prompt_embeds)[case]
    enc = kwargs.pop("enc", prompt_embeds)
    with pytest.raises(ValueError, match=message):
        tiny_model(encoder_hidden_states=enc, store_kv=True, **kwargs)
    assert cache_snapshot(tiny_model) == before, name


@torch.no_grad()
def test_dtype_and_device_changes_against_a_filled_tag_are_errors(tiny_model, latents, prompt_embeds):
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    before = cache_snapshot(tiny_model)
    tiny_model.double()
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        tiny_model(latents[:, :, 5:].double(), torch.zeros(2), prompt_embeds.double(), start_frame=5, store_kv=True)
    assert cache_snapshot(tiny_model) == before
    engine = tiny_model.kv_cache_engines["main"]
    with pytest.raises(ValueError, match="device=cpu"):
        engine.check_call(
            "pos", start_frame=5, batch_size=2, frame_seqlen=15, num_heads=2, head_dim=32,
            dtype=torch.float32, device=torch.device("meta"),
        )  # fmt: skip


def test_an_unregistered_module_is_a_clear_error(tiny_model):
    foreign = make_causal_transformer(seed=1)
    ctx = CausalContext(cache_engines=tiny_model.kv_cache_engines)
    with pytest.raises(RuntimeError, match="No KV-cache engine registered"):
        ctx.resolve_registered_engine(foreign.blocks[0].attn1)
    with pytest.raises(RuntimeError, match="is not registered"):
        KVCacheEngine().block_index(foreign.blocks[0].attn1)
    with pytest.raises(RuntimeError, match="needs a `causal_context`"):
        tiny_model.blocks[0].attn1(torch.zeros(1, 15, 64))


def test_set_kv_cache_engines_checks_branch_names(tiny_model):
    with pytest.raises(ValueError, match="missing: \\['main'\\]"):
        tiny_model.set_kv_cache_engines({"vace": KVCacheEngine()})
    engine = KVCacheEngine()
    tiny_model.set_kv_cache_engines({"main": engine})
    assert tiny_model.kv_cache_engines["main"] is engine and engine.num_blocks == 2
    assert engine.block_index(tiny_model.blocks[1].attn2) == 1


@torch.no_grad()
def test_rewind_and_copy_tag(tiny_model, latents, prompt_embeds):
    t = torch.full((2,), 500.0)
    tiny_model(latents[:, :, :5], torch.zeros(2), prompt_embeds, store_kv=True)
    expected = tiny_model(latents[:, :, 5:], t, prompt_embeds, start_frame=5, return_dict=False)[0]
    tiny_model(latents[:, :, 5:], torch.zeros(2), prompt_embeds, start_frame=5, store_kv=True)
    engine = tiny_model.kv_cache_engines["main"]
    engine.copy_tag("pos", "fork")
    engine.rewind("pos", 3)
    assert engine.num_stored_frames("pos") == 5 and engine.num_stored_frames("fork") == 8
    assert torch.equal(expected, tiny_model(latents[:, :, 5:], t, prompt_embeds, start_frame=5).sample)
    with pytest.raises(ValueError, match="stored chunks start at"):
        engine.truncate("fork", 6)


def test_inference_mode_tensors_fill_and_reuse_the_cross_cache(tiny_model, latents, prompt_embeds):
    with torch.inference_mode():
        embeds = prompt_embeds.clone()  # an inference tensor: it tracks no version counter
        tiny_model(latents[:, :, :5], torch.zeros(2), embeds, store_kv=True)
        engine = tiny_model.kv_cache_engines["main"]
        assert engine.cross_mode("pos", (embeds, None), store_kv=False, grad_enabled=False) is CrossKVMode.READ
        other = embeds + 1.0
        assert engine.cross_mode("pos", (other, None), store_kv=False, grad_enabled=False) is CrossKVMode.COMPUTE
    assert engine.num_stored_frames("pos") == 5


def test_gradient_checkpointing_recompute_does_not_write_the_cache_again(latents, prompt_embeds):
    """Backward re-runs a checkpointed block; a chunk stored since then must stay in the cache."""
    timesteps = torch.zeros(2)
    model = make_causal_transformer()
    model.enable_gradient_checkpointing()
    model.train()
    out = model(latents[:, :, :5], timesteps, prompt_embeds, store_kv=True).sample
    with torch.no_grad():
        model(latents[:, :, 5:], timesteps, prompt_embeds, start_frame=5, store_kv=True)
    out.square().mean().backward()
    reference = make_causal_transformer()
    with torch.no_grad():
        reference(latents[:, :, :5], timesteps, prompt_embeds, store_kv=True)
        reference(latents[:, :, 5:], timesteps, prompt_embeds, start_frame=5, store_kv=True)
    assert model.kv_cache_bytes() == reference.kv_cache_bytes()
    assert model.kv_cache_engines["main"].num_stored_frames("pos") == 8


@pytest.mark.parametrize("kind", ["vanilla", "static"])
@torch.no_grad()
def test_a_multi_chunk_store_leaves_every_chunk_boundary_usable(latents, prompt_embeds, kind):
    """Teacher forcing stores [0, 8) in one call (chunks 5 + 3); redoing the last chunk then works like a rollout."""
    from fastgen_diffusers import make_engines

    timesteps = torch.rand(2, 8, generator=torch.Generator().manual_seed(4)) * 1000
    model = make_causal_transformer()
    model.set_kv_cache_engines(make_engines(model, kind))
    model(latents, timesteps, prompt_embeds, store_kv=True)
    engine = model.kv_cache_engines["main"]
    assert engine.tag_state("pos").chunk_starts == [0, 5]
    engine.rewind("pos", 3)
    assert engine.num_stored_frames("pos") == 5
    redone = model(latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, return_dict=False)[0]
    reference = make_causal_transformer()
    reference(latents[:, :, :5], timesteps[:, :5], prompt_embeds, store_kv=True)
    expected = reference(latents[:, :, 5:], timesteps[:, 5:], prompt_embeds, start_frame=5, return_dict=False)[0]
    assert (redone - expected).abs().max().item() <= 1e-5
    assert model.kv_cache_bytes() == reference.kv_cache_bytes()
