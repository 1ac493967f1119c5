"""Prompt-switch policies against recordings of their authors' own inference code (see each data README).

``tests/data/infinity_rope_tiny``: Infinity-RoPE's ``CausalInferencePipeline.inference`` with a tiny random Wan, window
6 / sink 1 / chunks of 3, positions within the window, three scenes ``a[2 chunks] | b[1 chunk #] | c[2 chunks]``: a
KV flush at the switch to ``b`` (chunk 2) and a flush plus a scene cut (RoPE jump to 45) at the switch to ``c``
(chunk 3). Replayed call by call through the engine operations (``flush``, ``set_rope_cut``) and as one free run of
the pipeline (``kv_flush=True, rope_cut=[33]``); controls: the same run without the cut, and with LongLive's recache
instead of the flush, miss the recording.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from recorded_sampler import RecordedSampler, model_layout
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.kv_cache import make_engines

DATA = Path(__file__).resolve().parent / "data"
INFINITY = DATA / "infinity_rope_tiny"
PARITY = 1e-5


def infinity_renoise_key(chunk: int, index: int, steps: int) -> str:
    """Infinity-RoPE records one draw per chunk: ``renoise{chunk}``."""
    return f"renoise{chunk:02d}"


@pytest.fixture(scope="module")
def infinity():
    meta = json.loads((INFINITY / "meta.json").read_text())
    return meta, load_file(INFINITY / "inputs.safetensors"), load_file(INFINITY / "outputs.safetensors")


def infinity_model(kind: str = "static") -> WanCausalTransformer3DModel:
    model = WanCausalTransformer3DModel.from_pretrained(INFINITY / "transformer", chunk_size=3).eval()
    engines = make_engines(model, kind, window_frames=6, sink_frames=1, rope_positions="window", max_frames=16)
    model.set_kv_cache_engines(engines)
    return model


def test_infinity_rope_recording_is_consistent(infinity):
    """Per call: the scene's prompt, the flush (3 frames held at a switch), the cut flag on the cut chunk only, and the
    layer-0 RoPE calls (queries at window slots 3..5 once the window is full; keys 0..5)."""
    meta, inputs, outputs = infinity
    calls = meta["calls"]
    assert len(calls) == 5 * 3  # 5 chunks: 2 denoising steps + the cache pass
    for call in calls:
        chunk = call["start_frame"] // 3
        assert call["prompt"] == "scene " + "aabcc"[chunk]
        first = call["timestep"][0] == 1000.0
        assert call["scene_cut"] == (chunk == 3)
        if first and chunk in (2, 3):  # just flushed: the sink and 2 frames held, the cross K/V to refill
            assert call["local_end_frames"] == 3 and not call["cross_is_init"]
        rope = call["layer0_rope"]
        assert rope["queries"]["start_frame"] == min(call["start_frame"], 3)
        assert rope["keys"] == {"start_frame": 0, "frames": min(call["start_frame"] + 3, 6), "scene_cut": chunk == 3}
        assert outputs[f"call{call['index']:02d}.flow_pred"].shape == (1, 3, 4, 30, 52)
    assert meta["kv_flush"]["kept_frames_after_sink"] == 2 and meta["rope_cut"]["transition_from"] == 45
    assert outputs["final_latents"].shape == (1, 15, 4, 30, 52)
    assert len([name for name in inputs if name.startswith("renoise")]) == 5


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_infinity_rope_calls_replay_through_flush_and_cut(infinity, kind):
    """Every recorded call through our engine: at a switch ``flush(tag, 2)`` and new cross K/V; on the cut chunk
    ``set_rope_cut(tag, 45)``, cleared at the next chunk. Control: without the cut the cut chunk's calls miss."""
    meta, inputs, outputs = infinity
    model = infinity_model(kind)
    engine = model.kv_cache_engines["main"]
    worst, worst_cut_missing = 0.0, 0.0
    for cut in (True, False):
        model.clear_caches()
        prompt = None
        for call in meta["calls"]:
            if call["timestep"][0] == 1000.0:
                engine.set_rope_cut("pos", None)
                if prompt is not None and call["prompt"] != prompt:
                    engine.flush("pos", 2)
                    engine.invalidate_cross("pos")
                    if call["scene_cut"] and cut:
                        engine.set_rope_cut("pos", 45)
            prompt = call["prompt"]
            name = f"call{call['index']:02d}"
            out = model(
                model_layout(outputs[f"{name}.hidden_states"]),
                torch.tensor([call["timestep"]]),
                inputs[f"prompt_embeds.{prompt[-1]}"],
                start_frame=call["start_frame"],
                store_kv=call["timestep"][0] == 0.0,
                return_dict=False,
            )[0]
            error = (model_layout(out) - outputs[f"{name}.flow_pred"]).abs().max().item()
            if cut:
                worst = max(worst, error)
            elif call["scene_cut"]:
                worst_cut_missing = max(worst_cut_missing, error)
    assert worst <= PARITY, worst
    assert worst_cut_missing > 1e-3, worst_cut_missing


