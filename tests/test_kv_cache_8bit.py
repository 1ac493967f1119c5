"""The 8-bit KV cache (issue #15 §5): ``kv_cache_dtype=torch.float8_e4m3fn`` / ``torch.int8`` on both engines.

Quantization with one scale per (sample, frame, head), bytes = formula (1 byte per element plus the scales, both
parts), the static engine's gather path, clear errors before any work (bad dtype, gradients, a torch without
float8), failed forwards rolled back exactly (scales included), the pipelines / CLI surface, and the output error
against the float32 cache over a 50-chunk windowed rollout of the tiny model (the README's numbers).
"""

from __future__ import annotations

import copy

import pytest
import torch
from bench_loader import load_benchmark
from cache_state import assert_same_state, model_state
from conftest import make_causal_transformer

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine, cli, make_engines
from fastgen_diffusers.kv_cache import (
    KV_CACHE_DTYPE_NAMES,
    QuantizedFrames,
    expected_scale_bytes,
    expected_self_cache_bytes,
)
from fastgen_diffusers.kv_cache.quantize import quantize_frames
from fastgen_diffusers.testing import tiny_pipeline

KINDS = ("static", "vanilla")
DTYPES = (torch.int8, torch.float8_e4m3fn)
T = torch.full((1,), 500.0)


def frames(count: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 16, count, 2, 2, generator=torch.Generator().manual_seed(seed))


def text(seed: int = 7, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 4, 32, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- quantization
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantization_is_per_sample_frame_and_head_and_its_error_is_bounded(dtype):
    seqlen = 5
    x = torch.randn(2, 4 * seqlen, 3, 8, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-3, 2, 4).repeat_interleave(seqlen)[None, :, None, None]  # frames of very different range
    x[1, :seqlen] = 0  # an all-zero frame
    stored = quantize_frames(x, seqlen, dtype)
    assert stored.data.dtype == dtype and stored.data.shape == x.shape
    assert stored.scale.dtype == torch.float32 and stored.scale.shape == (2, 4, 3)
    restored = stored.dequantize(torch.float32)
    scale = stored.scale.repeat_interleave(seqlen, dim=1)[..., None]  # per token
    error = (restored - x).abs()
    if dtype == torch.int8:
        assert (error <= scale / 2 * (1 + 1e-5)).all()
    else:  # 3 mantissa bits: relative rounding 2^-4, subnormal spacing 2^-9 (in units of the scale)
        assert (error <= x.abs() * 2**-4 + scale * 2**-9).all()
    assert error.max() > 0  # it really quantized
    assert torch.equal(restored[1, :seqlen], x[1, :seqlen]) and (stored.scale[1, 0] == 1).all()
    # a sample's bytes never depend on the rest of its batch, a frame's never on the other frames
    alone = quantize_frames(x[:1], seqlen, dtype)
    assert torch.equal(alone.data, stored.data[:1]) and torch.equal(alone.scale, stored.scale[:1])
    tail = quantize_frames(x[:, 2 * seqlen :], seqlen, dtype)
    assert torch.equal(tail.data, stored[:, 2 * seqlen :].data) and torch.equal(tail.scale, stored.scale[:, 2:])


def test_quantized_frames_slice_whole_frames_only():
    stored = quantize_frames(torch.randn(1, 6, 1, 4), 3, torch.int8)
    with pytest.raises(IndexError, match="whole frames of 3 tokens"):
        stored[:, 1:3]
    with pytest.raises(TypeError, match="quantize first"):
        stored[:, :3] = torch.zeros(1, 3, 1, 4)


# ---------------------------------------------------------------------- construction errors
@pytest.mark.parametrize("engine_class", [StaticKVCacheEngine, VanillaKVCacheEngine])
@pytest.mark.parametrize("bad", ["float16", torch.bfloat16, torch.uint8, "fp8", 8, True])
def test_an_unsupported_kv_cache_dtype_is_a_clear_error(engine_class, bad):
    with pytest.raises(ValueError, match=r"`kv_cache_dtype` must be None or one of \('float8_e4m3fn', 'int8'\)"):
        engine_class(kv_cache_dtype=bad)


@pytest.mark.parametrize("given", [torch.int8, "int8", "torch.int8", torch.float8_e4m3fn, "float8_e4m3fn", None])
def test_kv_cache_dtype_takes_torch_dtypes_and_their_names(given):
    expected = None if given is None else getattr(torch, str(given).removeprefix("torch."))
    for name, engine in make_engines(make_causal_transformer(), "static", kv_cache_dtype=given).items():
        assert name == "main" and engine.kv_cache_dtype == expected
    assert VanillaKVCacheEngine(kv_cache_dtype=given).kv_cache_dtype == expected


def test_float8_on_a_torch_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="needs a torch with float8_e4m3fn .* use 'int8'"):
        StaticKVCacheEngine(kv_cache_dtype="float8_e4m3fn")
    assert StaticKVCacheEngine(kv_cache_dtype="int8").kv_cache_dtype == torch.int8


