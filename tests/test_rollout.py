"""The rollout shape: continue / redo for every conditioning kind, per-chunk schedules, stored window settings, the
window rule shared with the engines, and a long windowed stream in flat memory."""

from __future__ import annotations

import PIL.Image
import pytest
import torch
from test_pipeline_i2v import SIZE, make_pipeline

from fastgen_diffusers.kv_cache import StaticKVCacheEngine, VanillaKVCacheEngine
from fastgen_diffusers.pipelines import RolloutOptions
from fastgen_diffusers.settings import CacheSettings
from fastgen_diffusers.testing import tiny_pipeline, tiny_vace_pipeline

PROMPT = "a red fox runs through fresh snow"


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _image(size: int) -> PIL.Image.Image:
    return PIL.Image.fromarray((torch.rand(size, size, 3, generator=_seed(4)) * 255).to(torch.uint8).numpy())


# ------------------------------------------------------------------------------------------- continue / redo
@pytest.mark.parametrize("layout", ["wan2.1-i2v", "ti2v", "t2v-student"])
def test_image_to_video_rollouts_continue_like_one_longer_call_and_redo(layout):
    pipe = make_pipeline(layout)
    pipe.set_progress_bar_config(disable=True)
    common = dict(image=_image(SIZE[layout]), prompt=PROMPT, num_inference_steps=2, max_sequence_length=16)
    channels, side = pipe.transformer.config.out_channels, 4
    noise = torch.randn(1, channels, 6, side, side, generator=_seed(1))
    # 13 frames = 4 latent frames (chunks of 2, or [1, 3] for the student); 8 more frames = 2 latent frames.
    torch.manual_seed(0)  # the scheduler's re-noising draws from the global RNG (no generator)
    whole = pipe(**common, num_frames=21, latents=noise, output_type="latent").frames
    torch.manual_seed(0)
    kept = pipe(**common, num_frames=13, latents=noise[:, :, :4], keep_cache=True, output_type="latent").frames
    assert torch.equal(kept, whole[:, :, :4])
    longer = pipe.continue_rollout(8, latents=noise[:, :, 4:], output_type="latent").frames
    torch.testing.assert_close(longer, whole, rtol=0, atol=0)  # the image condition grew, its prefix unchanged

    again = pipe.redo_last_chunk(latents=noise[:, :, 4:], generator=_seed(3), output_type="latent").frames
    other = pipe.redo_last_chunk(generator=_seed(3), output_type="latent").frames
    assert torch.equal(again[:, :, :4], whole[:, :, :4]) and torch.equal(other[:, :, :4], whole[:, :, :4])
    assert not torch.allclose(other[:, :, 4:], again[:, :, 4:])
    assert torch.equal(pipe.redo_last_chunk(latents=noise[:, :, 4:], generator=_seed(3), output_type="latent")
                       .frames, again)  # fmt: skip
    pipe.fork_rollout("alt")
    fork = pipe.continue_rollout(4, generator=_seed(5), output_type="latent", branch="alt").frames
    main = pipe.continue_rollout(4, generator=_seed(5), output_type="latent").frames
    assert torch.equal(fork, main) and fork.shape[2] == 7
    pipe.discard_rollout()
    assert pipe.rollout_branches == [] and pipe.transformer.kv_cache_bytes() == 0


def test_vace_rollouts_continue_past_the_control_video_like_one_longer_call():
    pipe = tiny_vace_pipeline()
    pipe.set_progress_bar_config(disable=True)
    reference = PIL.Image.new("RGB", (32, 32), (200, 30, 30))
    video = torch.rand(17, 3, 32, 32, generator=_seed(2))
    common = dict(prompt=PROMPT, reference_images=reference, height=32, width=32, num_inference_steps=2)
    noise = torch.randn(1, 16, 9, 4, 4, generator=_seed(1))  # 1 reference + 8 video latent frames
    # The one-shot call gets the control the continuation grows: black frames (under the white default mask; a
    # given mask is folded over time by diffusers' interpolation, so only a constant one keeps earlier frames).
    long_video = torch.cat([video, torch.zeros(12, 3, 32, 32)])
    torch.manual_seed(0)
    whole = pipe(**common, video=long_video, num_frames=29, latents=noise, output_type="latent")
    torch.manual_seed(0)
    kept = pipe(**common, video=video, num_frames=17, latents=noise[:, :, :6], keep_cache=True,
                output_type="latent").frames  # fmt: skip
    assert torch.equal(kept, whole.frames[:, :, :5])  # the output leaves the reference frame out
    longer = pipe.continue_rollout(12, latents=noise[:, :, 6:], output_type="latent").frames
    torch.testing.assert_close(longer, whole.frames, rtol=0, atol=0)
    again = pipe.redo_last_chunk(latents=noise[:, :, 6:], generator=_seed(4), output_type="latent").frames
    assert torch.equal(pipe.redo_last_chunk(latents=noise[:, :, 6:], generator=_seed(4), output_type="latent")
                       .frames, again)  # fmt: skip
    assert torch.equal(again[:, :, :5], kept)
    decoded = pipe.continue_rollout(4, generator=_seed(6)).frames  # the reference frame is not decoded
    assert decoded.shape[1] == 4 * 9 - 3  # 8 + 1 video latent frames
    pipe.discard_rollout()
    mask = (torch.rand(17, 1, 32, 32, generator=_seed(3)) > 0.5).float()  # a masked control continues too
    kept = pipe(**common, video=video, mask=mask, num_frames=17, keep_cache=True, output_type="latent").frames
    longer = pipe.continue_rollout(12, generator=_seed(6), output_type="latent").frames
    assert longer.shape[2] == 8 and torch.equal(longer[:, :, :5], kept)
    pipe.discard_rollout()


