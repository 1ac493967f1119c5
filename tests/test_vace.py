"""Causal VACE: two engine branches ("main" for ``blocks``, "vace" for ``vace_blocks``) on a tiny VACE model."""

from __future__ import annotations

import copy
import gc

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import TINY_WAN_CONFIG
from diffusers import WanVACETransformer3DModel

from fastgen_diffusers import VACEHintCache, WanCausalVACETransformer3DModel
from fastgen_diffusers.pipelines import VACEConditioner

TINY_VACE_CONFIG = {**TINY_WAN_CONFIG, "num_layers": 3, "vace_layers": [0, 2], "vace_in_channels": 96}
CHUNK = 2
FRAMES = 6  # three chunks of two latent frames


def make_vace(seed: int = 0, **overrides) -> WanCausalVACETransformer3DModel:
    torch.manual_seed(seed)
    return WanCausalVACETransformer3DModel(**{**TINY_VACE_CONFIG, "chunk_size": CHUNK, **overrides}).eval()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model():
    return make_vace()


@pytest.fixture
def inputs():
    """Latents ``(2, 16, 6, 4, 6)``, control ``(2, 96, 6, 4, 6)``, text ``(2, 8, 32)``, timesteps ``(2, 6)``."""
    return {
        "x": randn(2, 16, FRAMES, 4, 6, seed=1),
        "control": randn(2, 96, FRAMES, 4, 6, seed=2),
        "text": randn(2, 8, 32, seed=3),
        "t": torch.rand(2, FRAMES, generator=torch.Generator().manual_seed(4)) * 1000,
    }


def call(model, inputs, start, end, *, control=None, **kwargs):
    control = inputs["control"] if control is None else control
    return model(
        inputs["x"][:, :, start:end],
        inputs["t"][:, start:end],
        inputs["text"],
        control_hidden_states=control[:, :, start:end],
        start_frame=start,
        return_dict=False,
        **kwargs,
    )[0]


def count_calls(modules):
    """Forward hooks counting calls per module; returns ``(counts, handles)``."""
    counts = {id(m): 0 for m in modules}

    def hook(module, args, output):
        counts[id(module)] += 1

    return counts, [m.register_forward_hook(hook) for m in modules]


@torch.no_grad()
def test_cached_chunked_rollout_matches_full_block_causal_forward(model, inputs):
    full = call(model, inputs, 0, FRAMES, control_hidden_states_scale=[0.7, 1.3])
    model.clear_caches()
    outputs = []
    for start in range(0, FRAMES, CHUNK):
        noisy = dict(inputs, x=randn(*inputs["x"].shape, seed=10 + start))
        call(model, noisy, start, start + CHUNK, control_hidden_states_scale=[0.7, 1.3])  # a denoising call
        outputs.append(
            call(model, inputs, start, start + CHUNK, store_kv=True, control_hidden_states_scale=[0.7, 1.3])
        )
    assert (torch.cat(outputs, dim=2) - full).abs().max().item() <= 1e-5
    for engine in model.kv_cache_engines.values():
        assert engine.num_stored_frames("pos") == FRAMES


@torch.no_grad()
def test_single_chunk_matches_stock_vace_on_the_same_weights(inputs):
    torch.manual_seed(0)
    stock = WanVACETransformer3DModel(**TINY_VACE_CONFIG).eval()
    model = make_vace(seed=1)
    model.load_state_dict(stock.state_dict())
    x, control = inputs["x"][:, :, :CHUNK], inputs["control"][:, :, :CHUNK]
    t = torch.tensor([937.5, 250.0])
    scale = torch.tensor([0.5, 2.0])
    expected = stock(x, t, inputs["text"], control_hidden_states=control, control_hidden_states_scale=scale)[0]
    out = model(x, t, inputs["text"], control_hidden_states=control, control_hidden_states_scale=scale)[0]
    assert (out - expected).abs().max().item() <= 1e-4


