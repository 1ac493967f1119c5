"""``WanCausalImageToVideoPipeline`` on tiny offline components, one pipeline per image layout.

* ``wan2.1-i2v``: 36-channel transformer with CLIP image tokens (tiny ``CLIPVisionModel`` + ``CLIPImageProcessor``).
* ``ti2v``: Wan2.2 TI2V-5B layout: 48-channel latents from a tiny Wan2.2-style VAE (z_dim 48, residual, patch 2,
  16x spatial) and ``expand_timesteps=True``.
* ``t2v-student``: a 16-channel T2V student; the image (``[1, 3, 3, ...]`` layout) or a clip is prefilled.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import AutoencoderKLWan
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from fastgen_diffusers import WanCausalImageToVideoPipeline
from fastgen_diffusers.cli.i2v import add_image_arguments, conditioning_kwargs, load_i2v_pipeline, wants_i2v
from fastgen_diffusers.kv_cache import CrossKVMode
from fastgen_diffusers.pipelines import GivenFramesConditioner, detect_i2v_layout
from fastgen_diffusers.testing import tiny_scheduler, tiny_text_encoder, tiny_tokenizer, tiny_transformer, tiny_vae

LAYOUTS = ("wan2.1-i2v", "ti2v", "t2v-student")
SIZE = {"wan2.1-i2v": 32, "ti2v": 64, "t2v-student": 32}  # 4x4 latents (Wan2.2 VAE: 16x spatial)
PROMPT = "a red fox runs through fresh snow"


def tiny_wan22_vae(seed: int = 0) -> AutoencoderKLWan:
    """A Wan2.2-style VAE (z_dim 48, residual blocks, patch 2: 16x spatial, 4x temporal) at test size."""
    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=[0.0] * 48,
        latents_std=[1.0] * 48,
    ).eval()


def tiny_clip(seed: int = 0) -> tuple[CLIPImageProcessor, CLIPVisionModel]:
    """diffusers' I2V test CLIP, with 4x4 patches (65 image tokens of width 4)."""
    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=4,
        projection_dim=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=16,
        patch_size=4,
    )
    return CLIPImageProcessor(crop_size=32, size=32), CLIPVisionModel(config).eval()


def make_pipeline(layout: str, **transformer_overrides) -> WanCausalImageToVideoPipeline:
    """A tiny pipeline of ``layout`` with 2-frame chunks (13 frames = 4 latent frames = 2 chunks, or [1, 3])."""
    tokenizer = tiny_tokenizer()
    components = {
        "tokenizer": tokenizer,
        "text_encoder": tiny_text_encoder(len(tokenizer)),
        "scheduler": tiny_scheduler(),
    }
    if layout == "wan2.1-i2v":
        processor, encoder = tiny_clip()
        overrides = {"in_channels": 36, "image_dim": 4, "added_kv_proj_dim": 64}
        components.update(vae=tiny_vae(), image_processor=processor, image_encoder=encoder)
    elif layout == "ti2v":
        overrides = {"in_channels": 48, "out_channels": 48}
        components.update(vae=tiny_wan22_vae(), expand_timesteps=True)
    else:
        overrides = {"independent_first_frame": True}
        components.update(vae=tiny_vae())
    transformer = tiny_transformer(**{"chunk_size": 2, **overrides, **transformer_overrides})
    return WanCausalImageToVideoPipeline(transformer=transformer, **components)


@pytest.fixture(scope="module", params=LAYOUTS)
def pipe(request):
    return make_pipeline(request.param)


@pytest.fixture(scope="module")
def baseline(pipe):
    """``(video_latents, cache-pass calls)`` of one recorded run on image 0 (``keep_cache`` runs every cache pass)."""
    with TransformerCalls(pipe.transformer) as record:
        video_latents = run(pipe, make_image(SIZE[pipe.i2v_layout]), keep_cache=True)
    pipe.transformer.clear_caches()
    return video_latents, [(kwargs, out) for kwargs, out in record.calls if kwargs["store_kv"]]


def make_image(size: int, seed: int = 0) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def run(pipe, image, **kwargs):
    kwargs = {"num_frames": 13, "num_inference_steps": 2, "output_type": "latent", "max_sequence_length": 16, **kwargs}
    return pipe(image=image, prompt=PROMPT, generator=torch.Generator().manual_seed(0), **kwargs).frames