# ------------------------------------------------------------------------------------ per-chunk schedules
def _count_forwards(pipe):
    """Record ``(start_frame, store_kv, timestep)`` of every transformer forward."""
    calls = []

    def hook(module, args, kwargs):
        timestep = kwargs["timestep"]
        calls.append((kwargs["start_frame"], kwargs["store_kv"], float(timestep.flatten()[0])))

    return calls, pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)


def _per_chunk(calls):
    starts = sorted({start for start, _, _ in calls})
    return {s: [t for start, store, t in calls if start == s and not store] for s in starts}


T2V = dict(
    prompt_embeds=torch.randn(1, 8, 32, generator=_seed(7)), height=16, width=16, num_frames=33, output_type="latent"
)  # fmt: skip  (9 latent frames: chunks at 0, 3, 6)


def test_first_chunk_timesteps_run_on_the_first_chunk_only():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    calls, handle = _count_forwards(pipe)
    first = [1000.0, 750.0, 500.0, 250.0]
    out = pipe(**T2V, timesteps=[1000.0, 500.0], first_chunk_timesteps=first, generator=_seed(0)).frames
    assert _per_chunk(calls) == {0: first, 3: [1000.0, 500.0], 6: [1000.0, 500.0]}
    assert [start for start, store, _ in calls if store] == [0, 3]  # the last chunk's cache pass only when kept

    calls.clear()  # stored as the pipeline's default (the converter writes it) when the call names no schedule
    pipe.register_to_config(timesteps=[1000.0, 500.0], first_chunk_timesteps=first)
    assert torch.equal(pipe(**T2V, generator=_seed(0)).frames, out)
    assert [len(steps) for steps in _per_chunk(calls).values()] == [4, 2, 2]
    calls.clear()
    pipe(**T2V, num_inference_steps=3)  # a schedule named by the call replaces both stored ones
    assert [len(steps) for steps in _per_chunk(calls).values()] == [3, 3, 3]
    calls.clear()
    pipe(**T2V, first_chunk_timesteps=[1000.0])
    assert [len(steps) for steps in _per_chunk(calls).values()] == [1, 2, 2]

    calls.clear()  # a kept rollout: its continuation runs `timesteps`, a redo of chunk 0 its own timesteps again
    kept = pipe(**{**T2V, "num_frames": 9}, keep_cache=True, generator=_seed(1)).frames
    pipe.continue_rollout(12, generator=_seed(2), output_type="latent")
    pipe.redo_last_chunk(generator=_seed(2), output_type="latent")
    pipe.discard_rollout()
    pipe(**{**T2V, "num_frames": 9}, keep_cache=True, generator=_seed(1))
    redone = pipe.redo_last_chunk(generator=_seed(1), output_type="latent").frames
    assert torch.equal(redone, kept)  # chunk 0 regenerated on its own schedule with the same seed
    assert _per_chunk(calls) == {0: first * 3, 3: [1000.0, 500.0] * 2}
    pipe.discard_rollout()
    handle.remove()
    with pytest.raises(ValueError, match="first_chunk_timesteps"):
        pipe(**T2V, first_chunk_timesteps=[500.0, 900.0])


def test_stored_window_settings_are_defaults_that_calls_override():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    call = {**T2V, "num_frames": 61, "num_inference_steps": 1}  # 16 latent frames
    explicit = pipe(**call, attention_window=7, sink_frames=3, generator=_seed(0)).frames
    plain = pipe(**call, generator=_seed(0)).frames
    pipe.register_to_config(attention_window=7, sink_frames=3)
    assert torch.equal(pipe(**call, generator=_seed(0)).frames, explicit)
    engine = pipe.transformer.kv_cache_engines["main"]
    assert (engine.window_frames, engine.sink_frames) == (7, 3)
    wider = pipe(**call, attention_window=16, sink_frames=0, generator=_seed(0)).frames
    assert torch.equal(wider, plain)  # a window holding every frame attends like no window
    pipe.register_to_config(attention_window=None, sink_frames=0)


