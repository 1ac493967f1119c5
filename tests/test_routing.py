"""The spec's routing rule: each causal processor asks ``CausalContext.resolve_registered_engine`` for the engine that
owns the module it runs for and reads that engine's prepared inputs; compiled blocks keep one graph for every block."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import make_causal_transformer
from test_vace import TINY_VACE_CONFIG
from torch._dynamo.utils import counters

from fastgen_diffusers import CausalContext, StaticKVCacheEngine, WanCausalVACETransformer3DModel

CHUNK = 2


@pytest.fixture
def resolved(monkeypatch):
    """``(attn, engine)`` of every ``resolve_registered_engine`` call, in order."""
    calls = []
    resolve = CausalContext.resolve_registered_engine

    def spy(self, attn):
        engine = resolve(self, attn)
        calls.append((attn, engine))
        return engine

    monkeypatch.setattr(CausalContext, "resolve_registered_engine", spy)
    return calls


def text(seed=3):
    return torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(seed))


def latents(frames, seed=1, channels=16):
    return torch.randn(1, channels, frames, 4, 6, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("store_kv", [False, True])
def test_a_t2v_forward_resolves_each_attention_module_once(resolved, store_kv):
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=3)
    model(latents(2), torch.tensor([0.0]), text(), store_kv=True)  # something cached: the next call reads it
    resolved.clear()
    model(latents(2), torch.tensor([500.0]), text(), start_frame=2, store_kv=store_kv)
    modules = [module for block in model.blocks for module in (block.attn1, block.attn2)]
    assert [attn for attn, _ in resolved] == modules  # 2 per block, in order
    assert all(engine is model.kv_cache_engines["main"] for _, engine in resolved)


@torch.no_grad()
def test_a_vace_forward_routes_vace_blocks_to_vace_and_blocks_to_main(resolved):
    torch.manual_seed(0)
    model = WanCausalVACETransformer3DModel(**TINY_VACE_CONFIG, chunk_size=CHUNK).eval()
    control = latents(2, seed=2, channels=96)
    model(latents(2), torch.tensor([0.0]), text(), control_hidden_states=control, store_kv=True)
    engines = {id(engine): name for name, engine in model.kv_cache_engines.items()}
    expected = {id(attn): "vace" for block in model.vace_blocks for attn in (block.attn1, block.attn2)}
    expected |= {id(attn): "main" for block in model.blocks for attn in (block.attn1, block.attn2)}
    assert len(resolved) == len(expected) == 2 * (len(model.blocks) + len(model.vace_blocks))
    assert {id(attn): engines[id(engine)] for attn, engine in resolved} == expected


@torch.no_grad()
def test_a_module_no_engine_registered_is_the_clear_error_from_the_processor_lookup():
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=2)
    foreign = make_causal_transformer(seed=1, chunk_size=CHUNK, num_layers=2)
    views = []
    handle = model.blocks[1].register_forward_pre_hook(lambda module, args: views.append(args[-1]))
    model(latents(2), torch.tensor([0.0]), text())
    handle.remove()
    hidden = torch.zeros(1, 2 * 6, 64)
    with pytest.raises(RuntimeError, match="No KV-cache engine registered this WanAttention") as error:
        foreign.blocks[1].attn1(hidden, causal_context=views[0])
    assert "_block_inputs" in {entry.name for entry in error.traceback}  # raised from the processor's lookup
    with pytest.raises(RuntimeError, match="is block 0 of its engine, but runs with the view of block 1"):
        model.blocks[0].attn2(hidden, text(), causal_context=views[0])


@torch.no_grad()
def test_engine_ownership_follows_registration():
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=2)
    old = model.kv_cache_engines["main"]
    new = StaticKVCacheEngine(8)
    model.set_kv_cache_engines({"main": new})
    ctx = CausalContext(cache_engines={"old": old, "main": new})
    assert ctx.resolve_registered_engine(model.blocks[1].attn2) is new and not old.owns(model.blocks[1].attn2)


@torch.no_grad()
def test_compiled_blocks_resolve_at_trace_time_with_one_graph_for_every_block_and_no_recompile():
    """A 15-chunk windowed rollout (the ring wraps several times) under ``compile_repeated_blocks(fullgraph=True)``:
    no graph break, the graphs of a one-block model (one graph serves every block), no recompile, the eager outputs."""

    def run(num_layers, num_chunks, compiled):
        model = make_causal_transformer(chunk_size=CHUNK, num_layers=num_layers)
        model.set_kv_cache_engines({"main": StaticKVCacheEngine(window_frames=6, sink_frames=2)})
        if compiled:
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
        x, prompt, outputs, graphs = latents(num_chunks * CHUNK), text(), [], []
        for index in range(num_chunks):
            chunk = x[:, :, index * CHUNK : (index + 1) * CHUNK]
            for step, t in enumerate((1000.0, 0.0)):
                out = model(chunk, torch.tensor([t]), prompt, start_frame=index * CHUNK, store_kv=step == 1)
                outputs.append(out[0])
            graphs.append(counters["stats"]["unique_graphs"])
        return torch.cat(outputs, dim=2), graphs

    torch._dynamo.reset()
    counters.clear()
    try:
        _, one_block = run(num_layers=1, num_chunks=2, compiled=True)
        torch._dynamo.reset()
        counters.clear()
        compiled, graphs = run(num_layers=3, num_chunks=15, compiled=True)
        assert not counters["graph_break"] and not counters["recompiles"]
        assert graphs == [one_block[0]] + [one_block[1]] * 14  # the second chunk reads the cross cache: no new one
    finally:
        torch._dynamo.reset()
    eager, _ = run(num_layers=3, num_chunks=15, compiled=False)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