def test_plain_vace_weights_load_bit_identically(tmp_path):
    torch.manual_seed(0)
    stock = WanVACETransformer3DModel(**TINY_VACE_CONFIG)
    stock.save_pretrained(tmp_path)
    model = WanCausalVACETransformer3DModel.from_pretrained(tmp_path, chunk_size=CHUNK)
    assert model.config.chunk_size == CHUNK
    loaded, saved = model.state_dict(), stock.state_dict()
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@torch.no_grad()
def test_each_engine_holds_exactly_its_own_blocks(model, inputs):
    main, vace = model.kv_cache_engines["main"], model.kv_cache_engines["vace"]
    assert main.num_blocks == len(model.blocks) == 3
    assert vace.num_blocks == len(model.vace_blocks) == 2
    for engine, blocks in ((main, model.blocks), (vace, model.vace_blocks)):
        for idx, block in enumerate(blocks):
            assert engine.block_index(block.attn1) == engine.block_index(block.attn2) == idx  # local to the branch
    assert not any(vace.owns(b.attn1) for b in model.blocks) and not any(main.owns(b.attn1) for b in model.vace_blocks)

    for tag in ("pos", "neg"):
        for start in (0, CHUNK):
            call(model, inputs, start, start + CHUNK, store_kv=True, cache_tag=tag)
    assert len(main._self_kv) == len(main._cross_kv) == 3
    assert len(vace._self_kv) == len(vace._cross_kv) == 2
    main_entries = [dict(per_tag) for per_tag in main._self_kv]

    vace.clear("pos")
    assert vace.num_stored_frames("pos") == 0 and vace.num_stored_frames("neg") == 2 * CHUNK
    assert main.num_stored_frames("pos") == main.num_stored_frames("neg") == 2 * CHUNK
    assert all(per_tag["pos"] is before["pos"] for per_tag, before in zip(main._self_kv, main_entries))
    main.clear("neg")
    assert vace.num_stored_frames("neg") == 2 * CHUNK and main.num_stored_frames("neg") == 0


@torch.no_grad()
def test_cross_kv_reuse_is_bit_exact_in_both_branches(model, inputs):
    call(model, inputs, 0, CHUNK, store_kv=True)
    projections = [p for b in (*model.blocks, *model.vace_blocks) for p in (b.attn2.to_k, b.attn2.to_v)]
    counts, handles = count_calls(projections)
    read = call(model, inputs, CHUNK, 2 * CHUNK)
    assert sum(counts.values()) == 0  # no K/V projection ran in either branch
    for engine in model.kv_cache_engines.values():
        engine.invalidate_cross("pos")
    recomputed = call(model, inputs, CHUNK, 2 * CHUNK)
    for handle in handles:
        handle.remove()
    assert all(counts[id(p)] == 1 for p in projections)
    assert torch.equal(read, recomputed)


@torch.no_grad()
def test_control_video_steers_the_output(model, inputs):
    other = randn(*inputs["control"].shape, seed=99)
    out = call(model, inputs, 0, CHUNK)
    assert (call(model, inputs, 0, CHUNK, control=other) - out).abs().max().item() > 1e-2
    muted = call(model, inputs, 0, CHUNK, control_hidden_states_scale=0.0)
    assert torch.equal(muted, call(model, inputs, 0, CHUNK, control=other, control_hidden_states_scale=0.0))

    # The control of an earlier chunk reaches later chunks through the "vace" branch's cache.
    def second_chunk(control):
        model.clear_caches()
        call(model, inputs, 0, CHUNK, control=control, store_kv=True)
        return call(model, inputs, CHUNK, 2 * CHUNK)

    changed_first = inputs["control"].clone()
    changed_first[:, :, :CHUNK] = other[:, :, :CHUNK]
    assert (second_chunk(changed_first) - second_chunk(inputs["control"])).abs().max().item() > 1e-4


@pytest.mark.parametrize(
    ("control_shape", "scale"),
    [
        ((2, 16, CHUNK, 4, 6), None),  # latent channels instead of 96
        ((2, 96, CHUNK - 1, 4, 6), None),  # does not cover the frames of the call
        ((2, 96, CHUNK, 4, 4), None),  # wrong spatial size
        ((1, 96, CHUNK, 4, 6), None),  # wrong batch
        (None, None),  # missing
        ((2, 96, CHUNK, 4, 6), [1.0, 1.0, 1.0]),  # one scale per VACE layer (2)
    ],
)
@torch.no_grad()
def test_invalid_control_raises_before_any_work(model, inputs, control_shape, scale):
    control = None if control_shape is None else torch.zeros(control_shape)
    counts, handles = count_calls([model.patch_embedding, model.vace_patch_embedding])
    with pytest.raises(ValueError):
        model(
            inputs["x"][:, :, :CHUNK],
            inputs["t"][:, :CHUNK],
            inputs["text"],
            control_hidden_states=control,
            control_hidden_states_scale=scale,
            store_kv=True,
        )
    for handle in handles:
        handle.remove()
    assert sum(counts.values()) == 0
    assert all(engine.tag_state("pos") is None for engine in model.kv_cache_engines.values())