@torch.no_grad()
def infinity_free_run(infinity, **policy):
    """The recorded three-scene rollout through ``WanCausalPipeline(...)`` (window 6, sink 1, window positions) with
    ``policy``'s prompt-switch arguments. Returns ``(latents, calls)``, calls = ``(hidden_states, flow)``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastgen_diffusers import WanCausalPipeline

    meta, inputs, outputs = infinity
    transformer = WanCausalTransformer3DModel.from_pretrained(INFINITY / "transformer", chunk_size=3).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)
    pipe = WanCausalPipeline(
        None, None, None, RecordedSampler(scheduler, meta, inputs, infinity_renoise_key), transformer
    )
    pipe.set_progress_bar_config(disable=True)
    noise = torch.cat([outputs[f"call{3 * c:02d}.hidden_states"] for c in range(5)], dim=1)
    calls, forward = [], transformer.forward

    def recording(hidden_states, *args, **kwargs):
        out = forward(hidden_states, *args, **kwargs)
        calls.append((hidden_states, out[0]))
        return out

    transformer.forward = recording
    schedule = {0: inputs["prompt_embeds.a"], 21: inputs["prompt_embeds.b"], 33: inputs["prompt_embeds.c"]}
    latents = pipe(
        prompt_embeds=schedule, height=240, width=416, num_frames=57, timesteps=meta["timesteps_to_model"],
        latents=model_layout(noise), attention_window=6, sink_frames=1, rope_positions="window",
        output_type="latent", **policy,
    ).frames  # fmt: skip
    return latents, calls


def test_infinity_rope_free_run_matches_every_call_and_the_final_latents(infinity):
    """``kv_flush=True, rope_cut=[33]`` (the switch to scene c, chunk 3, is the cut) reproduce every forward (the
    last chunk's cache pass excepted: the pipeline does not run it) and the final latents; without the cut, or with a
    recache instead of the flush, the final latents miss.

    This reference does **not** distinguish the flush from no flush: at window 6 / sink 1 with chunks of 3 the flush
    keeps exactly the frames the next chunk would see (the sink and the last 2), so ``rope_cut=[33]`` without
    ``kv_flush`` matches the recording just as closely (the control below). Only the RoPE cut is checked against
    upstream here; that the flush runs, and what it drops under a wider window, is checked in
    ``test_prompt_switch_policies.py``."""
    meta, _, outputs = infinity
    final, calls = infinity_free_run(infinity, kv_flush=True, rope_cut=[33])
    assert len(calls) == len(meta["calls"]) - 1
    # the pipeline's cache passes are store-only (no prediction): what they store is read by every later call
    assert [out is None for _, out in calls] == [call["timestep"][0] == 0.0 for call in meta["calls"][: len(calls)]]
    worst_in = worst_out = 0.0
    for call, (x, out) in zip(meta["calls"], calls):
        name = f"call{call['index']:02d}"
        worst_in = max(worst_in, (model_layout(x) - outputs[f"{name}.hidden_states"]).abs().max().item())
        if out is None:
            continue
        worst_out = max(worst_out, (model_layout(out) - outputs[f"{name}.flow_pred"]).abs().max().item())
    final_error = (model_layout(final) - outputs["final_latents"]).abs().max().item()
    assert max(worst_in, worst_out, final_error) <= PARITY, (worst_in, worst_out, final_error)

    # control: no flush at all reproduces the recording as well (the flush is invisible in this setting)
    without_flush, _ = infinity_free_run(infinity, rope_cut=[33])
    assert (model_layout(without_flush) - outputs["final_latents"]).abs().max().item() <= PARITY
    without_cut, _ = infinity_free_run(infinity, kv_flush=True)
    assert (model_layout(without_cut) - outputs["final_latents"]).abs().max().item() > 1e-3
    recached, _ = infinity_free_run(infinity, recache=True, rope_cut=True)
    assert (model_layout(recached) - outputs["final_latents"]).abs().max().item() > 1e-3
