"""Compiled rollouts: the causal blocks compile with ``fullgraph=True`` and reuse a few graphs for every chunk.

The inductor test compiles the repeated block once (three graphs: cross-attention computing, filling and reading its
K/V) and checks a 7-chunk rollout, then a 15-chunk windowed rollout whose ring wraps several times, against eager,
with no new graph after the first chunk. The other checks trace with dynamo only (``backend="eager"``), which is
where graph breaks, guards and recompiles are decided, and keeps the file well under a minute.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import block_self_inputs, make_causal_transformer
from torch._dynamo.utils import counters

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine

CHUNK = 3
FRAMES = 7 * CHUNK  # 7 chunks


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 16, 15 * CHUNK, 4, 6, generator=gen)  # 6 tokens per frame, up to 15 chunks
    timesteps = torch.tensor([1000.0, 750.0, 0.0])
    return latents, timesteps, torch.randn(1, 8, 32, generator=gen)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@torch.no_grad()
def rollout(model, inputs, engine, num_chunks, on_chunk=None):
    """Two denoising calls and a store call per chunk; the outputs of every call, concatenated over frames."""
    latents, timesteps, text = inputs
    model.set_kv_cache_engines({"main": engine})
    outputs = []
    for index in range(num_chunks):
        start = index * CHUNK
        chunk = latents[:, :, start : start + CHUNK]
        for step, t in enumerate(timesteps):
            outputs.append(model(chunk, t[None], text, start_frame=start, store_kv=step == 2, return_dict=False)[0])
        if on_chunk is not None:
            on_chunk(index)
    return torch.cat(outputs, dim=2)


def graph_count() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_rollout_equals_eager_with_the_same_graphs_for_every_chunk_and_window(inputs):
    model = make_causal_transformer(chunk_size=CHUNK)
    eager = rollout(model, inputs, StaticKVCacheEngine(FRAMES), 7)
    window = {"window_frames": FRAMES, "sink_frames": 3}  # the ring of 21 slots wraps twice in 45 frames
    eager_windowed = rollout(model, inputs, StaticKVCacheEngine(FRAMES, **window), 15)

    model.compile_repeated_blocks(fullgraph=True)
    graphs = []
    compiled = rollout(model, inputs, StaticKVCacheEngine(FRAMES), 7, lambda index: graphs.append(graph_count()))
    assert (compiled - eager).abs().max() <= 1e-4
    # chunk 0 computes, then fills, the cross K/V; chunk 1 reads them: three graphs, then none new
    assert graphs[1] == graphs[-1] == 3
    assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"]

    compiled_windowed = rollout(model, inputs, StaticKVCacheEngine(FRAMES, **window), 15)
    assert (compiled_windowed - eager_windowed).abs().max() <= 1e-4
    assert graph_count() == graphs[-1]  # 15 windowed chunks: no graph more than after 7 chunks
    assert not counters["recompiles"]


def test_window_rope_and_ema_sink_compile_with_the_same_graphs_for_every_window_position(inputs):
    """Keys stored before RoPE and rotated at read time (one rotation per buffer slot, read up to the dynamic valid
    length) and the EMA sink (applied before the blocks run): ``fullgraph=True``, one set of graphs while the ring
    wraps, equal to eager. Dynamo only (``backend="eager"``); inductor was checked by hand (7e-7 over 15 chunks)."""
    model = make_causal_transformer(chunk_size=CHUNK)
    options = {**REWARD_CACHE, "sink_decay": 0.9}
    eager = rollout(model, inputs, StaticKVCacheEngine(FRAMES, **options), 15)
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    graphs = []
    compiled = rollout(
        model, inputs, StaticKVCacheEngine(FRAMES, **options), 15, lambda index: graphs.append(graph_count())
    )
    assert (compiled - eager).abs().max() <= 1e-5
    assert graphs[1] == graphs[-1] == 3
    assert not counters["recompiles"] and not counters["graph_break"]


def block_calls(model, inputs, engine, num_chunks=2):
    """The ``(args, kwargs)`` block 0 was called with in every forward of an eager rollout."""
    calls = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(args))
    try:
        rollout(model, inputs, engine, num_chunks)
    finally:
        handle.remove()
    return calls


REWARD_CACHE = {"window_frames": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"}


@pytest.mark.parametrize(
    "engine_kind", ["static", "vanilla", "static_windowed", "static_window_rope", "vanilla_window_rope"]
)
def test_one_block_traces_as_one_graph_in_store_and_read_paths(inputs, engine_kind):
    engine = {
        "static": lambda: StaticKVCacheEngine(FRAMES),
        "vanilla": VanillaKVCacheEngine,
        "static_windowed": lambda: StaticKVCacheEngine(window_frames=6, sink_frames=3),
        "static_window_rope": lambda: StaticKVCacheEngine(**REWARD_CACHE),
        "vanilla_window_rope": lambda: VanillaKVCacheEngine(**REWARD_CACHE),
    }[engine_kind]()
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=1)
    calls = block_calls(model, inputs, engine, num_chunks=3)
    assert len(calls) == 9
    # read (step 0: cross K/V computed; chunk 1: read) and store (chunk 0: cross fill; chunk 1: read) calls
    for args in (calls[0], calls[2], calls[3], calls[5]):
        # a gathered prefix is dropped after its block ran; gather it again
        block_self_inputs(model.blocks[0], args).load()
        explanation = torch._dynamo.explain(model.blocks[0])(*args)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        ops = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
        syncs = {"item", "tolist", "nonzero", "<built-in method nonzero of type object>"}
        assert not ops & syncs and not [op for op in ops if "_local_scalar_dense" in op]  # no host sync


def test_static_block_reads_fixed_shapes_for_every_chunk(inputs):
    """Every chunk of a static rollout hands attention the same buffer shapes; the valid length is a dynamic-marked
    tensor size (no Python-int size that changes per chunk)."""
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=1)
    calls = block_calls(model, inputs, StaticKVCacheEngine(FRAMES), num_chunks=4)
    shapes = set()
    for args in calls:
        self_attn = block_self_inputs(model.blocks[0], args)
        assert self_attn.static
        shapes.add((self_attn.key_cache.shape, self_attn.write_index.shape))
        assert 0 in getattr(self_attn.valid_length, "_dynamo_weak_dynamic_indices", set())
    assert len(shapes) == 1


@pytest.mark.parametrize("engine_kind", ["static", "vanilla"])
def test_torch_compile_of_the_whole_transformer_matches_eager_without_recompiles(inputs, engine_kind):
    """``torch.compile(transformer)``: the per-call Python (checks, engines, stores) runs outside the graphs."""
    engine = (lambda: StaticKVCacheEngine(FRAMES)) if engine_kind == "static" else VanillaKVCacheEngine
    model = make_causal_transformer(chunk_size=CHUNK)
    eager = rollout(model, inputs, engine(), 7)
    compiled_model = torch.compile(model, backend="eager")
    graphs = []
    compiled = rollout(compiled_model, inputs, engine(), 7, lambda index: graphs.append(graph_count()))
    assert (compiled - eager).abs().max() <= 1e-5
    assert graphs[2] == graphs[-1]  # nothing new after the third chunk (vanilla: the prefix length turns dynamic)
    # vanilla: each block's prefix is gathered just before it runs, outside the graph (one break per block)
    assert graphs[-1] <= (6 if engine_kind == "static" else 12)


def tiny_t2v():
    from fastgen_diffusers.testing import tiny_pipeline

    return tiny_pipeline()


def tiny_i2v():
    from test_pipeline_i2v import make_pipeline

    return make_pipeline("wan2.1-i2v")


def tiny_vace():
    from fastgen_diffusers.testing import tiny_vace_pipeline

    return tiny_vace_pipeline()


def random_frames(count: int, size: int):
    import numpy as np
    import PIL.Image

    rng = np.random.default_rng(0)
    return [PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


T2V = {"height": 32, "width": 32, "num_frames": 41, "num_inference_steps": 2, "output_type": "latent"}
PIPELINE_CASES = {
    "t2v-cfg-prompt-switch": (tiny_t2v, {**T2V, "prompt": {0: "a cat", 20: "a dog"}, "guidance_scale": 2.0}),
    "t2v-cfg-switch-window": (
        tiny_t2v,
        {**T2V, "prompt": {0: "a cat", 20: "a dog"}, "guidance_scale": 2.0, "attention_window": 6, "sink_frames": 1},
    ),
    "t2v-window": (tiny_t2v, {**T2V, "prompt": "a cat", "num_frames": 61, "attention_window": 6, "sink_frames": 1}),
    "t2v-stream": (tiny_t2v, {**T2V, "prompt": "a cat"}),
    "i2v": (tiny_i2v, {**T2V, "num_frames": 13, "prompt": "a cat", "max_sequence_length": 16}),
    "vace": (tiny_vace, {**T2V, "height": 16, "width": 16, "num_frames": 29, "prompt": "a cat"}),
}


@pytest.mark.parametrize(
    ("case", "how"),
    [(case, "blocks") for case in sorted(PIPELINE_CASES) if case != "t2v-cfg-switch-window"]
    + [("t2v-cfg-switch-window", "whole")],  # tracing the whole forward is slow: one case gathers CFG, switch, window
)
def test_compiled_pipelines_match_eager(case, how):
    """T2V (CFG, prompt switch, window, stream), I2V and VACE under ``compile_repeated_blocks(fullgraph=True)`` and
    ``torch.compile(transformer)``: the eager latents, no graph break inside a block, nothing recompiled on a second
    call. Dynamo only (``backend="eager"``): inductor is covered by the rollout test above."""
    make, kwargs = PIPELINE_CASES[case]
    pipe = make()
    pipe.set_progress_bar_config(disable=True)
    if case == "i2v":
        kwargs = {**kwargs, "image": random_frames(1, 32)[0]}
    if case == "vace":
        kwargs = {**kwargs, "video": random_frames(29, 16)}

    def run():
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            if case == "t2v-stream":
                return torch.cat([chunk.latents for chunk in pipe.stream(**kwargs, generator=generator)], dim=2)
            return pipe(**kwargs, generator=generator).frames

    eager = run()
    if how == "blocks":
        pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    else:
        pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    compiled = run()
    graphs = graph_count()
    again = run()
    assert (compiled - eager).abs().max() <= 1e-4 and (again - eager).abs().max() <= 1e-4
    assert graph_count() == graphs and not counters["recompiles"]
    breaks = [reason for reason in counters["graph_break"] if "torch.compiler.disable" not in reason]
    assert not breaks  # whole model: only the per-call Python (begin / end of a forward) runs outside the graphs
