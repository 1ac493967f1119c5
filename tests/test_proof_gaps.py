"""Claims of issues #14 and #15 that other tests checked only indirectly, each checked against an independent number.

* Recompute (#14): after every chunk but the first, the cache holds exactly ``context_frames`` frames, i.e. the
  byte formula over ``context_frames`` frames (fewer only while fewer have been produced; not a size derived from
  the run itself), the engine's buffers never grow once the context exists, and every forward's RoPE positions
  stay below ``context_frames + chunk`` frames, over 20 chunks.
* 8-bit cache (#15): never silently on: a call without ``kv_cache_dtype`` builds engines that store the compute
  dtype, bit-equal to ``kv_cache_dtype=None``, and a converted model's config cannot carry it.
* EMA sink (#15): kept per tag (interleaved CFG tags equal each tag alone) and per block (each block's sink is the
  EMA of its own evicted K/V).
* LongLive's infinity mode (#15 §1): its positions rule, and a 1101-frame stream with a recached switch.
* Processors (#14, #15): they import no pipeline module and name no policy.
* Rolling Forcing with CFG (#15): supported, and equal to the unguided run when the negative prompt is the prompt.
"""

from __future__ import annotations

import pytest
import torch
from conftest import recorded_forwards

from fastgen_diffusers.kv_cache import expected_self_cache_bytes
from fastgen_diffusers.testing import tiny_pipeline

