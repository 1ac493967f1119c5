"""Every kind of bad call argument, on the three pipelines: one clear error naming the argument, raised before any
model runs and with the kept KV caches untouched.

Each row of ``CASES`` is ``(id, pipelines, overrides, exception type, message fragment)``; ``pipelines`` is a string of
``t`` (text-to-video), ``i`` (image-to-video, a T2V student taking the image as its first chunk) and ``v`` (VACE).
"""

from __future__ import annotations

import math

import numpy as np
import PIL.Image
import pytest
import torch

from fastgen_diffusers import WanCausalImageToVideoPipeline
from fastgen_diffusers.testing import tiny_components, tiny_pipeline, tiny_transformer, tiny_vace_pipeline

SIZE = 16
BASE = {
    "prompt": "a red fox",
    "height": SIZE,
    "width": SIZE,
    "num_frames": 25,  # 7 latent frames: chunks start at pixel frames 0, 13 (t, v) or 0, 1, 13 (i)
    "num_inference_steps": 2,
    "output_type": "latent",
    "max_sequence_length": 16,
}
NAN, INF = math.nan, math.inf


def rgb(mode: str = "RGB") -> PIL.Image.Image:
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    return image if mode == "RGB" else image.convert(mode)


def embeds(tokens: int = 8, value: float | None = None, **kwargs) -> torch.Tensor:
    tensor = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(3), **kwargs)
    return tensor if value is None else tensor.fill_(value)


def full(shape, value, **kwargs) -> torch.Tensor:
    return torch.full(shape, value, **kwargs)


LATENTS = (1, 16, 7, 2, 2)
FRAMES = (25, 3, SIZE, SIZE)
EMBEDS = {"prompt": None}  # overrides that pass embeddings instead of the prompt

