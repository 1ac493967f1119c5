"""The KV-cache attention bias (issue #14, part 2) on every forward the engines serve, on both mask backends.

A denoising forward adds ``log(bias)`` to the scaled logits of the keys of frames ``1 <= f < s`` (``s``: the start of
the query's chunk): every cached key but the anchor (frame 0) and the query's own chunk. Each case below records the
attention inputs of a biased forward and compares the processor's output with ``softmax(Q K^T * scale + bias) V``
computed here in float64, with the key frames derived here from the window rule (the static engine's ring: slot of
frame ``f`` is ``S + (f - S) % (W - S)``), on the SDPA float-mask path and the FlexAttention ``score_mod`` path.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from conftest import block_self_inputs, make_causal_transformer
from torch._dynamo.utils import counters

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine
from fastgen_diffusers.processors import attention as attention_module

CHUNK, SEQLEN, BIAS = 2, 4, 0.3  # 2 frames a chunk, 2x2 tokens a frame after patching
TIMESTEPS = (1000.0, 500.0)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(1, 16, 16, 4, 4, generator=gen), torch.randn(1, 8, 32, generator=gen)


def rollout_to(model, data, engine, start, bias=BIAS):
    """Chunks ``[0, start)`` chunk by chunk (a biased denoising call, then the store), the model set to ``engine``."""
    latents, text = data
    model.set_kv_cache_engines({"main": engine})
    for first in range(0, start, CHUNK):
        chunk = latents[:, :, first : first + CHUNK]
        model(chunk, torch.tensor([TIMESTEPS[0]]), text, start_frame=first, kv_cache_attention_bias=bias)
        model(chunk, torch.tensor([0.0]), text, start_frame=first, store_kv=True, kv_cache_attention_bias=bias)


def recorded_call(model, data, start, frames, monkeypatch, bias=BIAS):
    """One denoising forward of ``frames`` frames at ``start``: its output, what block 0's self-attention was given,
    and every ``masked_attention`` call (query, key, value, output)."""
    latents, text = data
    calls, given = [], []
    masked = attention_module.masked_attention

    def recording(query, key, value, mask, bias=None):
        out = masked(query, key, value, mask, bias)
        calls.append((query, key, value, out))
        return out

    monkeypatch.setattr(attention_module, "masked_attention", recording)
    handle = model.blocks[0].register_forward_pre_hook(
        lambda module, args: given.append(block_self_inputs(module, args))
    )
    try:
        x = latents[:, :, start : start + frames]
        out = model(x, torch.tensor([TIMESTEPS[1]]), text, start_frame=start, kv_cache_attention_bias=bias)[0]
    finally:
        handle.remove()
        monkeypatch.setattr(attention_module, "masked_attention", masked)
    return out, given[0], calls


# ---------------------------------------------------------------------------------------------- the test's own rule
def sees(frame, chunk_end, window, sink):
    return frame < chunk_end and (window is None or frame < sink or frame >= chunk_end - (window - sink))


def gathered_frames(start, frames, window, sink):
    """Key frames of a gathered call: the prefix its first chunk sees, in frame order, then its own frames."""
    first_end = start + min(frames, CHUNK)
    return [f for f in range(start) if sees(f, first_end, window, sink)] + list(range(start, start + frames))


def ring_frames(end, window, sink):
    """Key frames of a static in-place call ending at ``end``, in slot order."""
    slots = [None] * min(end, window)
    for frame in range(end):
        if sees(frame, end, window, sink):
            slots[frame if frame < sink else sink + (frame - sink) % (window - sink)] = frame
    return slots


def reference(query, key, value, key_frames, start, frames, window, sink, bias=BIAS):
    """``softmax(Q K^T / sqrt(D) + mask + bias) V`` in float64 (``(B, L, H, D)`` in and out)."""
    q, k, v = (t.double().transpose(1, 2) for t in (query, key, value))
    kf = torch.tensor(key_frames).repeat_interleave(SEQLEN)
    chunk_starts = [start + c for c in range(0, frames, CHUNK)]
    qs = torch.tensor([s for s in chunk_starts for _ in range(min(CHUNK, start + frames - s) * SEQLEN)])
    qe = torch.tensor([min(s + CHUNK, start + frames) for s in chunk_starts for _ in range(CHUNK * SEQLEN)])[: len(qs)]
    visible = torch.tensor([[sees(int(f), int(e), window, sink) for f in kf] for e in qe])
    biased = (kf[None] >= 1) & (kf[None] < qs[:, None])
    add = torch.where(biased, math.log(bias), 0.0).double().masked_fill(~visible, float("-inf"))
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + add
    return (torch.softmax(logits, dim=-1) @ v).transpose(1, 2)


CASES = {
    # name: (engine, stored frames, frames of the biased call, window, sink, static in-place path)
    "unwindowed": (VanillaKVCacheEngine, 6, 2, None, 0, False),
    "static-unwindowed": (lambda: StaticKVCacheEngine(16), 6, 2, None, 0, True),
    "static-ring-wrapped": (lambda: StaticKVCacheEngine(window_frames=5, sink_frames=1), 12, 2, 5, 1, True),
    "gather-window-sink": (lambda: VanillaKVCacheEngine(window_frames=5, sink_frames=1), 12, 2, 5, 1, False),
    "gather-window-sink2": (lambda: VanillaKVCacheEngine(window_frames=6, sink_frames=2), 12, 2, 6, 2, False),
    "gather-window-no-sink": (lambda: VanillaKVCacheEngine(window_frames=4), 12, 2, 4, 0, False),
    "multi-chunk": (VanillaKVCacheEngine, 4, 6, None, 0, False),
    "multi-chunk-window": (lambda: VanillaKVCacheEngine(window_frames=5, sink_frames=1), 6, 6, 5, 1, False),
    "multi-chunk-from-frame-0": (VanillaKVCacheEngine, 0, 6, None, 0, False),
}


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_biased_attention_equals_the_float64_reference(data, monkeypatch, case, backend):
    make_engine, start, frames, window, sink, static = CASES[case]
    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_block_mask_backend(backend)
    rollout_to(model, data, make_engine(), start)
    _, given, calls = recorded_call(model, data, start, frames, monkeypatch)

    assert given.static is static
    if static:
        key_frames = ring_frames(start + frames, window or 99, sink)
        assert list(given.valid_length.shape)[0] == len(key_frames) * SEQLEN
        if window is not None:
            assert key_frames != sorted(key_frames)  # the ring has wrapped: slot order is not frame order
    else:
        key_frames = gathered_frames(start, frames, window, sink)
    # the SDPA path gets one float mask, the Flex path a BlockMask (several chunks) and a bias for its score_mod
    if backend == "sdpa":
        assert given.bias is None and given.mask.dtype == torch.float32
        assert given.mask.shape == (1, 1, 1 if frames == CHUNK else frames * SEQLEN, len(key_frames) * SEQLEN)
    else:
        assert given.bias is not None and given.bias.rows.shape[1] == len(key_frames) * SEQLEN
        assert (given.mask is None) == (frames == CHUNK)
    if window is not None and sink == 0:
        assert 0 not in key_frames  # the anchor has left the window: every cached key is biased
    assert len(calls) == 2  # both blocks
    for query, key, value, out in calls:
        expected = reference(query, key, value, key_frames, start, frames, window, sink)
        assert (out.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", ["static-ring-wrapped", "gather-window-sink", "multi-chunk-window", "unwindowed"])
def test_flex_score_mod_equals_sdpa_float_mask(data, case):
    make_engine, start, frames, *_ = CASES[case]
    latents, text = data
    outs = {}
    for backend in ("sdpa", "flex"):
        model = make_causal_transformer(chunk_size=CHUNK)
        model.set_block_mask_backend(backend)
        rollout_to(model, data, make_engine(), start)
        x = latents[:, :, start : start + frames]
        outs[backend] = model(x, torch.tensor([500.0]), text, start_frame=start, kv_cache_attention_bias=BIAS)[0]
    assert (outs["sdpa"] - outs["flex"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [None, (5, 1)])
def test_static_in_place_and_gathered_biased_rollouts_agree(data, window):
    """The ring order of the static in-place path and the frame order of the vanilla path bias the same keys."""
    kwargs = {} if window is None else {"window_frames": window[0], "sink_frames": window[1]}
    latents, text = data
    outputs = {}
    for name, engine in (("static", StaticKVCacheEngine(**kwargs)), ("vanilla", VanillaKVCacheEngine(**kwargs))):
        model = make_causal_transformer(chunk_size=CHUNK)
        rollout_to(model, data, engine, 12)
        x = latents[:, :, 12:14]
        biased = model(x, torch.tensor([500.0]), text, start_frame=12, kv_cache_attention_bias=BIAS)[0]
        plain = model(x, torch.tensor([500.0]), text, start_frame=12)[0]
        outputs[name] = biased
        assert (biased - plain).abs().max().item() > 1e-3  # the bias does something
    assert (outputs["static"] - outputs["vanilla"]).abs().max().item() <= 1e-5


def test_multi_chunk_bias_equals_chunk_by_chunk_calls(data):
    """One layer (K/V = projections of the inputs): a biased call of three chunks gives each chunk what a
    single-chunk biased call gives once the earlier chunks are stored: the call's earlier chunks count as cached."""
    latents, text = data
    model = make_causal_transformer(chunk_size=CHUNK, num_layers=1)
    model.set_kv_cache_engines({"main": VanillaKVCacheEngine()})
    t = torch.tensor([500.0])
    x = latents[:, :, :8]
    model(x[:, :, :2], t, text, start_frame=0, store_kv=True)
    whole = model(x[:, :, 2:], t, text, start_frame=2, kv_cache_attention_bias=BIAS)[0]
    for first in (2, 4, 6):
        chunk = x[:, :, first : first + CHUNK]
        alone = model(chunk, t, text, start_frame=first, kv_cache_attention_bias=BIAS)[0]
        assert (alone - whole[:, :, first - 2 : first]).abs().max().item() <= 1e-5
        model(chunk, t, text, start_frame=first, store_kv=True)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("case", ["unwindowed", "static-ring-wrapped", "gather-window-sink", "multi-chunk"])
