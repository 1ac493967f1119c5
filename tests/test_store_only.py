"""Store-only forwards: a cache pass stores what the full forward stores and skips what only its prediction needs.

The pipelines' cache passes run ``store_only=True`` (their prediction is never read): the last block computes only its
K/V (and the cross K/V it fills), its attention outputs, feed-forward and the output head do not run. At 1 layer this
is most of a cache pass; the outputs of every later forward are bit-identical.
"""

from __future__ import annotations

import copy

import numpy as np
import PIL.Image
import pytest
import torch
import torch._dynamo
from conftest import make_causal_transformer, recorded_forwards
from torch._dynamo.utils import counters

from fastgen_diffusers.kv_cache import make_engines
from fastgen_diffusers.testing import tiny_pipeline, tiny_vace_pipeline

ENGINES = [
    {"kind": "static"},
    {"kind": "vanilla"},
    {"kind": "static", "window_frames": 5, "sink_frames": 1},
    {"kind": "vanilla", "window_frames": 5, "sink_frames": 1, "rope_positions": "window"},  # keys before RoPE
    {"kind": "vanilla", "kv_cache_dtype": "int8"},
]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def with_engines(model, options):
    model.set_kv_cache_engines(make_engines(model, max_frames=16, **options))
    return model


@pytest.mark.parametrize("options", ENGINES, ids=lambda o: "-".join(map(str, o.values())))
@torch.no_grad()
def test_store_only_stores_what_the_full_forward_stores(options):
    """Two models roll out the same chunks, one storing with full forwards and one with store-only forwards: every
    denoising forward between the stores (reading what they stored, self and cross K/V) is bit-identical."""
    full = with_engines(make_causal_transformer(), options)
    store_only = with_engines(copy.deepcopy(full), options)
    latents, text = randn(1, 16, 14, 4, 4, seed=1), randn(1, 8, 32, seed=2)
    layout = [(0, 5), (5, 8), (8, 11), (11, 14)]  # the window (5 frames) slides over the last two stores
    for start, end in layout:
        chunk, t_denoise, t_store = latents[:, :, start:end], torch.full((1,), 750.0), torch.zeros(1)
        call = {"start_frame": start, "return_dict": False}
        expected = full(chunk, t_denoise, text, **call)[0]
        got = store_only(chunk, t_denoise, text, **call)[0]
        assert torch.equal(got, expected), (start, (got - expected).abs().max())
        assert full(chunk, t_store, text, store_kv=True, **call)[0] is not None
        assert store_only(chunk, t_store, text, store_kv=True, store_only=True, **call)[0] is None
        assert store_only.kv_cache_bytes() == full.kv_cache_bytes()
    if "window_frames" in options:
        return
    # one call of several chunks (block-causal mask, gathered prefix) stores the same too
    full.clear_caches()
    store_only.clear_caches()
    full(latents[:, :, :8], torch.zeros(1), text, store_kv=True)
    store_only(latents[:, :, :8], torch.zeros(1), text, store_kv=True, store_only=True)
    call = {"start_frame": 8, "return_dict": False}
    assert torch.equal(store_only(latents[:, :, 8:11], torch.full((1,), 500.0), text, **call)[0],
                       full(latents[:, :, 8:11], torch.full((1,), 500.0), text, **call)[0])  # fmt: skip


def test_store_only_stores_the_image_kv_and_a_store_with_gradients():
    """I2V (image tokens lead the context, ``added_kv_proj``): the image cross K/V are filled as the full forward
    fills them. A store with gradients enabled (training) stores what the full forward stores."""
    full = make_causal_transformer(added_kv_proj_dim=64, image_dim=24)
    store_only = copy.deepcopy(full)
    latents, text, image = randn(1, 16, 9, 4, 4, seed=1), randn(1, 8, 32, seed=2), randn(1, 5, 24, seed=3)
    for start in (0, 3, 6):
        chunk, call = latents[:, :, start : start + 3], {"start_frame": start, "return_dict": False}
        with torch.no_grad():
            expected = full(chunk, torch.full((1,), 750.0), text, image, **call)[0]
            assert torch.equal(store_only(chunk, torch.full((1,), 750.0), text, image, **call)[0], expected)
        with torch.enable_grad():
            full(chunk, torch.zeros(1), text, image, store_kv=True, **call)
            store_only(chunk, torch.zeros(1), text, image, store_kv=True, store_only=True, **call)
    with torch.no_grad():
        call = {"start_frame": 9, "return_dict": False}
        got = store_only(latents[:, :, 6:9], torch.full((1,), 500.0), text, image, **call)[0]
        assert torch.equal(got, full(latents[:, :, 6:9], torch.full((1,), 500.0), text, image, **call)[0])


