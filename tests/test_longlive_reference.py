"""LongLive's global sink at a recache (``recache=True, recache_sink="keep"``) against a recording of LongLive's own
interactive inference (``tests/data/longlive_tiny``, see its README).

Upstream: NVlabs/LongLive v1.0, ``InteractiveCausalInferencePipeline`` with its released interactive config
(``global_sink: true``, window 12 with a sink of 3, chunks of 3, 4 warped steps), a tiny random Wan, 21 latent frames
and prompts ``a`` (chunks 0-1), ``b`` from frame 6, ``c`` from frame 15. The switch to ``b`` lies within the window:
the recache re-runs frames 0..5 and rewrites the sink. The switch to ``c`` lies past it: the recache forward runs
frames 3..14 without a mask, keeps the sink's K/V (frames 0..2, written under ``b``) and writes frames 6..14, so
frames 3..5 touch nothing (their keys are never written nor read): ours re-runs frames 6..14 only, in one forward.
Replayed call by call through the engine (``truncate`` + one unmasked chunk) and as one free run of the pipeline;
control: the default sink rule (``recache_sink="rerun"``) misses the recording.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import recorded_forwards
from recorded_sampler import RecordedSampler, model_layout
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.kv_cache import make_engines

DATA = Path(__file__).resolve().parent / "data" / "longlive_tiny"
PARITY = 1e-5
WINDOW, SINK, CHUNK = 12, 3, 3


def longlive_renoise_key(chunk: int, index: int, steps: int) -> str:
    """LongLive records a draw after every step but a chunk's last: ``renoise{steps * chunk + index}``."""
    return f"renoise{steps * chunk + index:02d}"


@pytest.fixture(scope="module")
def longlive():
    meta = json.loads((DATA / "meta.json").read_text())
    return meta, load_file(DATA / "inputs.safetensors"), load_file(DATA / "outputs.safetensors")


def test_longlive_recording_is_consistent(longlive):
    """7 chunks of 4 steps and a cache pass, and one recache forward at each switch: at frame 6 (within the window)
    over frames 0..5, rewriting the sink; at frame 15 over frames 3..14 (LongLive's ``min(window, t)``), leaving the
    sink's K/V bit for bit as they were (the global sink) while the window's other 9 frames are rewritten."""
    meta, inputs, outputs = longlive
    calls = meta["calls"]
    assert meta["config"]["global_sink"] is True and len(calls) == 7 * 5 + 2
    recaches = [call for call in calls if call["recache"]]
    assert [(c["start_frame"], c["num_frames"], c["prompt"]) for c in recaches] == [
        (0, 6, "scene b"),
        (3, 12, "scene c"),
    ]
    assert [c["sink_kv_unchanged"] for c in recaches] == [False, True]
    assert all(c["timestep"] == [0.0] * c["num_frames"] and not c["cross_is_init"] for c in recaches)
    assert not any(c["sink_recache_after_switch"] for c in calls)
    for call in calls:
        if not call["recache"] and call["start_frame"] >= SINK:  # later chunks never write the sink
            assert call["sink_kv_unchanged"], call["index"]
        assert outputs[f"call{call['index']:02d}.flow_pred"].shape[1] == call["num_frames"]
    assert outputs["final_latents"].shape == (1, 21, 4, 8, 8)
    assert len([name for name in inputs if name.startswith("renoise")]) == 7 * 3


def keep_start(end: int) -> int:
    """The first frame a global-sink recache at frame ``end`` writes (0 while the video is within the window)."""
    return end - WINDOW + SINK if end > WINDOW else 0


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_longlive_calls_replay_through_a_recache_keeping_the_sink(longlive, kind):
    """Every recorded call through our engine. A recache: new cross K/V, ``truncate(tag, start)`` and one forward of
    frames ``[start, t)`` as one chunk (no mask) storing K/V, start = ``t - window + sink`` past the window (the sink's
    K/V stay), else 0; its outputs match upstream's for those frames. Control: the rerun rule (the sink's chunks re-run
    under the new prompt before the recent frames) misses the calls after the second switch."""
    meta, inputs, outputs = longlive
    model = WanCausalTransformer3DModel.from_pretrained(DATA / "transformer", chunk_size=CHUNK).eval()
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=WINDOW, sink_frames=SINK, max_frames=21))
    engine = model.kv_cache_engines["main"]

    def forward(hidden_states, timestep, prompt, start_frame, **kwargs):
        embeds = inputs[f"prompt_embeds.{prompt[-1]}"]
        out = model(
            model_layout(hidden_states), timestep, embeds, start_frame=start_frame, return_dict=False, **kwargs
        )
        return model_layout(out[0])

    second_recache = [call["index"] for call in meta["calls"] if call["recache"]][-1]
    sink_clean = outputs[f"call{CHUNK + 1:02d}.hidden_states"]  # chunk 0's cache pass: its clean frames
    worst, worst_rerun = 0.0, 0.0
    for keep in (True, False):
        model.clear_caches()
        for call in meta["calls"]:
            name = f"call{call['index']:02d}"
            hidden, expected = outputs[f"{name}.hidden_states"], outputs[f"{name}.flow_pred"]
            if call["recache"]:
                end = call["start_frame"] + call["num_frames"]
                start = keep_start(end)
                engine.invalidate_cross("pos")
                engine.truncate("pos", start)
                if start and not keep:  # control: the sink's frames re-run under the new prompt too
                    engine.truncate("pos", 0)
                    forward(sink_clean, torch.zeros(1), call["prompt"], 0, store_kv=True)
                    engine.skip_evicted("pos", start)
                offset = start - call["start_frame"]
                out = forward(
                    hidden[:, offset:],
                    torch.zeros(1),
                    call["prompt"],
                    start,
                    store_kv=True,
                    chunk_layout=(end - start,),
                )
                engine.end_recache("pos")
                expected = expected[:, offset:]
            else:
                timestep = torch.tensor([call["timestep"]])
                store = call["timestep"][0] == 0.0
                out = forward(hidden, timestep, call["prompt"], call["start_frame"], store_kv=store)
            error = (out - expected).abs().max().item()
            if keep:
                worst = max(worst, error)
            elif call["index"] >= second_recache:
                worst_rerun = max(worst_rerun, error)
    assert worst <= PARITY, worst
    assert worst_rerun > 1e-3, worst_rerun


