"""Every pipeline takes the prompt-switch options (``recache_sink``, ``kv_flush``, ``rope_cut``) as text-to-video does:
video-to-video at strength 1 is text-to-video from the same noise, with each option too; image-to-video and VACE
apply them at their switches (the chunks before a switch unchanged); each pipeline refuses what text-to-video refuses,
with the settings' message, before any forward; the live doors (a stream's prompt change, a continuation) keep the
settings' rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgen_diffusers import WanCausalPipeline, WanCausalVideoToVideoPipeline
from fastgen_diffusers.testing import TINY_TEXT_DIM, tiny_components, tiny_transformer, tiny_vace_pipeline

# 45 pixel frames = 12 latent frames = 4 chunks of 3, starting at pixel frames 0, 9, 21, 33
CALL = {"height": 16, "width": 16, "num_inference_steps": 2, "output_type": "latent"}


def embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, TINY_TEXT_DIM, generator=torch.Generator().manual_seed(seed))


SCHEDULE = {0: embeds(1), 21: embeds(2), 33: embeds(3)}  # switches at chunks 2 and 3
# (the option under test, the same call without it): each changes the chunks from the first switch on
OPTIONS = {
    "kv_flush": ({"kv_flush": True}, {"attention_window": 9, "sink_frames": 1}),
    "rope_cut": ({"rope_cut": [33]}, {"attention_window": 6, "sink_frames": 1, "rope_positions": "window"}),
    "recache_sink": ({"recache_sink": "keep"}, {"attention_window": 6, "sink_frames": 3, "recache": True}),
}
# the first latent frame the option changes (chunk 3 for the cut, the first switch's chunk 2 otherwise)
CHANGED_FROM = {"kv_flush": 6, "rope_cut": 9, "recache_sink": 6}


@pytest.fixture(scope="module")
def components():
    return tiny_components()


def _pipe(cls, components):
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("name", list(OPTIONS))
def test_video_to_video_at_strength_one_is_text_to_video_with_each_option(components, name):
    option, base = OPTIONS[name]
    t2v, v2v = _pipe(WanCausalPipeline, components), _pipe(WanCausalVideoToVideoPipeline, components)
    noise = torch.randn(1, 16, 12, 2, 2, generator=torch.Generator().manual_seed(1))
    rng = np.random.default_rng(0)
    video = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(45)]

    def latents(pipe, **kwargs):
        call = {**CALL, "prompt_embeds": SCHEDULE, "latents": noise, "generator": torch.Generator().manual_seed(2)}
        if pipe is v2v:
            return pipe(video=video, strength=1.0, **call, **kwargs).frames
        return pipe(num_frames=45, **call, **kwargs).frames

    with_option = latents(v2v, **base, **option)
    assert torch.equal(with_option, latents(t2v, **base, **option))
    without = latents(v2v, **base)
    start = CHANGED_FROM[name]
    assert torch.equal(with_option[:, :, :start], without[:, :, :start])
    assert (with_option[:, :, start:] - without[:, :, start:]).abs().max() > 1e-4


def i2v_run(pipe, **kwargs):
    """A T2V student as image-to-video (chunks of 2 after an independent first frame: latent frames [0, 1), [1, 3),
    [3, 5), [5, 7), [7, 9)); the switches at pixel frames 17 and 25 take effect at latent frames 5 and 7."""
    image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(2))
    call = {**CALL, "num_frames": 33, "image": image, "prompt": {0: "a cat", 17: "a dog", 25: "a bird"}}
    return pipe(generator=torch.Generator().manual_seed(0), **call, **kwargs).frames


def vace_run(pipe, **kwargs):
    call = {**CALL, "num_frames": 45, "prompt": {0: "a cat", 21: "a dog", 33: "a bird"}}
    return pipe(generator=torch.Generator().manual_seed(0), **call, **kwargs).frames


def i2v_pipeline():
    from fastgen_diffusers import WanCausalImageToVideoPipeline

    components = tiny_components()
    components["transformer"] = tiny_transformer(chunk_size=2, independent_first_frame=True)
    pipe = WanCausalImageToVideoPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def vace_pipeline():
    pipe = tiny_vace_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


# per pipeline: its run, the options with the base calls that suit its chunks, the first latent frame they change
CONDITIONED = {
    "i2v": (
        i2v_pipeline,
        i2v_run,
        {
            "kv_flush": ({"kv_flush": True}, {"attention_window": 6, "sink_frames": 1}, 5),
            "rope_cut": ({"rope_cut": [25]}, {"attention_window": 6, "sink_frames": 1, "rope_positions": "window"}, 7),
            "recache_sink": ({"recache_sink": "keep"}, {"attention_window": 4, "sink_frames": 2, "recache": True}, 5),
        },
    ),
    "vace": (vace_pipeline, vace_run, {name: (*OPTIONS[name], CHANGED_FROM[name]) for name in OPTIONS}),
}


@pytest.mark.parametrize("kind", list(CONDITIONED))
def test_image_to_video_and_vace_apply_each_option_at_their_switches(kind):
    make, run, options = CONDITIONED[kind]
    pipe = make()
    for name, (option, base, start) in options.items():
        with_option, without = run(pipe, **base, **option), run(pipe, **base)
        assert torch.equal(with_option[:, :, :start], without[:, :, :start]), name
        assert (with_option[:, :, start:] - without[:, :, start:]).abs().max() > 1e-4, name


REFUSED = [
    ({"kv_flush": True}, "`kv_flush=True` keeps the sink and the last frames of a sliding window"),
    ({"rope_cut": True, "attention_window": 6}, "use rope_positions='window' (got 'absolute')"),
    ({"recache_sink": "keep", "recache": True, "attention_window": 6, "sink_frames": 1}, "multiples of the chunk"),
]


@pytest.mark.parametrize("kind", ["t2v", "v2v", "i2v", "vace"])
def test_every_pipeline_refuses_what_text_to_video_refuses_before_any_forward(components, kind):
    if kind == "i2v":
        pipe, run = i2v_pipeline(), i2v_run
    elif kind == "vace":
        pipe, run = vace_pipeline(), vace_run
    else:
        pipe = _pipe(WanCausalPipeline if kind == "t2v" else WanCausalVideoToVideoPipeline, components)
        video = [np.zeros((16, 16, 3), np.uint8)] * 45
        extra = {"num_frames": 45} if kind == "t2v" else {"video": video}

        def run(pipe, **kwargs):
            return pipe(prompt_embeds=SCHEDULE, **CALL, **extra, **kwargs)

    pipe.transformer.forward = lambda *args, **kwargs: pytest.fail("a forward ran before the refusal")
    try:
        for options, message in REFUSED:
            with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
                run(pipe, **options)
    finally:
        del pipe.transformer.forward


def test_a_refused_live_switch_leaves_the_run_unchanged(components):
    """``run.switch_prompt`` checks everything before it changes the run: a refused transition (a KV flush switches
    at once) or a switch that cannot be blended (another shape) leaves the session and the options as they were."""
    pipe = _pipe(WanCausalPipeline, components)
    flush = {"kv_flush": True, "attention_window": 6, "sink_frames": 1}
    run = pipe.prepare_rollout(pipe.stream_options(prompt_embeds=SCHEDULE[0], num_frames=45, **CALL, **flush))
    options, transition = run.options, run.session.prompt_transition_chunks
    with pytest.raises(ValueError, match="use prompt_transition_chunks=0 with kv_flush"):
        run.switch_prompt(2, SCHEDULE[21], transition_chunks=2)
    assert run.session.prompt_transition_chunks == transition and run.options is options and not run.prompt_switches

    run = pipe.prepare_rollout(pipe.stream_options(prompt_embeds=SCHEDULE[0], num_frames=45, **CALL))
    options, transition = run.options, run.session.prompt_transition_chunks
    with pytest.raises(ValueError, match="blends prompt embeddings"):
        run.switch_prompt(2, SCHEDULE[21][:, :3], transition_chunks=2)
    assert run.session.prompt_transition_chunks == transition and run.options is options and not run.prompt_switches
    run.switch_prompt(2, SCHEDULE[21], transition_chunks=2)  # accepted: the session and the options agree
    assert run.session.prompt_transition_chunks == 2 == run.options.prompt_transition_chunks
    assert run.options.settings.prompts.prompt_transition_chunks == 2 and 2 in run.prompt_switches


def test_live_doors_keep_the_rules(components):
    """A stream's live prompt change cannot blend in a switch a KV flush makes at once; a kept rollout that flushes at
    its switches cannot be continued with a recache."""
    pipe = _pipe(WanCausalPipeline, components)
    flush = {"kv_flush": True, "attention_window": 6, "sink_frames": 1}
    run = pipe.prepare_rollout(pipe.stream_options(prompt_embeds=SCHEDULE[0], num_frames=45, **CALL, **flush))
    with pytest.raises(ValueError, match="use prompt_transition_chunks=0 with kv_flush"):
        run.switch_prompt(2, SCHEDULE[21], transition_chunks=2)
    run.switch_prompt(2, SCHEDULE[21], transition_chunks=0)
    pipe(prompt_embeds={0: SCHEDULE[0], 9: SCHEDULE[21]}, num_frames=21, keep_cache=True, **CALL, **flush)
    try:
        with pytest.raises(ValueError, match=r"`kv_flush=True` replaces the recache"):
            pipe.continue_rollout(12, prompt_embeds=SCHEDULE[33], recache=True, output_type="latent")
        pipe.continue_rollout(12, prompt_embeds=SCHEDULE[33], output_type="latent")
    finally:
        pipe.discard_rollout()