class TransformerCalls:
    """Records ``(kwargs, output)`` of every transformer forward while active."""

    def __init__(self, transformer):
        self.transformer = transformer
        self.calls = []

    def __enter__(self):
        self.handle = self.transformer.register_forward_hook(self._record, with_kwargs=True)
        return self

    def _record(self, module, args, kwargs, output):
        self.calls.append((dict(kwargs), output[0] if isinstance(output, tuple) else output.sample))

    def __exit__(self, *exc):
        self.handle.remove()


def test_layout_is_detected_from_config_and_components(pipe, tmp_path):
    expected = {36: "wan2.1-i2v", 48: "ti2v", 16: "t2v-student"}[pipe.transformer.config.in_channels]
    assert pipe.i2v_layout == expected
    pipe.save_pretrained(tmp_path)
    assert WanCausalImageToVideoPipeline.from_pretrained(tmp_path).i2v_layout == expected
    with pytest.raises(ValueError, match="cannot take an image"):
        detect_i2v_layout(tiny_transformer(in_channels=20).config, tiny_vae().config, expand_timesteps=False)


def test_cached_rollout_equals_full_block_causal_forward(pipe, baseline):
    """Every cache pass (given or generated chunk, with its conditioning) equals one teacher-forced forward (the
    pipeline's cache passes are store-only: their inputs are replayed with the prediction)."""
    video_latents, stored = baseline
    assert all(kw["store_only"] and out is None for kw, out in stored)
    pipe.transformer.clear_caches()
    with torch.no_grad():
        stored = [(kw, pipe.transformer(**{**kw, "store_only": False})[0]) for kw, _ in stored]
    assert len(stored) == 2
    assert [kw["start_frame"] for kw, _ in stored] == [s for s, _ in pipe.rollout_chunk_bounds(4)]
    hidden_states = torch.cat([kw["hidden_states"] for kw, _ in stored], dim=2)
    torch.testing.assert_close(hidden_states[:, : video_latents.shape[1]], video_latents, rtol=0, atol=0)
    timesteps = torch.cat(
        [
            kw["timestep"] if kw["timestep"].ndim == 2 else kw["timestep"][:, None].expand(-1, out.shape[2])
            for kw, out in stored
        ],
        dim=1,
    )
    pipe.transformer.clear_caches()
    with torch.no_grad():
        full = pipe.transformer(
            hidden_states,
            timesteps,
            stored[0][0]["encoder_hidden_states"],
            stored[0][0].get("encoder_hidden_states_image"),
            return_dict=False,
        )[0]
    pipe.transformer.clear_caches()
    torch.testing.assert_close(torch.cat([out for _, out in stored], dim=2), full, rtol=0, atol=1e-5)


def test_first_frame_stays_the_conditioning_latent(pipe, baseline):
    """TI2V and T2V students keep latent frame 0 exactly the image latent; Wan2.1 I2V generates frame 0, and its
    condition channels carry the image latent (and a mask of ones) on frame 0 only, in every chunk's forward."""
    size = SIZE[pipe.i2v_layout]
    pixels = pipe.video_processor.preprocess(make_image(size), height=size, width=size)
    expected = pipe.encode_video_latents(pixels[:, :, None], torch.device("cpu"))
    video_latents, stored = baseline
    if pipe.i2v_layout != "wan2.1-i2v":
        assert torch.equal(video_latents[:, :, :1], expected)
        return
    condition = torch.cat([kwargs["hidden_states"][:, 16:] for kwargs, _ in stored], dim=2)
    mask, image_latent = condition[:, :4], condition[:, 4:]
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    torch.testing.assert_close(image_latent[:, :, :1], expected, rtol=0, atol=1e-5)


def test_a_different_image_changes_the_video(pipe, baseline):
    size = SIZE[pipe.i2v_layout]
    first = baseline[0]
    second = run(pipe, make_image(size, seed=1))
    assert (first[:, :, 1:] - second[:, :, 1:]).abs().max() > 1e-3  # the generated frames, not just the given one


def test_video_latents_decode_to_frames(pipe, baseline):
    size = SIZE[pipe.i2v_layout]
    frames = pipe.decode_latents(baseline[0], output_type="np")  # the Wan2.2 VAE unpatchifies its 48 channels
    assert frames.shape == (1, 13, size, size, 3)
    assert np.isfinite(frames).all()