@torch.no_grad()
def longlive_free_run(longlive, **policy):
    """The recorded rollout through ``WanCausalPipeline(...)`` (window 12, sink 3, prompts a, b from latent frame 6,
    c from 15) with ``policy``'s recache arguments. Returns ``(latents, calls)``, calls = ``(hidden_states, flow)``
    in LongLive's layout."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastgen_diffusers import WanCausalPipeline

    meta, inputs, outputs = longlive
    transformer = WanCausalTransformer3DModel.from_pretrained(DATA / "transformer", chunk_size=CHUNK).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)
    pipe = WanCausalPipeline(
        None, None, None, RecordedSampler(scheduler, meta, inputs, longlive_renoise_key), transformer
    )
    pipe.set_progress_bar_config(disable=True)
    # latent frames 6 and 15 begin at pixel frames 4 * 6 - 3 = 21 and 4 * 15 - 3 = 57
    schedule = {0: inputs["prompt_embeds.a"], 21: inputs["prompt_embeds.b"], 57: inputs["prompt_embeds.c"]}
    with recorded_forwards(transformer) as forwards:
        latents = pipe(
            prompt_embeds=schedule, height=64, width=64, num_frames=81, timesteps=meta["timesteps_to_model"],
            latents=model_layout(outputs["noise"]), attention_window=WINDOW, sink_frames=SINK, output_type="latent",
            **{"recache": True, **policy},
        ).frames  # fmt: skip
    calls = [(model_layout(c.hidden_states), None if c.out is None else model_layout(c.out)) for c in forwards]
    return model_layout(latents), calls


def test_longlive_free_run_matches_every_call_and_the_final_latents(longlive):
    """``recache=True, recache_sink="keep"`` reproduces every forward's input and every prediction (the recache at
    frame 15 on frames 6..14 included, the last chunk's cache pass excepted: the pipeline does not run it) and the
    final latents; the default sink rule
    (``"rerun"``) and the plain switch (no recache) miss the final latents."""
    meta, _, outputs = longlive
    final, calls = longlive_free_run(longlive, recache_sink="keep")
    assert len(calls) == len(meta["calls"]) - 1
    # the pipeline's cache passes and recaches are store-only (no prediction): what they store is read by every
    # later call
    cache_passes = [call["timestep"][0] == 0.0 or call["recache"] for call in meta["calls"][: len(calls)]]
    assert [out is None for _, out in calls] == cache_passes
    worst_in = worst_out = 0.0
    for call, (x, out) in zip(meta["calls"], calls):
        name = f"call{call['index']:02d}"
        offset = call["num_frames"] - x.shape[1]  # the recache past the window runs its last window - sink frames
        assert offset == (call["num_frames"] - (WINDOW - SINK) if call["recache"] and call["start_frame"] else 0)
        worst_in = max(worst_in, (x - outputs[f"{name}.hidden_states"][:, offset:]).abs().max().item())
        if out is None:
            continue
        worst_out = max(worst_out, (out - outputs[f"{name}.flow_pred"][:, offset:]).abs().max().item())
    final_error = (final - outputs["final_latents"]).abs().max().item()
    assert max(worst_in, worst_out, final_error) <= PARITY, (worst_in, worst_out, final_error)

    rerun, _ = longlive_free_run(longlive, recache_sink="rerun")
    assert (rerun - outputs["final_latents"]).abs().max().item() > 1e-3
    plain, _ = longlive_free_run(longlive, recache=False)
    assert (plain - outputs["final_latents"]).abs().max().item() > 1e-3
