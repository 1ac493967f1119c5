"""Rolling Forcing's rolling-window rollout (issue #15 §3) against its recorded reference (``tests/data/
rolling_forcing_tiny``, see its README): [`RollingPolicy`] decides every forward (frames, per-frame timesteps,
``store_kv``, attention window, chunk layout) and the sampler arithmetic between them.

* Replay stub: the transformer is replaced by the recorded flow predictions; every call the policy makes is checked
  against the recorded call (its frames, per-frame timesteps, store flag and inputs) and the final latents against
  the recorded ones. The re-noise draws come from a generator seeded like upstream's global RNG (2025) and drawn in
  its layout, so they are upstream's draws.
* The real transformer: every forward of a free run, and its final latents, against the recording.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.chunking import ChunkPlan
from fastgen_diffusers.kv_cache import AttentionWindow, make_engines
from fastgen_diffusers.pipelines.rollout.conditioning import Conditioner
from fastgen_diffusers.pipelines.rollout.core import CausalRolloutMixin
from fastgen_diffusers.pipelines.rollout.policy_rolling import RollingPolicy, rolling_windows
from fastgen_diffusers.pipelines.rollout.session import RolloutSession
from fastgen_diffusers.pipelines.rollout.sources import NoiseSource
from fastgen_diffusers.testing import PolicyHost, tiny_pipeline

ROLLING = Path(__file__).resolve().parent / "data" / "rolling_forcing_tiny"
BLOCK = 3
PARITY = 1e-5


@pytest.fixture(scope="module")
def reference():
    meta = json.loads((ROLLING / "meta.json").read_text())
    return meta, load_file(ROLLING / "inputs.safetensors"), load_file(ROLLING / "outputs.safetensors")


def layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` (upstream's layout) <-> ``[B, C, F, H, W]``."""
    return x.permute(0, 2, 1, 3, 4)


class ReplayTransformer:
    """Stands in for the transformer: checks each call against the next recorded one and returns its flow."""

    dtype = torch.float32
    kv_cache_engines: dict = {}

    def __init__(self, meta, outputs):
        self.calls, self.outputs, self.index, self.worst_input = meta["calls"], outputs, 0, 0.0

    def __call__(self, *, hidden_states, timestep, start_frame, store_kv, attention_window, chunk_layout=None, **_):
        call = self.calls[self.index]
        self.index += 1
        commit = call["kind"] == "commit"
        key = f"window{call['window']}.commit" if commit else f"window{call['window']}"
        frames = hidden_states.shape[2]
        assert (start_frame, frames, store_kv) == (call["start_frame"], call["num_frames"], call["updating_cache"])
        per_frame = timestep if timestep.ndim == 2 else timestep[:, None].expand(-1, frames)  # commits: (B,)
        assert per_frame.shape == (1, frames) and per_frame[0].tolist() == call["timestep"], call["index"]
        recorded = layout(self.outputs[f"{key}.input" if commit else f"{key}.noisy_input"])
        self.worst_input = max(self.worst_input, (hidden_states - recorded).abs().max().item())
        # denoising forwards: one chunk (no mask), the anchor + 21 frames; commits: the last 21 frames, no sink
        if commit:
            assert attention_window == AttentionWindow(21, 0) and chunk_layout is None
        else:
            assert attention_window == AttentionWindow(21, BLOCK) and chunk_layout == (frames,)
        return (layout(self.outputs[f"{key}.flow_pred"]),)


def run_policy(meta, inputs, transformer, store_last=True):
    """Drive a [`RollingPolicy`] over the recording's 10 chunks; returns the yielded chunks."""
    session = RolloutSession(
        transformer, Conditioner(), prompt_embeds=inputs["prompt_embeds"], negative_prompt_embeds=None,
        guidance_scale=1.0, context_noise=0.0, schedule={}, keep_history=False,
    )  # fmt: skip
    pipe = PolicyHost()
    schedule = CausalRolloutMixin.rollout_schedule(pipe, 5, timesteps=meta["denoising_step_list_used"])
    plan = ChunkPlan.from_bounds([(BLOCK * b, BLOCK * b + BLOCK) for b in range(meta["num_blocks"])], schedule)
    generator = torch.Generator().manual_seed(meta["seeds"]["loop_global_rng"])  # upstream's global RNG seed
    with torch.no_grad():
        return list(
            RollingPolicy().run(
                pipe, session, plan, NoiseSource(layout(inputs["noise"])), generator=generator, store_last=store_last
            )
        )


