"""WanCausalPipeline on the tiny offline model: loading, determinism, cache hygiene, causality, CFG, bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from fastgen_diffusers import (
    ChunkOutput,
    WanCausalPipeline,
    WanCausalTransformer3DModel,
    causal_transformer_from_wan,
    expected_self_cache_bytes,
    wan_transformer_from_causal,
)
from fastgen_diffusers.pipelines import GivenFramesConditioner
from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG, tiny_components, tiny_pipeline

HEIGHT = WIDTH = 32  # 4x4 latents, 2x2 tokens per frame
NUM_FRAMES = 25  # 7 latent frames: chunks [0, 4) and [4, 7) (the first chunk absorbs the remainder)
STEPS = 4


@pytest.fixture
def pipe() -> WanCausalPipeline:
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text(seed: int, batch: int = 1, tokens: int = 8) -> torch.Tensor:
    return torch.randn(
        batch, tokens, TINY_TRANSFORMER_CONFIG["text_dim"], generator=torch.Generator().manual_seed(seed)
    )


def generate(pipe, seed: int = 0, **kwargs) -> torch.Tensor:
    """Latents ``(B, 16, 7, 4, 4)`` of a text-embedding call (no text encoder, no VAE) unless ``kwargs`` say else."""
    defaults = {"prompt_embeds": text(1), "height": HEIGHT, "width": WIDTH, "num_frames": NUM_FRAMES}
    defaults |= {"generator": torch.Generator().manual_seed(seed), "output_type": "latent"}
    return pipe(**{**defaults, **kwargs}).frames


def plain_wan_pipeline(seed: int = 1) -> WanPipeline:
    """A stock WanPipeline (plain transformer, UniPC scheduler) as `WanPipeline.save_pretrained` users have it."""
    components = tiny_components()
    config = {key: value for key, value in TINY_TRANSFORMER_CONFIG.items() if key != "chunk_size"}
    torch.manual_seed(seed)
    components["transformer"] = WanTransformer3DModel(**config).eval()
    components["scheduler"] = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    pipe = WanPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------------------------------------- schedule and layout
def test_default_schedule_is_self_forcing_four_steps(pipe):
    pipe.scheduler.set_timesteps(**pipe.rollout_schedule(4))
    torch.testing.assert_close(pipe.scheduler.timesteps, torch.tensor([1000.0, 937.5, 2500.0 / 3.0, 625.0]))
    torch.testing.assert_close(pipe.scheduler.sigmas, torch.tensor([1.0, 0.9375, 2.5 / 3.0, 0.625, 0.0]))


def test_custom_timesteps_are_used_as_given_with_matching_sigmas(pipe):
    timesteps = [960.0, 888.9, 727.3]
    pipe.scheduler.set_timesteps(**pipe.rollout_schedule(4, timesteps=timesteps))
    torch.testing.assert_close(pipe.scheduler.timesteps, torch.tensor(timesteps), rtol=0, atol=0)
    torch.testing.assert_close(pipe.scheduler.sigmas[:-1], torch.tensor(timesteps) / 1000, rtol=0, atol=1e-6)


def test_chunks_follow_the_transformer_partition():
    assert tiny_pipeline().rollout_chunk_bounds(7) == [(0, 4), (4, 7)]
    assert tiny_pipeline(independent_first_frame=True).rollout_chunk_bounds(7) == [(0, 1), (1, 4), (4, 7)]
    assert tiny_pipeline().rollout_chunk_bounds(7, chunk_size=2) == [(0, 3), (3, 5), (5, 7)]


# ---------------------------------------------------------------------------------------------- loading
def test_loading_a_plain_wan_directory_gives_identical_weights_and_the_causal_scheduler(tmp_path):
    wan = plain_wan_pipeline()
    wan.save_pretrained(tmp_path)
    pipe = WanCausalPipeline.from_pretrained(tmp_path)
    assert type(pipe.transformer) is WanCausalTransformer3DModel
    assert pipe.transformer.config.chunk_size == 3
    plain, causal = wan.transformer.state_dict(), pipe.transformer.state_dict()
    assert plain.keys() == causal.keys()
    assert all(torch.equal(plain[key], causal[key]) for key in plain)
    assert pipe.scheduler.config.shift == 5.0 and pipe.scheduler.config.stochastic_sampling is True


def test_save_pretrained_then_from_pretrained_round_trips(pipe, tmp_path):
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=4.0, stochastic_sampling=True)  # kept as it is on load
    pipe.save_pretrained(tmp_path)
    loaded = WanCausalPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.scheduler.config.shift == 4.0
    kwargs = {"prompt": "a red fox runs", "num_frames": 9, "output_type": "np", "max_sequence_length": 16}
    expected = pipe(**kwargs, height=HEIGHT, width=WIDTH, generator=torch.Generator().manual_seed(0)).frames
    frames = loaded(**kwargs, height=HEIGHT, width=WIDTH, generator=torch.Generator().manual_seed(0)).frames
    np.testing.assert_array_equal(frames, expected)


def test_from_pipe_works_both_ways_with_wan_pipeline():
    wan = plain_wan_pipeline()
    causal = WanCausalPipeline.from_pipe(wan)
    causal.set_progress_bar_config(disable=True)
    assert type(causal.transformer) is WanCausalTransformer3DModel
    assert causal.transformer.proj_out.weight.data_ptr() == wan.transformer.proj_out.weight.data_ptr()  # shared
    assert causal.scheduler.config.stochastic_sampling is True
    assert generate(causal).isfinite().all()

    back = WanPipeline.from_pipe(causal, transformer=wan_transformer_from_causal(causal.transformer))
    assert type(back.transformer) is WanTransformer3DModel
    assert back.transformer.proj_out.weight.data_ptr() == wan.transformer.proj_out.weight.data_ptr()
    kwargs = {"prompt_embeds": text(1), "height": HEIGHT, "width": WIDTH, "num_frames": 9, "guidance_scale": 1.0}
    kwargs |= {"num_inference_steps": 2, "output_type": "latent"}
    back.scheduler = wan.scheduler
    expected = wan(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    torch.testing.assert_close(back(**kwargs, generator=torch.Generator().manual_seed(0)).frames, expected)


def test_a_plain_transformer_is_refused_by_init_and_converted_without_copy():
    components = tiny_components()
    plain = wan_transformer_from_causal(components["transformer"])
    with pytest.raises(ValueError, match="causal_transformer_from_wan"):
        WanCausalPipeline(**{**components, "transformer": plain})
    causal = causal_transformer_from_wan(plain, chunk_size=2)
    assert causal.config.chunk_size == 2
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(plain.parameters(), causal.parameters()))


# ---------------------------------------------------------------------------------------------- the rollout
def test_same_seed_gives_identical_frames(pipe):
    first = pipe(
        "a red fox runs", height=HEIGHT, width=WIDTH, num_frames=9, generator=torch.Generator().manual_seed(3)
    )
    second = pipe(
        "a red fox runs", height=HEIGHT, width=WIDTH, num_frames=9, generator=torch.Generator().manual_seed(3)
    )
    assert first.frames.shape == (1, 9, HEIGHT, WIDTH, 3)
    np.testing.assert_array_equal(first.frames, second.frames)
    other = pipe(
        "a red fox runs", height=HEIGHT, width=WIDTH, num_frames=9, generator=torch.Generator().manual_seed(4)
    )
    assert np.abs(other.frames - first.frames).max() > 1e-3


def test_a_call_with_another_prompt_in_between_changes_nothing(pipe):
    fresh = generate(tiny_pipeline())
    first = generate(pipe)
    assert pipe.transformer.kv_cache_bytes() == 0  # freed at the end of the call
    generate(pipe, seed=5, prompt_embeds=text(9), guidance_scale=3.0, negative_prompt_embeds=text(10))
    torch.testing.assert_close(generate(pipe), first, rtol=0, atol=0)
    torch.testing.assert_close(first, fresh, rtol=0, atol=0)


def test_changing_the_last_chunk_noise_leaves_earlier_chunks_bit_identical(pipe):
    noise = torch.randn(1, 16, 7, 4, 4, generator=torch.Generator().manual_seed(7))
    changed = noise.clone()
    changed[:, :, 4:] = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(8))
    base = generate(pipe, latents=noise)
    other = generate(pipe, latents=changed)
    torch.testing.assert_close(other[:, :, :4], base[:, :, :4], rtol=0, atol=0)
    assert (other[:, :, 4:] - base[:, :, 4:]).abs().max() > 1e-2


def test_rollout_follows_the_design_protocol(pipe):
    """The pipeline equals the loop of DESIGN.md written out against the transformer."""
    embeds, generator = text(1), torch.Generator().manual_seed(0)
    noise = torch.randn(1, 16, 7, 4, 4, generator=generator)
    sigmas = torch.tensor([1.0, 0.9375, 2.5 / 3.0, 0.625, 0.0])
    transformer, chunks = pipe.transformer, []
    transformer.clear_caches()
    for start, end in [(0, 4), (4, 7)]:
        x = noise[:, :, start:end]
        for i in range(STEPS):
            flow = transformer(x, (sigmas[i] * 1000).expand(1), embeds, start_frame=start, return_dict=False)[0]
            x0 = x - sigmas[i] * flow
            x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(x.shape, generator=generator)
        transformer(x0, torch.zeros(1), embeds, start_frame=start, store_kv=True)
        chunks.append(x0)
    expected = torch.cat(chunks, dim=2)
    torch.testing.assert_close(generate(pipe, prompt_embeds=embeds), expected, rtol=0, atol=2e-6)


def test_cfg_runs_with_its_own_cache_and_differs_from_guidance_one(pipe):
    plain = generate(pipe)
    guided = generate(pipe, guidance_scale=4.0, negative_prompt_embeds=text(2), keep_cache=True)
    assert guided.isfinite().all()
    assert (guided - plain).abs().max() > 1e-2
    per_tag = expected_self_cache_bytes(2, 1, 2, 7 * 4, 32, torch.float32)  # layers, batch, heads, tokens, head_dim
    assert pipe.transformer.kv_cache_bytes("pos") == per_tag
    assert pipe.transformer.kv_cache_bytes("neg") == per_tag
    generate(pipe)
    assert pipe.transformer.kv_cache_bytes() == 0


def test_context_noise_changes_the_cache_pass_and_chunk_size_is_honoured(pipe):
    plain = generate(pipe)
    noisy_context = generate(pipe, context_noise=100.0)
    torch.testing.assert_close(noisy_context[:, :, :4], plain[:, :, :4], rtol=0, atol=0)  # same first chunk
    assert (noisy_context[:, :, 4:] - plain[:, :, 4:]).abs().max() > 1e-3
    seen = []
    generate(pipe, chunk_size=2, callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].shape[2]) or {})
    assert seen == [3] * STEPS + [2] * STEPS + [2] * STEPS


def test_callback_progress_bar_and_output_types(pipe):
    calls = []

    def callback(pipeline, step, timestep, callback_kwargs):
        calls.append((step, float(timestep), tuple(callback_kwargs["latents"].shape)))
        return {}

    stream = io.StringIO()
    pipe.set_progress_bar_config(file=stream, disable=False, ncols=80)
    generate(pipe, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
    assert [c[0] for c in calls] == list(range(8))
    assert [c[1] for c in calls[:4]] == [1000.0, 937.5, pytest.approx(833.3333), 625.0]
    assert calls[0][2] == (1, 16, 4, 4, 4) and calls[-1][2] == (1, 16, 3, 4, 4)
    assert "8/8" in stream.getvalue()

    kwargs = {"prompt_embeds": text(1), "height": HEIGHT, "width": WIDTH, "num_frames": 5}
    pipe.set_progress_bar_config(disable=True)
    assert pipe(**kwargs, output_type="pt").frames.shape == (1, 5, 3, HEIGHT, WIDTH)
    pil = pipe(**kwargs, output_type="pil").frames
    assert len(pil) == 1 and len(pil[0]) == 5 and pil[0][0].size == (WIDTH, HEIGHT)
    assert pipe(**kwargs, output_type="latent", return_dict=False)[0].shape == (1, 16, 2, 4, 4)


def test_context_chunks_are_cached_not_denoised():
    class FirstChunkGiven(WanCausalPipeline):
        def prepare_conditioner(self, options, shape, batch_size, device):
            return GivenFramesConditioner(self.given)  # covers chunk [0, 1) only

    pipe = FirstChunkGiven(**tiny_components(independent_first_frame=True))
    pipe.set_progress_bar_config(disable=True)
    pipe.given = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    steps = []
    out = generate(pipe, callback_on_step_end=lambda p, i, t, kw: steps.append(i) or {})
    torch.testing.assert_close(out[:, :, :1], pipe.given, rtol=0, atol=0)
    assert len(steps) == 2 * STEPS  # chunks [1, 4) and [4, 7) only
    pipe.given = pipe.given + 1.0
    assert (generate(pipe)[:, :, 1:] - out[:, :, 1:]).abs().max() > 1e-3  # later chunks attend to the context


def test_rollout_generator_yields_each_chunk(pipe):
    latents = torch.randn(1, 16, 7, 4, 4, generator=torch.Generator().manual_seed(0))
    schedule = pipe.rollout_schedule(2)
    chunks = list(pipe.rollout(latents, text(1), chunk_bounds=[(0, 4), (4, 7)], schedule=schedule))
    assert [(c.chunk_index, c.start, c.end) for c in chunks] == [(0, 0, 4), (1, 4, 7)]
    assert all(isinstance(c, ChunkOutput) and c.latents.shape[2] == c.end - c.start for c in chunks)
    early = pipe.rollout(latents, text(1), chunk_bounds=[(0, 4), (4, 7)], schedule=schedule, keep_cache=True)
    next(early)
    assert pipe.transformer.kv_cache_bytes() > 0
    early.close()  # a consumer that stops early leaves nothing behind
    assert pipe.transformer.kv_cache_bytes() == 0


# ---------------------------------------------------------------------------------------------- failures
def test_an_exception_midway_leaves_the_pipeline_fresh(pipe):
    expected = generate(tiny_pipeline())

    def fail_in_second_chunk(pipeline, step, timestep, callback_kwargs):
        if step == 5:
            raise RuntimeError("boom")
        return {}

    with pytest.raises(RuntimeError, match="boom"):
        generate(pipe, guidance_scale=2.0, negative_prompt_embeds=text(2), callback_on_step_end=fail_in_second_chunk)
    assert pipe.transformer.kv_cache_bytes() == 0
    torch.testing.assert_close(generate(pipe), expected, rtol=0, atol=0)


def test_an_interruption_returns_the_finished_chunks_and_leaves_the_pipeline_fresh(pipe):
    expected = generate(pipe)
    noise = torch.randn(1, 16, 7, 4, 4, generator=torch.Generator().manual_seed(0))

    def interrupt_in_second_chunk(pipeline, step, timestep, callback_kwargs):
        pipeline._interrupt = step == 5
        return {}

    out = generate(pipe, latents=noise, keep_cache=True, callback_on_step_end=interrupt_in_second_chunk)
    assert pipe.transformer.kv_cache_bytes() == 0
    torch.testing.assert_close(out[:, :, 4:], noise[:, :, 4:], rtol=0, atol=0)
    assert (out[:, :, :4] - noise[:, :, :4]).abs().max() > 1e-2
    torch.testing.assert_close(generate(pipe), expected, rtol=0, atol=0)


BAD_INPUTS = [
    ({"height": 40}, "`height` and `width`"),
    ({"width": 24}, "`height` and `width`"),
    ({"num_frames": 24}, "`num_frames`"),
    ({"num_frames": 0}, "`num_frames`"),
    ({"chunk_size": 6}, "`chunk_size=6` cannot be served"),
    ({"chunk_size": 0}, "`chunk_size`"),
    ({"prompt": "a fox"}, "either `prompt` or `prompt_embeds`"),
    ({"prompt_embeds": None}, "one of `prompt`"),
    ({"prompt_embeds": text(1, batch=2), "generator": None}, "`negative_prompt_embeds` has batch"),
    ({"prompt_embeds": torch.zeros(1, 8, 16)}, "`prompt_embeds` must be a"),
    ({"negative_prompt_embeds": torch.zeros(1, 8, 16), "guidance_scale": 2.0}, "`negative_prompt_embeds` must be"),
    (
        {"prompt": ["a", "b"], "prompt_embeds": None, "negative_prompt_embeds": None, "negative_prompt": ["c"]}
        | {"guidance_scale": 2.0, "generator": None},
        "`negative_prompt` has 1 entries",
    ),
    ({"timesteps": [1000.0, 1000.0, 500.0]}, "`timesteps` must be strictly decreasing"),
    ({"timesteps": [1200.0, 500.0]}, r"`timesteps` must lie within \[0, 1000\]"),
    ({"timesteps": [500.0, -1.0]}, r"`timesteps` must lie within"),
    ({"sigmas": [0.5, 0.75]}, "`sigmas` must be strictly decreasing"),
    ({"timesteps": [900.0], "sigmas": [0.9]}, "at most one of `timesteps` and `sigmas`"),
    ({"num_inference_steps": 0}, "`num_inference_steps`"),
    ({"timesteps": []}, "`timesteps` must hold at least one step"),
    ({"generator": [torch.Generator(), torch.Generator()]}, "`generator`"),
    ({"output_type": "mp4"}, "`output_type` must be one of"),
    ({"context_noise": 1001.0}, "`context_noise`"),
    ({"latents": torch.zeros(1, 16, 6, 4, 4)}, "`latents` must have shape"),
    ({"callback_on_step_end_tensor_inputs": ["noise_pred"]}, "`callback_on_step_end_tensor_inputs`"),
    ({"max_sequence_length": 0}, "`max_sequence_length`"),
]


@pytest.fixture(scope="module")
def watched_pipe():
    """One pipeline for all bad-input cases, with the forward calls of its models recorded in ``pipe.model_calls``."""
    pipe = tiny_pipeline()
    pipe.model_calls = []
    for model in (pipe.transformer, pipe.text_encoder, pipe.vae):
        model.register_forward_pre_hook(lambda module, args: pipe.model_calls.append(type(module).__name__))
    return pipe


@pytest.mark.parametrize("bad, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_raises_before_any_model_work(watched_pipe, bad, message):
    watched_pipe.model_calls.clear()
    with pytest.raises(ValueError, match=message):
        generate(watched_pipe, **{"negative_prompt_embeds": text(2), **bad})
    assert watched_pipe.model_calls == []


def test_cfg_without_a_usable_negative_prompt_is_refused():
    pipe = tiny_pipeline()
    pipe.text_encoder = pipe.tokenizer = None
    with pytest.raises(ValueError, match="`guidance_scale=3.0`.*negative_prompt_embeds"):
        generate(pipe, guidance_scale=3.0)
    with pytest.raises(ValueError, match="`prompt` needs a `text_encoder`"):
        generate(pipe, prompt="a fox", prompt_embeds=None)
    assert generate(pipe, guidance_scale=3.0, negative_prompt_embeds=text(2)).isfinite().all()