def test_bias_one_builds_no_mask_and_is_bit_identical(data, monkeypatch, case, backend):
    make_engine, start, frames, *_ = CASES[case]
    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_block_mask_backend(backend)
    rollout_to(model, data, make_engine(), start, bias=1.0)
    plain, given_plain, _ = recorded_call(model, data, start, frames, monkeypatch, bias=1.0)
    latents, text = data
    x = latents[:, :, start : start + frames]
    default = model(x, torch.tensor([TIMESTEPS[1]]), text, start_frame=start)[0]
    assert torch.equal(plain, default)
    assert given_plain.bias is None and model.block_masks.num_biases == 0
    if frames == CHUNK:
        assert given_plain.mask is None  # no mask tensor at all
    else:
        window, layout = model.kv_cache_engines["main"].window, model.chunk_layout_for(frames, start)
        assert given_plain.mask is model.block_masks.get(backend, window, start, layout, SEQLEN, "cpu")  # plain mask


def test_cache_passes_and_calls_with_nothing_to_bias_build_no_mask(data, monkeypatch):
    latents, text = data
    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_kv_cache_engines({"main": StaticKVCacheEngine(16)})
    _, first, _ = recorded_call(model, data, 0, CHUNK, monkeypatch)  # nothing cached
    given = []
    handle = model.blocks[0].register_forward_pre_hook(
        lambda module, args: given.append(block_self_inputs(module, args))
    )
    model(latents[:, :, :2], torch.tensor([0.0]), text, start_frame=0, store_kv=True, kv_cache_attention_bias=BIAS)
    handle.remove()
    _, after_two, _ = recorded_call(model, data, 2, CHUNK, monkeypatch)  # frames 0 (the anchor) and 1 cached
    for inputs in (first, given[0]):
        assert inputs.mask is None and inputs.bias is None
    assert after_two.mask is not None  # frame 1 is cached and not the anchor