# ---------------------------------------------------------------------- engines
def rollout(model, chunks: int, batch: int = 1, start_seed: int = 0) -> list[torch.Tensor]:
    """Chunks of 2 frames: a denoising call, then the store; returns the denoising outputs."""
    outputs = []
    for index in range(chunks):
        latents, timestep, prompt = frames(2, start_seed + index, batch), T.expand(batch), text(batch=batch)
        outputs.append(model(latents, timestep, prompt, start_frame=2 * index, return_dict=False)[0])
        model(latents, timestep, prompt, start_frame=2 * index, store_kv=True)
    return outputs


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_both_engines_give_the_same_numbers_and_static_takes_the_gather_path(dtype):
    results = {}
    for kind in KINDS:
        model = make_causal_transformer(chunk_size=2)
        model.set_kv_cache_engines(make_engines(model, kind, window_frames=6, sink_frames=2, kv_cache_dtype=dtype))
        results[kind] = torch.stack(rollout(model, 6, batch=2))
        if kind == "static":
            engine = model.kv_cache_engines["main"]
            assert engine.static_call("pos", 12, 2, 2) is None
            with pytest.raises(RuntimeError, match="no compute-dtype buffers"):
                engine.static_buffers(0, "pos")
            reference = make_engines(model, "static", window_frames=6, sink_frames=2)["main"]
            reference.register_blocks(model.blocks)
            layout = dict(batch_size=1, frame_seqlen=1, num_heads=2, head_dim=32, dtype=torch.float32)
            reference.ensure_capacity("pos", **layout, device=torch.device("cpu"), text_len=4)
            assert reference.static_call("pos", 0, 2, 2) is not None  # unquantized: the in-place fast path
    model = make_causal_transformer(chunk_size=2)
    model.set_kv_cache_engines(make_engines(model, "vanilla", window_frames=6, sink_frames=2))
    full = torch.stack(rollout(model, 6, batch=2))
    assert torch.allclose(results["static"], results["vanilla"], rtol=0, atol=1e-6)
    error = (results["static"] - full).abs().max()
    assert 0 < error < 0.05  # quantized (not the float32 numbers), close to them


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_a_sample_gets_the_same_numbers_alone_or_in_a_batch(dtype):
    outputs = []
    for batch in (1, 2):
        model = make_causal_transformer(chunk_size=2)
        model.set_kv_cache_engines(make_engines(model, "vanilla", window_frames=6, kv_cache_dtype=dtype))
        outputs.append(torch.stack(rollout(model, 4, batch=batch))[:, :1])
    assert torch.allclose(outputs[0], outputs[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_bytes_follow_the_formula_with_one_byte_per_element_plus_the_scales(kind, dtype):
    batch, layers, heads, head_dim, seqlen = 2, 2, 2, 32, 1  # frames(…): 2x2 latents, patch 2x2: 1 token per frame
    engines = {}
    for storage in (None, dtype):
        model = make_causal_transformer(chunk_size=2)
        model.set_kv_cache_engines(make_engines(model, kind, window_frames=6, sink_frames=2, kv_cache_dtype=storage))
        rollout(model, 5, batch=batch)
        engines[storage] = model.kv_cache_engines["main"]
    engine = engines[dtype]
    held = engine.held_frames("pos")
    assert held == 6  # sink 2 + the 4 most recent frames
    data = expected_self_cache_bytes(layers, batch, heads, held * seqlen, head_dim, dtype)
    scales = expected_scale_bytes(layers, batch, heads, held)
    assert data == 2 * layers * batch * heads * held * seqlen * head_dim * 1
    assert scales == 2 * layers * batch * heads * held * 4
    assert engine.self_cache_scale_bytes("pos") == scales
    assert engine.self_cache_bytes("pos") == data + scales == engine.self_cache_bytes()
    assert engines[None].self_cache_bytes("pos") == 4 * data and engines[None].self_cache_scale_bytes() == 0
    entries = [engine._self_kv[block]["pos"] for block in range(layers)]
    if kind == "vanilla":  # what the tensors hold, part by part
        stored = [s for entry in entries for s in (*entry.keys, *entry.values)]
        assert all(isinstance(s, QuantizedFrames) for s in stored)
        assert sum(s.data.numel() * s.data.element_size() for s in stored) == data
        assert sum(s.scale.numel() * s.scale.element_size() for s in stored) == scales
        assert engine.allocated_self_cache_bytes("pos") == data + scales
    else:  # the ring holds exactly the window: capacity = held here
        assert all(entry.key.data.dtype == dtype and entry.key.scale.dtype == torch.float32 for entry in entries)
        assert engine.allocated_self_cache_bytes("pos") == data + scales


# ---------------------------------------------------------------------- errors and transactions
@pytest.mark.parametrize("kind", KINDS)
def test_an_8bit_cache_with_gradients_enabled_is_a_clear_error_before_any_work(kind):
    model = make_causal_transformer(chunk_size=2)
    model.set_kv_cache_engines(make_engines(model, kind, kv_cache_dtype="int8"))
    with torch.no_grad():
        rollout(model, 2)
    before = model_state(model)
    with pytest.raises(ValueError, match=r"8-bit KV cache .* inference only: .*torch.no_grad\(\)"):
        model(frames(2, 9), T, text(), start_frame=4, store_kv=True)
    with torch.no_grad():
        assert_same_state(before, model_state(model))


def test_an_8bit_pipeline_rollout_with_gradients_enabled_is_a_clear_error():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.set_kv_cache_engines(make_engines(pipe.transformer, "static", kv_cache_dtype=torch.int8))
    chunks = pipe.rollout(
        torch.randn(1, 16, 3, 4, 4),
        torch.randn(1, 8, 32),
        chunk_bounds=[(0, 3)],
        schedule=pipe.rollout_schedule(1),
    )
    with pytest.raises(ValueError, match="8-bit KV cache"):
        next(iter(chunks))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_a_failed_forward_leaves_the_8bit_cache_exactly_as_it_was(kind, dtype, monkeypatch):
    # Window 4, chunks of 2, RoPE table of 8 frames with re-basing: frames [0, 8) stored, 4-7 held. A call at 8
    # re-bases (re-quantizes every cached key in place), evicts frames 4-5 and (static) quantizes its K/V into their
    # slots; a call at 6 replaces the last chunk. Each fails after some of its writes: in block 1, or in the store of
    # block 1 after block 0 has stored (quantized data and scales written into held slots).
    model = make_causal_transformer(chunk_size=2, rope_max_seq_len=8)
    model.enable_rope_rebasing()
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=4, kv_cache_dtype=dtype))
    rollout(model, 4)
    engine = model.kv_cache_engines["main"]
    before = model_state(model)
    untouched = copy.deepcopy(model)
    expected = untouched(frames(2, 20), T, text(), start_frame=8, store_kv=True, return_dict=False)[0]

    def fail(module, args):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(frames(2, 21), T, text(), start_frame=8, store_kv=True)
    finally:
        handle.remove()
    assert_same_state(before, model_state(model))

    append, stored_blocks = engine.append_self_kv, []

    def append_then_fail(block_idx, *args):
        if block_idx == 1:
            raise RuntimeError("boom in the store")
        append(block_idx, *args)
        stored_blocks.append(block_idx)

    monkeypatch.setattr(engine, "append_self_kv", append_then_fail)
    for start in (8, 6):
        with pytest.raises(RuntimeError, match="boom in the store"):
            model(frames(2, 22), T, text(), start_frame=start, store_kv=True)
        assert_same_state(before, model_state(model))
    assert stored_blocks == [0, 0]  # block 0 had written each time
    monkeypatch.undo()
    assert engine.rope_offset("pos") == 0
    got = model(frames(2, 20), T, text(), start_frame=8, store_kv=True, return_dict=False)[0]
    assert torch.equal(got, expected)
    assert engine.rope_offset("pos") == 8  # the call re-based, as the untouched model's did
    assert_same_state(model_state(untouched), model_state(model))


