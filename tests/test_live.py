"""Live generation: prompt switches (with and without recache), rewind / redo, fork, and the engine operations."""

from __future__ import annotations

import pytest
import torch

from fastgen_diffusers.testing import tiny_pipeline

CALL = {"height": 16, "width": 16, "num_frames": 33, "num_inference_steps": 2, "output_type": "latent"}
# 9 latent frames in chunks of 3, starting at pixel frames 0, 9 and 21.


def _embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(seed))


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def cat(pipe):
    return pipe(prompt_embeds=_embeds(1), generator=_seed(0), **CALL).frames


def test_prompt_switch_keeps_earlier_chunks_and_changes_later_ones(pipe, cat):
    switched = pipe(prompt_embeds={0: _embeds(1), 9: _embeds(2)}, generator=_seed(0), **CALL).frames
    assert torch.equal(switched[:, :, :3], cat[:, :, :3])
    assert not torch.allclose(switched[:, :, 3:6], cat[:, :, 3:6])
    assert not torch.allclose(switched[:, :, 6:], cat[:, :, 6:])
    # A switch inside a chunk takes effect at the next chunk boundary (frame 10 -> the chunk starting at 21).
    late = pipe(prompt_embeds={0: _embeds(1), 10: _embeds(2)}, generator=_seed(0), **CALL).frames
    assert torch.equal(late[:, :, :6], cat[:, :, :6]) and not torch.allclose(late[:, :, 6:], cat[:, :, 6:])


def test_recache_changes_the_chunk_after_the_switch(pipe, cat):
    schedule = {0: _embeds(1), 9: _embeds(2)}
    plain = pipe(prompt_embeds=schedule, generator=_seed(0), **CALL).frames
    recached = pipe(prompt_embeds=schedule, recache=True, generator=_seed(0), **CALL).frames
    assert torch.equal(recached[:, :, :3], cat[:, :, :3])
    assert not torch.allclose(recached[:, :, 3:6], plain[:, :, 3:6])


@pytest.mark.parametrize("recache", [False, True])
def test_a_live_switch_equals_the_scheduled_switch_recache_included(pipe, recache):
    """``RolloutRun.switch_prompt`` while the stream runs (the server's live prompt change) recaches exactly as a
    scheduled switch: a run with ``recache=True`` keeps the history a recache needs from its start."""
    scheduled = pipe(prompt_embeds={0: _embeds(1), 9: _embeds(2)}, recache=recache, generator=_seed(0), **CALL).frames
    options = pipe.stream_options(prompt_embeds=_embeds(1), recache=recache, generator=_seed(0), **CALL)
    run = pipe.prepare_rollout(options)
    chunks = []
    for chunk in pipe.stream_run(run):
        chunks.append(chunk.latents)
        if len(chunks) == 1:
            run.switch_prompt(1, _embeds(2))
    assert torch.equal(torch.cat(chunks, dim=2), scheduled)


def test_streamed_prompt_switch_equals_call(pipe):
    kwargs = {**CALL, "prompt": {0: "a cat", 9: "a dog"}, "recache": True}
    streamed = torch.cat([c.latents for c in pipe.stream(generator=_seed(0), **kwargs)], dim=2)
    assert torch.equal(streamed, pipe(generator=_seed(0), **kwargs).frames)


def test_prompt_schedule_errors(pipe):
    with pytest.raises(ValueError, match="0 included"):
        pipe(prompt={9: "a dog"}, **CALL)
    with pytest.raises(ValueError, match="past the last chunk"):
        pipe(prompt={0: "a cat", 30: "a dog"}, **CALL)
    with pytest.raises(ValueError, match="same chunk"):
        pipe(prompt={0: "a cat", 10: "a dog", 20: "a fox"}, **CALL)


def test_redo_last_chunk_with_the_same_seed_gives_the_same_chunk(pipe, cat):
    kept = pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL).frames
    assert torch.equal(kept, cat) and pipe.rollout_branches == ["main"]
    longer = pipe.continue_rollout(12, generator=_seed(5), output_type="latent").frames
    assert longer.shape[2] == 12 and torch.equal(longer[:, :, :9], cat)
    again = pipe.redo_last_chunk(generator=_seed(5), output_type="latent").frames
    assert torch.equal(again, longer)
    other = pipe.redo_last_chunk(generator=_seed(6), output_type="latent").frames
    assert torch.equal(other[:, :, :9], cat) and not torch.allclose(other[:, :, 9:], longer[:, :, 9:])
    pipe.discard_rollout()
    assert pipe.rollout_branches == []


def test_fork_continues_like_the_original_and_diverges_with_other_inputs(pipe):
    pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL)
    pipe.fork_rollout("alt")
    main = pipe.continue_rollout(12, generator=_seed(7), output_type="latent").frames
    same = pipe.continue_rollout(12, generator=_seed(7), output_type="latent", branch="alt").frames
    assert torch.equal(main, same)
    pipe.redo_last_chunk(generator=_seed(7), output_type="latent", branch="alt")  # the fork rewinds on its own
    dog = pipe.redo_last_chunk(prompt_embeds=_embeds(2), generator=_seed(7), output_type="latent", branch="alt")
    assert torch.equal(dog.frames[:, :, :9], main[:, :, :9]) and not torch.allclose(
        dog.frames[:, :, 9:], main[:, :, 9:]
    )
    assert torch.equal(pipe.kept_rollout("main").latents, main)  # the original branch is untouched
    pipe.discard_rollout()


def test_engine_rewind_and_copy_tag(pipe):
    pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL)
    engine = pipe.transformer.kv_cache_engines["main"]
    engine.copy_tag("pos", "copy")
    engine.rewind("pos", 3)
    assert engine.num_stored_frames("pos") == 6 and engine.num_stored_frames("copy") == 9
    with pytest.raises(ValueError, match="chunks start at"):
        engine.truncate("copy", 4)
    pipe.discard_rollout()
    assert engine.num_stored_frames("copy") == 0


def test_failed_continuation_keeps_its_branch_prefix_and_leaves_the_others(pipe):
    pipe(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **CALL)
    pipe.fork_rollout("alt")

    def fail(*args):
        raise RuntimeError("boom")

    hook = pipe.transformer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            pipe.continue_rollout(12, branch="alt")
    finally:
        hook.remove()
    assert pipe.rollout_branches == ["main", "alt"]
    assert pipe.transformer.kv_cache_engines["main"].num_stored_frames("alt/pos") == 9
    assert pipe.kept_rollout("alt").num_latent_frames == 9
    retried = pipe.continue_rollout(12, branch="alt", generator=_seed(3), output_type="latent").frames
    expected = pipe.continue_rollout(12, branch="main", generator=_seed(3), output_type="latent").frames
    torch.testing.assert_close(retried, expected, rtol=0, atol=0)
    pipe.discard_rollout()


def test_a_continuation_past_the_rope_table_raises_the_settings_message():
    """A continuation is held to the settings' RoPE-table rule (``check_rope_table``), with its message: 12 latent
    frames kept on a table of 12, three more refused before any work, the kept rollout left as it was."""
    small = tiny_pipeline(rope_max_seq_len=12)
    small.set_progress_bar_config(disable=True)
    small(prompt_embeds=_embeds(1), generator=_seed(0), keep_cache=True, **{**CALL, "num_frames": 45})
    kept = small.kept_rollout("main").num_latent_frames
    with pytest.raises(ValueError, match=r"15 latent frames run past the transformer's RoPE table of 12 frames"):
        small.continue_rollout(12, output_type="latent")
    assert small.kept_rollout("main").num_latent_frames == kept == 12
