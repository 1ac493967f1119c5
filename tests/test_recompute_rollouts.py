"""Krea's recompute policy with the re-encoded anchor in the live rollout API: kept rollouts (keep_cache, continue,
redo, fork), ``stream()``, and video-to-video (`WanCausalVideoToVideoPipeline` with ``kv_cache_policy="recompute"``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgen_diffusers import WanCausalVideoToVideoPipeline
from fastgen_diffusers.testing import tiny_pipeline

RECOMPUTE = {"kv_cache_policy": "recompute", "context_frames": 3}
CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def noise(frames: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 16, frames, 2, 2, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bias", [None, 0.3])
def test_keep_and_continue_equals_one_longer_call(pipe, bias):
    """Two chunks kept, then two continued (the anchor of chunk 2 re-encodes frame 12, decoded by the first call):
    the latents and the frames of one 4-chunk call, exactly."""
    options = {**CALL, **RECOMPUTE, "kv_cache_attention_bias": bias}
    z = noise(12)
    whole = pipe(num_frames=45, latents=z, generator=torch.Generator().manual_seed(0), output_type="pt", **options)
    long_latents = pipe(
        num_frames=45, latents=z, generator=torch.Generator().manual_seed(0), output_type="latent", **options
    ).frames
    generator = torch.Generator().manual_seed(0)
    pipe(num_frames=21, latents=z[:, :, :6], generator=generator, keep_cache=True, output_type="latent", **options)
    frames = pipe.continue_rollout(24, latents=z[:, :, 6:], generator=generator, output_type="pt").frames
    assert torch.equal(pipe.kept_rollout().latents, long_latents)
    assert torch.equal(frames, whole.frames)
    pipe.discard_rollout()


def test_redo_and_fork_under_recompute(pipe):
    """``redo_last_chunk`` rewinds the context frames (and the decoder) by one chunk: the same inputs give the same
    chunk; a fork continues exactly like its source."""
    z = noise(15)
    pipe(num_frames=33, latents=z[:, :, :9], keep_cache=True, output_type="latent", **CALL, **RECOMPUTE)
    pipe.continue_rollout(12, latents=z[:, :, 9:12], generator=torch.Generator().manual_seed(5), output_type="latent")
    made = pipe.kept_rollout().latents
    redone = pipe.redo_last_chunk(latents=z[:, :, 9:12], generator=torch.Generator().manual_seed(5))
    assert torch.equal(pipe.kept_rollout().latents, made) and redone.frames.shape[1] == 45
    other = pipe.redo_last_chunk(latents=z[:, :, 9:12], generator=torch.Generator().manual_seed(6))
    assert not np.array_equal(other.frames, redone.frames)
    pipe.fork_rollout("b")
    results = []
    for branch in ("main", "b"):
        pipe.continue_rollout(
            12, latents=z[:, :, 12:], generator=torch.Generator().manual_seed(7), branch=branch, output_type="latent"
        )
        results.append(pipe.kept_rollout(branch).latents)
    assert torch.equal(results[0], results[1])
    pipe.discard_rollout()


def test_continue_refuses_recache_under_recompute(pipe):
    pipe(num_frames=21, keep_cache=True, output_type="latent", **CALL, **RECOMPUTE)
    with pytest.raises(ValueError, match="recache"):
        pipe.continue_rollout(12, prompt="a dog", recache=True)
    pipe.discard_rollout()


def test_stream_with_the_reencoded_anchor_equals_the_call(pipe):
    options = {**CALL, **RECOMPUTE, "num_frames": 45, "kv_cache_attention_bias": 0.5}
    chunks = list(pipe.stream(generator=torch.Generator().manual_seed(0), **options))
    called = pipe(generator=torch.Generator().manual_seed(0), **options).frames
    assert [c.frame_start for c in chunks] == [0, 9, 21, 33]
    assert all(c.pixels is None for c in chunks)  # the decoded tensors are not handed out twice
    assert np.array_equal(np.concatenate([c.frames for c in chunks], axis=1), called)
    keep = pipe(generator=torch.Generator().manual_seed(0), keep_first_frame=True, **options).frames
    assert np.array_equal(keep[:, :21], called[:, :21]) and not np.array_equal(keep, called)


@pytest.mark.parametrize(("num_frames", "decoded"), [(21, []), (45, [3, 3, 3]), (57, [3, 3, 3, 3])])
def test_latent_output_decodes_only_the_chunks_a_reencode_reads(pipe, num_frames, decoded):
    """With ``output_type="latent"`` (and no kept rollout) a chunk is decoded only when a later re-encode reads its
    frames: none in 2 chunks (the anchor never leaves the context), not the last one otherwise (before: every chunk).
    The latents equal those of a run that outputs frames (which decodes every chunk)."""
    from fastgen_diffusers.pipelines.video_io import streaming_decode

    options = {**CALL, **RECOMPUTE, "num_frames": num_frames}
    expected = [c.latents for c in pipe.stream(generator=torch.Generator().manual_seed(0), **options)]
    decodes, decode = [], streaming_decode.StreamingWanDecoder.decode

    def counting(self, z):
        decodes.append(z.shape[2])
        return decode(self, z)

    streaming_decode.StreamingWanDecoder.decode = counting
    try:
        latents = pipe(generator=torch.Generator().manual_seed(0), **{**options, "output_type": "latent"}).frames
        assert decodes == decoded
        decodes.clear()
        pipe(generator=torch.Generator().manual_seed(0), keep_cache=True, **{**options, "output_type": "latent"})
        assert decodes == [3] * len(expected)  # a kept rollout decodes every chunk: a continuation re-encodes
    finally:
        streaming_decode.StreamingWanDecoder.decode = decode
        pipe.discard_rollout()
    assert torch.equal(latents, torch.cat(expected, dim=2))


# ---------------------------------------------------------------------------------------------- video-to-video
def clip(num_frames: int = 45) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.random((16, 16, 3), dtype=np.float32) for _ in range(num_frames)]


@pytest.fixture(scope="module")
def v2v(pipe):
    v2v = WanCausalVideoToVideoPipeline.from_pipe(pipe)
    v2v.set_progress_bar_config(disable=True)
    return v2v


@pytest.mark.parametrize("bias", [None, 0.3])
def test_v2v_recompute_iterator_equals_list_and_stays_bounded(v2v, bias):
    frames = clip()
    options = {"prompt": "a cat", "strength": 0.7, "num_inference_steps": 2, "output_type": "latent"}
    options |= {**RECOMPUTE, "kv_cache_attention_bias": bias}
    starts, forward = [], v2v.transformer.forward

    def recording(hidden_states, *args, **kw):
        starts.append(kw["start_frame"] + hidden_states.shape[2])
        return forward(hidden_states, *args, **kw)

    v2v.transformer.forward = recording
    try:
        listed = v2v(video=frames, generator=torch.Generator().manual_seed(0), **options).frames
    finally:
        del v2v.transformer.forward
    assert max(starts) <= 3 + 3  # RoPE positions below context + chunk
    streamed = [
        c.latents for c in v2v.stream(video=iter(frames), generator=torch.Generator().manual_seed(0), **options)
    ]
    assert torch.equal(torch.cat(streamed, 2), listed)
    sequential = v2v(video=frames, generator=torch.Generator().manual_seed(0), **{**options, "kv_cache_policy": None,
                     "context_frames": None, "kv_cache_attention_bias": None}).frames  # fmt: skip
    assert not torch.equal(sequential[:, :, 6:], listed[:, :, 6:])


def test_v2v_recompute_frames_are_decoded_once(v2v):
    options = {"prompt": "a cat", "strength": 0.7, "num_inference_steps": 2, "output_type": "pt", **RECOMPUTE}
    frames = v2v(video=clip(), generator=torch.Generator().manual_seed(0), **options).frames
    latents = v2v(video=clip(), generator=torch.Generator().manual_seed(0), **{**options, "output_type": "latent"})
    latents = latents.frames
    assert torch.equal(frames, v2v.decode_latents(latents, output_type="pt"))
    streamed = [
        c.frames for c in v2v.stream(video=iter(clip()), generator=torch.Generator().manual_seed(0), **options)
    ]
    assert torch.equal(torch.cat(streamed, 1), frames)


def test_v2v_sequential_rollout_takes_the_attention_bias(v2v):
    """The bias is defined under any policy: a plain (windowed) V2V rollout biases its denoising forwards; bias 1
    equals no bias exactly."""
    options = {"prompt": "a cat", "strength": 0.7, "num_inference_steps": 2, "output_type": "latent"}
    options |= {"attention_window": 6, "sink_frames": 1}

    def run(bias):
        return v2v(video=clip(), generator=torch.Generator().manual_seed(0), kv_cache_attention_bias=bias, **options)

    plain, off, biased = run(None).frames, run(1.0).frames, run(0.3).frames
    assert torch.equal(plain, off)
    assert torch.equal(plain[:, :, :3], biased[:, :, :3])  # the first chunk has no cached key to bias
    assert not torch.allclose(plain[:, :, 3:], biased[:, :, 3:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_policy": "recompute"}, "context_frames"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "attention_window": 6}, "attention_window"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "recache": True}, "recache"),
        ({"keep_first_frame": True}, "keep_first_frame"),
        ({"kv_cache_attention_bias": 2.0}, "kv_cache_attention_bias"),
        ({"prompt_transition_chunks": -2}, "prompt_transition_chunks"),
    ],
)
def test_v2v_bad_recompute_arguments_raise(v2v, kwargs, message):
    with pytest.raises(ValueError, match=message):
        v2v("a cat", video=clip(9), **kwargs)


def test_recompute_outgrows_the_rope_table():
    """Positions stay below context + chunk: a recompute video (and its continuation) may be longer than the RoPE
    table, which the sequential rollout refuses."""
    small = tiny_pipeline(rope_max_seq_len=8)
    small.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        small(num_frames=45, output_type="latent", **CALL)
    small(num_frames=45, keep_cache=True, output_type="latent", **CALL, **RECOMPUTE)
    assert small.continue_rollout(12, output_type="latent").frames.shape[2] == 15


def test_the_rebuild_keeps_the_cross_kv(pipe, monkeypatch):
    """Each rebuild drops the self-attention K/V only: the text K/V are projected once per rollout (by the first
    rebuild's cache pass), however many chunks follow, and a prompt switch projects them once more."""
    from fastgen_diffusers.processors import WanCausalCrossAttnProcessor

    projections = []
    project = WanCausalCrossAttnProcessor._project_context
    monkeypatch.setattr(
        WanCausalCrossAttnProcessor,
        "_project_context",
        staticmethod(lambda *args: projections.append(1) or project(*args)),
    )

    def count(num_frames, prompt="a cat"):
        projections.clear()
        pipe(**{**CALL, "prompt": prompt}, num_frames=num_frames, output_type="latent", **RECOMPUTE)
        return len(projections)

    blocks = pipe.transformer.config.num_layers
    steps = CALL["num_inference_steps"]
    # chunk 0 computes its K/V in each denoising forward (nothing stored yet); the first rebuild fills them once
    assert count(21) == count(45) == blocks * (steps + 1)
    assert count(45, prompt={0: "a cat", 21: "a dog"}) == blocks * (steps + 2)