@torch.no_grad()
def test_hint_cache_is_opt_in_and_skips_vace_layers_only_on_reused_steps(model, inputs):
    with pytest.raises(ValueError, match="allow_lossy"):
        VACEHintCache(2)
    exact_cache = VACEHintCache(1, allow_lossy=True)
    lossy_cache = VACEHintCache(2, allow_lossy=True)
    counts, handles = count_calls(list(model.vace_blocks))
    steps = [dict(inputs, x=randn(*inputs["x"].shape, seed=20 + i)) for i in range(3)]
    results = {}
    for name, cache in (("exact", None), ("k1", exact_cache), ("k2", lossy_cache)):
        model.clear_caches()
        outs = []
        for step, step_inputs in enumerate(steps):
            if cache is not None:
                cache.set_step(step)
            outs.append(call(model, step_inputs, 0, CHUNK, vace_hint_cache=cache))
        call(model, inputs, 0, CHUNK, vace_hint_cache=cache, store_kv=True)  # always runs the VACE layers
        results[name] = (outs, dict(counts))
        counts.update(dict.fromkeys(counts, 0))
    for handle in handles:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(results["exact"][0], results["k1"][0]))
    assert set(results["k1"][1].values()) == {4}
    assert set(results["k2"][1].values()) == {3}  # steps 0 and 2 and the store call
    assert torch.equal(results["k2"][0][0], results["exact"][0][0])
    assert not torch.equal(results["k2"][0][1], results["exact"][0][1])
    assert model.kv_cache_engines["vace"].num_stored_frames("pos") == CHUNK
    assert (lossy_cache.num_computed, lossy_cache.num_reused) == (2, 1)


@torch.no_grad()
def test_deepcopy_resolves_both_branches_to_the_copy(model, inputs):
    copied = copy.deepcopy(model)
    for name, blocks in copied.kv_cache_branches().items():
        assert all(copied.kv_cache_engines[name].owns(b.attn1) for b in blocks)
        assert not any(model.kv_cache_engines[name].owns(b.attn1) for b in blocks)
    assert torch.equal(call(copied, inputs, 0, CHUNK, store_kv=True), call(model, inputs, 0, CHUNK))
    assert model.kv_cache_engines["vace"].tag_state("pos") is not None  # created by ensure_capacity only
    assert model.kv_cache_engines["vace"].num_stored_frames("pos") == 0


# ---------------------------------------------------------------------------------------------------- pipeline
def make_pipeline(chunk_size: int = CHUNK):
    from fastgen_diffusers import WanCausalVACEPipeline
    from fastgen_diffusers.testing import tiny_components

    components = tiny_components()
    components["transformer"] = make_vace(chunk_size=chunk_size)
    return WanCausalVACEPipeline(**components)