def test_wan21_image_kv_reuse_is_bit_exact_and_projects_nothing_in_reads():
    pipe = make_pipeline("wan2.1-i2v")
    image = make_image(32)
    counter = [0]

    def count(*_):
        counter[0] += 1

    modules = [m for b in pipe.transformer.blocks for m in (b.attn2.add_k_proj, b.attn2.add_v_proj)]
    handles = [m.register_forward_hook(count) for m in modules]
    try:
        cached = run(pipe, image, guidance_scale=2.0, num_inference_steps=1)
    finally:
        for handle in handles:
            handle.remove()
    # Only chunk 0's denoising step (2 CFG branches) and its cache passes (2 tags) project the image tokens; every
    # later no-grad forward (chunk 1's step, 2 branches) reads the cached image K/V.
    assert counter[0] == len(modules) * (2 + 2)

    engine = pipe.transformer.kv_cache_engines["main"]
    original = engine.cross_mode

    def never_read(*args, **kwargs):
        mode = original(*args, **kwargs)
        return CrossKVMode.COMPUTE if mode is CrossKVMode.READ else mode

    engine.cross_mode = never_read
    try:
        recomputed = run(pipe, image, guidance_scale=2.0, num_inference_steps=1)
    finally:
        del engine.cross_mode
    assert torch.equal(cached, recomputed)


def test_t2v_student_extends_a_clip():
    pipe = make_pipeline("t2v-student", independent_first_frame=False)
    clip = torch.rand(5, 3, 32, 32)  # 5 frames = 2 latent frames = one 2-frame chunk
    video_latents = pipe(
        video=clip, prompt=PROMPT, num_frames=13, num_inference_steps=2, output_type="latent", max_sequence_length=16
    ).frames
    expected = pipe.encode_video_latents(pipe.video_processor.preprocess_video(clip, 32, 32), torch.device("cpu"))
    assert video_latents.shape[2] == 4
    assert torch.equal(video_latents[:, :, :2], expected)
    with TransformerCalls(pipe.transformer) as record:  # the clip goes into the cache clean, at t=0, always
        pipe(
            video=clip,
            prompt=PROMPT,
            num_frames=13,
            num_inference_steps=1,
            context_noise=100.0,
            max_sequence_length=16,
        )
    kwargs, _ = next((kwargs, out) for kwargs, out in record.calls if kwargs["store_kv"])
    assert kwargs["start_frame"] == 0 and not kwargs["timestep"].any()
    assert torch.equal(kwargs["hidden_states"], expected)
    other = pipe(
        video=clip.flip(0),
        prompt=PROMPT,
        num_frames=13,
        num_inference_steps=2,
        output_type="latent",
        max_sequence_length=16,
    ).frames
    assert (other[:, :, 2:] - video_latents[:, :, 2:]).abs().max() > 1e-3


def live_conditioners(kind) -> int:
    gc.collect()
    return sum(type(obj) is kind for obj in gc.get_objects())


def test_streamed_clip_extension_equals_call_and_releases_the_clip():
    pipe = make_pipeline("t2v-student", independent_first_frame=False)
    clip = torch.rand(5, 3, 32, 32)
    common = dict(video=clip, prompt=PROMPT, num_frames=13, num_inference_steps=2, max_sequence_length=16)
    expected = pipe(generator=torch.Generator().manual_seed(0), **common).frames
    chunks = list(pipe.stream(generator=torch.Generator().manual_seed(0), **common))
    assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), expected)
    assert live_conditioners(GivenFramesConditioner) == 0  # the clip lives in the run's session, not on the pipe
    stream = pipe.stream(**common)
    next(stream)
    assert live_conditioners(GivenFramesConditioner) == 1 and pipe.rollout_branches == []
    stream.close()
    assert live_conditioners(GivenFramesConditioner) == 0