def test_bias_memo_reuses_masks_and_stays_bounded(data):
    """Every step and tag of a chunk share one bias; a windowed ring cycles through a few; a long unwindowed run
    keeps at most ``max_biases``."""
    latents, text = data
    model = make_causal_transformer(chunk_size=CHUNK)
    rollout_to(model, data, StaticKVCacheEngine(window_frames=5, sink_frames=1), 4)
    held = model.block_masks.num_biases  # chunk 1 (chunk 0 has nothing to bias)
    x = latents[:, :, 4:6]
    first = [model(x, torch.tensor([t]), text, start_frame=4, kv_cache_attention_bias=BIAS) for t in (750.0, 500.0)]
    again = model(x, torch.tensor([750.0]), text, start_frame=4, kv_cache_attention_bias=BIAS)
    assert held == 1 and model.block_masks.num_biases == 2 and torch.equal(first[0][0], again[0])
    model.block_masks.max_biases = 2
    rollout_to(model, data, VanillaKVCacheEngine(), 16)
    assert model.block_masks.num_biases == 2
    model.clear_caches()
    assert model.block_masks.num_biases == 0


# ---------------------------------------------------------------------------------------------- compiled
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_compiled_biased_windowed_rollout_equals_eager_without_recompiles(data, fresh_dynamo, backend):
    """``compile_repeated_blocks(fullgraph=True)`` (dynamo, ``backend="eager"``): a biased windowed static rollout
    whose ring wraps gives the eager outputs with no graph break and no new graph once the ring is full."""
    latents, text = data
    model = make_causal_transformer(chunk_size=CHUNK)
    model.set_block_mask_backend(backend)

    def run(on_chunk=None):
        model.set_kv_cache_engines({"main": StaticKVCacheEngine(window_frames=5, sink_frames=1)})
        outs = []
        with torch.no_grad():
            for index, first in enumerate(range(0, 16, CHUNK)):
                chunk = latents[:, :, first : first + CHUNK]
                for t in (1000.0, 500.0, 0.0):
                    store = t == 0.0
                    outs.append(model(chunk, torch.tensor([t]), text, start_frame=first, store_kv=store,
                                      kv_cache_attention_bias=BIAS, return_dict=False)[0])  # fmt: skip
                if on_chunk is not None:
                    on_chunk(index)
        return torch.cat(outs, dim=2)

    eager = run()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    graphs = []
    compiled = run(lambda index: graphs.append(counters["stats"]["unique_graphs"]))
    assert (compiled - eager).abs().max().item() <= 1e-5
    assert not counters["graph_break"]
    assert graphs[4] == graphs[-1]  # the ring is full from chunk 3 on: nothing new after it