@torch.no_grad()
def test_compiled_blocks_store_what_their_full_forward_stores():
    """Under ``compile_repeated_blocks`` the last block of a store-only forward runs its compiled graph whole (only
    the output head is skipped): the cache equals a compiled full store bit for bit (inductor rounds differently
    from the eager store-only path), with no graph and no recompile more."""
    torch._dynamo.reset()
    counters.clear()
    model = make_causal_transformer()
    model.compile_repeated_blocks(fullgraph=True)
    latents, text = randn(1, 16, 12, 4, 6, seed=1), randn(1, 8, 32, seed=2)

    def rollout(**store):
        model.set_kv_cache_engines(make_engines(model, max_frames=12, kind="static"))
        outputs = []
        for start in range(0, 12, 3):
            chunk, call = latents[:, :, start : start + 3], {"start_frame": start, "return_dict": False}
            outputs.append(model(chunk, torch.full((1,), 750.0), text, **call)[0])
            model(chunk, torch.zeros(1), text, store_kv=True, **call, **store)
        return torch.cat(outputs, dim=2)

    try:
        expected = rollout()
        graphs = counters["stats"]["unique_graphs"]
        assert torch.equal(rollout(store_only=True), expected)
        assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"]
    finally:
        torch._dynamo.reset()


@torch.no_grad()
def test_store_only_skips_what_only_the_prediction_needs():
    model = make_causal_transformer()
    last, first = model.blocks[-1], model.blocks[0]
    watched = {
        "last.attn1.to_q": last.attn1.to_q,
        "last.attn1.to_k": last.attn1.to_k,
        "last.attn1.to_out": last.attn1.to_out[0],
        "last.attn2.to_q": last.attn2.to_q,
        "last.attn2.to_k": last.attn2.to_k,  # the first store fills the cross K/V
        "last.ffn": last.ffn,
        "first.ffn": first.ffn,
        "proj_out": model.proj_out,
    }
    counts = dict.fromkeys(watched, 0)
    handles = [
        module.register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
        for name, module in watched.items()
    ]
    text = randn(1, 8, 32, seed=2)
    model(randn(1, 16, 3, 4, 4, seed=1), torch.zeros(1), text, store_kv=True, store_only=True)
    for handle in handles:
        handle.remove()
    ran = {name for name, count in counts.items() if count}
    assert ran == {"last.attn1.to_k", "last.attn2.to_k", "first.ffn"}


def test_store_only_needs_store_kv():
    model = make_causal_transformer()
    with pytest.raises(ValueError, match="store_only"):
        model(randn(1, 16, 3, 4, 4, seed=1), torch.zeros(1), randn(1, 8, 32, seed=2), store_only=True)


def frames(count: int) -> list[PIL.Image.Image]:
    rng = np.random.RandomState(0)
    return [PIL.Image.fromarray(rng.randint(0, 255, (16, 16, 3), dtype=np.uint8)) for _ in range(count)]


T2V_CALL = {
    "prompt_embeds": randn(1, 8, 32, seed=3),
    "negative_prompt_embeds": randn(1, 8, 32, seed=4),
    "guidance_scale": 2.0,
    "height": 32,
    "width": 32,
    "num_frames": 33,
    "num_inference_steps": 2,
    "output_type": "latent",
}
SWITCH = {  # latent frames 0-14, the prompt switches at frame 12 (pixel frame 45): the window has evicted frames
    "prompt_embeds": {0: randn(1, 8, 32, seed=3), 45: randn(1, 8, 32, seed=5)},
    "num_frames": 57,
    "recache": True,
    "attention_window": 9,
    "sink_frames": 3,
}
VACE_CALL = {
    "video": frames(25),
    "prompt_embeds": randn(1, 8, 32, seed=3),
    "height": 16,
    "width": 16,
    "num_frames": 25,
    "num_inference_steps": 2,
    "output_type": "latent",
}


@pytest.mark.parametrize(
    "make, call",
    [
        (tiny_pipeline, T2V_CALL),
        (tiny_vace_pipeline, VACE_CALL),  # VACE on both layers: the last block runs whole, the head is skipped
        (lambda: tiny_vace_pipeline(vace_layers=(0,)), VACE_CALL),  # the last main block only stores
        (tiny_pipeline, {**T2V_CALL, "kv_cache_policy": "recompute", "context_frames": 3}),  # the rebuilds
        (tiny_pipeline, {**T2V_CALL, "kv_cache_policy": "rolling", "num_frames": 57}),  # the commits
        (tiny_pipeline, {**T2V_CALL, **SWITCH}),  # the recache of the frames the window keeps
        (tiny_pipeline, {**T2V_CALL, **SWITCH, "recache_sink": "keep"}),  # LongLive's recache keeping the sink
    ],
    ids=["t2v-cfg", "vace-last-layer", "vace-first-layer", "recompute", "rolling", "recache", "recache-keep-sink"],
)
@torch.no_grad()
def test_pipeline_cache_passes_are_store_only_and_change_nothing(make, call):
    """Every forward of a pipeline that stores (cache pass, rebuild, commit, recache) is store-only; the latents
    equal those of the same rollout with every store a full forward, bit for bit."""
    pipe = make()
    pipe.set_progress_bar_config(disable=True)
    with recorded_forwards(pipe.transformer) as calls:
        got = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    stores = [(c.kwargs.get("store_only", False), c.out) for c in calls if c.kwargs["store_kv"]]
    assert stores and all(store_only and out is None for store_only, out in stores)
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda *args, store_only=False, **kwargs: forward(*args, **kwargs)  # full stores
    expected = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    del pipe.transformer.forward
    assert torch.equal(got, expected)