CASES = [
    # non-finite values in every tensor and number a user passes
    ("latents-nan", "tiv", {"latents": full(LATENTS, NAN)}, ValueError, "`latents` holds .* non-finite"),
    ("latents-inf", "tiv", {"latents": full(LATENTS, INF)}, ValueError, "`latents` holds .* non-finite"),
    ("prompt_embeds-nan", "tiv", EMBEDS | {"prompt_embeds": embeds(value=NAN)}, ValueError, "`prompt_embeds` holds"),
    (
        "negative_prompt_embeds-inf",
        "tiv",
        {"guidance_scale": 2.0, "negative_prompt_embeds": embeds(value=INF)},
        ValueError,
        "`negative_prompt_embeds` holds",
    ),
    ("image-nan", "i", {"image": full((3, SIZE, SIZE), NAN)}, ValueError, "`image` holds"),
    ("image_embeds-nan", "i", {"image_embeds": embeds(value=NAN)}, ValueError, "`image_embeds` holds"),
    ("clip-nan", "i", {"image": None, "video": full((5, 3, SIZE, SIZE), NAN)}, ValueError, "`video` holds"),
    ("control-video-nan", "v", {"video": full(FRAMES, NAN)}, ValueError, "`video` holds"),
    ("control-mask-inf", "v", {"video": full(FRAMES, 0.5), "mask": full(FRAMES, INF)}, ValueError, "`mask` holds"),
    ("conditioning_scale-nan", "v", {"conditioning_scale": NAN}, ValueError, "`conditioning_scale` must be finite"),
    ("conditioning_scale-list-inf", "v", {"conditioning_scale": [1.0, INF]}, ValueError, "`conditioning_scale`"),
    ("conditioning_scale-tensor-nan", "v", {"conditioning_scale": full((2,), NAN)}, ValueError, "`conditioning_sc"),
    ("guidance_scale-nan", "tiv", {"guidance_scale": NAN}, ValueError, "`guidance_scale` must be finite"),
    ("guidance_scale-inf", "tiv", {"guidance_scale": INF}, ValueError, "`guidance_scale` must be finite"),
    ("context_noise-nan", "tiv", {"context_noise": NAN}, ValueError, "`context_noise` must be finite"),
    ("timesteps-nan", "tiv", {"timesteps": [1000.0, NAN]}, ValueError, "`timesteps` must hold finite"),
    ("sigmas-inf", "tiv", {"sigmas": [INF, 0.5]}, ValueError, "`sigmas` must hold finite"),
    # wrong types
    ("guidance_scale-str", "tiv", {"guidance_scale": "3"}, TypeError, "`guidance_scale` must be a number"),
    ("guidance_scale-bool", "tiv", {"guidance_scale": True}, TypeError, "`guidance_scale` must be a number"),
    ("timesteps-nested", "tiv", {"timesteps": [[1000.0, 500.0]]}, TypeError, "`timesteps` must be a flat list"),
    ("timesteps-2d-tensor", "tiv", {"timesteps": torch.ones(2, 2)}, TypeError, "`timesteps` must be a flat list"),
    ("sigmas-str", "tiv", {"sigmas": "0.5"}, TypeError, "`sigmas` must be a list of numbers"),
    ("prompt-int", "tiv", {"prompt": 42}, TypeError, "`prompt` must be a string or a non-empty list"),
    ("prompt-list-non-str", "tiv", {"prompt": ["a fox", 3]}, TypeError, "`prompt` must be a list of strings"),
    ("prompt-empty-list", "tiv", {"prompt": []}, TypeError, "`prompt` must be a string or a non-empty list"),
    ("negative_prompt-none-item", "tiv", {"negative_prompt": [None]}, TypeError, "`negative_prompt` must be a list"),
    ("schedule-none", "tiv", {"prompt": {0: "a fox", 13: None}}, TypeError, "`prompt` schedule entry at frame 13"),
    ("schedule-int", "tiv", {"prompt": {0: "a fox", 13: 7}}, TypeError, r"`prompt\[13\]` must be a string"),
    ("num_frames-bool", "tiv", {"num_frames": True}, TypeError, "`num_frames` must be an int"),
    ("num_frames-float", "tiv", {"num_frames": 25.0}, TypeError, "`num_frames` must be an int"),
    ("height-float", "tiv", {"height": 16.0}, TypeError, "`height` must be an int"),
    ("width-str", "tiv", {"width": "16"}, TypeError, "`width` must be an int"),
    ("height-zero", "tv", {"height": 0}, ValueError, "`height` must be at least 1"),
    ("num_inference_steps-float", "tiv", {"num_inference_steps": 2.0}, TypeError, "`num_inference_steps` must be"),
    ("chunk_size-float", "tiv", {"chunk_size": 2.5}, TypeError, "`chunk_size` must be an int"),
    ("keep_cache-str", "tiv", {"keep_cache": "yes"}, TypeError, "`keep_cache` must be True or False"),
    ("recache-int", "tiv", {"recache": 1}, TypeError, "`recache` must be True or False"),
    ("return_dict-str", "tiv", {"return_dict": "no"}, TypeError, "`return_dict` must be True or False"),
    ("allow_lossy-str", "v", {"allow_lossy": "yes"}, TypeError, "`allow_lossy` must be True or False"),
    ("vace_hint_refresh-float", "v", {"vace_hint_refresh_interval": 1.0}, TypeError, "`vace_hint_refresh_interval`"),
    ("attention_window-bool", "tiv", {"attention_window": True}, TypeError, "`attention_window` must be an int"),
    ("sink_frames-negative", "tiv", {"sink_frames": -1}, ValueError, "`sink_frames` must be at least 0"),
    ("max_sequence_length-str", "tiv", {"max_sequence_length": "16"}, TypeError, "`max_sequence_length` must be"),
    ("generator-int", "tiv", {"generator": 42}, TypeError, "`generator` must be a torch.Generator"),
    ("callback-not-callable", "tiv", {"callback_on_step_end": 5}, TypeError, "`callback_on_step_end` must be"),
    ("prompt_embeds-list", "tiv", EMBEDS | {"prompt_embeds": [[0.0] * 32]}, TypeError, "`prompt_embeds` must be a"),
    (
        "prompt_embeds-int-dtype",
        "tiv",
        EMBEDS | {"prompt_embeds": torch.zeros(1, 8, 32, dtype=torch.long)},
        TypeError,
        "`prompt_embeds` must be a floating-point tensor",
    ),
    ("latents-array", "tiv", {"latents": np.zeros(LATENTS)}, TypeError, "`latents` must be a torch.Tensor"),
    ("latents-int-dtype", "tiv", {"latents": torch.zeros(LATENTS, dtype=torch.int64)}, TypeError, "`latents` must"),
    ("timesteps-str", "tiv", {"timesteps": "1000"}, TypeError, "`timesteps` must be a list of numbers"),
    ("conditioning_scale-str", "v", {"conditioning_scale": "1"}, TypeError, "`conditioning_scale` must be a number"),
    ("image-str", "i", {"image": "frame.png"}, TypeError, "`image` must be a PIL image"),
    ("image-list-of-str", "i", {"image": ["frame.png"]}, TypeError, "`image` must hold PIL images"),
    ("num_videos_per_prompt-zero", "tiv", {"num_videos_per_prompt": 0}, ValueError, "`num_videos_per_prompt` must"),
    ("num_videos_per_prompt-float", "tiv", {"num_videos_per_prompt": 1.5}, TypeError, "`num_videos_per_prompt`"),
    # tensors without data
    ("latents-meta", "tiv", {"latents": torch.empty(LATENTS, device="meta")}, ValueError, "`latents` is on the meta"),
    (
        "prompt_embeds-meta",
        "tiv",
        EMBEDS | {"prompt_embeds": torch.empty(1, 8, 32, device="meta")},
        ValueError,
        "`prompt_embeds` is on the meta",
    ),
    ("image-meta", "i", {"image": torch.empty(3, SIZE, SIZE, device="meta")}, ValueError, "`image` is on the meta"),
    # empty embeddings
    ("prompt_embeds-no-tokens", "tiv", EMBEDS | {"prompt_embeds": embeds(0)}, ValueError, "`prompt_embeds` must hold"),
    (
        "negative_prompt_embeds-no-tokens",
        "tiv",
        {"guidance_scale": 2.0, "negative_prompt_embeds": embeds(0)},
        ValueError,
        "`negative_prompt_embeds` must hold at least one",
    ),
    # negative guidance
    ("guidance_scale-negative", "tiv", {"guidance_scale": -1.0}, ValueError, "`guidance_scale` must be a finite num"),
    # guidance in (0, 1): no CFG runs below 1, so it would silently mean 1 (the CLI refuses it too)
    ("guidance_scale-half", "tiv", {"guidance_scale": 0.5}, ValueError, "`guidance_scale` must be a finite number >="),
    # pixels outside the documented [0, 1]
    (
        "image-tensor-255",
        "i",
        {"image": full((3, SIZE, SIZE), 255.0)},
        ValueError,
        r"`image` values must lie in \[0, 1\]",
    ),
    ("image-tensor-signed", "i", {"image": full((3, SIZE, SIZE), -1.0)}, ValueError, r"`image` values must lie"),
    (
        "image-array-uint8",
        "i",
        {"image": np.full((SIZE, SIZE, 3), 200, dtype=np.uint8)},
        ValueError,
        "`image` values must lie in .* divide 8-bit pixels by 255",
    ),
    ("clip-range", "i", {"image": None, "video": full((5, 3, SIZE, SIZE), 2.0)}, ValueError, "`video` values must"),
    ("control-video-range", "v", {"video": full(FRAMES, 2.0)}, ValueError, "`video` values must lie"),
    ("control-mask-range", "v", {"video": full(FRAMES, 0.5), "mask": full(FRAMES, -0.5)}, ValueError, "`mask` value"),
    # PIL modes that cannot be converted to RGB without clipping
    ("image-mode-I;16", "i", {"image": PIL.Image.new("I;16", (SIZE, SIZE))}, ValueError, "`image` is a PIL image in"),
    ("image-mode-F", "i", {"image": PIL.Image.new("F", (SIZE, SIZE))}, ValueError, "mode 'F'"),
    (
        "mask-mode-I",
        "v",
        {"video": [rgb()] * 25, "mask": [PIL.Image.new("I", (SIZE, SIZE))] * 25},
        ValueError,
        "`mask",
    ),
    # prompt schedules that do not fit the chunks: raised before the text encoder runs
    ("schedule-past-last-chunk", "tiv", {"prompt": {0: "a fox", 20: "a dog"}}, ValueError, "past the last chunk"),
    ("schedule-two-in-one-chunk", "tiv", {"prompt": {0: "a", 5: "b", 9: "c"}}, ValueError, "Two prompt switches"),
    (
        "embeds-schedule-nan",
        "tiv",
        EMBEDS | {"prompt_embeds": {0: embeds(), 13: embeds(value=NAN)}},
        ValueError,
        r"`prompt_embeds\[13\]` holds",
    ),
]