def test_rolling_schedule_is_upstreams(reference):
    meta, _, _ = reference
    windows = rolling_windows(meta["num_blocks"], 5)
    assert len(windows) == meta["window_num"] == 14
    steps = meta["denoising_step_list_used"]
    for window, recorded in zip(windows, meta["windows"]):
        assert (window.first, window.last) == (recorded["start_block"], recorded["end_block"])
        assert [steps[window.level(b)] for b in window.chunks] == recorded["block_timesteps"]
        finished = steps[-1]
        renoised = [b for b in window.chunks if steps[window.level(b)] != finished]
        assert renoised == [entry["block"] for entry in recorded["renoised_blocks"]]


def test_rolling_policy_replays_every_recorded_call_and_the_final_latents(reference):
    meta, inputs, outputs = reference
    stub = ReplayTransformer(meta, outputs)
    chunks = run_policy(meta, inputs, stub)
    assert stub.index == len(meta["calls"]) == 28  # 14 denoising forwards, 14 commits, in the recorded order
    assert stub.worst_input <= 1e-6, stub.worst_input  # every window input and commit input
    assert [(c.chunk_index, c.start, c.end, c.is_last) for c in chunks] == [
        (b, BLOCK * b, BLOCK * b + BLOCK, b == 9) for b in range(10)
    ]
    final = torch.cat([c.latents for c in chunks], dim=2)
    assert (final - layout(outputs["final_latents"])).abs().max().item() <= 1e-6
    # without a continuation the last commit serves nothing: the pipeline skips it
    stub = ReplayTransformer(meta, outputs)
    run_policy(meta, inputs, stub, store_last=False)
    assert stub.index == 27


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_rolling_policy_with_the_transformer_matches_every_recorded_forward(reference, kind):
    """A free run of the policy on the tiny model: its 28 forwards and final latents against upstream's. The engines
    hold the anchor and the last 21 frames (window 24, sink 3) and store keys before RoPE: the anchor is rotated at
    read time to sit right before the oldest frame a denoising forward sees (``rope_positions="anchor"``)."""
    meta, inputs, outputs = reference
    model = WanCausalTransformer3DModel.from_pretrained(ROLLING / "transformer", chunk_size=BLOCK).eval()
    window = RollingPolicy().engine_window(BLOCK)
    assert window == AttentionWindow(24, BLOCK)  # upstream's 24-frame cache
    engines = make_engines(
        model, kind, window_frames=window.frames, sink_frames=window.sink, max_frames=30, rope_positions="anchor"
    )
    model.set_kv_cache_engines(engines)
    flows = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        flows.append(out[0])
        return out

    model.forward = recording
    try:
        chunks = run_policy(meta, inputs, model)
    finally:
        del model.forward
    assert len(flows) == len(meta["calls"]) == 28
    # the commits are store-only (no prediction): what they store is read by every later forward
    assert [flow is None for flow in flows] == [call["kind"] == "commit" for call in meta["calls"]]
    worst = 0.0
    for call, flow in zip(meta["calls"], flows):
        if flow is None:
            continue
        key = f"window{call['window']}.commit" if call["kind"] == "commit" else f"window{call['window']}"
        worst = max(worst, (layout(flow) - outputs[f"{key}.flow_pred"]).abs().max().item())
    assert worst <= PARITY, f"max abs diff {worst:.3e} over 28 forwards"
    final = torch.cat([c.latents for c in chunks], dim=2)
    error = (final - layout(outputs["final_latents"])).abs().max().item()
    assert error <= PARITY, f"final latents: max abs diff {error:.3e}"
    # the engines never hold more than the anchor and 21 frames
    assert all(engine.held_frames("pos") <= 24 for engine in model.kv_cache_engines.values())


# ---------------------------------------------------------------- through the pipeline

CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 57, "num_inference_steps": 4}  # 5 chunks of 3


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class CountingForwards:
    """Counts (and records the store flag and frame count of) the transformer forwards of a block of code."""

    def __init__(self, pipe):
        self.pipe, self.calls = pipe, []

    def __enter__(self):
        forward = self.pipe.transformer.forward

        def counting(hidden_states, *args, **kwargs):
            self.calls.append((kwargs["store_kv"], hidden_states.shape[2], kwargs.get("attention_window")))
            return forward(hidden_states, *args, **kwargs)

        self.pipe.transformer.forward = counting
        return self

    def __exit__(self, *args):
        del self.pipe.transformer.forward