# ------------------------------------------------------------------------------------------------------ bad inputs
@pytest.fixture()
def no_work(pipe):
    """Fails the test if any model runs (validation must come first)."""

    def forbid(*_):
        raise AssertionError("a model ran before the inputs were validated")

    modules = [pipe.transformer, pipe.vae, pipe.text_encoder] + ([pipe.image_encoder] if pipe.image_encoder else [])
    handles = [m.register_forward_pre_hook(forbid) for m in modules]
    yield pipe
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"image": "first_frame.png"}, "`image` must be a PIL image"),
        ({"image": torch.rand(3, 24, 24)}, "not a multiple of"),
        ({"image": torch.rand(3, 32, 32), "height": 64, "width": 64}, "not resampled"),
        ({"image": torch.rand(4, 32, 32)}, "must be RGB"),
        ({"image": None}, "exactly one of `image`"),
        ({"num_frames": 12}, "num_frames"),
    ],
)
def test_bad_inputs_raise_before_any_work(no_work, kwargs, match):
    size = SIZE[no_work.i2v_layout]
    kwargs = {"image": make_image(size), **kwargs}
    if isinstance(kwargs["image"], torch.Tensor) and size != 32:
        kwargs["image"] = torch.nn.functional.interpolate(kwargs["image"][None], scale_factor=size // 32)[0]
        kwargs.update({k: v * size // 32 for k, v in kwargs.items() if k in ("height", "width")})
    with pytest.raises(ValueError, match=match):
        no_work(prompt=PROMPT, **kwargs)


def test_arguments_that_do_not_apply_to_the_layout_raise(no_work):
    size = SIZE[no_work.i2v_layout]
    clip = [make_image(size)] * 5
    if no_work.i2v_layout != "t2v-student":
        with pytest.raises(ValueError, match="applies only to T2V students"):
            no_work(video=clip, prompt=PROMPT)
    if no_work.i2v_layout != "wan2.1-i2v":
        with pytest.raises(ValueError, match="apply only to Wan2.1 I2V"):
            no_work(image=make_image(size), image_embeds=torch.zeros(1, 65, 4), prompt=PROMPT)


def test_clips_and_images_that_do_not_fit_the_chunking_raise():
    pipe = make_pipeline("t2v-student", independent_first_frame=False)
    with pytest.raises(ValueError, match="independent_first_frame=True"):
        pipe(image=make_image(32), prompt=PROMPT, num_frames=13)
    with pytest.raises(ValueError, match="do not fill whole chunks"):
        pipe(video=[make_image(32)] * 9, prompt=PROMPT, num_frames=21)  # 3 latent frames, 2-frame chunks
    with pytest.raises(ValueError, match="4k\\+1 frames"):
        pipe(video=[make_image(32)] * 6, prompt=PROMPT, num_frames=21)
    with pytest.raises(ValueError, match="leaves nothing to generate"):
        pipe(video=[make_image(32)] * 9, prompt=PROMPT, num_frames=9)


def test_clip_tokens_need_an_image_encoder():
    pipe = make_pipeline("wan2.1-i2v")
    pipe.image_encoder = None
    with pytest.raises(ValueError, match="no `image_encoder`"):
        pipe(image=make_image(32), prompt=PROMPT, num_frames=9)
    # Pre-computed CLIP tokens serve instead.
    frames = pipe(
        image=make_image(32),
        image_embeds=torch.randn(1, 65, 4),
        prompt=PROMPT,
        num_frames=9,
        num_inference_steps=1,
        output_type="latent",
        max_sequence_length=16,
    ).frames
    assert frames.shape == (1, 16, 3, 4, 4)


def test_cli_image_and_video_options(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_image_arguments(parser)
    make_image(32).save(tmp_path / "first.png")
    args = parser.parse_args(["--image", str(tmp_path / "first.png")])
    assert wants_i2v(args) and not wants_i2v(parser.parse_args([]))
    assert isinstance(conditioning_kwargs(args)["image"], PIL.Image.Image)
    assert load_i2v_pipeline(args, torch.float32).i2v_layout == "t2v-student"
    with pytest.raises(ValueError, match="--video"):
        conditioning_kwargs(parser.parse_args(["--video", str(tmp_path / "missing.mp4")]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--image", "a.png", "--video", "b.mp4"])


def test_prompt_schedule_switches_at_a_chunk_boundary_in_i2v():
    """Chunks before a switch are unchanged by it; the chunks after it change."""
    import numpy as np
    import PIL.Image

    from fastgen_diffusers import WanCausalImageToVideoPipeline
    from fastgen_diffusers.testing import tiny_components

    pipe = WanCausalImageToVideoPipeline(**tiny_components(independent_first_frame=True))
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    common = dict(image=image, num_frames=25, num_inference_steps=2, output_type="latent")
    plain = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), **common).frames
    switched = pipe(prompt={0: "a red fox", 13: "a blue whale"}, generator=torch.Generator().manual_seed(0), **common)
    switched = switched.frames
    # chunks (1, 3, 3) start at latent frames 0, 1, 4 = pixel frames 0, 1, 13: the switch lands on the third chunk
    assert torch.equal(plain[:, :, :4], switched[:, :, :4])
    assert not torch.equal(plain[:, :, 4:], switched[:, :, 4:])