def make_i2v_pipeline() -> WanCausalImageToVideoPipeline:
    components = tiny_components()
    components["transformer"] = tiny_transformer(independent_first_frame=True)
    return WanCausalImageToVideoPipeline(**components)


BUILDERS = {"t": tiny_pipeline, "i": make_i2v_pipeline, "v": tiny_vace_pipeline}


def base_kwargs(kind: str) -> dict:
    return BASE | ({"image": rgb()} if kind == "i" else {})


def cache_state(pipe) -> tuple:
    """What a bad call must leave as it was: the kept rollouts, the engines and what they hold."""
    engines = pipe.transformer.kv_cache_engines
    held = tuple((name, e.num_stored_frames("pos"), e.cache_bytes()) for name, e in sorted(engines.items()))
    return tuple(pipe.rollout_branches), tuple(map(id, engines.values())), held


@pytest.fixture(scope="module")
def watched():
    """``watched(kind) -> (pipe, model_calls)``: one pipeline per kind, built on first use, holding a kept rollout,
    with its models' forwards recorded."""
    pipes = {}

    def get(kind: str):
        if kind not in pipes:
            pipe = BUILDERS[kind]()
            pipe.set_progress_bar_config(disable=True)
            pipe(**base_kwargs(kind), keep_cache=True, generator=torch.Generator().manual_seed(0))
            calls = []
            for model in (pipe.transformer, pipe.text_encoder, pipe.vae):
                model.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(type(module).__name__))
            pipes[kind] = pipe, calls
        return pipes[kind]

    return get