# 16x16 pixels: 2x2 latents, patch 2x2 -> 1 token per latent frame; tiny model: 2 layers, 2 heads of 32
CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_inference_steps": 1, "output_type": "latent"}
LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 32, 3


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("context_frames", [2, 3, 5])
def test_recompute_holds_exactly_the_context_after_any_number_of_chunks(pipe, kind, context_frames):
    chunks = 20
    num_frames = 4 * (CHUNK * chunks - 1) + 1
    held, frames_held, allocated = [], [], []
    with recorded_forwards(pipe.transformer) as calls:
        stream = pipe.stream(
            **CALL, num_frames=num_frames, kv_cache_engine=kind, kv_cache_policy="recompute",
            context_frames=context_frames, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        ends = []
        for record in stream:
            engine = pipe.transformer.kv_cache_engines["main"]
            ends.append(record.end)
            held.append(engine.self_cache_bytes())
            frames_held.append(engine.held_frames("pos") if record.end > CHUNK else None)
            allocated.append(engine.allocated_self_cache_bytes())
    positions = [c.kwargs["start_frame"] + c.hidden_states.shape[2] for c in calls]  # one past the last RoPE position
    assert ends == [CHUNK * (c + 1) for c in range(chunks)]
    # the context of chunk c: the last min(context_frames, 3c) frames produced (fewer only while fewer exist)
    context = [min(context_frames, CHUNK * c) for c in range(1, chunks)]
    assert held[0] == 0  # the first chunk stores nothing (no clean cache pass after a chunk)
    assert held[1:] == [expected_self_cache_bytes(LAYERS, 1, HEADS, n, HEAD_DIM, torch.float32) for n in context]
    assert frames_held[1:] == context and context[-1] == context_frames  # exactly context_frames once they exist
    assert len(set(held[2:])) == 1  # constant bytes from the second rebuild on, however many chunks
    assert len(set(allocated[2:])) == 1  # buffers never grow once the context exists, however many chunks
    assert max(positions) <= context_frames + CHUNK  # positions 0 .. context_frames + chunk - 1
    assert len(positions) == 1 + (chunks - 1) * 2  # per later chunk: one rebuild pass + one denoising step


def _stream(pipe, **kwargs):
    """33 frames: 9 latent frames, 3 chunks under window 6; the latents and, after the second chunk (6 frames held),
    the main engine's storage dtype, scale bytes and cache bytes."""
    chunks, seen = [], None
    call = {**CALL, "num_frames": 33, "attention_window": 6, "generator": torch.Generator().manual_seed(0)}
    for record in pipe.stream(**call, **kwargs):
        chunks.append(record.latents)
        if len(chunks) == 2:
            engine = pipe.transformer.kv_cache_engines["main"]
            seen = (engine.kv_cache_dtype, engine.self_cache_scale_bytes(), engine.self_cache_bytes())
    return torch.cat(chunks, 2), seen


def test_an_8bit_cache_is_never_on_unless_asked(pipe):
    default, seen = _stream(pipe)
    full = expected_self_cache_bytes(LAYERS, 1, HEADS, 6, HEAD_DIM, torch.float32)
    assert seen == (None, 0, full)  # compute dtype, no scales, the float32 formula over the 6 held frames
    off, seen_off = _stream(pipe, kv_cache_dtype=None)
    assert torch.equal(off, default) and seen_off == seen
    on, seen_on = _stream(pipe, kv_cache_dtype="int8")
    assert seen_on[0] == torch.int8 and seen_on[1] > 0 and seen_on[2] < full
    assert not torch.equal(on, default)  # the opt-in changes the numbers: the default is not quantized
    again, seen_again = _stream(pipe)  # nothing sticks from the previous call
    assert torch.equal(again, default) and seen_again == seen
    # a pipeline config (what `convert` writes) cannot switch it on: it is a call / CLI option only
    from fastgen_diffusers import WanCausalPipeline

    with pytest.raises(TypeError):
        WanCausalPipeline(**pipe.components, kv_cache_dtype="int8")


# ------------------------------------------------------------------------------ EMA sink: per tag, per block (#15 §2)
REWARD = {"window_frames": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema", "sink_decay": 0.5}


def _tagged_rollout(model, tags, num_chunks=6):
    """Per chunk and per tag (interleaved): a denoising call then the store, each tag on its own latents and text.
    Returns every output per tag and, per tag, block and chunk, the visible (sink + recent) K/V after the store."""
    gen = torch.Generator().manual_seed(5)
    data = {tag: (torch.randn(1, 16, CHUNK * num_chunks, 4, 6, generator=gen), torch.randn(1, 8, 32, generator=gen))
            for tag in ("pos", "neg")}  # fmt: skip
    outputs, prefixes = {tag: [] for tag in tags}, {tag: [] for tag in tags}
    engine = model.kv_cache_engines["main"]
    for chunk in range(num_chunks):
        start = CHUNK * chunk
        for tag in tags:
            latents, text = data[tag]
            x = latents[:, :, start : start + CHUNK]
            for t, store in ((1000.0, False), (0.0, True)):
                out = model(x, torch.tensor([t]), text, start_frame=start, cache_tag=tag, store_kv=store)
                outputs[tag].append(out[0] if isinstance(out, tuple) else out.sample)
            prefixes[tag].append(
                [tuple(p.clone() for p in engine.get_self_prefix(b, tag, start + CHUNK, CHUNK))
                 for b in range(engine.num_blocks)]
            )  # fmt: skip
    return outputs, prefixes


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_the_ema_sink_is_kept_per_tag_and_per_block(kind):
    from conftest import make_causal_transformer

    from fastgen_diffusers.kv_cache import make_engines

    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_kv_cache_engines(make_engines(model, kind, **REWARD))
    both, both_prefixes = _tagged_rollout(model, ("pos", "neg"))
    tokens = both_prefixes["pos"][0][0][0].shape[1] // CHUNK  # after chunk 0 the cache holds the sink: 3 frames
    for tag in ("pos", "neg"):  # interleaving the two tags changes nothing of either: their sinks do not mix
        model.set_kv_cache_engines(make_engines(model, kind, **REWARD))
        alone, _ = _tagged_rollout(model, (tag,))
        assert all(torch.equal(a, b) for a, b in zip(alone[tag], both[tag]))
    sink = slice(0, 3 * tokens)
    for tag in ("pos", "neg"):
        prefixes = both_prefixes[tag]
        for block in range(len(prefixes[0])):
            # chunk 3's store evicts frames 3..5 (seen after chunk 1 right behind the sink) into the sink
            for kv in (0, 1):
                before = prefixes[2][block][kv][:, sink]
                evicted = prefixes[1][block][kv][:, 3 * tokens : 6 * tokens]
                after = prefixes[3][block][kv][:, sink]
                assert torch.equal(prefixes[1][block][kv][:, sink], before)  # no eviction before chunk 3
                torch.testing.assert_close(after, 0.5 * before + 0.5 * evicted, rtol=0, atol=1e-6)
                assert (after - before).abs().max() > 1e-2
        # each block and each tag has its own sink
        assert not torch.allclose(prefixes[3][0][0][:, sink], prefixes[3][1][0][:, sink])
    assert not torch.allclose(both_prefixes["pos"][3][0][0][:, sink], both_prefixes["neg"][3][0][0][:, sink])


# ------------------------------------------------------------------ LongLive's infinity mode (#15 §1), by its rule
def test_longlive_infinity_positions_are_window_slots_with_a_fixed_sink():
    """LongLive's infinity mode (NVlabs/LongLive ``wan/modules/causal_model_infinity.py``, commit 7add41d:
    ``local_attn_size 12, sink_size 3``) keeps K before RoPE and rotates the cached keys by their slot ``0 .. n-1``;
    once the window is full its queries sit at ``local_attn_size - F .. local_attn_size - 1`` (9..11), before that at
    their own frame. ``rope_positions="window"`` with the default fixed sink gives exactly that."""
    from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine

    for engine_class in (StaticKVCacheEngine, VanillaKVCacheEngine):
        engine = engine_class(window_frames=12, sink_frames=3, rope_positions="window")
        assert engine.keys_before_rope
        for start in (0, 3, 6, 9, 12, 15, 300, 3000):
            positions = engine.key_positions("pos", start, CHUNK, CHUNK)
            visible = min(start + CHUNK, 12)
            assert positions.keys == tuple(range(visible))
            assert positions.queries == tuple(range(visible - CHUNK, visible))


def test_a_longlive_infinity_stream_with_a_recached_switch_runs_past_the_rope_table(pipe):
    """Window 12, sink 3, window-relative RoPE, fixed sink, a prompt switch with ``recache`` at latent frame 600:
    1101 latent frames (past the 1024-position table, re-basing off) in flat memory, positions never re-based, and the
    switch re-runs the window's chunks only."""
    assert pipe.transformer.config.rope_max_seq_len == 1024 and not pipe.transformer.rope_rebasing
    latent_frames = 1101
    forwards, held, offsets = [], [], set()
    handle = pipe.transformer.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        stream = pipe.stream(
            **{**CALL, "prompt": {0: "a cat", 4 * 600: "a dog"}}, num_frames=4 * (latent_frames - 1) + 1,
            attention_window=12, sink_frames=3, rope_positions="window", recache=True,
        )  # fmt: skip
        for _ in stream:
            engine = pipe.transformer.kv_cache_engines["main"]
            held.append(engine.self_cache_bytes())
            offsets.add(engine.rope_offset("pos"))
    finally:
        handle.remove()
    assert len(held) == latent_frames // CHUNK and offsets == {0}
    assert set(held[3:-1]) == {expected_self_cache_bytes(LAYERS, 1, HEADS, 12, HEAD_DIM, torch.float32)}
    # per chunk one denoising step and one store (the last chunk is not stored), plus the recache of the window's
    # 12 / 3 = 4 chunks at the switch (not the 200 chunks before it)
    assert len(forwards) == 2 * len(held) - 1 + 4


# ------------------------------------------------------------------ processors stay policy-agnostic (#14, #15)
def test_processors_never_name_a_policy_or_import_the_pipelines():
    """The attention processors ask the block's inputs (from the context and engine) what to attend to and with which
    bias: their module imports nothing of ``pipelines`` and names no policy, window rule or position mode."""
    import ast
    from pathlib import Path

    import fastgen_diffusers.processors as processors

    for path in Path(processors.__file__).parent.glob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                assert "pipelines" not in (node.module or ""), (path.name, node.module)
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("#", '"', "'")))
        for word in ("recompute", "rolling", "policy", "krea", "reward", "sink", "rope_positions", "ema", "anchor"):
            assert word not in code.lower().replace("schema", ""), (path.name, word)


# ------------------------------------------------------------------ rolling denoising with CFG (#15 §3, §Proof)
def test_rolling_with_guidance_is_supported_and_reduces_to_the_unguided_run(pipe):
    """Rolling Forcing under classifier-free guidance is supported (so there is nothing to refuse): with the negative
    prompt equal to the prompt the guided prediction ``neg + s (pos - neg)`` is ``pos`` and the run equals the
    unguided one exactly; another negative prompt changes it."""
    call = {**CALL, "num_frames": 57, "num_inference_steps": 4, "kv_cache_policy": "rolling"}  # 5 chunks of 3

    def latents(**kwargs):
        return pipe(**call, generator=torch.Generator().manual_seed(0), **kwargs).frames

    plain = latents()
    assert torch.equal(latents(guidance_scale=3.0, negative_prompt="a cat"), plain)
    assert (latents(guidance_scale=3.0, negative_prompt="blur") - plain).abs().max() > 1e-3
