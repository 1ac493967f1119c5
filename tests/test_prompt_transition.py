"""``prompt_transition_chunks=N``: a prompt switch blended in linearly over N chunks (Krea's / scope's prompt
interpolation), under the sequential and the recompute policies, in ``__call__``, ``stream`` and a continuation.

The embeddings the transformer actually receives (its conditional ``encoder_hidden_states``) are recorded per chunk
and compared with the documented blend ``lerp(old, new, (k + 1) / N)`` for the k-th chunk from the switch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import recorded_forwards

from fastgen_diffusers.pipelines.rollout.session import PromptTransition
from fastgen_diffusers.testing import TINY_TEXT_DIM, tiny_pipeline

# 45 pixel frames = 12 latent frames = 4 chunks of 3, starting at pixel frames 0, 9, 21, 33
CALL = {"height": 16, "width": 16, "num_frames": 45, "num_inference_steps": 2, "output_type": "latent"}
POLICIES = [{}, {"kv_cache_policy": "recompute", "context_frames": 3}]


def embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, TINY_TEXT_DIM, generator=torch.Generator().manual_seed(seed))


A, B, C = embeds(1), embeds(2), embeds(3)


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, schedule, stream=False, **kwargs):
    """Latents and the conditional embeddings of every denoising forward, by chunk start frame."""
    arguments = {**CALL, "prompt_embeds": schedule, "generator": torch.Generator().manual_seed(0), **kwargs}
    with recorded_forwards(pipe.transformer) as calls:
        if stream:
            latents = torch.cat([chunk.latents for chunk in pipe.stream(**arguments)], 2)
        else:
            latents = pipe(**arguments).frames
    used = [c.kwargs["encoder_hidden_states"] for c in calls if not c.kwargs["store_kv"]]
    steps = CALL["num_inference_steps"]
    return latents, [used[i] for i in range(0, len(used), steps)]  # one per chunk (every step uses the same)


def blend(old, new, weight):
    return torch.lerp(old.float(), new.float(), weight).to(new.dtype)


@pytest.mark.parametrize("policy", POLICIES, ids=["sequential", "recompute"])
def test_the_embeddings_used_per_chunk_are_the_documented_blend(pipe, policy):
    _, used = run(pipe, {0: A, 9: B}, prompt_transition_chunks=3, **policy)
    expected = [A, blend(A, B, 1 / 3), blend(A, B, 2 / 3), B]
    assert len(used) == 4
    for got, want in zip(used, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("policy", POLICIES, ids=["sequential", "recompute"])
def test_zero_and_one_are_the_hard_switch_exactly(pipe, policy):
    hard, used = run(pipe, {0: A, 9: B}, **policy)
    assert [torch.equal(u, e) for u, e in zip(used, [A, B, B, B])] == [True] * 4
    for n in (0, 1):
        latents, used_n = run(pipe, {0: A, 9: B}, prompt_transition_chunks=n, **policy)
        assert torch.equal(latents, hard)
    blended, _ = run(pipe, {0: A, 9: B}, prompt_transition_chunks=3, **policy)
    assert not torch.equal(blended[:, :, 3:], hard[:, :, 3:]) and torch.equal(blended[:, :, :3], hard[:, :, :3])


def test_a_switch_mid_transition_starts_from_the_blend_in_use(pipe):
    _, used = run(pipe, {0: A, 9: B, 21: C}, prompt_transition_chunks=3)
    first = blend(A, B, 1 / 3)
    for got, want in zip(used, [A, first, blend(first, C, 1 / 3), blend(first, C, 2 / 3)]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("policy", POLICIES, ids=["sequential", "recompute"])
def test_stream_equals_call_with_a_transition(pipe, policy):
    called, _ = run(pipe, {0: A, 9: B}, prompt_transition_chunks=2, **policy)
    streamed, _ = run(pipe, {0: A, 9: B}, stream=True, prompt_transition_chunks=2, **policy)
    assert torch.equal(called, streamed)


def test_sequential_recache_runs_at_every_blended_chunk(pipe):
    """Under the sequential policy with ``recache=True`` every chunk of the blend recaches the history under its
    blend (the documented cost: N recaches); the result differs from the blend without recache."""
    plain, _ = run(pipe, {0: A, 9: B}, prompt_transition_chunks=2)
    recached, _ = run(pipe, {0: A, 9: B}, prompt_transition_chunks=2, recache=True)
    assert torch.equal(plain[:, :, :3], recached[:, :, :3]) and not torch.equal(plain, recached)


@pytest.mark.parametrize("policy", POLICIES, ids=["sequential", "recompute"])
def test_a_continuation_blends_its_new_prompt(pipe, policy):
    """A kept rollout keeps its ``prompt_transition_chunks``: ``continue_rollout(prompt_embeds=...)`` blends too."""
    run(pipe, {0: A}, keep_cache=True, prompt_transition_chunks=2, **{**policy, "num_frames": 21})
    try:
        with recorded_forwards(pipe.transformer) as calls:
            pipe.continue_rollout(24, prompt_embeds=B, output_type="latent")
    finally:
        pipe.discard_rollout()
    used = [c.kwargs["encoder_hidden_states"] for c in calls if not c.kwargs["store_kv"]]
    chunks = used[:: CALL["num_inference_steps"]]
    assert [torch.equal(u, e) for u, e in zip(chunks, [blend(A, B, 0.5), B])] == [True, True]


def test_a_continuation_whose_prompt_cannot_be_blended_is_refused_before_any_forward(pipe):
    """A kept rollout with ``prompt_transition_chunks=2`` and a new prompt of another token count: the ``__call__``
    error before any forward, the rollout still kept and continuable."""
    run(pipe, {0: A}, keep_cache=True, prompt_transition_chunks=2, num_frames=21)
    try:
        with recorded_forwards(pipe.transformer) as calls:
            with pytest.raises(ValueError, match="`prompt_transition_chunks=2` blends prompt embeddings"):
                pipe.continue_rollout(12, prompt_embeds=embeds(4)[:, :5], output_type="latent")
        assert calls == []
        assert pipe.continue_rollout(12, prompt_embeds=B, output_type="latent").frames.shape[2] == 9
    finally:
        pipe.discard_rollout()


def test_transition_weights():
    transition = PromptTransition(A, B, first_chunk=2, num_chunks=4)
    assert [transition.weight_at(i) for i in range(2, 8)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert transition.embeds_at(5) is B


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_transition_chunks": -1}, "prompt_transition_chunks"),
        ({"prompt_transition_chunks": 1.5}, "prompt_transition_chunks"),
        ({"prompt_transition_chunks": True}, "prompt_transition_chunks"),
        ({"prompt_transition_chunks": 2, "prompt_embeds": {0: A, 9: embeds(4)[:, :5]}}, "prompt_transition_chunks"),
    ],
)
def test_bad_transition_arguments_raise_before_any_forward(pipe, kwargs, message):
    with recorded_forwards(pipe.transformer) as calls, pytest.raises(ValueError, match=message):
        pipe(**{**CALL, "prompt_embeds": {0: A, 9: B}, **kwargs})
    assert calls == []