def frames(count: int, size: int = 16, seed: int = 0) -> list[PIL.Image.Image]:
    rng = np.random.RandomState(seed)
    return [PIL.Image.fromarray(rng.randint(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


PIPE_KWARGS = {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "output_type": "latent"}


@torch.no_grad()
def test_pipeline_with_one_chunk_matches_stock_vace_pipeline():
    """One chunk and one step: the causal rollout is WanVACEPipeline's forward (same control, same noise)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline

    pipe = make_pipeline(chunk_size=3)  # 1 reference + 2 latent frames: a single chunk
    stock_transformer = WanVACETransformer3DModel(**TINY_VACE_CONFIG).eval()
    stock_transformer.load_state_dict(pipe.transformer.state_dict())
    stock = WanVACEPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=stock_transformer,
    )
    mask = [PIL.Image.new("L", (16, 16), 0 if i < 2 else 255) for i in range(5)]
    reference = PIL.Image.new("RGB", (8, 16), (200, 30, 30))
    common = {
        "video": frames(5),
        "mask": mask,
        "reference_images": reference,
        "conditioning_scale": [0.5, 1.5],
        "height": 16,
        "width": 16,
        "num_frames": 5,
        "num_inference_steps": 1,
        "prompt_embeds": randn(1, 8, 32, seed=5),
        "latents": randn(1, 16, 3, 2, 2, seed=6),
        "output_type": "latent",
    }
    expected = stock(**common, guidance_scale=1.0).frames[:, :, 1:]
    out = pipe(**common).frames
    assert out.shape == (1, 16, 2, 2, 2)
    assert (out - expected).abs().max().item() <= 1e-4


@torch.no_grad()
def test_pipeline_control_video_steers_and_references_are_dropped():
    pipe = make_pipeline()
    embeds = randn(1, 8, 32, seed=5)
    noise = randn(1, 16, 3, 2, 2, seed=6)
    kwargs = {**PIPE_KWARGS, "prompt_embeds": embeds, "reference_images": PIL.Image.new("RGB", (16, 16))}
    a = pipe(video=frames(5, seed=1), latents=noise, **{**kwargs, "output_type": "pt"}).frames
    b = pipe(video=frames(5, seed=2), latents=noise, **{**kwargs, "output_type": "pt"}).frames
    assert a.shape == (1, 5, 3, 16, 16)  # the reference frame is not decoded
    assert (a - b).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"video": frames(3)}, "does not cover"),
        ({"video": frames(5, size=32)}, "16x16"),
        ({"video": torch.zeros(5, 4, 16, 16)}, "channels"),
        ({"video": torch.zeros(16, 16)}, "list of PIL images"),
        ({"video": frames(5), "mask": [PIL.Image.new("L", (16, 16))] * 3}, "does not cover"),
        ({"video": frames(5), "mask": [PIL.Image.new("L", (16, 8))] * 5}, "16x16"),
        ({"mask": [PIL.Image.new("L", (16, 16))] * 5}, "together with `video`"),
        ({"reference_images": PIL.Image.new("RGBA", (16, 16))}, "reference image"),
        ({"reference_images": [torch.zeros(3, 16, 16)]}, "reference image"),
        ({"conditioning_scale": [1.0, 1.0, 1.0]}, "per VACE layer"),
        ({"vace_hint_refresh_interval": 2}, "allow_lossy"),
        ({"latents": torch.zeros(1, 16, 2, 2, 2), "reference_images": PIL.Image.new("RGB", (8, 8))}, "latents"),
    ],
)
def test_pipeline_rejects_bad_control_inputs_before_any_work(overrides, match):
    pipe = make_pipeline()
    counts, handles = count_calls([pipe.vae.encoder, pipe.transformer.patch_embedding, pipe.text_encoder])
    with pytest.raises(ValueError, match=match):
        pipe(prompt_embeds=randn(1, 8, 32, seed=5), **{**PIPE_KWARGS, **overrides})
    for handle in handles:
        handle.remove()
    assert sum(counts.values()) == 0


@torch.no_grad()
def test_pipeline_lossy_hint_reuse_is_opt_in_and_close():
    pipe = make_pipeline()
    kwargs = {**PIPE_KWARGS, "num_inference_steps": 4, "video": frames(5), "prompt_embeds": randn(1, 8, 32, seed=5)}
    exact = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    same = pipe(**kwargs, vace_hint_refresh_interval=1, generator=torch.Generator().manual_seed(0)).frames
    lossy = pipe(**kwargs, vace_hint_refresh_interval=2, allow_lossy=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(exact, same)
    diff = (lossy.frames - exact).abs()
    assert 0 < diff.max().item() and diff.mean().item() < exact.abs().mean().item()


def test_pipeline_loads_a_saved_wan_vace_pipeline(tmp_path):
    from diffusers import WanVACEPipeline

    from fastgen_diffusers import WanCausalVACEPipeline

    pipe = make_pipeline()
    torch.manual_seed(0)
    stock_transformer = WanVACETransformer3DModel(**TINY_VACE_CONFIG)
    stock = WanVACEPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        scheduler=pipe.scheduler,
        transformer=stock_transformer,
    )
    stock.save_pretrained(tmp_path)
    for loaded in (WanCausalVACEPipeline.from_pretrained(tmp_path), WanCausalVACEPipeline.from_pipe(stock)):
        assert type(loaded.transformer) is WanCausalVACETransformer3DModel
        state = loaded.transformer.state_dict()
        assert all(torch.equal(state[k], v) for k, v in stock_transformer.state_dict().items())


def test_vace_prompt_schedule_counts_video_frames_after_the_reference_frames():
    from fastgen_diffusers.testing import tiny_vace_pipeline

    pipe = tiny_vace_pipeline()
    reference = PIL.Image.new("RGB", (32, 32), (200, 30, 30))
    common = dict(reference_images=reference, height=32, width=32, num_frames=21, num_inference_steps=1)
    common["output_type"] = "latent"
    plain = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), **common).frames
    switched = pipe(prompt={0: "a red fox", 9: "a blue whale"}, generator=torch.Generator().manual_seed(0), **common)
    # 1 reference + 6 video latent frames = chunks (4, 3): the video's pixel frame 9 (latent frame 3, after the
    # reference frame) starts the second chunk. The output holds the 6 video latent frames.
    assert plain.shape[2] == 6
    assert torch.equal(plain[:, :, :3], switched.frames[:, :, :3])
    assert not torch.equal(plain[:, :, 3:], switched.frames[:, :, 3:])


def live_conditioners(kind) -> int:
    gc.collect()
    return sum(type(obj) is kind for obj in gc.get_objects())


def test_stream_leaves_the_reference_frames_out_and_releases_the_control():
    from fastgen_diffusers.testing import tiny_vace_pipeline

    pipe = tiny_vace_pipeline()
    pipe.set_progress_bar_config(disable=True)
    reference = PIL.Image.new("RGB", (32, 32), (200, 30, 30))
    common = dict(prompt="a red fox", reference_images=reference, height=32, width=32, num_frames=21)
    common["num_inference_steps"] = 1
    expected = pipe(generator=torch.Generator().manual_seed(0), **common).frames
    chunks = list(pipe.stream(generator=torch.Generator().manual_seed(0), **common))
    # 1 reference + 6 video latent frames in chunks (4, 3): the first chunk decodes its 3 video latent frames.
    assert [(c.start, c.end, c.frame_start) for c in chunks] == [(0, 4, 0), (4, 7, 9)]
    assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), expected)
    assert live_conditioners(VACEConditioner) == 0  # the control lives in the run's session, not on the pipe
    stream = pipe.stream(**common)
    next(stream)
    assert live_conditioners(VACEConditioner) == 1 and pipe.rollout_branches == []
    stream.close()
    assert live_conditioners(VACEConditioner) == 0


@torch.no_grad()
def test_a_time_varying_mask_conditions_each_chunk_by_its_own_frames():
    """keep(21 frames) + continue(24) == one 45-frame call, with a mask that changes in time: a chunk's control is
    made from its own frames (diffusers resamples the whole mask over the call, so the first chunks of a 21- and a
    45-frame call differed by 0.43)."""
    from fastgen_diffusers.testing import tiny_vace_pipeline

    pipe = tiny_vace_pipeline()
    pipe.set_progress_bar_config(disable=True)
    mask = [PIL.Image.new("L", (32, 32), 255 * (i % 2)) for i in range(45)]  # odd frames generated, even kept
    noise = randn(1, 16, 12, 4, 4, seed=7)
    common = {"video": frames(45, size=32), "mask": mask, "prompt_embeds": randn(1, 8, 32, seed=5)}
    common.update(height=32, width=32, num_inference_steps=1, output_type="latent")
    whole = pipe(**common, num_frames=45, latents=noise).frames
    pipe(**common, num_frames=21, latents=noise[:, :, :6], keep_cache=True)
    continued = pipe.continue_rollout(24, latents=noise[:, :, 6:], output_type="latent").frames
    pipe.discard_rollout()
    assert continued.shape == whole.shape == (1, 16, 12, 4, 4)
    assert torch.equal(continued, whole)