def _latents(pipe, **kwargs):
    call = {**CALL, "output_type": "latent", "generator": torch.Generator().manual_seed(0), **kwargs}
    return pipe(**call).frames


def test_pipeline_rolling_rollout_streams_and_is_engine_agnostic(pipe):
    with CountingForwards(pipe) as counted:
        rolling = _latents(pipe, kv_cache_policy="rolling")
    windows = 5 + 4 - 1
    assert len(counted.calls) == 2 * windows - 1  # a denoising forward and a commit per window, no last commit
    assert [frames for store, frames, _ in counted.calls if not store] == [3, 6, 9, 12, 12, 9, 6, 3]
    assert all(frames == 3 for store, frames, _ in counted.calls if store)
    assert {window for _, _, window in counted.calls} == {AttentionWindow(21, 3), AttentionWindow(21, 0)}
    vanilla = _latents(pipe, kv_cache_policy="rolling", kv_cache_engine="vanilla")
    torch.testing.assert_close(rolling, vanilla, rtol=0, atol=1e-5)
    streamed = pipe.stream(generator=torch.Generator().manual_seed(0), kv_cache_policy="rolling", output_type="latent",
                           **CALL)  # fmt: skip
    chunks = list(streamed)
    assert [(c.start, c.end) for c in chunks] == [(3 * b, 3 * b + 3) for b in range(5)]
    assert torch.equal(torch.cat([c.latents for c in chunks], dim=2), rolling)
    assert (rolling - _latents(pipe)).abs().max().item() > 1e-3  # not the chunk-by-chunk rollout
    # classifier-free guidance: each forward runs under both tags
    with CountingForwards(pipe) as counted:
        guided = _latents(pipe, kv_cache_policy="rolling", guidance_scale=3.0, negative_prompt="blur")
    assert len(counted.calls) == 2 * (2 * windows - 1)
    assert (guided - rolling).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_cache": True}, "keep_cache"),
        ({"recache": True, "prompt": {0: "a cat", 20: "a dog"}}, "recache"),
        ({"prompt": {0: "a cat", 20: "a dog"}}, "prompt schedule"),
        ({"attention_window": 21, "sink_frames": 3}, "sink_frames"),
        ({"context_noise": 100.0}, "context_noise"),
        ({"first_chunk_timesteps": [1000.0, 750.0]}, "first_chunk_timesteps"),
        ({"num_frames": 33}, "at least as many chunks as denoising steps"),  # 3 chunks for 4 steps
        ({"attention_window": 14}, "too small"),
        ({"attention_window": 0}, "attention_window"),
        ({"rope_positions": "window"}, "pass no other `rope_positions`"),
        ({"sink_update": "ema"}, "pass no other `rope_positions` / `sink_update`"),
    ],
)
def test_bad_rolling_arguments_raise_before_any_forward(pipe, kwargs, message):
    with CountingForwards(pipe) as counted, pytest.raises(ValueError, match=message):
        _latents(pipe, kv_cache_policy="rolling", **kwargs)
    assert counted.calls == []


def test_rolling_refuses_videos_past_the_rope_table_before_any_forward(pipe):
    pipe.transformer.enable_rope_rebasing()
    try:
        with CountingForwards(pipe) as counted, pytest.raises(ValueError, match="at most 1024 latent frames"):
            _latents(pipe, kv_cache_policy="rolling", num_frames=4 * 1026 + 1)
    finally:
        pipe.transformer.enable_rope_rebasing(False)
    assert counted.calls == []


def test_rolling_checks_engines_it_did_not_configure(pipe):
    from fastgen_diffusers.kv_cache import KVCacheEngine

    pipe.transformer.set_kv_cache_engines({"main": KVCacheEngine()})  # absolute positions, no window
    with CountingForwards(pipe) as counted, pytest.raises(ValueError, match="rope_positions='anchor'"):
        _latents(pipe, kv_cache_policy="rolling", kv_cache_engine=None)
    small = make_engines(pipe.transformer, "vanilla", window_frames=12, sink_frames=3, rope_positions="anchor")
    pipe.transformer.set_kv_cache_engines(small)
    with CountingForwards(pipe) as counted, pytest.raises(ValueError, match="window_frames >= 24"):
        _latents(pipe, kv_cache_policy="rolling", kv_cache_engine=None)
    assert counted.calls == []
    fitting = make_engines(pipe.transformer, "vanilla", window_frames=24, sink_frames=3, rope_positions="anchor")
    pipe.transformer.set_kv_cache_engines(fitting)
    torch.testing.assert_close(
        _latents(pipe, kv_cache_policy="rolling", kv_cache_engine=None), _latents(pipe, kv_cache_policy="rolling"),
        rtol=0, atol=1e-5,
    )  # fmt: skip