# ---------------------------------------------------------------------- pipelines and CLI
def generate(pipe, chunks: int, **kwargs) -> torch.Tensor:
    return pipe(
        "a fox",
        num_frames=4 * (3 * chunks - 1) + 1,
        height=32,
        width=32,
        output_type="latent",
        attention_window=9,
        sink_frames=3,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    ).frames


def test_a_50_chunk_windowed_rollout_stays_close_to_the_float32_cache():
    """The README's numbers: 50 chunks of 3 latent frames, window 9 with sink 3, tiny model, 32x32."""
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    reference = generate(pipe, 50)
    assert torch.equal(generate(pipe, 50, kv_cache_dtype=None), reference)  # off: today's numbers
    for dtype in ("int8", "float8_e4m3fn"):
        latents = {kind: generate(pipe, 50, kv_cache_engine=kind, kv_cache_dtype=dtype) for kind in KINDS}
        assert pipe.transformer.kv_cache_engines["main"].kv_cache_dtype == getattr(torch, dtype)
        assert torch.allclose(latents["static"], latents["vanilla"], rtol=0, atol=1e-5)
        error = (latents["static"] - reference).abs()
        print(f"{dtype}: mean abs {error.mean():.3g}, max abs {error.max():.3g}")
        assert 1e-6 < error.max() < 0.02 and error.mean() < 2e-3