TABLE = [(kind, *case) for case in CASES for kind in case[1]]


@pytest.mark.parametrize(
    ("kind", "case", "applies", "overrides", "error", "fragment"), TABLE, ids=[f"{row[0]}-{row[1]}" for row in TABLE]
)
def test_bad_input_is_one_clear_error_before_any_model_work(watched, kind, case, applies, overrides, error, fragment):
    pipe, calls = watched(kind)
    before = cache_state(pipe)
    calls.clear()
    with pytest.raises(error, match=fragment):
        pipe(**{**base_kwargs(kind), **overrides})
    assert calls == [], f"{calls} ran before {case} was refused"
    assert cache_state(pipe) == before


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("overrides", [{"latents": full(LATENTS, NAN)}, {"guidance_scale": "3"}], ids=["nan", "type"])
def test_bad_input_to_a_stream_is_refused_before_any_model_work(watched, kind, overrides):
    pipe, calls = watched(kind)
    before = cache_state(pipe)
    calls.clear()
    with pytest.raises(ValueError):
        next(pipe.stream(**{**base_kwargs(kind), **overrides}))
    assert calls == [] and cache_state(pipe) == before


CONTINUE_CASES = [
    ({"latents": full((1, 16, 3, 2, 2), NAN)}, ValueError, "`latents` holds"),
    ({"prompt_embeds": embeds(0)}, ValueError, "`prompt_embeds` must hold at least one"),
    ({"prompt_embeds": embeds(value=INF)}, ValueError, "`prompt_embeds` holds"),
    ({"prompt": ["a fox", None]}, TypeError, "`prompt` must be a list of strings"),
    ({"recache": "yes"}, TypeError, "`recache` must be True or False"),
    ({"generator": 3}, TypeError, "`generator` must be a torch.Generator"),
]


@pytest.mark.parametrize(("overrides", "error", "fragment"), CONTINUE_CASES, ids=[c[2] for c in CONTINUE_CASES])
def test_bad_input_to_continue_rollout_keeps_the_rollout(watched, overrides, error, fragment):
    pipe, calls = watched("t")  # kept rollouts are continued by the text-to-video pipeline
    before = cache_state(pipe)
    calls.clear()
    with pytest.raises(error, match=fragment):
        pipe.continue_rollout(12, **overrides)
    assert calls == [] and cache_state(pipe) == before


@pytest.mark.parametrize(
    ("chunk_size", "fragment"),
    [
        (0, "`chunk_size` must be a positive number of latent frames or None, got 0"),
        # 24 new frames: one chunk of 6 latent frames, which the transformer (chunks of 3) would split: the call's
        # message (one check for both)
        (6, r"`chunk_size=6` cannot be served: its chunk of latent frames \[7, 13\) would be split"),
    ],
)
def test_continue_rollout_checks_its_chunk_size_as_the_call_does(watched, chunk_size, fragment):
    pipe, calls = watched("t")
    before = cache_state(pipe)
    calls.clear()
    with pytest.raises(ValueError, match=fragment):
        pipe.continue_rollout(24, chunk_size=chunk_size)
    assert calls == [] and cache_state(pipe) == before


def test_pil_images_in_other_modes_are_converted_to_rgb_as_diffusers_loads_them():
    pipe = make_i2v_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def run(image):
        kwargs = base_kwargs("i") | {"num_frames": 5, "generator": torch.Generator().manual_seed(0)}
        return pipe(**kwargs | {"image": image}).frames

    for mode in ("RGBA", "P", "L", "CMYK"):
        image = rgb(mode)
        torch.testing.assert_close(run(image), run(image.convert("RGB")), rtol=0, atol=0)


def test_vace_control_frames_in_other_modes_are_converted():
    pipe = tiny_vace_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def run(video, mask):
        kwargs = BASE | {"num_frames": 5, "generator": torch.Generator().manual_seed(0)}
        return pipe(**kwargs, video=video, mask=mask).frames

    frames = [rgb("P")] * 5
    converted = run(frames, [PIL.Image.new("1", (SIZE, SIZE), 1)] * 5)
    reference = run([frame.convert("RGB") for frame in frames], [PIL.Image.new("L", (SIZE, SIZE), 255)] * 5)
    torch.testing.assert_close(converted, reference, rtol=0, atol=0)