# ---------------------------------------------------------------------------------------------- krea_tiny, both paths
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_krea_tiny_biased_calls_match_the_unpadded_reference_on_both_backends(backend):
    """Every recorded biased call of scope's Krea sampler (tests/data/krea_tiny) replayed with its cache: the exact
    bias matches ``flow_pred_nopad`` (upstream without its zero-key padding) on the SDPA and FlexAttention paths."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from fastgen_diffusers import WanCausalTransformer3DModel

    root = Path(__file__).resolve().parent / "data" / "krea_tiny"
    meta = json.loads((root / "meta.json").read_text())
    prompt = load_file(root / "inputs.safetensors")["prompt_embeds"]
    outputs = load_file(root / "outputs.safetensors")
    model = WanCausalTransformer3DModel.from_pretrained(root / "transformer", chunk_size=3).eval()
    model.set_block_mask_backend(backend)
    worst, denoise_calls = 0.0, 0
    for call in meta["variants"]["biased"]["calls"]:
        if call["recompute"] or call["chunk"] == 0 and call["name"].endswith("step0"):
            model.clear_caches()
        x = outputs[f"{call['name']}.hidden_states"].permute(0, 2, 1, 3, 4)
        out = model(
            x, torch.tensor([call["timestep"]]), prompt, start_frame=call["replay_start_frame"],
            store_kv=call["replay_store_kv"], kv_cache_attention_bias=call["kv_cache_attention_bias"],
            return_dict=False,
        )[0].permute(0, 2, 1, 3, 4)  # fmt: skip
        name = call["name"] + (".flow_pred" if call["recompute"] else ".flow_pred_nopad")
        worst = max(worst, (out - outputs[name]).abs().max().item())
        denoise_calls += not call["recompute"]
    assert denoise_calls == 16 and worst <= 1e-5, worst


# ---------------------------------------------------------------------------------------------- through the pipeline
WINDOWED = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 61, "num_inference_steps": 2}
WINDOWED |= {"attention_window": 6, "sink_frames": 1, "output_type": "latent"}  # 16 latent frames: the ring wraps


@pytest.fixture(scope="module")
def pipe():
    from fastgen_diffusers.testing import tiny_pipeline

    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def windowed_latents(pipe, **kwargs):
    return pipe(generator=torch.Generator().manual_seed(0), **{**WINDOWED, **kwargs}).frames


def test_windowed_sequential_rollout_takes_the_bias_on_its_denoising_forwards_only(pipe):
    """``kv_cache_attention_bias`` with the plain windowed policy: the denoising forwards get it, the cache passes
    do not; the static (ring order) and vanilla (frame order) engines agree; 1 is the unbiased rollout exactly."""
    forwards = []
    forward = pipe.transformer.forward

    def recording(*args, **kwargs):
        forwards.append((kwargs["store_kv"], kwargs.get("kv_cache_attention_bias", 1.0)))
        return forward(*args, **kwargs)

    pipe.transformer.forward = recording
    try:
        static = windowed_latents(pipe, kv_cache_attention_bias=BIAS)
    finally:
        del pipe.transformer.forward
    assert {bias for store, bias in forwards if store} == {1.0}
    assert {bias for store, bias in forwards if not store} == {BIAS}
    vanilla = windowed_latents(pipe, kv_cache_attention_bias=BIAS, kv_cache_engine="vanilla")
    assert (static - vanilla).abs().max().item() <= 1e-5
    plain = windowed_latents(pipe)
    assert torch.equal(windowed_latents(pipe, kv_cache_attention_bias=1.0), plain)
    assert (static - plain).abs().max().item() > 1e-3


def test_cli_takes_the_bias_with_any_policy():
    from fastgen_diffusers.cli import app as cli
    from fastgen_diffusers.cli.checks import UsageError, generate_settings

    def settings(*flags):
        argv = ["generate", "--prompt", "a fox", "--attention-window", "6", "--sink-frames", "1", *flags]
        return generate_settings(cli.build_parser().parse_args(argv))

    assert settings("--kv-cache-attention-bias", "0.3").cache.kv_cache_attention_bias == 0.3
    assert settings("--kv-cache-attention-bias", "0.3", "--kv-cache-policy", "sequential").policy.name == "sequential"
    with pytest.raises(UsageError, match=r"\[0.01, 1\]"):
        settings("--kv-cache-attention-bias", "2.0")