def test_pipelines_check_kv_cache_dtype_before_any_work():
    pipe = tiny_pipeline()

    def no_work(*args, **kwargs):
        raise AssertionError("the prompt was encoded before the check")

    pipe.encode_prompt = no_work
    with pytest.raises(ValueError, match=r"`kv_cache_dtype` must be None or one of \('float8_e4m3fn', 'int8'\)"):
        pipe("a fox", num_frames=9, height=32, width=32, kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="`kv_cache_dtype` needs a `kv_cache_engine`"):
        pipe("a fox", num_frames=9, height=32, width=32, kv_cache_engine=None, kv_cache_dtype="int8")


def test_stream_takes_kv_cache_dtype_and_matches_the_call():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    expected = generate(pipe, 3, kv_cache_dtype=torch.float8_e4m3fn)
    streamed = [
        chunk.latents
        for chunk in pipe.stream(
            "a fox",
            num_frames=4 * 8 + 1,
            height=32,
            width=32,
            output_type="latent",
            attention_window=9,
            sink_frames=3,
            generator=torch.Generator().manual_seed(0),
            kv_cache_dtype="float8_e4m3fn",
        )
    ]
    assert torch.equal(torch.cat(streamed, dim=2), expected)


def test_cli_kv_cache_dtype_reaches_the_pipeline(tmp_path, monkeypatch):
    from fastgen_diffusers.pipelines import WanCausalPipeline

    (generate,) = [a.choices["generate"] for a in cli.build_parser()._actions if getattr(a, "choices", None)]
    (flag,) = [a for a in generate._actions if "--kv-cache-dtype" in a.option_strings]
    assert tuple(flag.choices) == tuple(KV_CACHE_DTYPE_NAMES)  # the flag's choices are the settings' names
    seen = []
    call = WanCausalPipeline.__call__

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("kv_cache_dtype"))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalPipeline, "__call__", recording)
    args = ["generate", "--prompt", "a fox", "--output", str(tmp_path / "q.mp4"), "--num-frames", "9"]
    args += ["--height", "32", "--width", "32", "--steps", "1", "--kv-cache-dtype", "int8"]
    assert cli.main(args) == 0
    assert seen == ["int8"]


def test_cli_kv_cache_dtype_errors_are_one_line(tmp_path, capsys, monkeypatch):
    args = ["generate", "--prompt", "a fox", "--output", str(tmp_path / "q.mp4"), "--kv-cache-dtype"]
    with pytest.raises(SystemExit) as exit_info:  # argparse's own exit
        cli.main([*args, "float16"])
    assert exit_info.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'float16'" in capsys.readouterr().err
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert cli.main([*args, "float8_e4m3fn"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-cache-dtype float8_e4m3fn needs a torch with float8_e4m3fn" in err


def test_the_kv8_benchmark_runs_in_its_tiny_mode(capsys):
    module = load_benchmark("bench_kv8")
    module.main(["--tiny"])
    printed = capsys.readouterr().out
    for dtype in ("int8", "float8_e4m3fn"):
        line = next(line for line in printed.splitlines() if line.startswith(f"[static {dtype}]"))
        assert "(data 0.250 + scales" in line  # 1 byte per element, plus the scales
    assert "error vs float32 cache" in printed


# ---------------------------------------------------------------------- with window-relative RoPE and the EMA sink
def test_the_ema_sink_and_an_8bit_cache_do_not_combine():
    with pytest.raises(ValueError, match="`sink_update='ema'` cannot be combined with an 8-bit `kv_cache_dtype`"):
        StaticKVCacheEngine(
            window_frames=9, sink_frames=3, rope_positions="window", sink_update="ema", kv_cache_dtype="int8"
        )
    pipe = tiny_pipeline()
    with pytest.raises(ValueError, match="cannot be combined with an 8-bit"):
        generate(pipe, 2, rope_positions="window", sink_update="ema", kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_relative_rope_keys_are_stored_8bit_and_rotated_after_dequantization(dtype):
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    reference = generate(pipe, 8, rope_positions="window")
    latents = {
        kind: generate(pipe, 8, kv_cache_engine=kind, rope_positions="window", kv_cache_dtype=dtype) for kind in KINDS
    }
    assert torch.allclose(latents["static"], latents["vanilla"], rtol=0, atol=1e-5)
    error = (latents["static"] - reference).abs()
    assert 1e-6 < error.max() < 0.02 and error.mean() < 2e-3