# ---------------------------------------------------------------------------------------------- the window rule
def test_the_pipeline_and_the_engines_accept_the_same_chunk_layouts():
    """The drifted case ([0, 3) with sink 3 and window 4) and every small layout: the pipeline's check (the call's
    cache settings) and both engines' call checks agree."""
    model = make_pipeline("t2v-student").transformer
    for window in range(1, 7):
        for sink in range(window):
            for first in range(1, 5):
                for size in range(1, 4):
                    bounds = [(0, first), (first, first + size)]
                    try:
                        CacheSettings(attention_window=window, sink_frames=sink).check_chunks(bounds)
                        pipeline_accepts = True
                    except ValueError:
                        pipeline_accepts = False
                    for engine in (StaticKVCacheEngine(window_frames=window, sink_frames=sink),
                                   VanillaKVCacheEngine(window_frames=window, sink_frames=sink)):  # fmt: skip
                        engine_accepts = True
                        try:
                            engine.window.check_chunks(bounds)
                        except ValueError:
                            engine_accepts = False
                        assert engine_accepts == pipeline_accepts, (window, sink, bounds)
    CacheSettings(attention_window=4, sink_frames=3).check_chunks([(0, 3)])  # the drifted case is accepted
    del model


# ------------------------------------------------------------------------------------------- flat memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_200_chunk_windowed_stream_keeps_memory_flat():
    pipe = tiny_pipeline(num_layers=1)
    pipe.set_progress_bar_config(disable=True)
    num_chunks = 200
    call = dict(
        prompt_embeds=torch.randn(1, 8, 32, generator=_seed(0)),
        height=64,
        width=64,  # 8x8 latents: a chunk kept by mistake (latents + cache input) would hold 24 KiB
        num_frames=4 * (3 * num_chunks) - 3,
        num_inference_steps=1,
        attention_window=6,
        sink_frames=3,
        output_type="latent",
    )
    rss = {}
    for chunk in pipe.stream(**call, generator=_seed(0)):
        if chunk.chunk_index in (49, num_chunks - 1):
            rss[chunk.chunk_index] = _rss_bytes()
    growth = rss[num_chunks - 1] - rss[49]
    assert growth < 2**20, f"RSS grew by {growth / 2**20:.2f} MiB over 150 chunks"

    # The same rollout, looking into its session: it holds no chunk tensor, the cache stops growing.
    run = pipe.prepare_rollout(RolloutOptions(**call, generator=_seed(0)))
    held, cache_bytes, indices = [], [], []
    for chunk in run.chunks():
        indices.append(chunk.chunk_index)
        held.append(sum(t.numel() * t.element_size() for t in run.session.held_tensors()))
        cache_bytes.append(pipe.transformer.kv_cache_bytes())
    assert indices == list(range(num_chunks))
    assert max(held) == 0 and run.session.chunks == []
    assert len(set(cache_bytes[2:-1])) == 1  # constant once the window is full (the last chunk stores nothing)


# ------------------------------------------------------------------------------------------------ policies
def test_call_stream_continue_and_redo_all_run_the_selected_policy():
    from fastgen_diffusers.pipelines import SequentialPolicy, WanCausalPipeline
    from fastgen_diffusers.testing import tiny_components

    class RecordingPolicy(SequentialPolicy):
        def __init__(self):
            self.runs = []

        def run(self, pipe, session, plan, source, **kwargs):
            self.runs.append([span.index for span in plan.spans])
            yield from super().run(pipe, session, plan, source, **kwargs)

    policy = RecordingPolicy()

    class Pipeline(WanCausalPipeline):
        default_policy = policy

    pipe = Pipeline(**tiny_components())
    pipe.set_progress_bar_config(disable=True)
    reference = tiny_pipeline()
    reference.set_progress_bar_config(disable=True)
    call = {**T2V, "num_inference_steps": 1}
    assert torch.equal(pipe(**call, generator=_seed(0)).frames, reference(**call, generator=_seed(0)).frames)
    list(pipe.stream(**call, keep_cache=True))
    pipe.continue_rollout(4, output_type="latent")
    pipe.redo_last_chunk(output_type="latent")
    assert policy.runs == [[0, 1, 2], [0, 1, 2], [3], [3]]
    pipe.discard_rollout()