def test_stored_rolling_policy_serves_text_to_video_only(pipe):
    from fastgen_diffusers import WanCausalPipeline
    from fastgen_diffusers.pipelines.rollout.options import RolloutOptions

    stored = WanCausalPipeline(**{**pipe.components, "kv_cache_policy": "rolling"})
    stored.set_progress_bar_config(disable=True)
    assert stored.resolve_options(RolloutOptions(prompt="a")).kv_cache_policy == "rolling"
    assert torch.equal(_latents(stored), _latents(pipe, kv_cache_policy="rolling"))
    assert torch.equal(_latents(stored, kv_cache_policy="sequential"), _latents(pipe))

    class Conditioned(WanCausalPipeline):  # a pipeline whose chunks carry conditioning (image, control, ...)
        def prepare_conditioner(self, options, shape, batch_size, device):
            return Conditioner()

    conditioned = Conditioned(**{**pipe.components, "kv_cache_policy": "rolling"})
    assert not conditioned.supports_rolling() and stored.supports_rolling()
    assert conditioned.resolve_options(RolloutOptions(prompt="a")).kv_cache_policy is None  # samples sequentially
    with pytest.raises(ValueError, match="cannot run on Conditioned: it conditions its chunks by frame"):
        _latents(conditioned, kv_cache_policy="rolling")


def test_rolling_callback_runs_per_window_and_interrupts(pipe):
    """The step callback sees each window's x0 (an uneven first chunk, the anchor, of 4 frames here); an interruption
    keeps the chunks finished so far and leaves the others at their noise."""
    call = {"num_frames": 61, "kv_cache_policy": "rolling"}  # 16 latent frames: chunks (4, 3, 3, 3, 3)
    whole = _latents(pipe, **call)
    seen = []

    def callback(p, step, timestep, tensors):
        seen.append((step, round(float(timestep), 1), tensors["latents"].shape[2]))
        p._interrupt = step == 5
        return tensors

    interrupted = _latents(pipe, callback_on_step_end=callback, **call)
    assert seen == [(0, 1000.0, 4), (1, 937.5, 7), (2, 833.3, 10), (3, 625.0, 13), (4, 625.0, 12), (5, 625.0, 9)]
    assert torch.equal(interrupted[:, :, :10], whole[:, :, :10])  # chunks 0-2 left their windows by window 5
    noise = torch.randn(whole.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(interrupted[:, :, 10:], noise[:, :, 10:])


def test_a_plan_run_directly_is_refused_with_the_policys_own_messages():
    """``RollingPolicy.run`` on a plan a pipeline call would refuse (a first-chunk schedule, a prompt schedule) says
    what the settings say (``RollingSettings.check``), before any forward."""
    pipe = PolicyHost()
    schedule = CausalRolloutMixin.rollout_schedule(pipe, 2, timesteps=[1000.0, 500.0])
    first = CausalRolloutMixin.rollout_schedule(pipe, 1, timesteps=[1000.0, 750.0, 500.0])
    bounds = [(0, 3), (3, 6), (6, 9)]
    session = RolloutSession(
        tiny_pipeline().transformer, Conditioner(), prompt_embeds=torch.zeros(1, 4, 32), negative_prompt_embeds=None,
        guidance_scale=1.0, context_noise=0.0, schedule={}, keep_history=False,
    )  # fmt: skip
    noise = NoiseSource(torch.zeros(1, 4, 9, 2, 2))
    with pytest.raises(ValueError, match="runs every chunk on one schedule: `first_chunk_timesteps` is not supported"):
        next(RollingPolicy().run(pipe, session, ChunkPlan.from_bounds(bounds, schedule, first_schedule=first), noise))
    with pytest.raises(ValueError, match="a prompt schedule .a dict `prompt`. needs `kv_cache_policy='sequential'`"):
        plan = ChunkPlan.from_bounds(bounds, schedule)
        next(RollingPolicy().run(pipe, session, plan, noise, prompt_switches={1: torch.zeros(1, 4, 32)}))
