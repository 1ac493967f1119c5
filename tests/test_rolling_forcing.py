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
from fastgen_diffusers.pipelines.conditioning import Conditioner
from fastgen_diffusers.pipelines.policy_rolling import RollingPolicy, rolling_windows
from fastgen_diffusers.pipelines.rollout import CausalRolloutMixin
from fastgen_diffusers.pipelines.session import RolloutSession
from fastgen_diffusers.pipelines.sources import NoiseSource
from fastgen_diffusers.testing import tiny_scheduler

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


class _Bar:
    total = 0

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None

    def update(self):
        pass


class StubPipe:
    """What a policy reads of a pipeline: the scheduler, the progress bar and the callback state."""

    interrupt = False
    _num_timesteps = 0
    _current_timestep = None

    def __init__(self):
        self.scheduler = tiny_scheduler()

    def progress_bar(self, total):
        return _Bar()


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
    pipe = StubPipe()
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
    worst = 0.0
    for call, flow in zip(meta["calls"], flows):
        key = f"window{call['window']}.commit" if call["kind"] == "commit" else f"window{call['window']}"
        worst = max(worst, (layout(flow) - outputs[f"{key}.flow_pred"]).abs().max().item())
    assert worst <= PARITY, f"max abs diff {worst:.3e} over 28 forwards"
    final = torch.cat([c.latents for c in chunks], dim=2)
    error = (final - layout(outputs["final_latents"])).abs().max().item()
    assert error <= PARITY, f"final latents: max abs diff {error:.3e}"
    # the engines never hold more than the anchor and 21 frames
    assert all(engine.held_frames("pos") <= 24 for engine in model.kv_cache_engines.values())
